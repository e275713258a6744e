// Random inputs, errors and autograd gradients for comparing mixer forms (see mixer_check.h).
#include "framework/cli/mixer_check.h"

#include "layers/mixer_grads.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace carry {

int64_t num_levels(const Shape& s) {
  int64_t last = s.offset + s.T - 1, L = 1;
  while ((int64_t{1} << (L - 1)) <= last) ++L;
  return L + 1;
}

MixerInputs random_inputs(const Mixer& m, const Shape& s, at::ScalarType dtype, uint64_t seed,
                          at::Device device) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto opt = at::TensorOptions().dtype(dtype);
  MixerInputs in;
  auto names = m.input_names();
  for (auto& n : m.optional_input_names()) names.push_back(n);
  bool delta = std::find(names.begin(), names.end(), "beta") != names.end();
  // g scales a per-head decay rate (Mamba-1: g = Δ, decay_rate = A): a step size, softplus of a normal.
  bool rate = std::find(names.begin(), names.end(), "decay_rate") != names.end();
  for (auto& n : names) {
    Tensor t;
    const int64_t T = s.T * m.rows_per_token(n, MixerOptions{});  // sub-step inputs: n_h rows a token
    const int64_t H = m.broadcasts_heads(n) ? 1 : s.H;            // Mamba-1's q, k: one shared head
    if (n == "q" || n == "k") t = at::randn({s.B, T, H, s.dk}, gen, opt);
    else if (n == "v") t = at::randn({s.B, T, s.H, s.dv}, gen, opt);
    else if (n == "g" && rate) t = at::softplus(at::randn({s.B, T, s.H}, gen, opt));
    else if (n == "decay_rate") t = -at::exp(at::randn({s.H, s.dk}, gen, opt) * 0.5);
    else if (n == "g") t = at::log_sigmoid(at::randn({s.B, T, s.H}, gen, opt) + 3);
    else if (n == "gk") t = at::log_sigmoid(at::randn({s.B, T, s.H, s.dk}, gen, opt) + 3);
    else if (n == "beta") t = at::sigmoid(at::randn({s.B, T, s.H}, gen, opt));
    else if (n == "l") t = at::sigmoid(at::randn({s.B, T, s.H, num_levels(s)}, gen, opt)) + 0.1;
    else if (n == "a") t = at::randn({s.B, T, s.H, s.dk}, gen, opt);
    else if (n == "b") t = at::sigmoid(at::randn({s.B, T, s.H, s.dk}, gen, opt));
    if (delta && n == "k") t = t / t.norm(2, -1, true);
    in.get(n) = t.to(device);
  }
  // RWKV-7's transition Diag(w) + b aᵀ with a = −κ̂ (a unit vector) and b = κ̂ ⊙ a_lr, a_lr in (0, 1).
  if (in.a.defined() && in.b.defined()) {
    Tensor kappa = in.a / in.a.norm(2, -1, true);
    in.a = -kappa;
    in.b = kappa * in.b;
  }
  return in;
}

State random_state(const Mixer& m, const MixerInputs& in, const MixerOptions& opt, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  State s = m.zero_state(in, opt);
  for (auto& t : s)
    t = at::randn(t.sizes(), gen, t.options().device(at::kCPU)).to(t.device());
  return s;
}

double rel_err(const Tensor& a, const Tensor& b) {
  if (!a.defined() && !b.defined()) return 0;
  TORCH_INTERNAL_ASSERT(a.defined() && b.defined() && a.sizes() == b.sizes());
  if (b.numel() == 0) return 0;
  double den = b.abs().max().item<double>();
  double num = (a - b).abs().max().item<double>();
  // A NaN anywhere is an infinite error (max() over a tensor with a NaN is NaN, and a NaN would pass
  // every `e <= bound` check as false and every std::max as the other operand).
  if (std::isnan(num) || std::isnan(den)) return std::numeric_limits<double>::infinity();
  return den > 0 ? num / den : num;
}

double max_rel_err(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  TORCH_INTERNAL_ASSERT(a.size() == b.size(), "comparing lists of ", a.size(), " and ", b.size());
  double e = 0;
  for (size_t i = 0; i < a.size(); ++i) e = std::max(e, rel_err(a[i], b[i]));
  return e;
}

FormResult run_with_grads(const Mixer& m, Form form, const MixerInputs& in, const State& state,
                          const MixerOptions& opt, uint64_t seed,
                          const std::function<Tensor(const Tensor&)>& make_leaf) {
  MixerLeaves leaves = make_mixer_leaves(in, state, make_leaf);
  MixerOptions fopt = opt;
  fopt.form = form;
  auto out = m.forward(leaves.in, leaves.state, fopt);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto weighted = [&](const Tensor& t) {
    auto dt = at::promote_types(t.scalar_type(), at::kFloat);
    auto w = at::randn(t.sizes(), gen, t.options().device(at::kCPU).dtype(dt)).to(t.device());
    return (t.to(dt) * w).sum();
  };
  FormResult r;
  r.outputs.push_back(out.o.detach());
  auto loss = weighted(out.o);
  for (auto& s : out.final_state) {
    r.outputs.push_back(s.detach());
    loss = loss + weighted(s);
  }
  r.grads = leaf_grads({loss}, leaves.all());
  return r;
}

}  // namespace carry
