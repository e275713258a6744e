// RWKV-7's state update, the diagonal-plus-rank-one ("generalized delta rule") transition (family "rwkv7",
// inputs q, k, v, gk, a, b), per head
//   S_t = (Diag(w_t) + b_t a_tᵀ) S_{t−1} + k_t v_tᵀ,   o_t = scale · S_tᵀ q_t,   w_t = e^{gk_t},
// with gk [B,T,H,dk] a log decay per key dimension and a, b [B,T,H,dk]: flash-linear-attention's
// `chunk_dplr_delta_rule(q, k, v, a, b, gk)` (its recurrence: S_t = Diag(w_t) S_{t−1} + b_t (a_tᵀ S_{t−1}) +
// k_t v_tᵀ). RWKV-7 feeds q = r (the receptance), a = −κ̂ and b = κ̂ ⊙ a_lr (κ̂ the normalized key, a_lr
// the in-context learning rate in (0, 1)), so that Diag(w) + b aᵀ = Diag(w) − (κ̂ ⊙ a_lr) κ̂ᵀ. State {S}
// [B,H,dk,dv]; transport dense {A} [B,H,dk,dk]. The family is the delta rule's
// (layers/delta_rule/delta_rule.cpp registers it beside DeltaNet, Gated DeltaNet and KDA, with the same
// summaries, scans and the token recurrence as its naive form); its chunk's closed form is below.
//
// One chunk: G_t = Σ_{r≤t} gk_r (restarting at the chunk, a vector), G⁻_t = G_t − gk_t (through t−1), and
// u_t = a_tᵀ S_{t−1} (a row). Unrolled, S_t = e^{G_t} ⊙ S_in + Σ_{s≤t} e^{G_t − G_s} ⊙ (b_s u_s + k_s v_sᵀ)
// (⊙ scaling row d by e^{·_d}), so
//   U = T·(A_in S_in + AK·V),   T = (I − AB)⁻¹ (unit lower triangular),
//   AB[t,s] = Σ_d a_td b_sd e^{G⁻_td − G_sd},  AK[t,s] = Σ_d a_td k_sd e^{G⁻_td − G_sd}   (s < t),
//   A_in = e^{G⁻} ⊙ A,
// and with QB, QK the same pairs of q_t with b_s, k_s over e^{G_td − G_sd} (s ≤ t) and Q_in = e^{G} ⊙ Q:
//   o = scale·((QK + QB·T·AK)·V + (Q_in + QB·T·A_in)·S_in),
//   S_out = (Diag(e^{G_C}) + B̃ᵀ T A_in)·S_in + (K̃ᵀ + B̃ᵀ T AK)·V,   B̃ = e^{G_C − G} ⊙ B, K̃ = e^{G_C − G} ⊙ K.
// Every exponent is a decay over tokens of the chunk (never positive), formed pairwise, so nothing
// overflows whatever the gates.
#pragma once

#include "layers/delta_rule/delta_rule.h"

namespace carry {

inline constexpr const char* kRwkv7Family = "rwkv7";

// The pieces of one chunk (DeltaChunkPieces' meaning: o = mixing·V + query_state·S_in, S_out =
// transport·S_in + state) from chunk-local tensors in [B,H,C,·] layout: q, k, a, b, gk [B,H,C,dk],
// v [B,H,C,dv]; computed in the tensors' dtype.
DeltaChunkPieces dplr_chunk(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& a, const Tensor& b,
                            const Tensor& gk, double scale);

}  // namespace carry
