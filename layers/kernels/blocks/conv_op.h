// The fused short convolution and L2 normalization (layers/kernels/blocks/conv.h) as differentiable
// ops (torch autograd Functions; CUDA builds only). MixerLayer uses them for CUDA tensors while
// fused_ops_enabled() (layers/core/fused_switch.h); their ATen forms are causal_conv1d and the L2
// normalization in layers/blocks/mixer_layer.cpp.
#pragma once

#include "layers/mixer.h"

#include <vector>

namespace carry {

// Whether fused_causal_conv1d takes x [B,T,C] (CUDA, bf16 or fp32) and weight [C,K] (1 ≤ K ≤ 4, a
// float dtype whose promotion with x's is fp32, or bf16 for bf16 x).
bool fused_conv_supports(const Tensor& x, const Tensor& weight);

// causal_conv1d(x, weight, halo, tap mask), then silu when `silu`, in one pass, returned as the
// channel groups `widths` of the output (each contiguous [B,T,width], summing to C) in the promoted
// dtype of x and weight, or in bf16 when `bf16_out` and x is bf16 (the autocast case where the mixer's
// kernel form reads q, k, v in bf16 anyway: no fp32 copy is written and cast again). Packed documents: `document_start` [B, ≥ offset+T] int64 on x's device, the
// absolute position of each position's document start (−1: none), read at [offset, offset+T) (the
// slice's tokens; its row stride is free, its column stride 1); undefined: one document. The taps are
// summed in causal_conv1d's order and rounding (fp32 accumulation). Differentiable in x, weight and
// halo (the halo exchange backpropagates its gradient); the weight gradient is reduced in fixed order.
std::vector<Tensor> fused_causal_conv1d(const Tensor& x, const Tensor& weight, const Tensor& halo,
                                        const Tensor& document_start, int64_t offset, bool silu,
                                        const std::vector<int64_t>& widths, bool bf16_out = false);

// Whether fused_l2_normalize takes x (CUDA, bf16 or fp32, last dimension 1..256).
bool fused_l2_supports(const Tensor& x);

// x · rsqrt(Σ x² + 1e−6) over the last dimension, fp32 math, in x's dtype. x may be a channel group of
// a wider tensor (read in place when its rows are evenly spaced). Differentiable.
Tensor fused_l2_normalize(const Tensor& x);

}  // namespace carry
