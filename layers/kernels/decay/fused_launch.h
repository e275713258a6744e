// The launchers of linear attention's fused kernels (fused.cu), for its autograd op
// (fused_op.cpp); private to the folder.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace carry::kernels::decay::fused {

// Whether the fused kernels are on (unless linear_attn_fused_set(0)) and the forced segments; for the
// scalar decay (unless scalar_decay_fused_set(0)).
bool fused_enabled();
int fused_forced_segments();
bool decay_fused_enabled();

// q, k, v bf16 [B,T,H,128] (16-byte aligned, contiguous), s0 fp32 [B,H,128,128], ns segments dividing T/64, and
// for the scalar decay gb (fp32 [B,T,H]: the log decay summed within each chunk; undefined: none):
// {o, final state, the segments' incoming states [ns,B,H,128,128], their log decays [ns,B,H] (with gb)}.
std::vector<at::Tensor> launch_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& s0,
                                   float scale, int ns, const at::Tensor& gb = {});
// With the forward's incoming states Sin (and gb, gam), d_o bf16 and dSfin fp32: {dq, dk, dv, d initial state,
// and with gb Σ_d q·dq and Σ_d k·dk a token [B,T,H] fp32}.
std::vector<at::Tensor> launch_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& Sin,
                                   const at::Tensor& d_o, const at::Tensor& dSfin, float scale, const at::Tensor& gb = {},
                                   const at::Tensor& gam = {});

}  // namespace carry::kernels::decay::fused
