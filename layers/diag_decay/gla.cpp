// Gated Linear Attention, family "gla": S_t = diag(exp(gk_t)) S_{t-1} + k_t v_tᵀ, o_t = scale·q_tᵀ S_t,
// gk [B,T,H,dk] a log decay per key dimension. State {S [B,H,dk,dv]}; transport diagonal, the decay
// factors Π_t exp(gk_t) per key dimension, [B,H,dk]; a summary is (transport, {S from zero}) and
// composes as (A2⊙A1, A2⊙B1 + B2). Forms: naive = token recurrence; chunkwise = diag_decay_chunkwise
// (per chunk: gates cumulated from the chunk start, an exact C×C intra-chunk mixing through pairwise
// gate differences masked before exp, the carried state in and out). MixerOptions::normalize is not
// used by this family.
#include "layers/diag_decay/gla.h"

#include "layers/diag_decay/decayed_pairs.h"

#include "layers/layout.h"
#include "layers/blocks/precision.h"
#ifdef CARRY_WITH_CUDA
#include "layers/kernels/decay/op.h"
#endif

#include <limits>

namespace carry {

DiagDecayResult diag_decay_chunkwise(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                     const Tensor& gk_in, const Tensor& initial_state,
                                     int64_t chunk_size, double scale) {
  const int64_t C = chunk_size;
  TORCH_INTERNAL_ASSERT(C > 0 && q_in.size(1) % C == 0);
  auto q = split_chunks(to_bhtd(q_in) * scale, C);  // [B,H,N,C,dk]
  auto k = split_chunks(to_bhtd(k_in), C);
  auto v = split_chunks(to_bhtd(v_in), C);          // [B,H,N,C,dv]
  auto gk = split_chunks(to_bhtd(gk_in), C);

  Tensor S = initial_state;
  Tensor transport;
  std::vector<Tensor> outs;
  for (int64_t n = 0; n < q.size(2); ++n) {
    auto qc = q.select(2, n), kc = k.select(2, n), vc = v.select(2, n);  // [B,H,C,D]
    auto G = gk.select(2, n).cumsum(-2);                                // restarts every chunk
    // Intra-chunk: A[t,s] = Σ_d q_td k_sd exp(G_td − G_sd), s ≤ t (layers/diag_decay/decayed_pairs.h).
    auto att = decayed_pairs(qc, G, kc, G, /*strict=*/false);  // [B,H,C,C]
    // Inter-chunk: the incoming state decayed to each position.
    outs.push_back(at::matmul(att, vc) + at::matmul(qc * G.exp(), S));
    auto G_last = G.select(-2, C - 1);  // [B,H,dk]
    auto decay = G_last.exp();
    auto k_to_end = kc * (G_last.unsqueeze(-2) - G).exp();
    S = decay.unsqueeze(-1) * S + at::matmul(k_to_end.transpose(-1, -2), vc);
    transport = transport.defined() ? transport * decay : decay;
  }
  return {from_bhtd(merge_chunks(at::stack(outs, 2))), S, transport};
}

Summary diag_decay_compose(const Summary& first, const Summary& second) {
  TORCH_INTERNAL_ASSERT(first.transport.size() == 1 && second.transport.size() == 1);
  TORCH_INTERNAL_ASSERT(first.state.size() == 1 && second.state.size() == 1);
  const Tensor& A2 = second.transport[0];
  return {{A2 * first.transport[0]}, {A2.unsqueeze(-1) * first.state[0] + second.state[0]}};
}

State diag_decay_apply(const Summary& summary, const State& state) {
  TORCH_INTERNAL_ASSERT(summary.transport.size() == 1 && summary.state.size() == 1);
  TORCH_CHECK(state.size() == 1, "a diagonal-decay state has one entry, got ", state.size());
  TORCH_CHECK(state[0].sizes() == summary.state[0].sizes(), "state must have shape ",
              shape_str(summary.state[0].sizes()), ", got ", shape_str(state[0].sizes()));
  return {summary.transport[0].unsqueeze(-1) * state[0] + summary.state[0]};
}

namespace {
std::vector<int64_t> diag_state_shape(const MixerInputs& in) {
  // H from v: Mamba-1's q has one head shared by all (Mixer::broadcasts_heads).
  return {in.q.size(0), in.v.size(2), in.q.size(3), in.v.size(3)};
}
}  // namespace

State DiagonalDecayMixer::zero_state(const MixerInputs& in, const MixerOptions&) const {
  return {at::zeros(diag_state_shape(in), in.q.options())};
}

Tensor DiagonalDecayMixer::initial(const MixerInputs& in, const State& init) const {
  TORCH_CHECK(init.size() <= 1, name(), ": initial_state has one entry (", state_names()[0], "), got ",
              init.size());
  return state_or_zeros(init, 0, diag_state_shape(in), in.q.options());
}

MixerOutput DiagonalDecayMixer::chunkwise(const MixerInputs& in, const State& init,
                                          const MixerOptions& opt) const {
  check(in, opt, true);
  auto r = diag_decay_chunkwise(in.q, in.k, in.v, in.gk, initial(in, init), opt.chunk_size,
                                output_scale(in, opt));
  return {r.o, {r.S}};
}

// The ATen form: bf16 inputs (a kernel form's, under autocast) cast up first.
Summary DiagonalDecayMixer::summarize(const MixerInputs& raw, const MixerOptions& opt) const {
  const MixerInputs in = full_precision(raw);
  check(in, opt, true);
  auto r = diag_decay_chunkwise(in.q, in.k, in.v, in.gk, initial(in, {}), opt.chunk_size,
                                output_scale(in, opt));
  return {{r.transport}, {r.S}};
}

Tensor DiagonalDecayMixer::state_output(const MixerInputs& in, const State& s_in, const MixerOptions& opt) const {
  return decayed_state_readout(in.q, in.gk, s_in.at(0), output_scale(in, opt));
}

std::vector<Tensor> DiagonalDecayMixer::transport(const MixerInputs& in, const MixerOptions&) const {
  return {at::exp(in.gk.sum(1))};
}

std::optional<Summary> DiagonalDecayMixer::fixed_summary(const MixerInputs&, const State& s) const {
  TORCH_CHECK(s.size() == 1 && s[0].defined() && s[0].dim() == 4, name(), ": fixed_summary expects a state {S}");
  return Summary{{at::zeros({s[0].size(0), s[0].size(1), s[0].size(2)}, s[0].options())}, {s[0]}};
}

Summary DiagonalDecayMixer::compose(const Summary& a, const Summary& b) const {
  return diag_decay_compose(a, b);
}

State DiagonalDecayMixer::apply(const Summary& s, const State& x) const {
  return diag_decay_apply(s, x);
}

namespace {

class GatedLinearAttention final : public DiagonalDecayMixer {
 public:
  std::string name() const override { return "gla"; }
  std::vector<std::string> state_names() const override { return {"S"}; }

  MixerOutput naive(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, false);
    auto S = initial(in, init);
    auto q = to_bhtd(in.q) * opt.scale_for(in.q.size(3)), k = to_bhtd(in.k), v = to_bhtd(in.v);
    auto gk = to_bhtd(in.gk);
    std::vector<Tensor> outs;
    for (int64_t t = 0; t < q.size(2); ++t) {
      auto kt = k.select(2, t), vt = v.select(2, t), qt = q.select(2, t);
      S = gk.select(2, t).exp().unsqueeze(-1) * S + kt.unsqueeze(-1) * vt.unsqueeze(-2);
      outs.push_back(at::matmul(qt.unsqueeze(-2), S).squeeze(-2));
    }
    return {from_bhtd(at::stack(outs, 2)), {S}};
  }


#ifdef CARRY_WITH_CUDA
  // The kernel form: layers/kernels/decay/{fwd,bwd}.cu through the autograd op of layers/kernels/decay/op.cpp.
  bool has_kernel() const override { return true; }
  bool kernel_supports(const MixerInputs& in, const MixerOptions& opt) const override {
    return decay_kernel_supports(in, opt);
  }
  MixerOutput kernel(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    return decay_kernel_form(*this, DecayKernel::diag, in.gk, in, init, opt);
  }
#endif
 protected:
  double output_scale(const MixerInputs& in, const MixerOptions& opt) const override {
    return opt.scale_for(in.q.size(3));
  }
};

CARRY_REGISTER_MIXER(GatedLinearAttention);

}  // namespace
}  // namespace carry
