// The fused CUDA kernels of the model block (layers/kernels/blocks/norm_swiglu.h) as differentiable ops:
// torch autograd Functions with hand-written backward, used by rms_norm, gated_rms_norm (layers/blocks/norm.h)
// and SwiGLU (layers/blocks/mlp.h) on CUDA tensors. Compiled with the CUDA sources only (CARRY_WITH_CUDA).
// All compute in fp32; inputs may be fp32 or bf16 (each its own dtype), gradients come back in each
// input's dtype (weight: fp32), and the norms' output dtype is the caller's (rounded once, from fp32).
#pragma once

#include "layers/blocks/parameters.h"

namespace carry {

// Whether the fused norms take `x` (and a gate of x's shape): a CUDA tensor, fp32 or bf16, with a last
// dimension in [1, 8192] and fewer than 2^31 rows.
bool fused_norm_supports(const Tensor& x);

// rms_norm(x, weight) over the last dimension, returned in out_dtype (fp32 or bf16). weight [D] is read
// in fp32 (cast when it is not).
Tensor fused_rms_norm(const Tensor& x, const Tensor& weight, double eps, at::ScalarType out_dtype);
// rms_norm(x, weight) ⊙ silu(z), z of x's shape (its own dtype), returned in out_dtype.
Tensor fused_gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& weight, double eps,
                            at::ScalarType out_dtype);

// h = x + residual and rms_norm(h, weight) in out_dtype, in one pass each way: {h, norm}. residual may be
// undefined (h is x itself; the norm's backward then adds the gradient reaching x directly), or a tensor
// of x's shape no wider than x (the sum keeps x's dtype: fp32 residual stream + bf16 branch output).
std::pair<Tensor, Tensor> fused_residual_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                                  double eps, at::ScalarType out_dtype);

// Whether the fused SwiGLU takes `t`: a CUDA tensor, fp32 or bf16, at least 1-D.
bool fused_swiglu_supports(const Tensor& t);
// silu(a) ⊙ b in a's dtype; a and b one shape, one dtype.
Tensor fused_swiglu(const Tensor& a, const Tensor& b);
// silu(a) ⊙ b where a and b are the two halves of ab's last dimension: ab [..., 2H] -> [..., H]. Its
// backward writes the gradient of ab in one tensor (no concatenation).
Tensor fused_swiglu_packed(const Tensor& ab);

// fused_swiglu_packed(ab) · w2ᵀ (w2 [d, H]) in ab's dtype, without keeping silu(a) ⊙ b for the backward:
// the backward recomputes it from ab. w2's gradient comes back in w2's dtype.
// result_only: the caller differentiates the result's graph without reading its values (a recomputation
// in the backward): the forward then returns uninitialized memory and computes nothing; the backward is
// the same.
Tensor fused_swiglu_linear(const Tensor& ab, const Tensor& w2, bool result_only = false);

}  // namespace carry
