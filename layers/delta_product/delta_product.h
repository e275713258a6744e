// Gated DeltaProduct (family "gated_deltaproduct", inputs q, k, v, g, beta; Siems et al. 2025,
// flash-linear-attention's `chunk_gated_delta_product`), per head: every token applies n_h delta-rule
// (Householder) steps to the state, each with its own key, value and write strength, after the token's
// decay:
//   S_{t,0} = e^{g_t} S_{t−1},   S_{t,j} = (I − β_{t,j} k_{t,j} k_{t,j}ᵀ) S_{t,j−1} + β_{t,j} k_{t,j} v_{t,j}ᵀ,
//   S_t = S_{t,n_h},   o_t = scale · S_tᵀ q_t,
// n_h = MixerOptions::num_householder. Inputs in FLA's layout: q [B,T,H,dk] and g [B,T,H] a token; k
// [B,T·n_h,H,dk], v [B,T·n_h,H,dv] and beta [B,T·n_h,H] with the sub-steps interleaved along T (token t's
// step j at row t·n_h + j). β in [0, 2] as for the delta rule; keys expected L2-normalized. State {S}
// [B,H,dk,dv], transport {A} [B,H,dk,dk]: the delta rule's.
//
// The forms rest on one identity: the product over T tokens IS Gated DeltaNet over the T·n_h sub-tokens
// whose gate is g_t on each token's first sub-token and 0 on the others (FLA puts it there; γ commutes
// with the first Householder factor) and whose query is q_t on the token's last sub-token and zero on
// the others, the output read at the last sub-tokens. So the chunkwise form is Gated DeltaNet's on the
// expanded sequence in chunks of chunk_size·n_h sub-tokens (chunk_size tokens), the kernel form Gated
// DeltaNet's CUDA kernels on it (chunks of 64 sub-tokens), and the summaries, scans and sequence
// parallelism are Gated DeltaNet's unchanged (the state is the same S). The naive form is the recurrence
// above, token by token and step by step.
#pragma once

#include "layers/mixer.h"

namespace carry {

// The Gated DeltaNet inputs on the T·n_h sub-tokens that compute these Gated DeltaProduct inputs (q on
// the last sub-token of each token, g on the first, k, v, beta as they are); n_h = 1 returns the
// tensors themselves. Shapes are not checked here (the family's check() does).
MixerInputs deltaproduct_as_gated_deltanet(const MixerInputs& in, int64_t num_householder);

// The token outputs [B,T,H,dv] of the expanded run's o [B,T·n_h,H,dv]: its rows n_h−1, 2n_h−1, ...
Tensor deltaproduct_token_rows(const Tensor& o_sub_tokens, int64_t num_householder);

}  // namespace carry
