// Log-linear Gated DeltaNet's levels above the chunk in one walk (level_walk.h states the math).
#include "layers/log_linear/level_walk.h"

#include <torch/csrc/autograd/custom_function.h>

#ifdef CARRY_WITH_CUDA
#include "layers/kernels/log_linear/api.h"
#endif

#include <vector>

namespace carry {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::ScalarType accumulation(const Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// The chunk-by-level flags, made on `o`'s device in its dtype: read [N,J] (the chunk is in the second half of
// its block at that level) and keep [N,J] (0 where a block of the level starts at the chunk, after the
// first chunk).
struct Flags {
  Tensor read, keep;
  std::vector<bool> any_reset;  // [N]: whether some level starts a block at chunk n (n > 0)
};
Flags flags_of(const LevelWalkPlace& pl, int64_t N, int64_t J, const at::TensorOptions& o) {
  Flags f;
  auto lo = o.dtype(at::kLong);
  auto pos = (at::arange(N, lo) * pl.chunk + pl.offset).reshape({N, 1});
  auto level = (at::arange(J, lo) + pl.first_level).reshape({1, J});
  f.read = at::bitwise_and(at::bitwise_right_shift(pos, level - 1), 1).to(o);
  auto starts = at::bitwise_and(pos, at::bitwise_left_shift(at::ones_like(level), level) - 1).eq(0);
  starts.narrow(0, 0, 1).fill_(false);
  f.keep = starts.logical_not().to(o);
  f.any_reset.assign(N, false);
  for (int64_t n = 1; n < N; ++n) {
    const int64_t p = pl.offset + n * pl.chunk;
    f.any_reset[n] = (p & ((int64_t{1} << pl.first_level) - 1)) == 0;  // the lowest level's blocks are the finest
  }
  return f;
}

void check_pieces(const Tensor& W, const Tensor& U, const Tensor& Kt, const Tensor& P, const Tensor& gamma,
                  const Tensor& lam, const Tensor& X0, const LevelWalkPlace& pl) {
  TORCH_CHECK(W.dim() == 3 && Kt.sizes() == W.sizes() && P.sizes() == W.sizes(),
              "level_walk: W, K̃ and P must be [BH,T,dk] of one shape, got ", W.sizes(), ", ", Kt.sizes(), ", ",
              P.sizes());
  const int64_t BH = W.size(0), T = W.size(1);
  TORCH_CHECK(pl.chunk > 0 && (pl.chunk & (pl.chunk - 1)) == 0 && T % pl.chunk == 0 && pl.offset % pl.chunk == 0,
              "level_walk: the chunk must be a power of two dividing T and the offset, got chunk ", pl.chunk, ", T ", T,
              ", offset ", pl.offset);
  TORCH_CHECK((int64_t{1} << (pl.first_level - 1)) >= pl.chunk,
              "level_walk: the first level's halves must hold whole chunks, got level ", pl.first_level, " and chunk ",
              pl.chunk);
  TORCH_CHECK(U.dim() == 3 && U.size(0) == BH && U.size(1) == T, "level_walk: U must be [", BH, ",", T, ",dv], got ",
              U.sizes());
  TORCH_CHECK(gamma.sizes() == at::IntArrayRef({BH, T / pl.chunk}), "level_walk: gamma must be [", BH, ",",
              T / pl.chunk, "], got ", gamma.sizes());
  TORCH_CHECK(lam.dim() == 3 && lam.size(0) == BH && lam.size(2) == T && lam.size(1) >= 1,
              "level_walk: lam must be [", BH, ",J,", T, "], got ", lam.sizes());
  TORCH_CHECK(!X0.defined() || X0.sizes() == at::IntArrayRef({lam.size(1), BH, W.size(2), U.size(2)}),
              "level_walk: X0 must be [", lam.size(1), ",", BH, ",", W.size(2), ",", U.size(2), "], got ", X0.sizes());
}

struct WalkOut {
  Tensor o, finals, states;  // states [BH,N,J,dv,dk]: S^ℓ_n transposed, entering each chunk (or undefined)
};

// The forward walk in ATen, out of place (differentiable): pieces in any floating dtype, computed in the
// accumulation dtype.
WalkOut aten_forward(const Tensor& W_, const Tensor& U_, const Tensor& Kt_, const Tensor& P_, const Tensor& gamma,
                     const Tensor& lam, const Tensor& X0, const LevelWalkPlace& pl, bool keep_states) {
  const auto dt = accumulation(W_);
  const int64_t BH = W_.size(0), T = W_.size(1), dk = W_.size(2), dv = U_.size(2), C = pl.chunk, N = T / C,
                J = lam.size(1);
  auto W = W_.to(dt).reshape({BH, N, C, dk}), Kt = Kt_.to(dt).reshape({BH, N, C, dk}), P = P_.to(dt).reshape({BH, N, C, dk});
  auto U = U_.to(dt).reshape({BH, N, C, dv});
  auto g = gamma.to(dt), lamc = lam.to(dt).reshape({BH, J, N, C});
  const Flags f = flags_of(pl, N, J, W.options());
  Tensor S = X0.defined() ? X0.to(dt) : at::zeros({J, BH, dk, dv}, W.options());
  std::vector<Tensor> outs, states;
  for (int64_t n = 0; n < N; ++n) {
    auto col = [&](const Tensor& m) { return m.select(0, n).reshape({J, 1, 1, 1}); };
    if (f.any_reset[n]) S = S * col(f.keep);
    if (keep_states) states.push_back(S.permute({1, 0, 3, 2}));  // [BH,J,dv,dk]
    auto Wn = W.select(1, n), Kn = Kt.select(1, n), Pn = P.select(1, n), Un = U.select(1, n);
    auto R = at::matmul(Pn.unsqueeze(0), S);                                        // [J,BH,C,dv]
    auto w = col(f.read) * lamc.select(2, n).permute({1, 0, 2}).unsqueeze(-1);      // [J,BH,C,1]
    outs.push_back((w * R).sum(0));
    auto V = (1 - col(f.read)) * Un.unsqueeze(0) - at::matmul(Wn.unsqueeze(0), S);
    S = g.select(1, n).reshape({1, BH, 1, 1}) * S + at::matmul(Kn.transpose(-1, -2).unsqueeze(0), V);
  }
  WalkOut r;
  r.o = at::stack(outs, 1).reshape({BH, T, dv});
  r.finals = S;
  if (keep_states) r.states = at::stack(states, 1);
  return r;
}

// The reverse walk in ATen: the state gradients dS^ℓ_{n+1} (transposed, [BH,N,J,dv,dk]) and dX0.
std::pair<Tensor, Tensor> aten_reverse(const Tensor& W_, const Tensor& Kt_, const Tensor& P_, const Tensor& gamma,
                                       const Tensor& lam, const Tensor& dO_, const Tensor& dF, const LevelWalkPlace& pl,
                                       int64_t dv) {
  const auto dt = accumulation(W_);
  const int64_t BH = W_.size(0), T = W_.size(1), dk = W_.size(2), C = pl.chunk, N = T / C, J = lam.size(1);
  auto W = W_.to(dt).reshape({BH, N, C, dk}), Kt = Kt_.to(dt).reshape({BH, N, C, dk}), P = P_.to(dt).reshape({BH, N, C, dk});
  auto g = gamma.to(dt), lamc = lam.to(dt).reshape({BH, J, N, C}), dO = dO_.to(dt).reshape({BH, N, C, dv});
  const Flags f = flags_of(pl, N, J, W.options());
  Tensor dS = dF.defined() ? dF.to(dt) : at::zeros({J, BH, dk, dv}, W.options());
  std::vector<Tensor> grads(N);
  for (int64_t n = N - 1; n >= 0; --n) {
    auto col = [&](const Tensor& m, int64_t i) { return m.select(0, i).reshape({J, 1, 1, 1}); };
    if (n + 1 < N && f.any_reset[n + 1]) dS = dS * col(f.keep, n + 1);
    grads[n] = dS.permute({1, 0, 3, 2});
    auto Wn = W.select(1, n), Kn = Kt.select(1, n), Pn = P.select(1, n);
    auto dV = at::matmul(Kn.unsqueeze(0), dS);                                                     // [J,BH,C,dv]
    auto dR = col(f.read, n) * lamc.select(2, n).permute({1, 0, 2}).unsqueeze(-1) * dO.select(1, n).unsqueeze(0);
    dS = g.select(1, n).reshape({1, BH, 1, 1}) * dS - at::matmul(Wn.transpose(-1, -2).unsqueeze(0), dV) +
         at::matmul(Pn.transpose(-1, -2).unsqueeze(0), dR);
  }
  return {at::stack(grads, 1), dS};
}

// The pieces' gradients from the states and their gradients, every chunk and level at once (level_walk.h),
// regrouped so that no product has a level dimension in its output: with M = Σ_ℓ dS^ℓ_{n+1} S^ℓ_nᵀ [dk,dk] and
// D = Σ_{writing ℓ} dS^ℓ_{n+1} [dk,dv] (sums over the levels' dv, done as one product each),
//   dW = −K̃ M,  dU = K̃ D,  dK̃ = U Dᵀ − W Mᵀ,  dγ = tr M,
// and with Z^ℓ = dO S^ℓᵀ [C,dk] a level: dP_t = Σ_{reading ℓ} λ_t[ℓ] Z^ℓ_t, dλ_t[ℓ] = <P_t, Z^ℓ_t>. The products
// over the stored states take `mm`'s dtype (the kernels' bf16, or the accumulation dtype) and sum in fp32 or
// wider; the rest is in the accumulation dtype. On CUDA with the kernels' bf16, D, dP and dλ come from kernels
// and the products by M and D take bf16 operands.
variable_list piece_grads(const Tensor& W, const Tensor& U, const Tensor& Kt, const Tensor& P, const Tensor& lam,
                          const Tensor& states, const Tensor& dstates, const Tensor& dO, const LevelWalkPlace& pl,
                          at::ScalarType mm) {
  const auto dt = accumulation(lam);
  const int64_t BH = W.size(0), T = W.size(1), dk = W.size(2), dv = U.size(2), C = pl.chunk, N = T / C,
                J = lam.size(1), BHN = BH * N;
#ifdef CARRY_WITH_CUDA
  if (W.is_cuda() && mm == at::kBFloat16) {
    // The kernels' pieces: M on one product, D and the level-reading gradients (dP, dλ) on kernels that read
    // each state once (layers/kernels/log_linear/api.h); the products by M and D on bf16 operands.
    namespace ll = kernels::log_linear;
    const auto bf = at::kBFloat16, f32 = at::kFloat;
    auto St = states.to(bf).reshape({BHN, J * dv, dk}), dSt = dstates.to(bf).reshape({BHN, J * dv, dk});
    auto M = at::bmm(dSt.transpose(1, 2), St, f32);  // [BHN, dk, dk]
    auto Dt = ll::level_write_sum(dstates.to(bf), pl.offset, pl.first_level).reshape({BHN, dv, dk});
    auto Mb = M.to(bf);
    auto Kc = Kt.to(bf).reshape({BHN, C, dk}), Wc = W.to(bf).reshape({BHN, C, dk}), Uc = U.to(bf).reshape({BHN, C, dv});
    auto dW = -at::bmm(Kc, Mb, f32);
    auto dU = at::bmm(Kc, Dt.transpose(1, 2), f32);
    auto dK = at::bmm(Uc, Dt, f32) - at::bmm(Wc, Mb.transpose(1, 2), f32);
    auto dgamma = M.diagonal(0, 1, 2).sum(-1).reshape({BH, N});
    auto r = ll::level_read_grads(states.to(bf), dO, P, lam, pl.offset, pl.first_level);
    return {dW.reshape({BH, T, dk}).to(dt), dU.reshape({BH, T, dv}).to(dt), dK.reshape({BH, T, dk}).to(dt),
            r[0].to(dt), dgamma.to(dt), r[1].to(dt)};
  }
#endif
  const Flags f = flags_of(pl, N, J, lam.options().dtype(dt));
  auto bmm = [&](const Tensor& a, const Tensor& b) {
#ifdef CARRY_WITH_CUDA
    if (a.is_cuda() && mm == at::kBFloat16) return at::bmm(a, b, at::kFloat).to(dt);
#endif
    return at::bmm(a, b).to(dt);
  };
  auto St = states.to(mm).reshape({BHN, J * dv, dk}), dSt = dstates.to(mm).reshape({BHN, J * dv, dk});
  auto M = bmm(dSt.transpose(1, 2), St);  // [BHN, dk, dk]
  auto wr = (1 - f.read).to(mm).reshape({1, N, 1, J}).expand({BH, N, 1, J}).reshape({BHN, 1, J});
  auto Dt = bmm(wr, dSt.reshape({BHN, J, dv * dk})).reshape({BHN, dv, dk});  // Dᵀ
  auto Kc = Kt.to(dt).reshape({BHN, C, dk}), Wc = W.to(dt).reshape({BHN, C, dk}), Uc = U.to(dt).reshape({BHN, C, dv});
  auto dW = -at::bmm(Kc, M);
  auto dU = at::bmm(Kc, Dt.transpose(1, 2));
  auto dK = at::bmm(Uc, Dt) - at::bmm(Wc, M.transpose(1, 2));
  auto dgamma = M.diagonal(0, 1, 2).sum(-1).reshape({BH, N});
  auto dO_rep = dO.to(mm).reshape({BHN, 1, C, dv}).expand({BHN, J, C, dv}).reshape({BHN * J, C, dv});
  auto Z = bmm(dO_rep, St.reshape({BHN * J, dv, dk})).reshape({BHN, J, C, dk});
  auto lamr = (lam.to(dt).reshape({BH, J, N, C}).permute({0, 2, 1, 3}) * f.read.reshape({1, N, J, 1})).reshape({BHN, J, C});
  auto dP = (Z * lamr.unsqueeze(-1)).sum(1);
  auto dlam = ((Z * P.to(dt).reshape({BHN, 1, C, dk})).sum(-1).reshape({BH, N, J, C}) * f.read.reshape({1, N, J, 1}))
                  .permute({0, 2, 1, 3})
                  .reshape({BH, J, T});
  return {dW.reshape({BH, T, dk}), dU.reshape({BH, T, dv}), dK.reshape({BH, T, dk}), dP.reshape({BH, T, dk}), dgamma, dlam};
}

bool kernels_apply(const Tensor& W, const Tensor& U, int64_t chunk) {
#ifdef CARRY_WITH_CUDA
  const int64_t dk = W.size(2), dv = U.size(2);
  return W.is_cuda() && W.scalar_type() == at::kBFloat16 && U.scalar_type() == at::kBFloat16 && chunk == 64 &&
         (dk == 64 || dk == 128) && (dv == 64 || dv == 128 || dv == 256);
#else
  (void)W, (void)U, (void)chunk;
  return false;
#endif
}

WalkOut walk_forward(const Tensor& W, const Tensor& U, const Tensor& Kt, const Tensor& P, const Tensor& gamma,
                     const Tensor& lam, const Tensor& X0, const LevelWalkPlace& pl, bool keep_states) {
#ifdef CARRY_WITH_CUDA
  if (kernels_apply(W, U, pl.chunk)) {
    auto r = kernels::log_linear::level_walk_fwd(W, U, Kt, P, gamma.to(at::kFloat), lam.to(at::kFloat), X0, pl.offset,
                                                 pl.first_level, keep_states);
    return {r[0], r[1], keep_states ? r[2] : Tensor()};
  }
#endif
  return aten_forward(W, U, Kt, P, gamma, lam, X0, pl, keep_states);
}

std::pair<Tensor, Tensor> walk_reverse(const Tensor& W, const Tensor& Kt, const Tensor& P, const Tensor& gamma,
                                       const Tensor& lam, const Tensor& dO, const Tensor& dF, const LevelWalkPlace& pl,
                                       int64_t dv, bool kernels) {
#ifdef CARRY_WITH_CUDA
  if (kernels) {
    auto r = kernels::log_linear::level_walk_bwd(W, Kt, P, gamma.to(at::kFloat), lam.to(at::kFloat),
                                                 dO.to(at::kBFloat16), dF, pl.offset, pl.first_level, dv);
    return {r[0], r[1]};
  }
#endif
  (void)kernels;
  return aten_reverse(W, Kt, P, gamma, lam, dO, dF, pl, dv);
}

struct LevelWalkFn : public torch::autograd::Function<LevelWalkFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& W, const Tensor& U, const Tensor& Kt,
                               const Tensor& P, const Tensor& gamma, const Tensor& lam, const Tensor& X0,
                               std::vector<int64_t> place) {
    const LevelWalkPlace pl{place[0], place[1], place[2]};
    // (An absent X0 comes as an empty tensor: autograd needs every input defined.)
    auto r = walk_forward(W, U, Kt, P, gamma, lam, X0.numel() ? X0 : Tensor(), pl, true);
    ctx->save_for_backward({W, U, Kt, P, gamma, lam, r.states});
    ctx->saved_data["place"] = place;
    ctx->saved_data["x0"] = X0.numel() > 0;
    return {r.o, r.finals};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const Tensor &W = s[0], &U = s[1], &Kt = s[2], &P = s[3], &gamma = s[4], &lam = s[5], &states = s[6];
    const auto place = ctx->saved_data["place"].toIntVector();
    const LevelWalkPlace pl{place[0], place[1], place[2]};
    const auto dt = accumulation(lam);
    const int64_t BH = W.size(0), T = W.size(1), dv = U.size(2);
    Tensor dO = grads[0].defined() ? grads[0] : at::zeros({BH, T, dv}, lam.options().dtype(dt));
    const bool kernels = kernels_apply(W, U, pl.chunk);
    auto [dstates, dX0] = walk_reverse(W, Kt, P, gamma, lam, dO, grads[1], pl, dv, kernels);
    auto g = piece_grads(W, U, Kt, P, lam, states, dstates, dO, pl, kernels ? at::kBFloat16 : accumulation(W));
    return {g[0].to(W.scalar_type()), g[1].to(U.scalar_type()), g[2].to(Kt.scalar_type()), g[3].to(P.scalar_type()),
            g[4].to(gamma.scalar_type()), g[5].to(lam.scalar_type()),
            ctx->saved_data["x0"].toBool() ? dX0.to(dt) : Tensor(), Tensor()};
  }
};

}  // namespace

bool level_walk_uses_kernels(const Tensor& W, const Tensor& U, int64_t chunk) { return kernels_apply(W, U, chunk); }

std::pair<Tensor, Tensor> level_walk(const Tensor& W, const Tensor& U, const Tensor& Kt, const Tensor& P,
                                     const Tensor& gamma, const Tensor& lam, const Tensor& X0,
                                     const LevelWalkPlace& place) {
  check_pieces(W, U, Kt, P, gamma, lam, X0, place);
  bool grad = false;
  if (at::GradMode::is_enabled())
    for (const Tensor* t : {&W, &U, &Kt, &P, &gamma, &lam, &X0})
      grad = grad || (t->defined() && t->requires_grad());
  if (!grad) {
    auto r = walk_forward(W, U, Kt, P, gamma, lam, X0, place, false);
    return {r.o, r.finals};
  }
  auto r = LevelWalkFn::apply(W, U, Kt, P, gamma, lam, X0.defined() ? X0 : at::empty({0}, lam.options()),
                              std::vector<int64_t>{place.offset, place.chunk, place.first_level});
  return {r[0], r[1]};
}

std::pair<Tensor, Tensor> level_walk_reference(const Tensor& W, const Tensor& U, const Tensor& Kt, const Tensor& P,
                                               const Tensor& gamma, const Tensor& lam, const Tensor& X0,
                                               const LevelWalkPlace& place) {
  check_pieces(W, U, Kt, P, gamma, lam, X0, place);
  auto r = aten_forward(W, U, Kt, P, gamma, lam, X0, place, false);
  return {r.o, r.finals};
}

}  // namespace carry
