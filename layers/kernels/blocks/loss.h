// The cross-entropy of the output head, one kernel per chunk of rows (layers/kernels/blocks/loss.cu),
// for the chunked linear + cross entropy (framework/model/chunked_loss.h) on CUDA: from a chunk's
// logits it writes each row's loss and, in the same pass, overwrites the logits with their gradient, so
// no fp32 copy, log-softmax, exp or scatter of the [rows, vocab] block is ever made.
//
// logits [n, V] contiguous, bf16 or fp32, math in fp32. Per row i, with valid_i = 0 ≤ t_i < V:
//   lse_i = log Σ_j e^{x_ij}   (max-shifted, one pass: running max and rescaled sum),
//   ce_i  = lse_i − x_{i,t_i} if valid_i, 0 if t_i < 0 (ignored), NaN if t_i ≥ V (out of range: loud);
//   pred_i = argmax_j x_ij (the first of equal maxima), when `predictions` is defined;
//   if grads: x_ij ← w_i·(e^{x_ij − lse_i} − [j = t_i]) with w_i = weights_i if valid_i else 0, rounded
//   once to the logits' dtype.
#pragma once

#include <ATen/ATen.h>

namespace carry::kernels::blocks {

// targets [n] int64, weights [n] fp32, ce [n] fp32 (contiguous views; written), predictions [n] int64
// or undefined. Runs on the current stream; no host synchronisation.
void cross_entropy_rows(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& weights,
                        const at::Tensor& ce, const at::Tensor& predictions, bool grads);

}  // namespace carry::kernels::blocks
