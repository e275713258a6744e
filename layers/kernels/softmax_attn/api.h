// Host launchers of the softmax-attention kernel form (causal or sliding-window), FlashAttention-2's
// algorithm on blocks of 64 queries and 64 keys:
//   o_t = Σ_{t−w < s ≤ t} exp(scale·q_t·k_s) v_s / Σ_{t−w < s ≤ t} exp(scale·q_t·k_s),  w = window (0: s ≤ t).
// Inputs q, k [B,T,H,dk], v [B,T,H,dv] (bf16 or fp32, one dtype), dk = dv ∈ {64,128}, T a positive
// multiple of 64, window ≥ 0 (0 or ≥ T: full causal). Scores, softmax statistics and every sum are fp32;
// outputs and gradients are in the inputs' dtype.
//
// attn_fwd returns {o [B,T,H,dv], lse [B,H,T] fp32}: lse is the base-2 log-sum-exp of each query's
// scaled scores, log2 Σ_s 2^{scale·log2(e)·q_t·k_s}; pass it unchanged to attn_bwd.
// attn_bwd returns {dq, dk, dv} for the output gradient d_o [B,T,H,dv] (the inputs' dtype).
//
// Deterministic and cut-invariant: no atomics, every output element is summed by one thread in a fixed
// order, block boundaries sit at multiples of 64 from the tensors' start and the order in which blocks
// meet depends only on their distance. So a run on a suffix [c − halo, T) (c, halo multiples of 64,
// halo ≥ w − 1) gives the whole run's bits for o, lse and dq of the rows ≥ c, and for dk, dv of the
// keys ≥ c (only queries ≥ c reach them).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace carry::kernels::softmax_attn {  // softmax attention's kernels (layers/softmax_attn)

std::vector<at::Tensor> attn_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                 int64_t window);

std::vector<at::Tensor> attn_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
                                 const at::Tensor& lse, const at::Tensor& d_o, double scale, int64_t window);

// Debug: fill every output and intermediate with NaN right after allocation (unwritten elements then
// show up in tests). Off by default.
void attn_set_poison(bool on);

}  // namespace carry::kernels::softmax_attn
