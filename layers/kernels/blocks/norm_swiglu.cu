// Fused RMSNorm, gated RMSNorm and SwiGLU kernels (norm_swiglu.h). Memory-bound: each reads its
// inputs once and writes its outputs once, with fp32 math in registers; tensors are fp32 or bf16, each
// told to the kernel by a runtime dtype code (one compiled kernel per vector width, not per dtype mix).
// Rows whose length is a multiple of 4 (and 4-element-aligned pointers) move 4 elements per access
// (16 bytes fp32, 8 bytes bf16); any other length takes one element per access. The norms hold K
// accesses of a row per thread in registers: K = 1 up to D = 2048 (the model's rows; few registers,
// many blocks per SM), K = 4 up to 8192; one-element accesses hold 16.
//
//  norm_fwd_kernel: one row per row group, a block (threads = min(512, D/V rounded up to 32)), or for
//    short rows (D ≤ 256) a warp, 8 rows per 256-thread block: the row is read once into registers
//    (≤ 16 elements per thread), Σx² is reduced over the group, and y = (x·rstd)·w [·silu(z)] is
//    written in the output dtype. HBM: N·D·(|x| + |z| + |y|) + 4N bytes.
//  norm_bwd_kernel: row groups, as many as a 132-SM GPU holds at once (kRefSMs; at most N), group p
//    walks rows p, p + P, ... (P groups):
//    with g = dy [·silu(z)] (the gradient reaching x·rstd·w),
//      dz = dy · (x·rstd·w) · silu'(z),   dx = rstd·g·w − x·rstd³·mean(g·w·x),   dw = Σ_rows g·x·rstd.
//    Each thread keeps its columns' w and partial dw in registers; group p writes its partial dw to
//    row p of a [P, D] fp32 buffer, and carry::kernels::primitives::column_sum (reduce.cuh) adds the P
//    partials in a fixed order (no atomics; P depends on N, D and the kernel's registers, not on the
//    device: bitwise reproducible).
//    HBM: N·D·(|dy| + |x| + |dx| [+ 2|z|]) + 8·P·D bytes.
//  swiglu_fwd_kernel / swiglu_bwd_kernel: elementwise over [N, H] rows with their own strides
//    (a and b may be the two halves of one [N, 2H] tensor, and so may da and db).
//    y = silu(a)·b;  da = dy·b·silu'(a),  db = dy·silu(a),  silu'(a) = s·(1 + a·(1 − s)), s = σ(a).
#include "layers/kernels/blocks/norm_swiglu.h"
#include "layers/kernels/primitives/reduce.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

namespace carry::kernels::blocks {

namespace {

enum DType : int { kF32 = 0, kBF16 = 1 };
constexpr int kRowElems = 16;      // elements of one norm row per thread, at most (registers)
constexpr int kMaxThreads = 512;   // threads per norm block
// The norm backward's row groups: as many blocks as the SMs of an H100 or H200 (132 SMs of 2048 threads
// and 64K registers) hold at once, so the grid is one wave there. It was about 2^18 threads: 1365
// blocks of 192 threads at D = 768, where 1056 fit (40 registers a thread), so 309 blocks walked their
// rows after the others (two blocks' time). Counted from the kernel's registers and these fixed
// limits, not from the device: the groups fix the weight gradient's summation order, the same on
// every GPU.
constexpr int kRefSMs = 132;

// ---- device helpers ----

// V consecutive elements p[i..i+V) as fp32; V = 4 is one 16-byte (fp32) or 8-byte (bf16) access.
template <int V>
__device__ __forceinline__ void load(const void* p, int dt, int64_t i, float (&v)[V]) {
  if (dt == kBF16) {
    const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(p) + i;
    if constexpr (V == 4) {
      const uint2 u = *reinterpret_cast<const uint2*>(q);
      const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
      const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
      v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
    } else {
      v[0] = __bfloat162float(*q);
    }
  } else {
    const float* q = static_cast<const float*>(p) + i;
    if constexpr (V == 4) {
      const float4 f = *reinterpret_cast<const float4*>(q);
      v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
      v[0] = *q;
    }
  }
}

// Stores V values at p[i..i+V), rounded to nearest even when the dtype is bf16.
template <int V>
__device__ __forceinline__ void store(void* p, int dt, int64_t i, const float (&v)[V]) {
  if (dt == kBF16) {
    __nv_bfloat16* q = static_cast<__nv_bfloat16*>(p) + i;
    if constexpr (V == 4) {
      __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
      uint2 u;
      u.x = *reinterpret_cast<const unsigned*>(&lo);
      u.y = *reinterpret_cast<const unsigned*>(&hi);
      *reinterpret_cast<uint2*>(q) = u;
    } else {
      *q = __float2bfloat16_rn(v[0]);
    }
  } else {
    float* q = static_cast<float*>(p) + i;
    if constexpr (V == 4) {
      *reinterpret_cast<float4*>(q) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
      *q = v[0];
    }
  }
}

__device__ __forceinline__ float sigmoid(float z) { return 1.f / (1.f + expf(-z)); }
__device__ __forceinline__ float silu(float z) { return z / (1.f + expf(-z)); }

// The sum of v over the block (blockDim.x a multiple of 32), in a fixed order; every thread gets it.
// sh: 33 floats of shared memory. Safe to call again right after (no trailing barrier needed).
__device__ __forceinline__ float block_sum(float v, float* sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (int)(blockDim.x >> 5) ? sh[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) sh[32] = v;
  }
  __syncthreads();
  return sh[32];
}

// ---- RMSNorm / gated RMSNorm ----

// Who owns a row: the whole block (WARP false), or one warp (WARP true: short rows, D ≤ 32·V, so that a
// block of 256 threads works on 8 rows at once and a 32-thread block does not idle the SM).
template <bool WARP>
struct RowGroup {
  __device__ __forceinline__ static int lane() { return WARP ? (int)(threadIdx.x & 31) : (int)threadIdx.x; }
  __device__ __forceinline__ static int width() { return WARP ? 32 : (int)blockDim.x; }
  __device__ __forceinline__ static int index() { return WARP ? (int)(threadIdx.x >> 5) : 0; }
  __device__ __forceinline__ static int count() { return WARP ? (int)(blockDim.x >> 5) : 1; }
  // The sum over the group, in a fixed order; every thread of the group gets it.
  __device__ __forceinline__ static float sum(float v, float* sh) {
    if constexpr (WARP) {
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      return v;
    } else {
      return block_sum(v, sh);
    }
  }
};

template <int V, int K, bool WARP>
__global__ void __launch_bounds__(kMaxThreads)
    norm_fwd_kernel(const void* __restrict__ x, int xdt, const void* __restrict__ z, int zdt,
                    const float* __restrict__ w, void* __restrict__ y, int ydt, float* __restrict__ rstd, int64_t N,
                    int D, float eps, const void* __restrict__ res, int resdt, void* __restrict__ hout) {
  static_assert(K * V <= kRowElems, "registers");
  using G = RowGroup<WARP>;
  __shared__ float sh[33];
  const int64_t row = (int64_t)blockIdx.x * G::count() + G::index();
  if (row >= N) return;  // a whole warp (WARP), never part of a block's group
  const int64_t base = row * D;
  float xv[K][V];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = (k * G::width() + G::lane()) * V;
    if (c < D) {
      load<V>(x, xdt, base + c, xv[k]);
      if (res != nullptr) {  // the residual add: h = x + res, written in x's dtype, normalized as rounded
        float rv[V];
        load<V>(res, resdt, base + c, rv);
#pragma unroll
        for (int j = 0; j < V; ++j) xv[k][j] += rv[j];
        store<V>(hout, xdt, base + c, xv[k]);
        if (xdt == kBF16) load<V>(hout, xdt, base + c, xv[k]);
      }
#pragma unroll
      for (int j = 0; j < V; ++j) ss += xv[k][j] * xv[k][j];
    }
  }
  const float r = rsqrtf(G::sum(ss, sh) / (float)D + eps);
  if (G::lane() == 0) rstd[row] = r;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = (k * G::width() + G::lane()) * V;
    if (c < D) {
      float wv[V], o[V];
      load<V>(w, kF32, c, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) o[j] = (xv[k][j] * r) * wv[j];
      if (z != nullptr) {
        float zv[V];
        load<V>(z, zdt, base + c, zv);
#pragma unroll
        for (int j = 0; j < V; ++j) o[j] *= silu(zv[j]);
      }
      store<V>(y, ydt, base + c, o);
    }
  }
}

// Group p (of P = gridDim.x · groups per block) walks rows p, p + P, ... and writes its partial dw to
// dw_part row p.
template <int V, int K, bool WARP>
__global__ void __launch_bounds__(kMaxThreads)
    norm_bwd_kernel(const void* __restrict__ dy, int dydt, const void* __restrict__ x, int xdt,
                    const void* __restrict__ z, int zdt, const float* __restrict__ w,
                    const float* __restrict__ rstd, void* __restrict__ dx, void* __restrict__ dz,
                    float* __restrict__ dw_part, int64_t N, int D, const void* __restrict__ dh, int dhdt,
                    void* __restrict__ dres, int resdt) {
  static_assert(K * V <= kRowElems, "registers");
  using G = RowGroup<WARP>;
  __shared__ float sh[33];
  const int64_t p = (int64_t)blockIdx.x * G::count() + G::index(), P = (int64_t)gridDim.x * G::count();
  float wv[K][V], acc[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = (k * G::width() + G::lane()) * V;
#pragma unroll
    for (int j = 0; j < V; ++j) wv[k][j] = 0.f, acc[k][j] = 0.f;
    if (c < D) load<V>(w, kF32, c, wv[k]);
  }
  for (int64_t row = p; row < N; row += P) {
    const int64_t base = row * D;
    const float r = rstd[row];
    float xv[K][V], gv[K][V];  // x, and g = the gradient reaching x·rstd·w
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = (k * G::width() + G::lane()) * V;
      if (c < D) {
        load<V>(x, xdt, base + c, xv[k]);
        load<V>(dy, dydt, base + c, gv[k]);
        if (z != nullptr) {
          float zv[V], dzv[V];
          load<V>(z, zdt, base + c, zv);
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const float s = sigmoid(zv[j]), n = (xv[k][j] * r) * wv[k][j];
            dzv[j] = gv[k][j] * n * (s * (1.f + zv[j] * (1.f - s)));
            gv[k][j] *= silu(zv[j]);
          }
          store<V>(dz, zdt, base + c, dzv);
        }
#pragma unroll
        for (int j = 0; j < V; ++j) {
          acc[k][j] += gv[k][j] * (xv[k][j] * r);
          dot += gv[k][j] * wv[k][j] * xv[k][j];
        }
      }
    }
    const float c3 = r * r * r * (G::sum(dot, sh) / (float)D);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = (k * G::width() + G::lane()) * V;
      if (c < D) {
        float o[V];
#pragma unroll
        for (int j = 0; j < V; ++j) o[j] = r * (gv[k][j] * wv[k][j]) - xv[k][j] * c3;
        if (dh != nullptr) {  // the gradient reaching the residual stream directly, added once
          float hv[V];
          load<V>(dh, dhdt, base + c, hv);
#pragma unroll
          for (int j = 0; j < V; ++j) o[j] += hv[j];
        }
        store<V>(dx, xdt, base + c, o);
        if (dres != nullptr) store<V>(dres, resdt, base + c, o);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = (k * G::width() + G::lane()) * V;
    if (c < D) store<V>(dw_part, kF32, p * D + c, acc[k]);
  }
}

// ---- SwiGLU ----

template <int V>
__global__ void swiglu_fwd_kernel(const void* __restrict__ a, const void* __restrict__ b, int dt, int64_t sa,
                                  int64_t sb, void* __restrict__ y, int ydt, int64_t N, int H) {
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x)
    for (int c = threadIdx.x * V; c < H; c += blockDim.x * V) {
      float av[V], bv[V], o[V];
      load<V>(a, dt, row * sa + c, av);
      load<V>(b, dt, row * sb + c, bv);
#pragma unroll
      for (int j = 0; j < V; ++j) o[j] = silu(av[j]) * bv[j];
      store<V>(y, ydt, row * H + c, o);
    }
}

template <int V>
__global__ void swiglu_bwd_kernel(const void* __restrict__ dy, int dydt, const void* __restrict__ a,
                                  const void* __restrict__ b, int dt, int64_t sa, int64_t sb, void* __restrict__ da,
                                  void* __restrict__ db, int ddt, int64_t sda, int64_t sdb, int64_t N, int H) {
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x)
    for (int c = threadIdx.x * V; c < H; c += blockDim.x * V) {
      float g[V], av[V], bv[V], dav[V], dbv[V];
      load<V>(dy, dydt, row * H + c, g);
      load<V>(a, dt, row * sa + c, av);
      load<V>(b, dt, row * sb + c, bv);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float s = sigmoid(av[j]);
        dav[j] = g[j] * bv[j] * (s * (1.f + av[j] * (1.f - s)));
        dbv[j] = g[j] * silu(av[j]);
      }
      store<V>(da, ddt, row * sda + c, dav);
      store<V>(db, ddt, row * sdb + c, dbv);
    }
}

// ---- host side ----

int dtype_code(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? kBF16 : kF32; }

bool float_or_bf16(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

// Whether `t`'s data pointer allows accesses of V elements.
bool aligned(const at::Tensor& t, int V) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % (uintptr_t)(V * t.element_size()) == 0;
}

int round32(int64_t n) { return (int)((n + 31) / 32 * 32); }

int norm_threads(int64_t D, int V) {
  const int64_t vectors = (D + V - 1) / V;
  const int threads = std::min<int>(kMaxThreads, round32(vectors));
  TORCH_INTERNAL_ASSERT((vectors + threads - 1) / threads <= kRowElems / V, "norm kernels: D = ", D, " too large");
  return threads;
}

// How the norm kernels run rows of D: one warp per row (rows of at most 256, 8 rows per 256-thread
// block; k1: one access of 4 a lane, else two), or one block per row with K accesses of V elements per
// thread (k1: K = 1). Rows of 129 to 256 took a block of 64 threads (two barriers a row) before.
struct NormShape {
  bool warp, k1;
  int threads, rows_per_block;
};

NormShape norm_shape(int64_t D, bool vec) {
  if (vec && D <= 32 * 4 * 2) return {true, D <= 32 * 4, 256, 8};
  const int V = vec ? 4 : 1, threads = norm_threads(D, V);
  return {false, vec && D <= 4 * threads, threads, 1};
}

// Blocks of `threads` threads of `kern` an SM of 2048 threads, 64K registers and 32 blocks holds at once
// (sm_90; registers allocated by warp in units of 256).
template <typename K>
int resident_blocks(K kern, int threads) {
  cudaFuncAttributes a{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&a, kern));
  const int warps = (threads + 31) / 32, per_warp = (a.numRegs * 32 + 255) / 256 * 256;
  const int by_regs = 65536 / std::max(1, per_warp * warps);
  return std::max(1, std::min({32, 2048 / threads, by_regs}));
}

void check_rows(const char* who, const char* name, const at::Tensor& t, const at::Tensor& like) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), who, ": ", name, " must be on ", like.device(), ", got ",
              t.device());
  TORCH_CHECK(t.sizes() == like.sizes(), who, ": ", name, " must have the shape ", like.sizes(), ", got ", t.sizes());
  TORCH_CHECK(float_or_bf16(t.scalar_type()), who, ": ", name, " must be fp32 or bf16, got ", t.scalar_type());
}

void check_norm(const char* who, const at::Tensor& x, const at::Tensor& z, const at::Tensor& w) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2, who, ": x must be a CUDA tensor [N, D], got ", x.sizes(), " on ",
              x.device());
  TORCH_CHECK(float_or_bf16(x.scalar_type()), who, ": x must be fp32 or bf16, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) >= 1 && x.size(1) <= kMaxNormDim, who, ": the last dimension must be in [1, ", kMaxNormDim,
              "], got ", x.size(1));
  TORCH_CHECK(x.size(0) <= INT32_MAX, who, ": at most 2^31-1 rows, got ", x.size(0));
  TORCH_CHECK(x.is_contiguous(), who, ": x must be contiguous");
  if (z.defined()) {
    check_rows(who, "z", z, x);
    TORCH_CHECK(z.is_contiguous(), who, ": z must be contiguous");
  }
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == at::kFloat && w.is_contiguous() &&
                  w.device() == x.device(),
              who, ": weight must be fp32 [", x.size(1), "] contiguous on ", x.device(), ", got ", w.scalar_type(),
              " ", w.sizes(), " on ", w.device());
}

}  // namespace

std::vector<at::Tensor> norm_fwd(const at::Tensor& x, const at::Tensor& z, const at::Tensor& w, double eps,
                                 at::ScalarType out_dtype, const at::Tensor& res) {
  check_norm("fused rms_norm", x, z, w);
  if (res.defined()) {
    check_rows("fused rms_norm", "the residual", res, x);
    TORCH_CHECK(res.is_contiguous(), "fused rms_norm: the residual must be contiguous");
  }
  TORCH_CHECK(float_or_bf16(out_dtype), "fused rms_norm: the output dtype must be fp32 or bf16, got ", out_dtype);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t N = x.size(0);
  const int D = (int)x.size(1);
  auto y = at::empty({N, D}, x.options().dtype(out_dtype));
  auto rstd = at::empty({N}, x.options().dtype(at::kFloat));
  at::Tensor h = res.defined() ? at::empty_like(x) : at::Tensor();
  if (N == 0) return {y, rstd, h};
  const bool vec = D % 4 == 0 && aligned(x, 4) && aligned(y, 4) && aligned(w, 4) && (!z.defined() || aligned(z, 4)) &&
                   (!res.defined() || (aligned(res, 4) && aligned(h, 4)));
  const NormShape sh = norm_shape(D, vec);
  auto stream = at::cuda::getCurrentCUDAStream();
  auto kern = !vec    ? norm_fwd_kernel<1, kRowElems, false>
              : sh.warp ? (sh.k1 ? norm_fwd_kernel<4, 1, true> : norm_fwd_kernel<4, 2, true>)
              : sh.k1   ? norm_fwd_kernel<4, 1, false>
                        : norm_fwd_kernel<4, 4, false>;
  const unsigned blocks = (unsigned)((N + sh.rows_per_block - 1) / sh.rows_per_block);
  kern<<<blocks, sh.threads, 0, stream>>>(x.data_ptr(), dtype_code(x), z.defined() ? z.data_ptr() : nullptr,
                                          z.defined() ? dtype_code(z) : kF32, w.data_ptr<float>(), y.data_ptr(),
                                          dtype_code(y), rstd.data_ptr<float>(), N, D, (float)eps,
                                          res.defined() ? res.data_ptr() : nullptr,
                                          res.defined() ? dtype_code(res) : kF32, res.defined() ? h.data_ptr() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {y, rstd, h};
}

std::vector<at::Tensor> norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& z, const at::Tensor& w,
                                 const at::Tensor& rstd, const at::Tensor& dh, c10::optional<at::ScalarType> res_dtype) {
  check_norm("fused rms_norm backward", x, z, w);
  if (dh.defined()) {
    check_rows("fused rms_norm backward", "dh", dh, x);
    TORCH_CHECK(dh.is_contiguous(), "fused rms_norm backward: dh must be contiguous");
  }
  TORCH_CHECK(!res_dtype || float_or_bf16(*res_dtype), "fused rms_norm backward: the residual's dtype must be fp32 or bf16");
  check_rows("fused rms_norm backward", "dy", dy, x);
  TORCH_CHECK(dy.is_contiguous(), "fused rms_norm backward: dy must be contiguous");
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.dim() == 1 && rstd.size(0) == x.size(0) && rstd.is_contiguous(),
              "fused rms_norm backward: rstd must be fp32 [", x.size(0), "], got ", rstd.scalar_type(), " ",
              rstd.sizes());
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t N = x.size(0);
  const int D = (int)x.size(1);
  auto dx = at::empty_like(x);
  at::Tensor dz = z.defined() ? at::empty_like(z) : at::Tensor();
  auto dw = at::zeros({D}, w.options());
  at::Tensor dres = res_dtype ? at::empty_like(x, x.options().dtype(*res_dtype)) : at::Tensor();
  if (N == 0) return {dx, dz, dw, dres};
  const bool vec = D % 4 == 0 && aligned(x, 4) && aligned(dy, 4) && aligned(dx, 4) && aligned(w, 4) &&
                   (!z.defined() || (aligned(z, 4) && aligned(dz, 4))) && (!dh.defined() || aligned(dh, 4)) &&
                   (!dres.defined() || aligned(dres, 4));
  const NormShape sh = norm_shape(D, vec);
  auto kern = !vec    ? norm_bwd_kernel<1, kRowElems, false>
              : sh.warp ? (sh.k1 ? norm_bwd_kernel<4, 1, true> : norm_bwd_kernel<4, 2, true>)
              : sh.k1   ? norm_bwd_kernel<4, 1, false>
                        : norm_bwd_kernel<4, 4, false>;
  // Row groups walking the rows (each keeps a partial dw): one wave of blocks on a kRefSMs-SM GPU, at most
  // N groups; fixed by (N, D), the access width (4 for 16-byte-aligned rows of D % 4 == 0, as every fresh
  // allocation is) and the kernel's registers, so the same inputs give the same bits on every GPU.
  const int64_t groups =
      std::min<int64_t>(N, (int64_t)kRefSMs * resident_blocks(kern, sh.threads) * sh.rows_per_block);
  const int blocks = (int)((groups + sh.rows_per_block - 1) / sh.rows_per_block);
  const int G = blocks * sh.rows_per_block;  // partial rows (a group past the last row writes zeros)
  auto part = at::empty({G, D}, w.options());
  auto stream = at::cuda::getCurrentCUDAStream();
  kern<<<blocks, sh.threads, 0, stream>>>(dy.data_ptr(), dtype_code(dy), x.data_ptr(), dtype_code(x),
                                          z.defined() ? z.data_ptr() : nullptr, z.defined() ? dtype_code(z) : kF32,
                                          w.data_ptr<float>(), rstd.data_ptr<float>(), dx.data_ptr(),
                                          z.defined() ? dz.data_ptr() : nullptr, part.data_ptr<float>(), N, D,
                                          dh.defined() ? dh.data_ptr() : nullptr, dh.defined() ? dtype_code(dh) : kF32,
                                          dres.defined() ? dres.data_ptr() : nullptr,
                                          dres.defined() ? dtype_code(dres) : kF32);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  carry::kernels::primitives::column_sum(part.data_ptr<float>(), dw.data_ptr<float>(), G, D, part.options(), stream);
  return {dx, dz, dw, dres};
}

namespace {

void check_swiglu_pair(const char* who, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.is_cuda() && a.dim() == 2, who, ": a must be a CUDA tensor [N, H], got ", a.sizes(), " on ",
              a.device());
  TORCH_CHECK(float_or_bf16(a.scalar_type()), who, ": a must be fp32 or bf16, got ", a.scalar_type());
  check_rows(who, "b", b, a);
  TORCH_CHECK(b.scalar_type() == a.scalar_type(), who, ": a and b must share one dtype, got ", a.scalar_type(), " and ",
              b.scalar_type());
  TORCH_CHECK(a.stride(1) == 1 && b.stride(1) == 1 && a.stride(0) >= a.size(1) && b.stride(0) >= b.size(1), who,
              ": a and b must have contiguous rows, got strides ", a.strides(), " and ", b.strides());
  TORCH_CHECK(a.size(1) <= INT32_MAX, who, ": rows of at most 2^31-1 elements, got ", a.size(1));
}

bool rows_vectorizable(const at::Tensor& t) { return t.stride(0) % 4 == 0 && aligned(t, 4); }

int swiglu_threads(int64_t H, int V) { return std::min<int>(256, round32((H + V - 1) / V)); }
unsigned swiglu_blocks(int64_t N) { return (unsigned)std::min<int64_t>(N, int64_t(1) << 20); }

}  // namespace

at::Tensor swiglu_fwd(const at::Tensor& a, const at::Tensor& b, at::ScalarType out_dtype) {
  check_swiglu_pair("fused swiglu", a, b);
  TORCH_CHECK(float_or_bf16(out_dtype), "fused swiglu: the output dtype must be fp32 or bf16, got ", out_dtype);
  c10::cuda::CUDAGuard guard(a.device());
  const int64_t N = a.size(0), H = a.size(1);
  auto y = at::empty({N, H}, a.options().dtype(out_dtype));
  if (y.numel() == 0) return y;
  const bool vec = H % 4 == 0 && rows_vectorizable(a) && rows_vectorizable(b) && aligned(y, 4);
  const int V = vec ? 4 : 1;
  auto stream = at::cuda::getCurrentCUDAStream();
  auto kern = vec ? swiglu_fwd_kernel<4> : swiglu_fwd_kernel<1>;
  kern<<<swiglu_blocks(N), swiglu_threads(H, V), 0, stream>>>(a.data_ptr(), b.data_ptr(), dtype_code(a), a.stride(0),
                                                              b.stride(0), y.data_ptr(), dtype_code(y), N, (int)H);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

void swiglu_bwd(const at::Tensor& dy, const at::Tensor& a, const at::Tensor& b, const at::Tensor& da,
                const at::Tensor& db) {
  const char* who = "fused swiglu backward";
  check_swiglu_pair(who, a, b);
  check_rows(who, "dy", dy, a);
  TORCH_CHECK(dy.is_contiguous(), who, ": dy must be contiguous");
  check_swiglu_pair(who, da, db);
  TORCH_CHECK(da.sizes() == a.sizes() && da.scalar_type() == a.scalar_type() && da.device() == a.device(), who,
              ": da must be ", a.scalar_type(), " ", a.sizes(), ", got ", da.scalar_type(), " ", da.sizes());
  c10::cuda::CUDAGuard guard(a.device());
  const int64_t N = a.size(0), H = a.size(1);
  if (N * H == 0) return;
  const bool vec = H % 4 == 0 && rows_vectorizable(a) && rows_vectorizable(b) && rows_vectorizable(da) &&
                   rows_vectorizable(db) && aligned(dy, 4);
  const int V = vec ? 4 : 1;
  auto stream = at::cuda::getCurrentCUDAStream();
  auto kern = vec ? swiglu_bwd_kernel<4> : swiglu_bwd_kernel<1>;
  kern<<<swiglu_blocks(N), swiglu_threads(H, V), 0, stream>>>(
      dy.data_ptr(), dtype_code(dy), a.data_ptr(), b.data_ptr(), dtype_code(a), a.stride(0), b.stride(0),
      da.data_ptr(), db.data_ptr(), dtype_code(da), da.stride(0), db.stride(0), N, (int)H);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace carry::kernels::blocks
