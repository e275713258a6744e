// hla2 and ahla composed of decay passes (decay_passes.h states the passes and why they are exact).
#include "layers/hla/decay_passes.h"

#include "layers/layout.h"

namespace carry {
namespace {

// The states' dtype: fp64 for fp64 inputs, else fp32.
at::ScalarType state_dtype(const Tensor& q) { return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// x one token later along T: ←x_t = x_{t−1}, ←x_0 = 0.
Tensor later(const Tensor& x) {
  const int64_t T = x.size(1);
  return at::cat({at::zeros_like(x.narrow(1, 0, 1)), x.narrow(1, 0, T - 1)}, 1);
}

// v' = [v, 1, 0…].
Tensor value_block(const Tensor& v) {
  auto s = v.sizes().vec();
  s.back() = kNormalizerColumns;
  Tensor extra = at::zeros(s, v.options());
  extra.select(-1, 0).fill_(1);
  return at::cat({v, extra}, -1);
}

// [value, norm, 0…] ([B,H,dk,dv] and [B,H,dk]) as the states of the passes.
Tensor state_block(const Tensor& value, const Tensor& norm, at::ScalarType dt) {
  auto s = value.sizes().vec();
  s.back() = kNormalizerColumns - 1;
  return at::cat({value.to(dt), norm.to(dt).unsqueeze(-1), at::zeros(s, value.options().dtype(dt))}, -1);
}

// Back: the value columns and the normalizer column.
std::pair<Tensor, Tensor> split_block(const Tensor& block, int64_t dv) {
  return {block.narrow(-1, 0, dv), block.select(-1, dv)};
}

// o = s·Y[:, :dv], normalized s·Y[:, :dv] / (s·Y[:, dv] + eps), in `out` dtype.
Tensor readout(const Tensor& y, int64_t dv, const MixerOptions& opt, double scale, at::ScalarType out) {
  Tensor o = y.narrow(-1, 0, dv) * scale;
  if (opt.normalize) o = o / (y.narrow(-1, dv, 1) * scale + opt.eps);
  return o.to(out);
}


}  // namespace

MixerOutput hla2_by_decay_passes(const MixerInputs& in, const State& init, const MixerOptions& opt,
                                 const DecayPass& pass) {
  const int64_t B = in.q.size(0), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3);
  const auto dt = state_dtype(in.q);
  const auto so = in.q.options().dtype(dt);
  Tensor S0 = state_or_zeros(init, 0, {B, H, dk, dk}, so).to(dt);
  Tensor C0 = state_block(state_or_zeros(init, 1, {B, H, dk, dv}, so), state_or_zeros(init, 2, {B, H, dk}, so), dt);
  Tensor G0 = state_block(state_or_zeros(init, 3, {B, H, dk, dv}, so), state_or_zeros(init, 4, {B, H, dk}, so), dt);
  const Tensor &q = in.q, &k = in.k, &g = in.g;
  Tensor v = value_block(in.v);
  auto [R, S_T] = pass(q, k, k, g, S0);
  Tensor W = pass(k, later(q), later(v), g.defined() ? later(g) : Tensor(), C0).first;
  auto [SC, C_T] = pass(R, q, v, g, C0);
  auto [Gq, G_T] = pass(q, k, W, g, G0);
  Tensor Y = SC.to(dt) - Gq.to(dt);
  auto [C, m] = split_block(C_T, dv);
  auto [G, h] = split_block(G_T, dv);
  return {readout(Y, dv, opt, opt.scale_for(dk), in.q.scalar_type()), {S_T, C, m, G, h}};
}

MixerOutput ahla_by_decay_passes(const MixerInputs& in, const State& init, const MixerOptions& opt,
                                 const DecayPass& pass) {
  const int64_t B = in.q.size(0), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3);
  const auto dt = state_dtype(in.q);
  const auto so = in.q.options().dtype(dt);
  Tensor P0 = state_block(state_or_zeros(init, 0, {B, H, dk, dv}, so), state_or_zeros(init, 1, {B, H, dk}, so), dt);
  Tensor E0 = state_block(state_or_zeros(init, 2, {B, H, dk, dv}, so), state_or_zeros(init, 3, {B, H, dk}, so), dt);
  const Tensor &q = in.q, &k = in.k, &g = in.g;
  Tensor v = value_block(in.v);
  auto [Y, P_T] = pass(q, k, v, g, P0);
  auto [Z, E_T] = pass(q, k, Y, g, E0);
  auto [P, mK] = split_block(P_T, dv);
  auto [E, n] = split_block(E_T, dv);
  return {readout(Z.to(dt), dv, opt, opt.scale_for(dk), in.q.scalar_type()), {P, mK, E, n}};
}

}  // namespace carry
