// hla2 and ahla composed of decay passes (decay_passes.h states the passes and why they are exact).
#include "layers/hla/decay_passes.h"

#include "layers/layout.h"

#include <cmath>
#include <tuple>

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


// normalizer_states with the read copies of a and g given: a_read, g_read are a and g one token later
// when strict (the pass then holds x_{t−1} at token t), a and g otherwise.
std::pair<Tensor, Tensor> normalizer_states_read(const DecayPass& pass, const Tensor& a, const Tensor& a_read,
                                                 const Tensor& e, const Tensor& f, const Tensor& g,
                                                 const Tensor& g_read, const Tensor& x0, const Tensor& y0,
                                                 bool strict) {
  const int64_t T = a.size(1);
  const auto dt = x0.scalar_type();
  // w_t = f_tᵀ x_t (x_{t−1} when strict): the pass's read-out of x, carried in a ones column.
  auto pad = x0.sizes().vec();
  pad.push_back(kNormalizerColumns - 1);
  Tensor X0 = at::cat({x0.unsqueeze(-1), at::zeros(pad, x0.options())}, -1);
  auto block = f.sizes().vec();
  block.back() = kNormalizerColumns;
  Tensor ones = at::zeros(block, f.options());
  ones.select(-1, 0).fill_(1);
  auto [r, X] = pass(f, a_read, ones, g_read, X0, 1.0);
  Tensor w = r.select(-1, 0).to(dt), x = X.select(-1, 0);  // w [B,T,H]
  if (strict) {  // the pass ends at x_{T−1}: the last token's step
    Tensor last = a.select(1, T - 1).to(dt);
    x = g.defined() ? x * g.select(1, T - 1).to(dt).exp().unsqueeze(-1) + last : x + last;
  }
  // y_T = e^{G_T} y_0 + Σ_t e^{G_T − G_t} e_t w_t: each exponent the sum of the gates after t (never
  // positive), summed from the end.
  // In [B,H,T], where the sums run along the innermost dimension.
  Tensor ed = e.to(dt), wt = w.transpose(1, 2);
  if (!g.defined()) return {x, y0 + at::einsum("bht,bthd->bhd", {wt, ed})};
  Tensor from = g.to(dt).transpose(1, 2).flip({-1}).cumsum(-1).flip({-1});  // Σ_{r ≥ t} g_r
  Tensor after = at::cat({from.narrow(-1, 1, T - 1), at::zeros_like(from.narrow(-1, 0, 1))}, -1);
  Tensor y = y0 * from.select(-1, 0).exp().unsqueeze(-1) + at::einsum("bht,bthd->bhd", {wt * after.exp(), ed});
  return {x, y};
}

}  // namespace

std::pair<Tensor, Tensor> normalizer_states(const DecayPass& pass, const Tensor& a, const Tensor& e, const Tensor& f,
                                            const Tensor& g, const Tensor& x0, const Tensor& y0, bool strict) {
  if (!strict) return normalizer_states_read(pass, a, a, e, f, g, g, x0, y0, false);
  return normalizer_states_read(pass, a, later(a), e, f, g, g.defined() ? later(g) : Tensor(), x0, y0, true);
}

MixerOutput hla2_by_decay_passes(const MixerInputs& in, const State& init, const MixerOptions& opt,
                                 const DecayPass& pass, bool joint_read) {
  const int64_t B = in.q.size(0), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3);
  const auto dt = state_dtype(in.q);
  const auto so = in.q.options().dtype(dt);
  const Tensor &q = in.q, &k = in.k;
  // The gate in the states' dtype: its gradient from every pass is summed there and rounded once.
  const Tensor g = in.g.defined() ? in.g.to(dt) : in.g;
  Tensor S0 = state_or_zeros(init, 0, {B, H, dk, dk}, so).to(dt);
  Tensor C0 = state_or_zeros(init, 1, {B, H, dk, dv}, so).to(dt), m0 = state_or_zeros(init, 2, {B, H, dk}, so).to(dt);
  Tensor G0 = state_or_zeros(init, 3, {B, H, dk, dv}, so).to(dt), h0 = state_or_zeros(init, 4, {B, H, dk}, so).to(dt);
  const bool ones = opt.normalize;  // the normalizer rides in the passes only when the output reads it
  const double scale = opt.scale_for(dk);
  // Without the normalizer the reads of passes 1 and 4 carry the scale (a scaled R makes SC scaled), and
  // o = SC − Gq is one subtraction, rounded once.
  const double read_scale = ones ? 1.0 : scale;
  Tensor v = ones ? value_block(in.v) : in.v;
  if (ones) C0 = state_block(C0, m0, dt), G0 = state_block(G0, h0, dt);
  const int64_t w = v.size(-1);
  Tensor q_before = later(q), g_before = g.defined() ? later(g) : Tensor();
  Tensor W = pass(k, q_before, later(v), g_before, C0, 1.0).first;
  Tensor R, S_T, Gq, G_T;
  if (joint_read) {  // passes 1 and 4 read the same q through the same keys k: one pass, values [k, W]
    auto [RG, SG_T] = pass(q, k, at::cat({k, W}, -1), g, at::cat({S0, G0}, -1), read_scale);
    auto parts = RG.split_with_sizes({dk, w}, -1);  // one concatenation of the gradients in the backward
    R = parts[0], Gq = parts[1];
    S_T = SG_T.narrow(-1, 0, dk), G_T = SG_T.narrow(-1, dk, w);
  } else {
    std::tie(R, S_T) = pass(q, k, k, g, S0, read_scale);
    std::tie(Gq, G_T) = pass(q, k, W, g, G0, read_scale);
  }
  auto [SC, C_T] = pass(R, q, v, g, C0, 1.0);
  if (!ones) {
    auto [m, h] = normalizer_states_read(pass, q, q_before, k, k, g, g_before, m0, h0, /*strict=*/true);
    return {at::sub(SC, Gq).to(in.q.scalar_type()), {S_T, C_T, m, G_T, h}};
  }
  Tensor Y = SC.to(dt) - Gq.to(dt);
  auto [C, m] = split_block(C_T, dv);
  auto [G, h] = split_block(G_T, dv);
  return {readout(Y, dv, opt, scale, in.q.scalar_type()), {S_T, C, m, G, h}};
}

MixerOutput ahla_by_decay_passes(const MixerInputs& in, const State& init, const MixerOptions& opt,
                                 const DecayPass& pass) {
  const int64_t B = in.q.size(0), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3);
  const auto dt = state_dtype(in.q);
  const auto so = in.q.options().dtype(dt);
  Tensor P0 = state_or_zeros(init, 0, {B, H, dk, dv}, so).to(dt), mK0 = state_or_zeros(init, 1, {B, H, dk}, so).to(dt);
  Tensor E0 = state_or_zeros(init, 2, {B, H, dk, dv}, so).to(dt), n0 = state_or_zeros(init, 3, {B, H, dk}, so).to(dt);
  const Tensor &q = in.q, &k = in.k;
  const Tensor g = in.g.defined() ? in.g.to(dt) : in.g;  // its gradient summed in the states' dtype
  const double scale = opt.scale_for(dk);
  // The ones column when the output reads the normalizer, or when a cut must give the whole's bits.
  if (!opt.normalize && !opt.serial_states) {  // the second pass's read, scaled, is the output
    auto [Y, P_T] = pass(q, k, in.v, g, P0, 1.0);
    auto [Z, E_T] = pass(q, k, Y, g, E0, scale);
    auto [mK, n] = normalizer_states(pass, k, k, q, g, mK0, n0, /*strict=*/false);
    return {Z.to(in.q.scalar_type()), {P_T, mK, E_T, n}};
  }
  auto [Y, P_T] = pass(q, k, value_block(in.v), g, state_block(P0, mK0, dt), 1.0);
  auto [Z, E_T] = pass(q, k, Y, g, state_block(E0, n0, dt), 1.0);
  auto [P, mK] = split_block(P_T, dv);
  auto [E, n] = split_block(E_T, dv);
  return {readout(Z.to(dt), dv, opt, scale, in.q.scalar_type()), {P, mK, E, n}};
}

}  // namespace carry
