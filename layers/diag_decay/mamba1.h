// Mamba-1's selective scan (S6) and H3's diagonal SSM, family "mamba1", as a diagonal-decay mixer with
// one head per channel. Per channel d the state h_d ∈ R^{N×dv} evolves
//   h_t,d = exp(Δ_t,d A_d) ⊙ h_{t-1},d + B_t (Δ_t,d x_t,d)ᵀ,   y_t,d = C_tᵀ h_t,d,
// which is GLA's recurrence with heads = channels. The contract carries S6's tensors compactly:
//   q = C [B,T,1,N] and k = B [B,T,1,N] (one head shared by all D channels, Mixer::broadcasts_heads),
//   v = Δ⊙x [B,T,D,dv] (dv = 1 in S6), g = Δ [B,T,D] (≥ 0), decay_rate = A [D,N] (≤ 0),
// so that gk = g ⊙ decay_rate = Δ·A is never an input (since dv = 1, (Δ B) x = B (Δ x)). The forms
// build GLA's dense view from them inside (q, k expanded to D heads, gk = Δ·A), and autograd returns
// the gradients of the compact tensors. The mixer computes y = Cᵀh exactly: MixerOptions::scale is
// ignored (S6 has no score scale). The skip term D⊙x and the output gate are the caller's, outside the
// mixer.
#pragma once

#include "layers/mixer.h"

namespace carry {

// x [B,T,D], dt [B,T,D] (Δ ≥ 0, e.g. softplus of a projection), A [D,N] (≤ 0), Bmat and Cmat
// [B,T,N] -> {q, k, v, g, decay_rate} as above, v = (dt ⊙ x)[..., None] (dv = 1). The mixer's o is
// then [B,T,D,1]: y is o.squeeze(-1). Throws with a message naming the tensor on a bad shape, dtype or
// sign.
MixerInputs mamba1_inputs(const Tensor& x, const Tensor& dt, const Tensor& A, const Tensor& Bmat,
                          const Tensor& Cmat, bool check_values = true);

}  // namespace carry
