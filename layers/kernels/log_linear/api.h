// Log-linear Mamba-2's kernels (layers/log_linear/level_passes.h): the levels above the chunk on three
// kernels (levels.cu), the levels inside a chunk on two (chunk_levels.cu); log-linear Gated DeltaNet's levels
// above the chunk on two walks (walk.cu, at the end). A level ℓ pairs each block of 2^ℓ tokens with itself: its first half (side 0) writes one
// state, Y = Σ_s a_s k_s v_sᵀ, which its second half (side 1) reads, o_t += w_t Yᵀ q_t; a and w are
// per-token factors (decay to and from the block's middle, times λ_t[ℓ] for w). Every product of the
// forward and the backward is one of two shapes, over all levels at once:
//   level_sum:  for each block, Σ_{t in one side} wt_t · x_t y_tᵀ         (Y from k, v; dY from q, dO)
//   level_read: out_t = Σ_{levels where t is on one side} wt_t · x_tᵀ Mat  (o, dq, dk, dv)
// with the level's factor row wt picked by the level. Inputs in [BH, T, d] layout (contiguous), bf16;
// sums and read-outs in fp32; the matrices between them in bf16 (the products' operand type).
// Deterministic: every sum runs in a fixed order (segments of a half summed by at::sum).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace carry::kernels::log_linear {

// One level's whole blocks in the slice: M blocks of 2^level tokens from token `start` (relative to the
// slice, a multiple of 64), level ≥ 7 (each half whole 64-token chunks).
struct LevelBlocks {
  int64_t level, start, M;
};

// The factors of every listed level, wt [BH, n, T] fp32 (n = levels.size()) and e [BH, n, T] fp32, zero
// outside the level's blocks: side 0 wt = a_t = e^{cum[mid] − cum[t+1]}; side 1 wt = λ_t[level]·e_t,
// e_t = e^{cum[t+1] − cum[mid]} (e is zero on side 0). cum [BH, T+1] fp64 (contiguous), lam [BH, L, T] fp32.
std::vector<at::Tensor> level_weights(const at::Tensor& cum, const at::Tensor& lam, const std::vector<LevelBlocks>& levels);

// For each level i and block m: Σ_{t in side `side` of the block} wt[:, i, t] · x_t y_tᵀ, summed in fp32,
// returned bf16 [BH, ΣM, dx, dy] (level i's blocks from Σ_{j<i} M_j). x [BH,T,dx] with dx ∈ {64, 128},
// y [BH,T,dy] with dy ∈ {64, 128, 256}, bf16 contiguous.
at::Tensor level_sum(const at::Tensor& x, const at::Tensor& y, const at::Tensor& wt, const std::vector<LevelBlocks>& levels,
                     int side);

// out_t = Σ_{levels i where t is on side `side` of its block m} wt[:, i, t] · x_tᵀ Mat_i,m, fp32 [BH, T, ·];
// Mat from `mats` [BH, ΣM, r, c] (level_sum's layout), used as is (x has r columns, out c) or, with
// `transposed`, as its transpose (x has c columns, out r). With `d` ([BH, T, out's width ≤ 128] bf16),
// also rowdot [BH, n, T] fp32: (x_tᵀ Mat)·d_t, zero where t does not read. x's width ∈ {64, 128, 256}
// (64 or 128 unless transposed), out's width ∈ {64, 128, 256}.
std::vector<at::Tensor> level_read(const at::Tensor& x, const at::Tensor& mats, const at::Tensor& wt,
                                   const std::vector<LevelBlocks>& levels, int side, bool transposed,
                                   const at::Tensor& d = {});

// The levels inside a 64-token chunk (0..6, chunk_levels.cu): o_t = Σ_{s ≤ t in t's chunk} λ_t[bit_width(t xor s)]
// e^{G_t − G_s} (q_t·k_s) v_s, G the chunk's cumulative sum of g (unscaled), fp32 [BH, T, dv]. q, k [BH,T,dk]
// (dk ∈ {64, 128}), v [BH,T,dv] (dv ∈ {64, 128, 256}) bf16, g [BH,T] fp32, lam [BH,L,T] fp32 (L ≥ 7).
at::Tensor chunk_levels_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& lam);
// Its gradients from d_o (bf16 [BH,T,dv]): {dq, dk, dv (fp32, the inputs' shapes), dg [BH,T], dlam [BH,L,T]
// (rows 7.. zero)}.
std::vector<at::Tensor> chunk_levels_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& g, const at::Tensor& lam, const at::Tensor& d_o);

// Log-linear Gated DeltaNet's levels above the chunk in one walk (walk.cu; the math in
// layers/log_linear/level_walk.h). Pieces bf16 [BH,T,·] (W, K̃, P [BH,T,dk], dk ∈ {64, 128}; U [BH,T,dv], dv ∈ {64,
// 128, 256}), gamma [BH,N] and lam [BH,J,T] fp32, X0 [J,BH,dk,dv] fp32 or undefined; the chunk is 64 and the
// slice starts at absolute position `offset` (a multiple of 64) with levels first_level .. first_level + J − 1.
// Forward: {o [BH,T,dv] fp32, finals [J,BH,dk,dv] fp32, and with keep_states the states entering each chunk,
// transposed, bf16 [BH,N,J,dv,dk]}. Reverse: from dO (bf16 [BH,T,dv]) and the finals' gradient dF ([J,BH,dk,dv]
// fp32 or undefined): {the gradients of the states leaving each chunk, transposed, bf16 [BH,N,J,dv,dk], dX0
// [J,BH,dk,dv] fp32}. Deterministic.
std::vector<at::Tensor> level_walk_fwd(const at::Tensor& W, const at::Tensor& U, const at::Tensor& Kt,
                                       const at::Tensor& P, const at::Tensor& gamma, const at::Tensor& lam,
                                       const at::Tensor& X0, int64_t offset, int64_t first_level, bool keep_states);
std::vector<at::Tensor> level_walk_bwd(const at::Tensor& W, const at::Tensor& Kt, const at::Tensor& P,
                                       const at::Tensor& gamma, const at::Tensor& lam, const at::Tensor& dO,
                                       const at::Tensor& dF, int64_t offset, int64_t first_level, int64_t dv);

// The walk pieces' gradients that read every level's state (piece_grads.cu), from level_walk_fwd's states St and
// level_walk_bwd's state gradients dSt ([BH,N,J,dv,dk] bf16, transposed): level_read_grads with dO (the read-outs'
// gradient, [BH,T,dv]), P [BH,T,dk] and lam [BH,J,T] gives {dP [BH,T,dk] = Σ_{ℓ read} λ[ℓ] ⊙ dO·S^ℓᵀ, dlam [BH,J,T]
// = <P, dO·S^ℓᵀ> where read, else 0}, fp32; level_write_sum gives D [BH,N,dv,dk] bf16 = Σ over the levels
// written at each chunk of dSt (fp32 sums in level order). Levels first_level .. first_level + J − 1, the slice at
// absolute position `offset`. Deterministic.
std::vector<at::Tensor> level_read_grads(const at::Tensor& St, const at::Tensor& dO, const at::Tensor& P,
                                         const at::Tensor& lam, int64_t offset, int64_t first_level);
at::Tensor level_write_sum(const at::Tensor& dSt, int64_t offset, int64_t first_level);

// Log-linear Gated DeltaNet's chunk pieces (chunk_pieces.cu; the math in chunk_pieces.cuh): from q, k [B,T,H,dk]
// (dk ∈ {64, 128}), v [B,T,H,dv] (dv ∈ {64, 128, 256}) bf16, g, beta [B,T,H] and lam [B,H,7,T] fp32 (the weights of
// the levels inside a 64-token chunk), {W, U, K̃, P [B,H,T,·] bf16, gamma [B,H,N] fp32, o [B,H,T,dv] fp32 (the levels
// inside the chunk, unscaled), and for the backward G [B,H,T] fp32 and T [B,H,N,64,64] bf16}. The backward takes
// q, k, v, beta, lam, G, T, W and the gradients of o, W, U, K̃, P (any floating dtype, undefined: zeros) and gamma,
// and returns {dq, dk [B,T,H,dk], dv [B,T,H,dv], dg, dbeta [B,T,H], dlam [B,H,7,T]}, fp32. Deterministic.
std::vector<at::Tensor> chunk_pieces_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& g, const at::Tensor& beta, const at::Tensor& lam);
std::vector<at::Tensor> chunk_pieces_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& beta, const at::Tensor& lam, const at::Tensor& G,
                                         const at::Tensor& Tm, const at::Tensor& W, const at::Tensor& dO,
                                         const at::Tensor& dW, const at::Tensor& dU, const at::Tensor& dKt,
                                         const at::Tensor& dP, const at::Tensor& dgamma);

}  // namespace carry::kernels::log_linear
