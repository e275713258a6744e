// Kimi Delta Attention (family "kda", inputs q, k, v, gk, beta), per head
//   S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} + β_t k_t v_tᵀ,   o_t = scale · S_tᵀ q_t,   α_t = e^{gk_t},
// gk [B,T,H,dk] a log decay per key dimension (flash-linear-attention's `chunk_kda` conventions), β in
// [0, 2] as for the delta rule. State {S} [B,H,dk,dv]; transport dense {A} [B,H,dk,dk]. The family is the
// delta rule's (layers/delta_rule/delta_rule.cpp registers it beside DeltaNet and Gated DeltaNet, with
// the same summaries, scans and naive recurrence); what differs is the chunk's closed form below.
//
// One chunk: with G_t = Σ_{r≤t} gk_r (restarting at the chunk, a vector), rescale the state row by row,
// S̄_t = Diag(e^{−G_t}) S_t. Then S̄_t = (I − β_t a_t b_tᵀ) S̄_{t−1} + β_t a_t v_tᵀ with a_t = e^{−G_t} ⊙ k_t and
// b_t = e^{G_t} ⊙ k_t: a delta rule without decay, so S̄_t = S_in + Σ_{s≤t} a_s δ_sᵀ with
//   Δ = T·diag(β)·(V − K_in S_in),   T = (I + strictly-lower(diag(β) KA))⁻¹,
//   KA[t,s] = b_tᵀ a_s = Σ_d k_td k_sd e^{G_td − G_sd},   K_in = e^{G} ⊙ K,
// and o = scale·(Q_in S_in + QA Δ) with QA[t,s] = Σ_d q_td k_sd e^{G_td − G_sd} (s ≤ t), Q_in = e^{G} ⊙ Q,
// S_out = Diag(e^{G_C}) S_in + K_outᵀ Δ, K_out = e^{G_C − G} ⊙ K. Every exponent is a decay over tokens
// of the chunk (never positive), formed pairwise, so nothing overflows whatever the gates.
#pragma once

#include "layers/delta_rule/delta_rule.h"

namespace carry {

// The pieces of one KDA chunk (DeltaChunkPieces' meaning: o = mixing·V + query_state·S_in, S_out =
// transport·S_in + state) from chunk-local tensors in [B,H,C,·] layout: q, k, gk [B,H,C,dk], v [B,H,C,dv],
// beta [B,H,C]; computed in the tensors' dtype.
DeltaChunkPieces kda_chunk(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, const Tensor& gk,
                           double scale);

}  // namespace carry
