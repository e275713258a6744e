// Linear attention's kernels without per-chunk states (layers/linear_attn/kernel_fused.cuh) as one
// differentiable op (CUDA builds only). On by default for linear attention's kernel form where it applies;
// CARRY_LA_FUSED=0 (read once) or linear_attn_fused_set(0) gives the decay class's kernels instead.
#pragma once

#include "layers/mixer.h"

namespace carry {

// Whether the fused kernels take these inputs: on (by default; linear_attn_fused_set, CARRY_LA_FUSED=0), CUDA bf16
// q, k, v [B,T,H,128] with dv = 128 and T a positive multiple of 64, chunk_size 64, no normalizer and no
// serial_states (the ordered scan keeps the decay class's kernels, whose bits do not depend on the cut).
bool linear_attn_fused_supports(const MixerInputs& in, const MixerOptions& opt);

// o = scale · q_t · S_t from initial_state [B,H,128,128] (undefined: zeros): o in bf16, the final state in
// fp32; differentiable in q, k, v and the initial state.
std::pair<Tensor, Tensor> linear_attn_fused_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                    const Tensor& initial_state, double scale);

// Tests and A/B: -1 the environment's choice (CARRY_LA_FUSED, on unless 0), 0 off, 1 on; segments: 0
// automatic (linear_attn_fused_segments), n > 0 that many (must divide the chunks).
void linear_attn_fused_set(int mode, int segments = 0);

// The segments for B·H heads of N chunks: about one backward block a SM (the largest power of two up to
// 32 at most SMs / (B·H)), halved until it divides N.
int linear_attn_fused_segments(int64_t B, int64_t H, int64_t N);

}  // namespace carry
