// Host launchers of KDA's state walks (walk.cuh; layers/kda/kernel_form.h states the algorithm). Inputs
// fp32 CUDA tensors in the chunked layouts [B,H,N,64,·] (64-token chunks), DK ∈ {64, 128}, DV a multiple
// of 16 up to 256.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace carry::kernels::kda {

// w, k_out [B,H,N,64,DK], u [B,H,N,64,DV], decay [B,H,N,DK], s0 [B,H,DK,DV]: {states [B,H,N,DK,DV] (the state
// entering each chunk), v_new [B,H,N,64,DV], final_state [B,H,DK,DV]}.
std::vector<at::Tensor> walk_fwd(const at::Tensor& w, const at::Tensor& u, const at::Tensor& k_out,
                                 const at::Tensor& decay, const at::Tensor& s0);

// q_s, w, k_out [B,H,N,64,DK], d_o, dv_pre [B,H,N,64,DV], decay [B,H,N,DK], d_final [B,H,DK,DV]: {out_grads
// [B,H,N,DK,DV] (the gradient of the state leaving each chunk), v_new_grads [B,H,N,64,DV], initial_grad}.
std::vector<at::Tensor> walk_bwd(const at::Tensor& q_s, const at::Tensor& d_o, const at::Tensor& w,
                                 const at::Tensor& k_out, const at::Tensor& decay, const at::Tensor& dv_pre,
                                 const at::Tensor& d_final);

// Debug: fill every output with NaN right after allocation (unwritten elements then show up in tests).
void set_poison(bool on);

}  // namespace carry::kernels::kda
