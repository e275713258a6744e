// Fused elementwise kernels of the model block (layers/kernels/blocks/norm_swiglu.cu): RMSNorm and the gated
// RMSNorm of the Gated DeltaNet / Mamba-2 output, forward and backward, and the SwiGLU activation
// y = silu(a) ⊙ b. Tensors are fp32 or bf16 (each its own dtype), the math is fp32, and the output
// dtype is the caller's choice (rounded once, from fp32). Inputs are [N, D] rows: contiguous for the
// norms; rows with their own stride for SwiGLU (so that a and b may be the halves of one tensor).
//
// norm_fwd returns {y, rstd}: y = (x · rstd) ⊙ w [⊙ silu(z)], rstd = 1/sqrt(mean(x²) + eps) [N] fp32.
// norm_bwd returns {dx (x's dtype), dz (z's dtype; undefined without z), dw (fp32)}; dw is summed per
// block into a [blocks, D] fp32 buffer and then over the blocks in a fixed order (no atomics): the
// same inputs give the same bits.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace carry::kernels::blocks {

// The largest last dimension the norm kernels take (one row lives in the registers of one block).
constexpr int64_t kMaxNormDim = 8192;

// x, z (undefined: plain RMSNorm) [N, D] contiguous, w [D] fp32 contiguous, N ≥ 1, D ≤ kMaxNormDim.
// With a residual `res` (x's shape, fp32 or bf16) the norm reads h = x + res (written in x's dtype and
// returned third) instead of x: {y, rstd, h}; without, the third is undefined.
std::vector<at::Tensor> norm_fwd(const at::Tensor& x, const at::Tensor& z, const at::Tensor& w, double eps,
                                 at::ScalarType out_dtype, const at::Tensor& res = at::Tensor());
// With dh (x's shape), the gradient reaching x (or h) directly is added to dx in the same pass; with
// res_dtype, that dx is also returned fourth in the residual's dtype (the residual's gradient).
std::vector<at::Tensor> norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& z, const at::Tensor& w,
                                 const at::Tensor& rstd, const at::Tensor& dh = at::Tensor(),
                                 c10::optional<at::ScalarType> res_dtype = c10::nullopt);

// a, b [N, H] 2-D views whose last dimension is contiguous (any row stride), one dtype; y [N, H] contiguous.
at::Tensor swiglu_fwd(const at::Tensor& a, const at::Tensor& b, at::ScalarType out_dtype);
// Writes da, db (a's dtype) into the given [N, H] views (allocated by the caller: two tensors, or the
// halves of one).
void swiglu_bwd(const at::Tensor& dy, const at::Tensor& a, const at::Tensor& b, const at::Tensor& da,
                const at::Tensor& db);

}  // namespace carry::kernels::blocks
