// Fused elementwise kernels around the token mixers (conv.cu): the short causal depthwise
// convolution over time with its halo, packed-document starts and an optional silu, and the L2
// normalization over the last dimension. Host launchers over at::Tensor (CUDA tensors only); the
// differentiable ops built on them are in conv_op.h.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace carry::kernels::blocks {

// Taps of the convolution the kernels take (conv_size 1..kMaxTaps).
constexpr int kMaxTaps = 4;

// y[b,t,c] = act(Σ_{j=0..K−1} w[c,j] · m_j(b,t) · x[b, t−K+1+j, c]), the taps summed in order j = 0..K−1
// in fp32 (each product and sum rounded as ATen's separate multiply and add passes round them),
// act = silu or the identity. x [B,T,C] contiguous, bf16 or fp32; w [C,K] fp32 contiguous; positions
// before the slice from `halo` [B,K−1,C] in x's dtype (undefined: zeros). `start` (optional, int64,
// [B, ≥T] with stride(1) == 1): the absolute position of token t's document start (−1: none); tap j of
// token t counts (m_j = 1) only where offset + t − K + 1 + j ≥ start[b,t]. The output is written as
// consecutive channel groups `widths` (summing to C; at most 3), each its own contiguous [B,T,width]
// tensor of dtype `out`.
std::vector<at::Tensor> conv_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& halo,
                                 const at::Tensor& start, int64_t offset, bool silu, at::IntArrayRef widths,
                                 at::ScalarType out);

// Gradients of conv_fwd for the groups' output gradients `dy` (undefined: zero; each [B,T,width] of
// the output dtype, contiguous): {dx [B,T,C] in x's dtype, dw [C,K] fp32, dhalo [B,K−1,C] in x's dtype
// (undefined without halo)}. dw: per-block partial sums in fixed order, then summed over the blocks in
// fixed order (no atomics: bitwise reproducible).
std::vector<at::Tensor> conv_bwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& halo,
                                 const at::Tensor& start, int64_t offset, bool silu, const std::vector<at::Tensor>& dy,
                                 at::IntArrayRef widths);

// y = x · rsqrt(Σ_last x² + 1e−6) over the last dimension, fp32 math. x [M,H,D] (bf16 or fp32) with
// stride(2) == 1 and stride(1) == D (any stride(0): a channel group of a wider tensor), D ≤ 256.
// Returns y [M,H,D] contiguous in x's dtype.
at::Tensor l2norm_fwd(const at::Tensor& x);
// dx = r·dy − x·r³·(dy·x), r = rsqrt(Σ x² + 1e−6); dy [M,H,D] contiguous in x's dtype. dx contiguous.
at::Tensor l2norm_bwd(const at::Tensor& x, const at::Tensor& dy);

}  // namespace carry::kernels::blocks
