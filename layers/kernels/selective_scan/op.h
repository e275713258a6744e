// Mamba-1's selective-scan kernels (layers/kernels/selective_scan/api.h) as one differentiable op (CUDA
// builds only): forward and hand-written backward behind a torch autograd Function.
#pragma once

#include <ATen/ATen.h>

#include <utility>

namespace carry {

// Whether the kernels take these inputs: CUDA tensors, u, delta [B,T,D] and B, C [B,T,N] in one dtype (bf16 or
// fp32), A [D,N] of any float dtype (read in fp32), N ∈ {4, 8, 16}, T ≥ 1.
bool selective_scan_kernel_supports(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
                                    const at::Tensor& B, const at::Tensor& C);

// The selective scan h_t = exp(Δ_t A) ⊙ h_{t−1} + B_t u_t, y_t = Σ_n C_t h_t from `initial_state` [B,D,N]
// (undefined: zeros). Returns y [B,T,D] in u's dtype and the final state [B,D,N] fp32; differentiable in u,
// delta, A, B, C and the initial state. serial_states: one segment, the state carried token by token
// (MixerOptions::serial_states), else the tokens are cut into segments scanned in parallel.
std::pair<at::Tensor, at::Tensor> selective_scan_kernel(const at::Tensor& u, const at::Tensor& delta,
                                                        const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                                                        const at::Tensor& initial_state, bool serial_states = false);

}  // namespace carry
