// Gated DeltaProduct ("gated_deltaproduct", delta_product.h): the recurrence as the naive form, and every
// other form, the summaries and the one-pass readout as Gated DeltaNet's on the T·n_h sub-tokens.
#include "layers/delta_product/delta_product.h"

#include "layers/delta_rule/delta_rule.h"
#include "layers/layout.h"

namespace carry {

MixerInputs deltaproduct_as_gated_deltanet(const MixerInputs& in, int64_t n) {
  MixerInputs out;
  out.k = in.k, out.v = in.v, out.beta = in.beta;
  if (n == 1) {
    out.q = in.q, out.g = in.g;
    return out;
  }
  const int64_t B = in.q.size(0), T = in.q.size(1), H = in.q.size(2), dk = in.q.size(3);
  // Token t's query on its last sub-token, its gate on its first; zeros elsewhere.
  out.q = at::cat({at::zeros({B, T, n - 1, H, dk}, in.q.options()), in.q.unsqueeze(2)}, 2).view({B, T * n, H, dk});
  out.g = at::cat({in.g.unsqueeze(2), at::zeros({B, T, n - 1, H}, in.g.options())}, 2).view({B, T * n, H});
  return out;
}

Tensor deltaproduct_token_rows(const Tensor& o, int64_t n) {
  if (n == 1) return o;
  TORCH_CHECK(o.dim() == 4 && o.size(1) % n == 0, "gated_deltaproduct: the sub-token outputs must be [B, T·",
              n, ", H, dv], got ", shape_str(o.sizes()));
  return o.reshape({o.size(0), o.size(1) / n, n, o.size(2), o.size(3)}).select(2, n - 1).contiguous();
}

namespace {

at::ScalarType compute_dtype(const Tensor& x) { return at::promote_types(x.scalar_type(), at::kFloat); }

const Mixer& gated_deltanet() { return get_mixer("gated_deltanet"); }

class GatedDeltaProduct final : public Mixer {
 public:
  std::string name() const override { return "gated_deltaproduct"; }
  std::vector<std::string> input_names() const override { return {"q", "k", "v", "g", "beta"}; }
  std::vector<std::string> state_names() const override { return {"S"}; }
  int64_t rows_per_token(const std::string& n, const MixerOptions& opt) const override {
    return n == "k" || n == "v" || n == "beta" ? opt.num_householder : 1;
  }

  State zero_state(const MixerInputs& in, const MixerOptions&) const override {
    return {at::zeros(state_shape(in), in.q.options().dtype(compute_dtype(in.q)))};
  }

  void check(const MixerInputs& in, const MixerOptions& opt, bool chunked) const override {
    for (const auto& n : input_names())
      TORCH_CHECK(in.get(n).defined(), name(), ": input '", n, "' is required (the family reads q, k, v, g, beta)");
    const int64_t nh = opt.num_householder;
    TORCH_CHECK(nh >= 1, name(), ": num_householder (delta-rule steps a token) must be >= 1, got ", nh);
    TORCH_CHECK(in.q.dim() == 4, name(), ": 'q' must be [B, T, H, dk], got shape ", shape_str(in.q.sizes()));
    const int64_t B = in.q.size(0), T = in.q.size(1), H = in.q.size(2), dk = in.q.size(3);
    const std::string sub = " (num_householder = " + std::to_string(nh) +
                            " sub-steps a token, interleaved along T: T·num_householder = " +
                            std::to_string(T * nh) + " rows for q's T = " + std::to_string(T) + ")";
    auto rows = [&](const std::string& n, std::vector<int64_t> shape, bool per_step) {
      const Tensor& t = in.get(n);
      const bool ok = t.dim() == static_cast<int64_t>(shape.size());
      if (ok && per_step && t.size(1) != T * nh)
        TORCH_CHECK(false, name(), ": '", n, "' must have T·num_householder rows along dim 1, got ", t.size(1), sub);
      check_tensor(t, name() + ": '" + n + "'" + (per_step ? sub : ""), shape);
    };
    rows("k", {B, T * nh, H, dk}, true);
    rows("v", {B, T * nh, H, -1}, true);
    rows("beta", {B, T * nh, H}, true);
    rows("g", {B, T, H}, false);
    for (const auto& n : input_names()) {
      const Tensor& t = in.get(n);
      const bool fp32_gate = MixerInputs::is_gate(n) && t.scalar_type() == at::kFloat;
      TORCH_CHECK(t.scalar_type() == in.q.scalar_type() || fp32_gate, name(), ": '", n, "' has dtype ",
                  t.scalar_type(), " but 'q' has ", in.q.scalar_type(),
                  "; all inputs must share one dtype (the gates g and beta may be fp32)");
    }
    if (opt.check_values) {
      for (const char* n : {"q", "k", "v", "beta"}) check_finite(in.get(n), name() + ": '" + n + "'");
      check_log_gate(in.g, name() + ": 'g'");
      const Tensor& beta = in.beta;
      TORCH_CHECK(((beta >= kDeltaBetaMin) & (beta <= kDeltaBetaMax)).all().item<bool>(), name(),
                  ": 'beta' (the delta-rule write strength) must lie in [", kDeltaBetaMin, ", ", kDeltaBetaMax,
                  "] everywhere; found values in [", beta.min().item<double>(), ", ", beta.max().item<double>(), "]");
    }
    if (chunked) {
      TORCH_CHECK(opt.chunk_size > 0, name(), ": chunk_size must be positive, got ", opt.chunk_size);
      TORCH_CHECK(T % opt.chunk_size == 0, name(), ": sequence length T=", T, " must be a multiple of chunk_size=",
                  opt.chunk_size, " in the chunkwise form");
    }
  }

  // The recurrence: per token the decay, then the n_h steps S ← S − β k (kᵀS) + β k vᵀ, then o = scale·Sᵀq.
  MixerOutput naive(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, /*chunked=*/false);
    const int64_t nh = opt.num_householder;
    const auto dt = compute_dtype(in.q);
    Tensor S = initial(in, init);
    auto q = to_bhtd(in.q).to(dt) * opt.scale_for(in.q.size(3));
    auto k = to_bhtd(in.k).to(dt), v = to_bhtd(in.v).to(dt), beta = to_bhtd(in.beta).to(dt);
    auto gamma = to_bhtd(in.g).to(dt).exp();
    std::vector<Tensor> outs;
    for (int64_t t = 0; t < q.size(2); ++t) {
      S = gamma.select(2, t).unsqueeze(-1).unsqueeze(-1) * S;
      for (int64_t j = 0; j < nh; ++j) {
        const int64_t r = t * nh + j;
        auto kr = k.select(2, r).unsqueeze(-1), vr = v.select(2, r).unsqueeze(-2);  // [B,H,dk,1], [B,H,1,dv]
        auto br = beta.select(2, r).unsqueeze(-1).unsqueeze(-1);
        S = S - br * kr * at::matmul(kr.transpose(-1, -2), S) + br * kr * vr;
      }
      outs.push_back(at::matmul(q.select(2, t).unsqueeze(-2), S).squeeze(-2));
    }
    return {from_bhtd(at::stack(outs, 2)).to(in.q.scalar_type()), {S}};
  }

  MixerOutput chunkwise(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, /*chunked=*/true);
    const int64_t nh = opt.num_householder;
    MixerOutput out = gated_deltanet().chunkwise(deltaproduct_as_gated_deltanet(in, nh), init,
                                                 inner_options(opt, opt.chunk_size * nh));
    return {deltaproduct_token_rows(out.o, nh), out.final_state};
  }

  // The kernel form: Gated DeltaNet's kernels (layers/kernels/delta_rule/) on the sub-tokens, in their
  // chunks of 64 sub-tokens; the kernel form takes chunk_size 64 (tokens), so every slice the ordered
  // scan cuts is whole kernel chunks. Their conditions are on q's and v's dtype, device and widths, the
  // same for the sub-token inputs.
  bool has_kernel() const override { return gated_deltanet().has_kernel(); }
  bool kernel_supports(const MixerInputs& in, const MixerOptions& opt) const override {
    return opt.chunk_size == kKernelChunk && gated_deltanet().kernel_supports(in, inner_options(opt, kKernelChunk));
  }
  MixerOutput kernel(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, /*chunked=*/true);
    TORCH_CHECK(kernel_supports(in, opt), name(), ": the kernel form (Gated DeltaNet's kernels on the sub-tokens) "
                "takes CUDA tensors in bf16 or fp32, dk in {64, 128}, dv in {64, 128, 256} and chunk_size 64, on a Hopper GPU; got q ",
                shape_str(in.q.sizes()), " ", in.q.scalar_type(), " on ", in.q.device(), ", v ",
                shape_str(in.v.sizes()), ", chunk_size ", opt.chunk_size);
    const int64_t nh = opt.num_householder;
    MixerOutput out = gated_deltanet().kernel(deltaproduct_as_gated_deltanet(in, nh), init,
                                              inner_options(opt, kKernelChunk));
    return {deltaproduct_token_rows(out.o, nh), out.final_state};
  }

  // Gated DeltaNet's summary of the sub-tokens (two runs: from zero, and from the identity with v = 0),
  // in the form this family would run (the kernel's chunks on CUDA).
  Summary summarize(const MixerInputs& in, const MixerOptions& opt) const override {
    check(in, opt, /*chunked=*/true);
    return gated_deltanet().summarize(deltaproduct_as_gated_deltanet(in, opt.num_householder),
                                      inner_options(opt, inner_chunk(in, opt)));
  }

  // The one-pass scans: the sub-token run from the identity with v = 0 gives the transport (its final
  // state) and, at the tokens' last sub-tokens, each token's readout row q̃_t = scale·(A_{≤t})ᵀq_t, so
  // forward(in, S_in).o = forward(in, 0).o + S_inᵀq̃_t (Gated DeltaNet's state_readout, read at the tokens).
  bool has_state_output(const MixerInputs&, const MixerOptions&) const override { return true; }
  std::vector<Tensor> transport(const MixerInputs& in, const MixerOptions& opt) const override {
    return state_readout(in, opt).transport;
  }
  Tensor state_output(const MixerInputs& in, const State& s_in, const MixerOptions& opt) const override {
    return state_readout(in, opt).share(s_in);
  }
  StateReadout state_readout(const MixerInputs& in, const MixerOptions& opt) const override {
    check(in, opt, /*chunked=*/true);
    const int64_t nh = opt.num_householder;
    const int64_t B = in.q.size(0), H = in.q.size(2), dk = in.q.size(3);
    MixerInputs writes_nothing = deltaproduct_as_gated_deltanet(in, nh);
    writes_nothing.v = at::zeros({B, in.k.size(1), H, dk}, in.v.options());
    Tensor eye = at::eye(dk, in.q.options().dtype(compute_dtype(in.q))).expand({B, H, dk, dk}).contiguous();
    MixerOptions plain = inner_options(opt, inner_chunk(in, opt));
    plain.on_final_state = nullptr;  // not the caller's run
    plain.on_initial_state_grad = nullptr;
    MixerOutput id = gated_deltanet().forward(writes_nothing, {eye}, plain);
    Tensor rows = deltaproduct_token_rows(id.o, nh);  // [B,T,H,dk]
    return {{id.final_state[0]}, [rows](const State& s_in) {
              TORCH_CHECK(s_in.size() == 1 && s_in[0].defined() && s_in[0].dim() == 4 && s_in[0].size(2) == rows.size(3),
                          "gated_deltaproduct: S_in's share expects a state {S [B,H,dk,dv]} with dk = ", rows.size(3));
              return state_product(rows, s_in[0]);
            }};
  }

  std::optional<Summary> fixed_summary(const MixerInputs& in, const State& s) const override {
    return gated_deltanet().fixed_summary(in, s);
  }
  Summary compose(const Summary& first, const Summary& second) const override {
    return gated_deltanet().compose(first, second);
  }
  State apply(const Summary& summary, const State& state) const override {
    return gated_deltanet().apply(summary, state);
  }

 private:
  static constexpr int64_t kKernelChunk = 64;

  // The options of a Gated DeltaNet run on the sub-tokens: chunks of `chunk` sub-tokens, no documents
  // (Mixer::forward runs them on this family, forward_documents), values checked here already. The
  // hooks, serial_states and the scale stay (the state and its gradient are this family's).
  static MixerOptions inner_options(const MixerOptions& opt, int64_t chunk) {
    MixerOptions o = opt;
    o.chunk_size = chunk;
    o.document_starts = Tensor();
    o.document_offsets.clear();
    o.check_values = false;
    o.num_householder = 1;
    return o;
  }
  // The sub-token chunk of the form this family's forward takes for these inputs.
  int64_t inner_chunk(const MixerInputs& in, const MixerOptions& opt) const {
    return resolve_form(in, opt) == Form::kernel ? kKernelChunk : opt.chunk_size * opt.num_householder;
  }

  std::vector<int64_t> state_shape(const MixerInputs& in) const {
    return {in.q.size(0), in.q.size(2), in.q.size(3), in.v.size(3)};
  }
  Tensor initial(const MixerInputs& in, const State& init) const {
    const auto dt = compute_dtype(in.q);
    Tensor S = state_or_zeros(init, 0, state_shape(in), in.q.options().dtype(dt));
    TORCH_CHECK(S.scalar_type() == dt, name(), ": initial_state S has dtype ", S.scalar_type(), " but inputs of dtype ",
                in.q.scalar_type(), " carry their state in ", dt);
    return S;
  }
};

CARRY_REGISTER_MIXER(GatedDeltaProduct);

}  // namespace
}  // namespace carry
