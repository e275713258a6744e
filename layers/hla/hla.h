// Higher-order linear attention: the families "hla2" (order 2, masked) and "ahla" (asymmetric HLA),
// both with an optional per-token scalar log decay g [B,T,H] (γ_t = exp(g_t); no g means γ ≡ 1) and
// MixerOptions::normalize. They register themselves in hla.cpp; this header states their math.
//
// hla2, per head:  S_t = γ_t S_{t−1} + k_t k_tᵀ        (dk×dk)
//                  C_t = γ_t C_{t−1} + q_t v_tᵀ        (dk×dv)      m_t = γ_t m_{t−1} + q_t
//                  G_t = γ_t G_{t−1} + k_t k_tᵀ C_{t−1} (dk×dv)     h_t = γ_t h_{t−1} + k_t k_tᵀ m_{t−1}
//   o_t = (s·q_t)ᵀ (S_t C_t − G_t), normalized: divided by (s·q_t)ᵀ (S_t m_t − h_t) + eps.
//   State (S, C, m, G, h). Transport (ρ [B,H], S̃ [B,H,dk,dk]) with ρ = Π γ_t, S̃ = Σ_t (ρ/γ_t) k_t k_tᵀ:
//   the map is S→ρS, C→ρC, m→ρm, G→ρG + S̃ C, h→ρh + S̃ m (plus the slice's own state).
//   With γ ≡ 1, S_t C_t − G_t = Σ_{s≤u≤t} k_s k_sᵀ q_u v_uᵀ (masked second order). With decay the pairs
//   u < s do not cancel (weight Γ_t(Γ_t − Γ_{s−1})/(Γ_s Γ_u), Γ the cumulative decay): the recurrence
//   above is the definition, and every form here follows it.
//
// ahla, per head:  P_t = γ_t P_{t−1} + k_t v_tᵀ,  E_t = γ_t E_{t−1} + k_t (q_tᵀ P_t)          (dk×dv)
//                  m_K_t = γ_t m_K_{t−1} + k_t,   n_t = γ_t n_{t−1} + k_t (q_tᵀ m_K_t)      (dk)
//   o_t = (s·q_t)ᵀ E_t, normalized: divided by (s·q_t)ᵀ n_t + eps.
//   State (P, m_K, E, n). Transport (ρ [B,H], R̄ [B,H,dk,dk]) with R̄ = Σ_t k_t q_tᵀ (undecayed):
//   the map is P→ρP, m_K→ρ m_K, E→ρE + ρR̄ P, n→ρn + ρR̄ m_K.
//
// Scale: s = MixerOptions::scale_for(dk) multiplies only the reading query (the q_t on the left of the
// output); the q written into C, m and read inside E's update is unscaled, so states and summaries do
// not depend on s. The normalized output is then (s·num)/(s·den + eps) in every form.
#pragma once

#include "layers/mixer.h"

namespace carry {

inline constexpr const char* kHla2Family = "hla2";
inline constexpr const char* kAhlaFamily = "ahla";

}  // namespace carry
