// The delta rule's kernel form as one differentiable op (CUDA builds only): the forward and the
// hand-written backward of layers/kernels/delta_rule/{fwd,bwd}.cu behind a torch autograd Function, so
// that Mixer::forward can hand it to autograd like the chunkwise form.
#pragma once

#include "layers/mixer.h"

namespace carry {

// Whether the kernels take these inputs: CUDA, bf16 or fp32 (one dtype), dk ∈ {64, 128},
// dv ∈ {64, 128, 256}, chunk_size 64 (T a multiple of it is checked by the family's check()).
bool delta_rule_kernel_supports(const MixerInputs& in, const MixerOptions& opt);

// o [B,T,H,dv] in the inputs' dtype and the final state {S} [B,H,dk,dv] fp32; differentiable in q, k,
// v, g (when defined: Gated DeltaNet), beta and the initial state (undefined: zeros).
MixerOutput delta_rule_kernel_forward(const MixerInputs& in, const Tensor& initial_state, const MixerOptions& opt);

}  // namespace carry
