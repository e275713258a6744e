// A fixed-order sum over the rows of an fp32 matrix, for the weight gradients that fused kernels leave
// as per-block partials (the norms' dw, the convolution's dw): out[i] = Σ_r part[r][i].
//
// Two stages, so that a few hundred columns still fill the GPU: stage 1, grid (⌈n/256⌉, S), sums
// slice s of the rows (L = ⌈R/S⌉ consecutive rows, in order) for 256 columns into tmp[s]; stage 2
// sums the S slices in order. S depends only on R, so the same partials give the same bits; no atomics.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>

namespace carry::kernels::primitives {

// A template so that every translation unit including this header may instantiate it (no ODR clash).
template <int kUnused = 0>
__global__ void rows_sum_kernel(const float* __restrict__ part, float* __restrict__ out, long R, long n, long L) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const long r0 = (long)blockIdx.y * L, r1 = std::min(R, r0 + L);
  float s = 0.f;
  for (long r = r0; r < r1; ++r) s += part[r * n + i];
  out[(long)blockIdx.y * n + i] = s;
}

// out[0..n) = Σ over the R rows of part [R, n] (both fp32 on the current device), in a fixed order.
inline void column_sum(const float* part, float* out, long R, long n, const at::TensorOptions& f32,
                       cudaStream_t stream) {
  if (n <= 0) return;
  const unsigned cols = (unsigned)((n + 255) / 256);
  const long S = std::max<long>(1, std::min<long>(64, R / 16));
  if (S == 1 || R <= 0) {
    rows_sum_kernel<<<dim3(cols, 1), 256, 0, stream>>>(part, out, R, n, std::max<long>(R, 1));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const long L = (R + S - 1) / S, slices = (R + L - 1) / L;
  at::Tensor tmp = at::empty({slices, n}, f32);
  rows_sum_kernel<<<dim3(cols, (unsigned)slices), 256, 0, stream>>>(part, tmp.data_ptr<float>(), R, n, L);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  rows_sum_kernel<<<dim3(cols, 1), 256, 0, stream>>>(tmp.data_ptr<float>(), out, slices, n, slices);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace carry::kernels::primitives
