// Linear attention's kernels without per-chunk states (layers/kernels/decay/fused.cuh) as one
// differentiable op (CUDA builds only), and the scalar decay's on the same kernels (below). On by default
// for linear attention's kernel form where it applies; linear_attn_fused_set(0) gives the decay class's
// kernels instead.
#pragma once

#include "layers/mixer.h"

namespace carry {

// Whether the fused kernels take these inputs: on (by default; linear_attn_fused_set(0): off), CUDA bf16
// q, k, v [B,T,H,128] with dv = 128 and T a positive multiple of 64, chunk_size 64, no normalizer and no
// serial_states (the ordered scan keeps the decay class's kernels, whose bits do not depend on the cut).
bool linear_attn_fused_supports(const MixerInputs& in, const MixerOptions& opt);

// o = scale · q_t · S_t from initial_state [B,H,128,128] (undefined: zeros): o in bf16, the final state in
// fp32; differentiable in q, k, v and the initial state.
std::pair<Tensor, Tensor> linear_attn_fused_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                    const Tensor& initial_state, double scale);

// Tests: -1 or 1 on (the default), 0 off; segments: 0 automatic (linear_attn_fused_segments), n > 0 that
// many (must divide the chunks).
void linear_attn_fused_set(int mode, int segments = 0);

// The scalar decay (RetNet, Lightning, simple GLA, Mamba-2's SSD core: one log decay a token and head) on
// the same kernels with the decay. On by default (on an H200 faster than the decay class's
// kernels at 131072 tokens, 5.57 against 6.27 ms at H=16 and 1.71 against 2.17 at H=4, level at 16384 and
// 32768 tokens, in half their memory); scalar_decay_fused_set(0) turns it off. It takes CUDA bf16 q, k, v [B,T,H,128] (dv = 128, T a positive
// multiple of 64), the log decay g [B,T,H] in any floating dtype, chunk_size 64, no serial_states.
bool scalar_decay_fused_supports(const MixerInputs& in, const MixerOptions& opt);
// The family's kernel form on them: {o, {final state}}, the state hooks of `opt` called as the decay
// class's kernel form calls them; differentiable in q, k, v, g and the initial state.
MixerOutput scalar_decay_fused_form(const Mixer& family, const MixerInputs& in, const State& init,
                                    const MixerOptions& opt);
// Tests: -1 or 1 on (the default), 0 off (the segments follow linear_attn_fused_set's).
void scalar_decay_fused_set(int mode);

// The segments for B·H heads of N chunks: about one backward block a SM (the largest power of two up to
// 32 at most SMs / (B·H)), halved until it divides N.
int linear_attn_fused_segments(int64_t B, int64_t H, int64_t N);

}  // namespace carry
