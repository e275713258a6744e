// The elementwise pieces between hla2's decay passes (glue.h): 16 bytes a thread, grid-stride.
#include "layers/kernels/hla/glue.h"

#include "layers/kernels/primitives/host.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

namespace carry::kernels::hla {
namespace {

// Eight bf16 or four floats: one 16-byte access, widened to fp32.
template <typename T>
struct Pack {
  static constexpr int n = 16 / sizeof(T);
  float x[n];
  __device__ __forceinline__ void load(const T* p) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int i = 0; i < n; ++i) x[i] = float(e[i]);
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < n; ++i) x[i] = 0.f;
  }
  __device__ __forceinline__ void add(const T* p, float sign = 1.f) {
    Pack o;
    o.load(p);
#pragma unroll
    for (int i = 0; i < n; ++i) x[i] += sign * o.x[i];
  }
  __device__ __forceinline__ void store(T* p, float sign = 1.f) const {
    uint4 u;
    T* e = reinterpret_cast<T*>(&u);
#pragma unroll
    for (int i = 0; i < n; ++i) e[i] = T(sign * x[i]);
    *reinterpret_cast<uint4*>(p) = u;
  }
};

template <typename T>
__global__ void cat_neg_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, long rows,
                               int da, int db) {
  constexpr int V = Pack<T>::n;
  const int w = da + db, per_row = w / V;
  for (long i = blockIdx.x * long(blockDim.x) + threadIdx.x; i < rows * per_row; i += long(gridDim.x) * blockDim.x) {
    const long r = i / per_row;
    const int j = int(i % per_row) * V;
    Pack<T> p;
    if (j < da) {
      p.load(a + r * da + j);
      p.store(out + r * w + j);
    } else {
      p.load(b + r * db + (j - da));
      p.store(out + r * w + j, -1.f);
    }
  }
}

template <typename T>
__global__ void sum_grads_kernel(const T* __restrict__ a, const T* __restrict__ b, const T* __restrict__ c,
                                 T* __restrict__ out, long rows, int d, int c_ld, int c_col0, float c_sign,
                                 bool next_token, long tokens, int heads) {
  constexpr int V = Pack<T>::n;
  const int per_row = d / V;
  for (long i = blockIdx.x * long(blockDim.x) + threadIdx.x; i < rows * per_row; i += long(gridDim.x) * blockDim.x) {
    const long r = i / per_row;
    const int j = int(i % per_row) * V;
    Pack<T> p;
    if (a) p.load(a + r * d + j);
    else p.zero();
    if (b) p.add(b + r * d + j);
    if (c) {
      long rc = r;
      bool in = true;
      if (next_token) {
        in = (r / heads) % tokens + 1 < tokens;
        rc = r + heads;
      }
      if (in) p.add(c + rc * c_ld + c_col0 + j, c_sign);
    }
    p.store(out + r * d + j);
  }
}

int blocks_for(long items) {
  const long per_block = 256;
  const long most = long(carry::kernels::primitives::sm_count()) * 16;
  return int(std::max(1L, std::min(most, (items + per_block - 1) / per_block)));
}

void check4(const at::Tensor& t, const char* what, const at::Tensor& like) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 4 && t.is_contiguous() && t.scalar_type() == like.scalar_type() &&
                  t.sizes().slice(0, 3) == like.sizes().slice(0, 3),
              "hla glue: '", what, "' must be a contiguous CUDA [B,T,H,d] tensor of ", like.scalar_type(),
              " with [B,T,H] = ", like.sizes().slice(0, 3), "; got ", t.sizes(), " ", t.scalar_type());
  const int V = 16 / int(t.element_size());
  TORCH_CHECK(t.size(3) % V == 0, "hla glue: '", what, "' needs its last dimension a multiple of ", V, ", got ",
              t.size(3));
}

}  // namespace

at::Tensor cat_neg(const at::Tensor& a, const at::Tensor& b) {
  check4(a, "a", a);
  check4(b, "b", a);
  c10::cuda::CUDAGuard guard(a.device());
  auto s = a.sizes().vec();
  s.back() = a.size(3) + b.size(3);
  at::Tensor out = at::empty(s, a.options());
  const long rows = a.numel() / a.size(3);
  const int V = 16 / int(a.element_size());
  const long items = rows * (s.back() / V);
  auto st = at::cuda::getCurrentCUDAStream();
  if (a.scalar_type() == at::kBFloat16)
    cat_neg_kernel<__nv_bfloat16><<<blocks_for(items), 256, 0, st>>>(
        reinterpret_cast<const __nv_bfloat16*>(a.data_ptr()), reinterpret_cast<const __nv_bfloat16*>(b.data_ptr()),
        reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), rows, int(a.size(3)), int(b.size(3)));
  else
    cat_neg_kernel<float><<<blocks_for(items), 256, 0, st>>>(a.data_ptr<float>(), b.data_ptr<float>(),
                                                             out.data_ptr<float>(), rows, int(a.size(3)),
                                                             int(b.size(3)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

namespace {

// out [B,T,H,d] = a + b + c_sign·c' (a, b optional; c' as sum_grads says).
at::Tensor combine(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, int64_t c_col0, int64_t d,
                   double c_sign, bool next_token) {
  const at::Tensor& like = a.defined() ? a : c;
  if (a.defined()) check4(a, "a", like);
  if (b.defined()) {
    check4(b, "b", like);
    TORCH_CHECK(b.sizes() == a.sizes(), "hla glue: 'b' must be shaped as 'a' ", a.sizes(), ", got ", b.sizes());
  }
  if (c.defined()) {
    check4(c, "c", like);
    TORCH_CHECK(c_col0 >= 0 && c_col0 + d <= c.size(3) && c_col0 % (16 / int(c.element_size())) == 0,
                "hla glue: columns [", c_col0, ", ", c_col0 + d, ") do not fit 'c' of width ", c.size(3));
  }
  c10::cuda::CUDAGuard guard(like.device());
  auto shape = like.sizes().vec();
  shape.back() = d;
  at::Tensor out = at::empty(shape, like.options());
  const long rows = out.numel() / d;
  const int V = 16 / int(like.element_size());
  const long items = rows * (d / V);
  auto st = at::cuda::getCurrentCUDAStream();
  const int ld = c.defined() ? int(c.size(3)) : 0;
  const long T = like.size(1);
  const int H = int(like.size(2));
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; };
  if (like.scalar_type() == at::kBFloat16) {
    using B16 = __nv_bfloat16;
    sum_grads_kernel<B16><<<blocks_for(items), 256, 0, st>>>(
        static_cast<const B16*>(ptr(a)), static_cast<const B16*>(ptr(b)), static_cast<const B16*>(ptr(c)),
        static_cast<B16*>(out.data_ptr()), rows, int(d), ld, int(c_col0), float(c_sign), next_token, T, H);
  } else {
    sum_grads_kernel<float><<<blocks_for(items), 256, 0, st>>>(
        static_cast<const float*>(ptr(a)), static_cast<const float*>(ptr(b)), static_cast<const float*>(ptr(c)),
        static_cast<float*>(out.data_ptr()), rows, int(d), ld, int(c_col0), float(c_sign), next_token, T, H);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

at::Tensor sum_grads(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, int64_t c_col0, bool next_token) {
  TORCH_CHECK(a.defined(), "hla glue: sum_grads needs 'a'");
  return combine(a, b, c, c_col0, a.size(3), 1.0, next_token);
}

at::Tensor minus_columns(const at::Tensor& a, const at::Tensor& c, int64_t c_col0) {
  TORCH_CHECK(a.defined() && c.defined(), "hla glue: minus_columns needs 'a' and 'c'");
  return combine(a, at::Tensor(), c, c_col0, a.size(3), -1.0, false);
}

at::Tensor columns(const at::Tensor& c, int64_t c_col0, int64_t d) {
  TORCH_CHECK(c.defined(), "hla glue: columns needs 'c'");
  return combine(at::Tensor(), at::Tensor(), c, c_col0, d, 1.0, false);
}

}  // namespace carry::kernels::hla
