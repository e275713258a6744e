// Softmax attention's kernel form as one differentiable op (CUDA builds only): the forward and the
// hand-written backward of layers/kernels/softmax_attn/{fwd,bwd}.cu behind a torch autograd Function, so
// that Mixer::forward can hand it to autograd like the chunkwise form.
#pragma once

#include "layers/mixer.h"

namespace carry {

// Whether the kernels take these inputs: q, k, v CUDA tensors of one dtype, bf16 or fp32, dk = dv ∈
// {64, 128}, T a positive multiple of 64, B and H positive (the kernels' block; MixerOptions::chunk_size is not read:
// the kernel form computes the same function for any chunk size), window ≥ 0.
bool softmax_attn_kernel_supports(const MixerInputs& in, const MixerOptions& opt);

// o [B,T,H,dv] in the inputs' dtype; differentiable in q, k and v.
Tensor softmax_attn_kernel_forward(const MixerInputs& in, const MixerOptions& opt);

}  // namespace carry
