// The elementwise pieces between hla2's decay passes (layers/kernels/hla/hla2_op.h), each one pass over
// memory. Tensors [B,T,H,d] contiguous, bf16 or fp32, d a multiple of 16 bytes' elements; sums in fp32,
// rounded once to the output's dtype.
#pragma once

#include <ATen/ATen.h>

namespace carry::kernels::hla {

// [a, −b] along the last dimension: a [B,T,H,da], b [B,T,H,db] → [B,T,H,da+db].
at::Tensor cat_neg(const at::Tensor& a, const at::Tensor& b);

// out = a + b + c' with out shaped as a: b undefined adds nothing; c' is columns [c_col0, c_col0 + d) of c
// [B,T,H,dc], taken one token later (c'_t = c_{t+1}, zero at the last token) when `next_token`.
at::Tensor sum_grads(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, int64_t c_col0, bool next_token);

// a − c[..., c_col0 : c_col0 + d] (d = a's last dimension), rounded once.
at::Tensor minus_columns(const at::Tensor& a, const at::Tensor& c, int64_t c_col0);

// c[..., c_col0 : c_col0 + d] as a contiguous tensor.
at::Tensor columns(const at::Tensor& c, int64_t c_col0, int64_t d);

}  // namespace carry::kernels::hla
