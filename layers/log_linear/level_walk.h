// Log-linear Gated DeltaNet's levels above the chunk in one walk over the chunks (level_passes.h's
// plan, with every such level at once).
//
// A level ℓ above the chunk (2^(ℓ−1) ≥ C) holds whole chunks in each half of its blocks, so a chunk either
// writes at ℓ (first half) or reads (second half), and the delta rule's chunk pieces are the same at every
// level. With the state S^ℓ_n entering chunk n, W, U, K̃ and the query state P of the chunk
// (delta_rule.h: W = T·diag(β e^G) K, U = T·diag(β) V, K̃ = diag(e^{G_C − G}) K, P = e^G Q − (QKᵀ ⊙ Γ) W, all
// unscaled) and γ = e^{G_C}:
//   reading chunks:   R^ℓ_n = P S^ℓ_n,   o_t += λ_t[ℓ] (R^ℓ_n)_t,   V^ℓ_n = −W S^ℓ_n;
//   writing chunks:   V^ℓ_n = U − W S^ℓ_n;
//   every chunk:      S^ℓ_{n+1} = γ S^ℓ_n + K̃ᵀ V^ℓ_n, reset to zero where a block of ℓ starts.
// (A reading chunk's values are zero: its U is zero and its output e^G Q S + (QKᵀ ⊙ Γ)(−W S) is P S.)
// The slice starts at absolute position `offset` (a multiple of C); level ℓ's blocks are aligned to
// multiples of 2^ℓ in absolute position; the state of level ℓ at the slice's start is X0[ℓ] (zeros where
// undefined).
//
// The backward is written by hand: a reverse walk gives the state gradients dS^ℓ_{n+1} at every chunk, and
// the pieces' gradients are batched products over all chunks and levels at once:
//   dW = −Σ_ℓ dV^ℓ S^ℓᵀ,  dP = Σ_ℓ dR^ℓ S^ℓᵀ,  dK̃ = Σ_ℓ V^ℓ dS^ℓ_{n+1}ᵀ,  dU = Σ_{writing ℓ} dV^ℓ,
//   dγ = Σ_ℓ <S^ℓ_n, dS^ℓ_{n+1}>,  dλ_t[ℓ] = <dO_t, R^ℓ_t>,  with dV^ℓ = K̃ dS^ℓ_{n+1}, dR^ℓ = λ[ℓ] ⊙ dO.
// The walks run on CUDA kernels (layers/kernels/log_linear/api.h) for bf16 CUDA pieces with C = 64,
// dk ∈ {64, 128}, dv ∈ {64, 128, 256}, and in ATen otherwise (the pieces' dtype). Deterministic.
#pragma once

#include "layers/mixer.h"

#include <utility>

namespace carry {

// Where the levels sit: the slice's absolute start, the chunk C (a power of two), and the first level
// above the chunk (log2(C) + 1); the walk's levels are first_level .. first_level + J − 1.
struct LevelWalkPlace {
  int64_t offset = 0, chunk = 64, first_level = 7;
};

// Pieces in [BH, T, ·] layout: W, K̃, P [BH,T,dk], U [BH,T,dv]; gamma [BH,N]; lam [BH,J,T] the level weights
// of the walk's levels; X0 [J,BH,dk,dv] (undefined: zeros). The pieces share one floating dtype
// (bf16 runs the kernels where they apply, the ATen walk computes in fp32 then); gamma and lam are in the
// accumulation dtype (fp32, or fp64 for fp64 pieces). Returns the read-outs o [BH,T,dv] (unscaled,
// Σ_ℓ λ_t[ℓ]·R^ℓ_t, accumulation dtype) and the final states [J,BH,dk,dv] (accumulation dtype).
// Differentiable in every input.
std::pair<Tensor, Tensor> level_walk(const Tensor& W, const Tensor& U, const Tensor& Kt, const Tensor& P,
                                     const Tensor& gamma, const Tensor& lam, const Tensor& X0,
                                     const LevelWalkPlace& place);

// The same walk as a chain of differentiable ATen operations, chunk by chunk (the reference of the tests).
std::pair<Tensor, Tensor> level_walk_reference(const Tensor& W, const Tensor& U, const Tensor& Kt, const Tensor& P,
                                               const Tensor& gamma, const Tensor& lam, const Tensor& X0,
                                               const LevelWalkPlace& place);

// Tests: whether level_walk takes the kernels for these pieces (false without CUDA).
bool level_walk_uses_kernels(const Tensor& W, const Tensor& U, int64_t chunk);

}  // namespace carry
