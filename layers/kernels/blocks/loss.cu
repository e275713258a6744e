// The head's cross-entropy over a chunk of rows (loss.h). One block per row, 512 threads (128
// for short rows); E elements per access (8 bf16 or 4 fp32 = 16 bytes when V and the row starts allow,
// else 1). Pass 1 reads the row once: every thread keeps a running max m and Σ e^{x − m} (rescaled when
// m grows), and the first index of its largest value; the block combines them in a fixed order. Pass 2
// (grads) reads the row again (from L2: a 32000-token row of bf16 is 64 KB) and writes the gradient
// over it. HBM per row: V·|x| read, V·|x| written (grads), 16 bytes of row data.
#include "layers/kernels/blocks/loss.h"
#include "layers/kernels/primitives/tiles.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <cfloat>
#include <cstdint>

namespace carry::kernels::blocks {

namespace {

using carry::kernels::primitives::from_f;
using carry::kernels::primitives::Pack;
using carry::kernels::primitives::to_f;

// The running (max, Σ e^{x − max}) of a thread, and its first largest value and index.
struct Acc {
  float m = -FLT_MAX, s = 0.f, best = -INFINITY;
  int arg = 0x7fffffff;
  __device__ __forceinline__ void add(float x, int j) {
    if (x > m) {
      s = s * __expf(m - x) + 1.f;
      m = x;
    } else {
      s += __expf(x - m);
    }
    if (x > best || (x == best && j < arg)) best = x, arg = j;
    if (x != x) s = x;  // NaN: the row's loss is NaN, as the ATen form gives
  }
  __device__ __forceinline__ void merge(float m2, float s2, float best2, int arg2) {
    const float M = fmaxf(m, m2);
    s = s * __expf(m - M) + s2 * __expf(m2 - M);
    m = M;
    if (best2 > best || (best2 == best && arg2 < arg)) best = best2, arg = arg2;
  }
};

template <typename T, int E>
__global__ void __launch_bounds__(512) ce_kernel(T* __restrict__ logits, int V, const int64_t* __restrict__ targets,
                                                 const float* __restrict__ weights, float* __restrict__ ce,
                                                 int64_t* __restrict__ pred, bool grads) {
  __shared__ float sm[32], ss[32], sb[32];
  __shared__ int sa[32];
  __shared__ float lse_sh;
  const int64_t row = blockIdx.x;
  T* x = logits + row * (int64_t)V;
  Acc a;
  const int nv = V / E;
  for (int i = threadIdx.x; i < nv; i += blockDim.x) {
    const Pack<T, E> p = reinterpret_cast<const Pack<T, E>*>(x)[i];
#pragma unroll
    for (int e = 0; e < E; ++e) a.add(to_f(p.v[e]), i * E + e);
  }
  // Fixed-order combination: lanes by xor shuffles, then warps in order by warp 0.
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, a.m, o), s2 = __shfl_xor_sync(0xffffffffu, a.s, o);
    const float b2 = __shfl_xor_sync(0xffffffffu, a.best, o);
    const int a2 = __shfl_xor_sync(0xffffffffu, a.arg, o);
    a.merge(m2, s2, b2, a2);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  if (lane == 0) sm[warp] = a.m, ss[warp] = a.s, sb[warp] = a.best, sa[warp] = a.arg;
  __syncthreads();
  const int64_t t = targets[row];
  if (threadIdx.x == 0) {
    Acc r;
    r.m = sm[0], r.s = ss[0], r.best = sb[0], r.arg = sa[0];
    for (int w = 1; w < nw; ++w) r.merge(sm[w], ss[w], sb[w], sa[w]);
    const float lse = r.m + __logf(r.s);
    lse_sh = lse;
    if (t >= V) ce[row] = NAN;
    else ce[row] = t >= 0 ? lse - to_f(x[t]) : 0.f;
    if (pred != nullptr) pred[row] = r.arg;
  }
  __syncthreads();
  if (!grads) return;
  const float lse = lse_sh;
  const bool valid = t >= 0 && t < V;
  const float w = valid ? weights[row] : 0.f;
  for (int i = threadIdx.x; i < nv; i += blockDim.x) {
    Pack<T, E> p = reinterpret_cast<const Pack<T, E>*>(x)[i];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int j = i * E + e;
      const float prob = __expf(to_f(p.v[e]) - lse);
      p.v[e] = from_f<T>(w * (prob - (j == t ? 1.f : 0.f)));
    }
    reinterpret_cast<Pack<T, E>*>(x)[i] = p;
  }
}

template <typename T, int E>
void launch(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& weights, const at::Tensor& ce,
            const at::Tensor& predictions, bool grads, cudaStream_t stream) {
  const int64_t n = logits.size(0);
  const int V = (int)logits.size(1);
  const int threads = V / E >= 2048 ? 512 : 128;
  ce_kernel<T, E><<<(unsigned)n, threads, 0, stream>>>(
      reinterpret_cast<T*>(logits.data_ptr()), V, targets.data_ptr<int64_t>(), weights.data_ptr<float>(),
      ce.data_ptr<float>(), predictions.defined() ? predictions.data_ptr<int64_t>() : nullptr, grads);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

}  // namespace

void cross_entropy_rows(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& weights,
                        const at::Tensor& ce, const at::Tensor& predictions, bool grads) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.is_contiguous() &&
                  (logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat),
              "cross_entropy_rows: logits must be a contiguous [rows, vocab] CUDA tensor in bf16 or fp32, got ",
              logits.scalar_type(), " ", logits.sizes());
  const int64_t n = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V >= 1 && V <= INT32_MAX / 2 && n <= INT32_MAX, "cross_entropy_rows: ", n, " rows of ", V,
              " logits are out of range");
  auto check = [&](const at::Tensor& t, at::ScalarType dt, const char* name) {
    TORCH_CHECK(t.device() == logits.device() && t.dim() == 1 && t.size(0) == n && t.is_contiguous() &&
                    t.scalar_type() == dt,
                "cross_entropy_rows: ", name, " must be a contiguous ", dt, " [", n, "] on ", logits.device(),
                ", got ", t.scalar_type(), " ", t.sizes());
  };
  check(targets, at::kLong, "targets");
  check(weights, at::kFloat, "weights");
  check(ce, at::kFloat, "ce");
  if (predictions.defined()) check(predictions, at::kLong, "predictions");
  if (n == 0) return;
  c10::cuda::CUDAGuard guard(logits.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  if (logits.scalar_type() == at::kBFloat16) {
    if (V % 8 == 0 && aligned16(logits)) launch<__nv_bfloat16, 8>(logits, targets, weights, ce, predictions, grads, stream);
    else launch<__nv_bfloat16, 1>(logits, targets, weights, ce, predictions, grads, stream);
  } else {
    if (V % 4 == 0 && aligned16(logits)) launch<float, 4>(logits, targets, weights, ce, predictions, grads, stream);
    else launch<float, 1>(logits, targets, weights, ce, predictions, grads, stream);
  }
}

}  // namespace carry::kernels::blocks
