// Scalar-decay linear attention, family "scalar_decay": RetNet, Lightning, simple GLA, and the Mamba-2
// SSD core (q = C, k = B·dt, v = x, g = dt·A). S_t = exp(g_t)·S_{t-1} + k_t v_tᵀ, o_t = s·q_tᵀ S_t.
// State {S [B,H,dk,dv]}; transport scalar a = exp(Σ g) [B,H]. Forms: naive = token recurrence;
// chunkwise = per chunk, with the gate cumulated inside the chunk only: intra-chunk
// (Q Kᵀ ⊙ exp(G_t − G_s))·V (masked before exp), inter-chunk exp(G_t)·q_tᵀ S_in, then
// S_out = exp(G_C)·S_in + Σ_s exp(G_C − G_s) k_s v_sᵀ.
#include "layers/layout.h"
#include "layers/blocks/precision.h"
#ifdef CARRY_WITH_CUDA
#include "layers/kernels/decay/op.h"
#include "layers/kernels/decay/fused_op.h"
#endif

namespace carry {
namespace {

class ScalarDecay final : public Mixer {
 public:
  std::string name() const override { return "scalar_decay"; }
  std::vector<std::string> input_names() const override { return {"q", "k", "v", "g"}; }
  std::vector<std::string> state_names() const override { return {"S"}; }

  State zero_state(const MixerInputs& in, const MixerOptions&) const override {
    return {at::zeros({in.q.size(0), in.q.size(2), in.q.size(3), in.v.size(3)}, in.q.options())};
  }

  MixerOutput naive(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, false);
    auto S = initial(in, init);
    auto q = to_bhtd(in.q) * opt.scale_for(in.q.size(3)), k = to_bhtd(in.k), v = to_bhtd(in.v);
    auto a = at::exp(in.g.transpose(1, 2));  // [B,H,T]
    std::vector<Tensor> outs;
    for (int64_t t = 0; t < q.size(2); ++t) {
      S = a.select(2, t).unsqueeze(-1).unsqueeze(-1) * S +
          k.select(2, t).unsqueeze(-1) * v.select(2, t).unsqueeze(-2);
      outs.push_back(at::matmul(q.select(2, t).unsqueeze(-2), S).squeeze(-2));
    }
    return {from_bhtd(at::stack(outs, 2)), {S}};
  }

  MixerOutput chunkwise(const MixerInputs& in, const State& init,
                        const MixerOptions& opt) const override {
    check(in, opt, true);
    auto S = initial(in, init);
    int64_t C = opt.chunk_size;
    auto q = split_chunks(to_bhtd(in.q) * opt.scale_for(in.q.size(3)), C);
    auto k = split_chunks(to_bhtd(in.k), C), v = split_chunks(to_bhtd(in.v), C);
    auto g = split_chunks(in.g.transpose(1, 2), C);  // [B,H,N,C]
    auto future = causal_mask(C, false, q.options()).logical_not();
    std::vector<Tensor> outs;
    for (int64_t n = 0; n < q.size(2); ++n) {
      auto qc = q.select(2, n), kc = k.select(2, n), vc = v.select(2, n);  // [B,H,C,D]
      auto G = g.select(2, n).cumsum(-1);                                 // [B,H,C]
      auto diff = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(future, -INFINITY);
      auto att = at::matmul(qc, kc.transpose(-1, -2)) * at::exp(diff);
      outs.push_back(at::matmul(att, vc) + at::matmul(qc * at::exp(G).unsqueeze(-1), S));
      auto G_last = G.select(-1, C - 1);
      auto k_decayed = kc * at::exp(G_last.unsqueeze(-1) - G).unsqueeze(-1);
      S = at::exp(G_last).unsqueeze(-1).unsqueeze(-1) * S +
          at::matmul(k_decayed.transpose(-1, -2), vc);
    }
    return {from_bhtd(merge_chunks(at::stack(outs, 2))), {S}};
  }

#ifdef CARRY_WITH_CUDA
  // The kernel form: layers/kernels/decay/{fwd,bwd}.cu through the autograd op of layers/kernels/decay/op.cpp.
  bool has_kernel() const override { return true; }
  bool kernel_supports(const MixerInputs& in, const MixerOptions& opt) const override {
    return decay_kernel_supports(in, opt);
  }
  MixerOutput kernel(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    // Without per-chunk states where those kernels take the inputs (fused_op.h; scalar_decay_fused_set(0): off).
    if (scalar_decay_fused_supports(in, opt)) return scalar_decay_fused_form(*this, in, init, opt);
    return decay_kernel_form(*this, DecayKernel::scalar, in.g, in, init, opt);
  }
#endif

  // transport {a [B,H]}: S_out = a·S_in + S.
  // The ATen form: bf16 inputs (a kernel form's, under autocast) cast up first.
  Summary summarize(const MixerInputs& in, const MixerOptions& opt) const override {
    auto out = chunkwise(full_precision(in), {}, opt);
    return {transport(in, opt), out.final_state};
  }
  Summary compose(const Summary& x, const Summary& y) const override {
    auto a2 = y.transport[0];
    return {{a2 * x.transport[0]}, {a2.unsqueeze(-1).unsqueeze(-1) * x.state[0] + y.state[0]}};
  }
  State apply(const Summary& s, const State& x) const override {
    return {s.transport[0].unsqueeze(-1).unsqueeze(-1) * x[0] + s.state[0]};
  }
  // S_in reaches token t decayed by e^{c_t}, c_t = Σ_{u ≤ t} g_u over the slice.
  bool has_state_output(const MixerInputs&, const MixerOptions&) const override { return true; }
  Tensor state_output(const MixerInputs& in, const State& s_in, const MixerOptions& opt) const override {
    return decayed_state_readout(in.q, in.g, s_in.at(0), opt.scale_for(in.q.size(3)));
  }
  std::vector<Tensor> transport(const MixerInputs& in, const MixerOptions&) const override {
    return {at::exp(in.g.sum(1))};
  }
  // transport zero: S_out = s whatever comes in.
  std::optional<Summary> fixed_summary(const MixerInputs&, const State& s) const override {
    TORCH_CHECK(s.size() == 1 && s[0].defined() && s[0].dim() == 4, name(), ": fixed_summary expects a state {S}");
    return Summary{{at::zeros({s[0].size(0), s[0].size(1)}, s[0].options())}, {s[0]}};
  }

 private:
  Tensor initial(const MixerInputs& in, const State& init) const {
    return state_or_zeros(init, 0, {in.q.size(0), in.q.size(2), in.q.size(3), in.v.size(3)},
                          in.q.options());
  }
};

CARRY_REGISTER_MIXER(ScalarDecay);

}  // namespace
}  // namespace carry
