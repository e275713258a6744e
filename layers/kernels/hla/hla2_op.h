// hla2's kernel form without the normalizer as one autograd op over the decay class's kernels (CUDA
// builds only). The passes are layers/hla/decay_passes.h's, with passes 1 and 4 joint:
//   W  = pass(k, ←q, ←v, ←g, C_0)             (the shifted pass: W_t = k_tᵀ C_{t−1})
//   RG = pass(q, k, [k, W], g, [S_0, G_0], s) (R = s·q_tᵀ S_t and Gq = s·q_tᵀ G_t in one pass)
//   SC = pass(R, q, v, g, C_0)
//   o = SC − Gq.
// The op runs the passes' kernels itself (decay_fwd / decay_bwd), so what lies between them is one pass
// over memory each: [dR, −dO] for the joint pass's output gradient, and each input's gradient summed from
// its passes (the shifted pass's one token later) in fp32 and rounded once (layers/kernels/hla/glue.h),
// where autograd would add them pairwise, each sum rounded, and copy the strided pieces first.
// The normalizer states m and h (which the output does not read) come from normalizer_states, by autograd.
#pragma once

#include "layers/mixer.h"

namespace carry {

// Whether hla2_joint_kernel_form takes these inputs (given the family's kernel form takes them): no
// normalizer and dk + dv ≤ 256 (the joint pass's values in one kernel pass).
bool hla2_joint_kernel_supports(const MixerInputs& in, const MixerOptions& opt);

// hla2's kernel form on the op: {o, {S, C, m, G, h}} as hla2_by_decay_passes gives them.
MixerOutput hla2_joint_kernel_form(const MixerInputs& in, const State& initial_state, const MixerOptions& opt);

}  // namespace carry
