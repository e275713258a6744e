// Mamba-1's selective scan (S6) and H3's diagonal SSM, family "mamba1", as a diagonal-decay mixer with
// one head per channel. Per channel d the state h_d ∈ R^{N×dv} evolves
//   h_t,d = exp(Δ_t,d A_d) ⊙ h_{t-1},d + Δ_t,d B_t x_t,dᵀ,   y_t,d = C_tᵀ h_t,d,
// which is GLA's recurrence with heads = channels and, in the contract's names,
//   q = C (the same for every channel) [B,T,D,N], k = Δ·B [B,T,D,N], v = x [B,T,D,dv] (dv = 1 in S6),
//   gk = Δ·A [B,T,D,N] (≤ 0).
// mamba1_inputs builds these from S6's usual tensors. The mixer computes y = Cᵀh exactly:
// MixerOptions::scale is ignored (S6 has no score scale). The skip term D⊙x and the output gate are the
// caller's, outside the mixer.
#pragma once

#include "layers/mixer.h"

namespace carry {

// x [B,T,D], dt [B,T,D] (Δ ≥ 0, e.g. softplus of a projection), A [D,N] (≤ 0), Bmat and Cmat
// [B,T,N] -> {q, k, v, gk} as above, v = x[..., None] (dv = 1). The mixer's o is then [B,T,D,1]: y is
// o.squeeze(-1). Throws with a message naming the tensor on a bad shape, dtype or sign.
MixerInputs mamba1_inputs(const Tensor& x, const Tensor& dt, const Tensor& A, const Tensor& Bmat,
                          const Tensor& Cmat, bool check_values = true);

}  // namespace carry
