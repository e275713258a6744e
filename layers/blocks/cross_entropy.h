// The head's cross entropy over a chunk of rows as one CUDA kernel (layers/kernels/blocks/loss.h), for
// the chunked linear + cross entropy (framework/model/chunked_loss.h): from a chunk's logits it writes
// each row's loss and, with grads, overwrites the logits with their gradient in the same pass. The
// framework reaches the kernel through this header; only layers/ includes kernel headers.
//
// logits [n, V] contiguous, bf16 or fp32 on CUDA, math in fp32; targets [n] int64 (negative: ignored,
// ≥ V: NaN loss), weights [n] fp32, ce [n] fp32 (written), predictions [n] int64 (the first argmax;
// undefined: not written). Gradient: x_ij ← w_i·(softmax_ij − [j = t_i]), zero for ignored rows,
// rounded once to the logits' dtype. Runs on the current stream; no host synchronisation.
#pragma once

#include <ATen/ATen.h>

namespace carry {

// Whether this build has the kernel (CUDA builds).
bool fused_cross_entropy_built();

// The kernel on these rows; in a build without CUDA kernels, an error.
void fused_cross_entropy_rows(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& weights,
                              const at::Tensor& ce, const at::Tensor& predictions, bool grads);

}  // namespace carry
