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


// The inclusive scan x_c = a_c x_{c−1} + b_c along dim 2 of b [B,H,N,d] with a [B,H,N] in [0, 1] and
// x_{−1} = x0 [B,H,d]: every x_c [B,H,N,d]. By doubling (log₂ N steps); the weights are products of
// decays, never quotients.
Tensor decayed_scan(Tensor a, Tensor b, const Tensor& x0) {
  const int64_t N = b.size(2);
  for (int64_t off = 1; off < N; off *= 2) {
    Tensor a_pre = at::cat({at::ones_like(a.narrow(2, 0, off)), a.narrow(2, 0, N - off)}, 2);
    Tensor b_pre = at::cat({at::zeros_like(b.narrow(2, 0, off)), b.narrow(2, 0, N - off)}, 2);
    b = b + a.unsqueeze(-1) * b_pre;
    a = a * a_pre;
  }
  return b + a.unsqueeze(-1) * x0.unsqueeze(2);
}

}  // namespace

std::pair<Tensor, Tensor> normalizer_states(const Tensor& a, const Tensor& e, const Tensor& f, const Tensor& g,
                                            const Tensor& x0, const Tensor& y0, bool strict, int64_t L) {
  const int64_t B = a.size(0), T = a.size(1), H = a.size(2), d = a.size(3);
  const auto dt = x0.scalar_type();
  const int64_t N = (T + L - 1) / L, pad = N * L - T;
  // [B,T,H,·] → [B,H,N,L,·] in the states' dtype, zero tokens after T (they add nothing and do not decay);
  // one copy a distinct input.
  std::vector<std::pair<const void*, Tensor>> done;
  auto chunks = [&](const Tensor& x) {
    for (auto& [ptr, t] : done)
      if (ptr == x.unsafeGetTensorImpl()) return t;
    Tensor y = x.transpose(1, 2).to(dt).contiguous();
    if (pad) y = at::constant_pad_nd(y, {0, 0, 0, pad});
    y = y.view({B, H, N, L, d});
    done.emplace_back(x.unsafeGetTensorImpl(), y);
    return y;
  };
  Tensor A = chunks(a), E = chunks(e), F = chunks(f);
  Tensor gc;  // [B,H,N,L]
  if (g.defined()) {
    gc = g.transpose(1, 2).to(dt);
    if (pad) gc = at::constant_pad_nd(gc, {0, pad});
    gc = gc.reshape({B, H, N, L});
  } else {
    gc = at::zeros({B, H, N, L}, x0.options());
  }
  Tensor Gc = gc.cumsum(-1);                 // the decay from the chunk's start through token i
  Tensor Gr = strict ? Gc - gc : Gc;          // ... through the token x is read at (i−1 when strict)
  Tensor last = Gc.narrow(-1, L - 1, 1);      // the chunk's whole decay [B,H,N,1]
  Tensor to_end = (last - Gc).exp();          // e^{decay from token i to the chunk's end}
  Tensor chunk_decay = last.squeeze(-1).exp();
  // Token i reads Σ_{j ≤ i (j < i when strict)} e^{Gr_i − Gc_j} (f_i·a_j) + e^{Gr_i} (f_i·x at the chunk's start).
  Tensor keep = at::ones({L, L}, at::TensorOptions().dtype(at::kBool).device(a.device())).tril(strict ? -1 : 0);
  Tensor pair_decay = (Gr.unsqueeze(-1) - Gc.unsqueeze(-2)).masked_fill(keep.logical_not(), -INFINITY).exp();
  Tensor w = (at::matmul(F, A.transpose(-1, -2)) * pair_decay).sum(-1);                      // [B,H,N,L]
  Tensor x_end = decayed_scan(chunk_decay, at::matmul(to_end.unsqueeze(-2), A).squeeze(-2), x0);  // [B,H,N,d]
  Tensor x_start = at::cat({x0.unsqueeze(2), x_end.narrow(2, 0, N - 1)}, 2);
  w = w + Gr.exp() * at::matmul(F, x_start.unsqueeze(-1)).squeeze(-1);
  Tensor y_end = decayed_scan(chunk_decay, at::matmul((to_end * w).unsqueeze(-2), E).squeeze(-2), y0);
  return {x_end.select(2, N - 1), y_end.select(2, N - 1)};
}

MixerOutput hla2_by_decay_passes(const MixerInputs& in, const State& init, const MixerOptions& opt,
                                 const DecayPass& pass, bool joint_read) {
  const int64_t B = in.q.size(0), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3);
  const auto dt = state_dtype(in.q);
  const auto so = in.q.options().dtype(dt);
  const Tensor &q = in.q, &k = in.k, &g = in.g;
  Tensor S0 = state_or_zeros(init, 0, {B, H, dk, dk}, so).to(dt);
  Tensor C0 = state_or_zeros(init, 1, {B, H, dk, dv}, so).to(dt), m0 = state_or_zeros(init, 2, {B, H, dk}, so).to(dt);
  Tensor G0 = state_or_zeros(init, 3, {B, H, dk, dv}, so).to(dt), h0 = state_or_zeros(init, 4, {B, H, dk}, so).to(dt);
  const bool ones = opt.normalize;  // the normalizer rides in the passes only when the output reads it
  Tensor v = ones ? value_block(in.v) : in.v;
  if (ones) C0 = state_block(C0, m0, dt), G0 = state_block(G0, h0, dt);
  const int64_t w = v.size(-1);
  Tensor W = pass(k, later(q), later(v), g.defined() ? later(g) : Tensor(), C0).first;
  Tensor R, S_T, Gq, G_T;
  if (joint_read) {  // passes 1 and 4 read the same q through the same keys k: one pass, values [k, W]
    auto [RG, SG_T] = pass(q, k, at::cat({k, W}, -1), g, at::cat({S0, G0}, -1));
    R = RG.narrow(-1, 0, dk), Gq = RG.narrow(-1, dk, w);
    S_T = SG_T.narrow(-1, 0, dk), G_T = SG_T.narrow(-1, dk, w);
  } else {
    std::tie(R, S_T) = pass(q, k, k, g, S0);
    std::tie(Gq, G_T) = pass(q, k, W, g, G0);
  }
  auto [SC, C_T] = pass(R, q, v, g, C0);
  Tensor Y = SC.to(dt) - Gq.to(dt);
  Tensor C = C_T, m, G = G_T, h;
  if (ones) {
    std::tie(C, m) = split_block(C_T, dv);
    std::tie(G, h) = split_block(G_T, dv);
  } else {
    std::tie(m, h) = normalizer_states(q, k, k, g, m0, h0, /*strict=*/true);
  }
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
