// Linear attention, family "linear_attn": S_t = S_{t-1} + k_t v_tᵀ, z_t = z_{t-1} + k_t,
// o_t = (s·q_t)ᵀ S_t, or with `normalize` o_t = (s·q_t)ᵀ S_t / ((s·q_t)ᵀ z_t + eps).
// State (S [B,H,dk,dv], z [B,H,dk]); transport is the identity (no tensors), so a summary is just the
// slice's (S, z) from zero and compose adds. Forms: naive = token recurrence; chunkwise = per chunk a
// causal C×C product plus the incoming state, state carried chunk to chunk in order.
#include "layers/linear_attn/linear_attn.h"

#include "layers/layout.h"
#include "layers/blocks/precision.h"
#ifdef CARRY_WITH_CUDA
#include "layers/kernels/decay/op.h"
#include "layers/kernels/decay/fused_op.h"
#endif

namespace carry {

Tensor elu_feature_map(const Tensor& x) { return at::elu(x) + 1; }

namespace {

class LinearAttention final : public Mixer {
 public:
  std::string name() const override { return "linear_attn"; }
  std::vector<std::string> input_names() const override { return {"q", "k", "v"}; }
  std::vector<std::string> state_names() const override { return {"S", "z"}; }

  State zero_state(const MixerInputs& in, const MixerOptions&) const override {
    int64_t B = in.q.size(0), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3);
    auto opt = in.q.options();
    return {at::zeros({B, H, dk, dv}, opt), at::zeros({B, H, dk}, opt)};
  }

  MixerOutput naive(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, false);
    auto [S, z] = initial(in, init);
    auto q = to_bhtd(in.q) * opt.scale_for(in.q.size(3)), k = to_bhtd(in.k), v = to_bhtd(in.v);
    std::vector<Tensor> outs;
    for (int64_t t = 0; t < q.size(2); ++t) {
      auto kt = k.select(2, t), vt = v.select(2, t), qt = q.select(2, t);
      S = S + kt.unsqueeze(-1) * vt.unsqueeze(-2);
      z = z + kt;
      auto o = at::matmul(qt.unsqueeze(-2), S).squeeze(-2);
      if (opt.normalize) o = o / ((qt * z).sum(-1, true) + opt.eps);
      outs.push_back(o);
    }
    return {from_bhtd(at::stack(outs, 2)), {S, z}};
  }

  MixerOutput chunkwise(const MixerInputs& in, const State& init,
                        const MixerOptions& opt) const override {
    check(in, opt, true);
    auto [S, z] = initial(in, init);
    int64_t C = opt.chunk_size;
    auto q = split_chunks(to_bhtd(in.q) * opt.scale_for(in.q.size(3)), C);
    auto k = split_chunks(to_bhtd(in.k), C), v = split_chunks(to_bhtd(in.v), C);
    auto mask = causal_mask(C, false, q.options());
    std::vector<Tensor> outs;
    for (int64_t n = 0; n < q.size(2); ++n) {
      auto qc = q.select(2, n), kc = k.select(2, n), vc = v.select(2, n);  // [B,H,C,D]
      auto att = at::matmul(qc, kc.transpose(-1, -2)).masked_fill(mask.logical_not(), 0);
      auto o = at::matmul(att, vc) + at::matmul(qc, S);
      if (opt.normalize) {
        // q_tᵀ z_t = q_tᵀ z_in + Σ_{s≤t} q_t·k_s
        auto den = att.sum(-1, true) + at::matmul(qc, z.unsqueeze(-1));
        o = o / (den + opt.eps);
      }
      outs.push_back(o);
      S = S + at::matmul(kc.transpose(-1, -2), vc);
      z = z + kc.contiguous().sum(-2);  // contiguous: the same summation order for any head count
    }
    return {from_bhtd(merge_chunks(at::stack(outs, 2))), {S, z}};
  }

#ifdef CARRY_WITH_CUDA
  // The kernel form: layers/kernels/decay/{fwd,bwd}.cu through the autograd op of layers/kernels/decay/op.cpp.
  bool has_kernel() const override { return true; }
  bool kernel_supports(const MixerInputs& in, const MixerOptions& opt) const override {
    return decay_kernel_supports(in, opt);
  }
  MixerOutput kernel(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, /*chunked=*/true);
    check_decay_kernel_supports(name(), in, opt);
    // The kernels carry S; the normalizer's state z is a running sum of k, done here in fp32.
    const Tensor S0 = init.empty() ? Tensor() : init[0];
    const double scale = opt.scale_for(in.q.size(3));
    // Normalized, the gradient of q is a difference of two near-equal terms: bf16 rounding of the
    // numerator or of o's gradient would show in it, so the kernels then read fp32 copies and o is fp32.
    const auto kdt = opt.normalize ? at::kFloat : in.q.scalar_type();
    // Without per-chunk states where the fused kernels take the inputs (fused_op.h; linear_attn_fused_set(0): off).
    auto [num, S] = linear_attn_fused_supports(in, opt)
                        ? linear_attn_fused_forward(in.q, in.k, in.v, S0, scale)
                        : decay_kernel_forward(DecayKernel::none, in.q.to(kdt), in.k.to(kdt), in.v.to(kdt), Tensor(),
                                               S0, scale, opt.serial_states);
    const auto f32 = in.k.options().dtype(at::kFloat);
    Tensor z0 = init.size() > 1 && init[1].defined() ? init[1].to(at::kFloat)
                                                     : at::zeros({in.q.size(0), in.q.size(2), in.q.size(3)}, f32);
    // Summed in fp32 straight from k's dtype: an fp32 copy of k first cost a write and a read of 4·T·H·dk
    // bytes (H100, H=16, dk=128, T=131072: about 1 ms of a 3.7 ms forward).
    Tensor z = z0 + at::sum(in.k, {1}, /*keepdim=*/false, at::kFloat);
    if (!opt.normalize) return {num, {S, z}};
    auto zt = z0.unsqueeze(1) + at::cumsum(in.k, 1, at::kFloat);  // [B,T,H,dk]: z after each token
    auto den = (in.q.to(at::kFloat) * scale * zt).sum(-1, /*keepdim=*/true) + opt.eps;
    // o stays fp32: its gradient reaches the cancelling terms unrounded (the layer casts it after).
    return {num.to(at::kFloat) / den, {S, z}};
  }
#endif

  // The ATen form: bf16 inputs (a kernel form's, under autocast) cast up first.
  Summary summarize(const MixerInputs& in, const MixerOptions& opt) const override {
    auto out = chunkwise(full_precision(in), {}, opt);
    return {{}, out.final_state};
  }
  Summary compose(const Summary& a, const Summary& b) const override {
    return {{}, {a.state[0] + b.state[0], a.state[1] + b.state[1]}};
  }
  State apply(const Summary& s, const State& x) const override {
    return {x[0] + s.state[0], x[1] + s.state[1]};
  }
  // Without the normalizer the output is linear in S_in: scale·q_t·S_in (the normalized output is not).
  bool has_state_output(const MixerInputs&, const MixerOptions& opt) const override { return !opt.normalize; }
  Tensor state_output(const MixerInputs& in, const State& s_in, const MixerOptions& opt) const override {
    TORCH_CHECK(!opt.normalize, name(), ": the normalized output is not linear in the incoming state");
    return decayed_state_readout(in.q, Tensor(), s_in.at(0), opt.scale_for(in.q.size(3)));
  }
  std::vector<Tensor> transport(const MixerInputs&, const MixerOptions&) const override { return {}; }
  // The identity is the only transport (no tensors): a summary of the end ranks' kind (Mixer::fixed_summary),
  // whose transport no rank reads, is the state alone.
  std::optional<Summary> fixed_summary(const MixerInputs&, const State& s) const override {
    TORCH_CHECK(s.size() == 2 && s[0].defined() && s[1].defined(), name(), ": fixed_summary expects a state {S, z}");
    return Summary{{}, s};
  }

 private:
  std::pair<Tensor, Tensor> initial(const MixerInputs& in, const State& init) const {
    int64_t B = in.q.size(0), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3);
    auto opt = in.q.options();
    return {state_or_zeros(init, 0, {B, H, dk, dv}, opt), state_or_zeros(init, 1, {B, H, dk}, opt)};
  }
};

CARRY_REGISTER_MIXER(LinearAttention);

}  // namespace
}  // namespace carry
