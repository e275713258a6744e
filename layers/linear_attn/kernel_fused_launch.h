// The launchers of linear attention's fused kernels (kernel_fused.cu), for its autograd op
// (kernel_fused_op.cpp); private to the folder.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace carry_la {

// Whether the fused kernels are on (linear_attn_fused_set, else unless CARRY_LA_FUSED=0) and the forced segments.
bool fused_enabled();
int fused_forced_segments();

// q, k, v bf16 [B,T,H,128] (16-byte aligned, contiguous), s0 fp32 [B,H,128,128], ns segments dividing T/64:
// {o, final state, the segments' incoming states [ns,B,H,128,128]}.
std::vector<at::Tensor> launch_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& s0,
                                   float scale, int ns);
// With the forward's incoming states Sin, d_o bf16 and dSfin fp32: {dq, dk, dv, d initial state}.
std::vector<at::Tensor> launch_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& Sin,
                                   const at::Tensor& d_o, const at::Tensor& dSfin, float scale);

}  // namespace carry_la
