// The Python package's operators: carry's mixer registry (layers/mixer.h) as PyTorch operators in the
// `carry` namespace, which python/carry/ loads with torch.ops.load_library and calls as
// torch.ops.carry.<name>. The library links carry's layers (and, in a CUDA build, its kernels) and
// libtorch only: no Python headers, so one build serves every Python version of the same torch.
//
// Autograd: the operators are registered as composite (CompositeImplicitAutograd) kernels, so autograd
// records the ATen ops and the kernels' hand-written autograd Functions that run inside them, exactly as
// in carry's own training: every output is differentiable in every input and in the initial state.
//
// The operators take carry's conventions as they are (layers/mixer.h: inputs [B,T,H,D], log gates,
// states [B,H,dk,dv]-like tuples, T a multiple of chunk_size for the chunkwise and kernel forms);
// python/carry/ops.py maps flash-linear-attention's arguments onto them.
#include "layers/mixer.h"

#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace carry {
namespace {

MixerInputs inputs(const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& g,
                   const std::optional<Tensor>& gk, const std::optional<Tensor>& beta,
                   const std::optional<Tensor>& l, const std::optional<Tensor>& a = std::nullopt,
                   const std::optional<Tensor>& b = std::nullopt,
                   const std::optional<Tensor>& decay_rate = std::nullopt) {
  MixerInputs in;
  in.q = q;
  in.k = k;
  in.v = v;
  if (g) in.g = *g;
  if (gk) in.gk = *gk;
  if (beta) in.beta = *beta;
  if (l) in.l = *l;
  if (a) in.a = *a;
  if (b) in.b = *b;
  if (decay_rate) in.decay_rate = *decay_rate;
  return in;
}

MixerOptions options(double scale, bool normalize, double eps, int64_t chunk_size, int64_t offset,
                     const std::string& form, int64_t num_householder) {
  MixerOptions opt;
  TORCH_CHECK(scale >= 0, "carry: scale must be positive (0 for the default 1/sqrt(dk)), got ", scale);
  TORCH_CHECK(chunk_size > 0, "carry: chunk_size must be positive, got ", chunk_size);
  TORCH_CHECK(offset >= 0, "carry: offset must be >= 0, got ", offset);
  TORCH_CHECK(num_householder >= 1, "carry: num_householder must be >= 1, got ", num_householder);
  opt.scale = scale;
  opt.normalize = normalize;
  opt.eps = eps;
  opt.chunk_size = chunk_size;
  opt.offset = offset;
  opt.form = parse_form(form);
  opt.num_householder = num_householder;
  return opt;
}

// The family's final state, or its output, as the Tensor[] the schema returns.
std::vector<Tensor> state_list(const State& s) { return std::vector<Tensor>(s.begin(), s.end()); }

std::tuple<Tensor, std::vector<Tensor>> mixer_forward(
    const std::string& family, const Tensor& q, const Tensor& k, const Tensor& v,
    const std::optional<Tensor>& g, const std::optional<Tensor>& gk, const std::optional<Tensor>& beta,
    const std::optional<Tensor>& l, const std::vector<Tensor>& initial_state, double scale, bool normalize,
    double eps, int64_t chunk_size, int64_t offset, const std::string& form, const std::optional<Tensor>& a,
    const std::optional<Tensor>& b, int64_t num_householder, const std::optional<Tensor>& decay_rate) {
  const Mixer& m = get_mixer(family);
  MixerOutput out = m.forward(inputs(q, k, v, g, gk, beta, l, a, b, decay_rate), State(initial_state.begin(), initial_state.end()),
                              options(scale, normalize, eps, chunk_size, offset, form, num_householder));
  return {out.o, state_list(out.final_state)};
}

// The form `automatic` dispatch runs for these inputs: "kernel" or "chunkwise".
std::string mixer_form(const std::string& family, const Tensor& q, const Tensor& k, const Tensor& v,
                       const std::optional<Tensor>& g, const std::optional<Tensor>& gk,
                       const std::optional<Tensor>& beta, const std::optional<Tensor>& l, double scale,
                       bool normalize, double eps, int64_t chunk_size, int64_t offset,
                       const std::optional<Tensor>& a, const std::optional<Tensor>& b, int64_t num_householder,
                       const std::optional<Tensor>& decay_rate) {
  const Mixer& m = get_mixer(family);
  return form_name(m.resolve_form(inputs(q, k, v, g, gk, beta, l, a, b, decay_rate),
                                  options(scale, normalize, eps, chunk_size, offset, "automatic", num_householder)));
}

std::vector<std::string> families() { return mixer_names(); }

// (inputs read, inputs read when given, state entry names, has a kernel form in this build)
std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::string>, bool> family_info(
    const std::string& family) {
  const Mixer& m = get_mixer(family);
  return {m.input_names(), m.optional_input_names(), m.state_names(), m.has_kernel()};
}

// The state-summary algebra (layers/mixer.h): a slice's affine map S_out = A·S_in + B as
// (transport, state), composed first-then-second, and applied to a state.
std::tuple<std::vector<Tensor>, std::vector<Tensor>> mixer_summarize(
    const std::string& family, const Tensor& q, const Tensor& k, const Tensor& v,
    const std::optional<Tensor>& g, const std::optional<Tensor>& gk, const std::optional<Tensor>& beta,
    const std::optional<Tensor>& l, double scale, bool normalize, double eps, int64_t chunk_size,
    int64_t offset, const std::optional<Tensor>& a, const std::optional<Tensor>& b, int64_t num_householder,
    const std::optional<Tensor>& decay_rate) {
  const Mixer& m = get_mixer(family);
  TORCH_CHECK(m.has_summary(), "carry: ", family, " has no recurrent state, so no state summary");
  Summary s = m.summarize(inputs(q, k, v, g, gk, beta, l, a, b, decay_rate),
                          options(scale, normalize, eps, chunk_size, offset, "automatic", num_householder));
  return {s.transport, state_list(s.state)};
}

std::tuple<std::vector<Tensor>, std::vector<Tensor>> mixer_compose(
    const std::string& family, const std::vector<Tensor>& first_transport, const std::vector<Tensor>& first_state,
    const std::vector<Tensor>& second_transport, const std::vector<Tensor>& second_state) {
  const Mixer& m = get_mixer(family);
  TORCH_CHECK(m.has_summary(), "carry: ", family, " has no recurrent state, so no state summary");
  Summary s = m.compose({first_transport, State(first_state.begin(), first_state.end())},
                        {second_transport, State(second_state.begin(), second_state.end())});
  return {s.transport, state_list(s.state)};
}

std::vector<Tensor> mixer_apply(const std::string& family, const std::vector<Tensor>& transport,
                                const std::vector<Tensor>& summary_state, const std::vector<Tensor>& state) {
  const Mixer& m = get_mixer(family);
  TORCH_CHECK(m.has_summary(), "carry: ", family, " has no recurrent state, so no state summary");
  return state_list(m.apply({transport, State(summary_state.begin(), summary_state.end())},
                            State(state.begin(), state.end())));
}

}  // namespace
}  // namespace carry

// The inputs and options every running operator takes, in MixerInputs' and MixerOptions' names; the
// rank-one inputs a and b (RWKV-7's update), Gated DeltaProduct's sub-steps a token and Mamba-1's
// per-channel decay_rate (A) come last, with defaults, after the options.
#define CARRY_INPUTS "Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? gk, Tensor? beta, Tensor? l"
#define CARRY_OPTIONS "float scale, bool normalize, float eps, int chunk_size, int offset"
#define CARRY_TRAILING "Tensor? a=None, Tensor? b=None, int num_householder=2, Tensor? decay_rate=None"

TORCH_LIBRARY(carry, m) {
  m.def("mixer_forward(str family, " CARRY_INPUTS ", Tensor[] initial_state, " CARRY_OPTIONS
        ", str form, " CARRY_TRAILING ") -> (Tensor, Tensor[])",
        &carry::mixer_forward);
  m.def("mixer_form(str family, " CARRY_INPUTS ", " CARRY_OPTIONS ", " CARRY_TRAILING ") -> str", &carry::mixer_form);
  m.def("families() -> str[]", &carry::families);
  m.def("family_info(str family) -> (str[], str[], str[], bool)", &carry::family_info);
  m.def("mixer_summarize(str family, " CARRY_INPUTS ", " CARRY_OPTIONS ", " CARRY_TRAILING
        ") -> (Tensor[], Tensor[])",
        &carry::mixer_summarize);
  m.def("mixer_compose(str family, Tensor[] first_transport, Tensor[] first_state, Tensor[] second_transport, "
        "Tensor[] second_state) -> (Tensor[], Tensor[])",
        &carry::mixer_compose);
  m.def("mixer_apply(str family, Tensor[] transport, Tensor[] summary_state, Tensor[] state) -> Tensor[]",
        &carry::mixer_apply);
}
