// RWKV-7's kernel form: the diagonal-plus-rank-one chunk (rwkv7.h) on KDA's state walks
// (layers/kda/kernel_form.h) with chunks of 32 tokens, each walked as 64 rows. With U_n = T·(A_in·S_in +
// AK·V) (rwkv7.h's names) the chunk is
//   S_out = Diag(e^{G_C})·S_in + B̃ᵀ·U_n + K̃ᵀ·V,   o = scale·(Q_in·S_in + QB·U_n + QK·V),
// so stacking the rank-one reads over the chunk's values,
//   W' = [−T·A_in; 0],  U' = [T·AK·V; V],  K_out' = [B̃; K̃],  QA' = scale·[QB | QK],  Q_s = scale·Q_in,
// gives KDA's walk exactly: V_new' = U' − W'·S_in = [U_n; V], S_out = Diag(e^{G_C})·S_in + K_out'ᵀ·V_new',
// o = Q_s·S_in + QA'·V_new'. The backward runs the reverse walk, forms the gradients of these pieces by
// batched products, and differentiates the pieces (batched ATen over every chunk, recomputed) by
// autograd. Any device: the walks are kernels on CUDA.
#pragma once

#include "layers/mixer.h"

namespace carry {

// The chunk the kernel form walks in (its own; MixerOptions::chunk_size is the chunkwise form's).
inline constexpr int64_t kRwkv7KernelChunk = 32;

// Whether the kernel form takes these inputs: CUDA, bf16 or fp32, dk ∈ {64, 128}, dv a multiple of 16 up to
// 256, chunk_size 64 (T a multiple of 64, so of 32).
bool rwkv7_kernel_supports(const MixerInputs& in, const MixerOptions& opt);

// o [B,T,H,dv] in the inputs' dtype and {S} [B,H,dk,dv] in fp32 (fp64 for fp64 inputs); differentiable in
// q, k, v, gk, a, b and the initial state. T a multiple of kRwkv7KernelChunk.
MixerOutput rwkv7_kernel_form(const MixerInputs& in, const Tensor& initial_state, const MixerOptions& opt);

}  // namespace carry
