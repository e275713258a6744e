// The delta rule: DeltaNet (family "deltanet", inputs q, k, v, beta) and Gated DeltaNet (family
// "gated_deltanet", inputs q, k, v, g, beta), per head
//   S_t = γ_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,   o_t = scale · S_tᵀ q_t,
// with γ_t = exp(g_t) (g a log decay, [B,T,H]) and γ_t ≡ 1 for DeltaNet. State {S} [B,H,dk,dv];
// transport dense, {A} [B,H,dk,dk], A = Π_t γ_t (I − β_t k_t k_tᵀ) with the later token on the left.
// Forms: naive = the token recurrence; chunkwise = the WY/UT form, chunk by chunk, built from the
// chunk pieces below. Both compute in the input dtype promoted to at least fp32 (states and
// transports are never below fp32); outputs come back in the input dtype.
//
// Accepted β: every element finite and in [0, 2]. β ∈ (0, 1) is DeltaNet's usual sigmoid range; up to
// 2 admits the "2β" variants (for unit keys I − β k kᵀ then has eigenvalues in [−1, 1], so the state
// stays bounded); β = 0 is a token that writes nothing (a sigmoid that underflows), harmless.
// Negative, > 2, NaN or infinite β are refused by check(). Keys are expected L2-normalized (not
// enforced).
#pragma once

#include "layers/mixer.h"

namespace carry {

// Inclusive bounds of the accepted write strength β.
constexpr double kDeltaBetaMin = 0.0;
constexpr double kDeltaBetaMax = 2.0;

// One chunk of the delta rule in closed (WY/UT) form. With C tokens, gate cumulative sums G_t =
// Σ_{r≤t} g_r restarting at the chunk, Φ(t, s) = Π_{r=s+1..t} γ_r (I − β_r k_r k_rᵀ) (later token on
// the left; Φ(t, t) = I) and S_in the state entering the chunk, the chunk's outputs and final state are
//   o = mixing·V + query_state·S_in,   S_out = transport·S_in + state,   state = value_state·V,
// entrywise
//   mixing[t, s]     = scale · β_s · q_tᵀ Φ(t, s) k_s          for s ≤ t, 0 above the diagonal,
//   query_state[t,:] = scale · q_tᵀ Φ(t, 0)                    (Φ(t, 0): tokens 1..t, t included),
//   transport        = Φ(C, 0),
//   value_state[:,s] = β_s Φ(C, s) k_s,   state = Σ_s β_s Φ(C, s) k_s v_sᵀ.
// They are formed through T = (I + strictly-lower(diag(β) K Kᵀ ⊙ Γ))⁻¹ (Γ[t,s] = e^{G_t − G_s}; a unit
// triangular solve, no explicit inverse), W = T·diag(β e^{G}) K and K̃ = diag(e^{G_C − G}) K:
//   mixing = (scale Q Kᵀ ⊙ Γ, causal) · T · diag(β),  query_state = scale e^{G} Q − (scale Q Kᵀ ⊙ Γ) W,
//   transport = e^{G_C} I − K̃ᵀ W,  value_state = K̃ᵀ T diag(β).
struct DeltaChunkPieces {
  Tensor mixing;       // M [B,H,C,C]
  Tensor query_state;  // P [B,H,C,dk]
  Tensor transport;    // A_chunk [B,H,dk,dk]
  Tensor state;        // B_chunk [B,H,dk,dv]
  Tensor value_state;  // R [B,H,dk,C]
  // ChunkParts::walk (the state walk's operands, unscaled: layers/log_linear/level_walk.h)
  Tensor w;          // W = T·diag(β e^G) K [B,H,C,dk]
  Tensor u;          // U = T·diag(β) V [B,H,C,dv]
  Tensor k_out;      // K̃ = diag(e^{G_C − G}) K [B,H,C,dk]
  Tensor gate_last;  // e^{G_C} [B,H]
};

// Which pieces delta_rule_chunk computes: all of them, the read side only (mixing and query_state), the
// mixing only (v may be undefined but for all and walk), or the mixing, query_state and a state walk's
// operands (w, u, k_out, gate_last).
enum class ChunkParts { all, reads, mixing, walk };

// The pieces of one chunk from chunk-local tensors in [B,H,C,·] layout: q, k [B,H,C,dk], v [B,H,C,dv],
// beta [B,H,C] and g [B,H,C] (log decays; undefined = no decay, DeltaNet). Computed in the tensors'
// dtype; no value checks (the callers' check() does them), only shapes. The pieces not asked for are
// undefined.
DeltaChunkPieces delta_rule_chunk(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& beta, const Tensor& g, double scale,
                                  ChunkParts parts = ChunkParts::all);

// The pieces of chunk `chunk` (tokens [chunk·C, (chunk+1)·C), C = opt.chunk_size) of inputs in the
// mixer layout [B,T,H,·]; reads g when it is defined. Computes in the input dtype promoted to fp32 at
// least. Values are checked as DeltaNet (no g) or Gated DeltaNet (g given) would check them.
DeltaChunkPieces delta_rule_chunk(const MixerInputs& in, int64_t chunk, const MixerOptions& opt);

}  // namespace carry
