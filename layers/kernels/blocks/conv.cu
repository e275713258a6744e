// Fused short convolution and L2 normalization (conv.h).
//
// conv: grid (C/(128·V), T/kRun, B), 128 threads, one thread per V channels (V = 16 bytes of x, 4 at
// most in the backward; 1 where widths or alignment do not allow it) and run of kRun tokens, channels
// fastest (coalesced rows, 16-byte loads; the next row is loaded before the current one is computed). Each thread keeps the K−1 previous inputs in registers (a sliding
// window), so x is read once plus K−1 rows per run. The backward walks the run forward once: it
// recomputes the pre-activation (silu), accumulates each input's gradient from the K outputs that read
// it in a ring of K fp32 accumulators (an input's gradient is complete K−1 outputs later), and sums
// the weight gradient of its own outputs; carry::kernels::primitives::column_sum (reduce.cuh) sums those
// per-run partials over the runs in fixed order. Tap masks (packed documents) come from the int64
// document start of each output token.
// l2norm: one warp per row of D ≤ 256 (8 values a lane in registers), fp32, butterfly reduction; a lane's
// values adjacent (one 8- or 16-byte access) where the rows allow it (l2norm_vec_kernel).
#include "layers/kernels/blocks/conv.h"
#include "layers/kernels/primitives/reduce.cuh"
#include "layers/kernels/primitives/tiles.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace carry::kernels::blocks {
namespace {

constexpr int kRun = 64;      // tokens a thread walks
constexpr int kThreads = 128;  // channels a block
constexpr int kMaxGroups = 3;
constexpr int kMaxD = 256;     // l2norm row length

using carry::kernels::primitives::from_f;
using carry::kernels::primitives::Pack;
using carry::kernels::primitives::to_f;

// The output's channel groups: group g holds channels [end[g−1], end[g]) as its own [B,T,width] tensor.
template <typename P>
struct Groups {
  P ptr[kMaxGroups];
  int end[kMaxGroups];
  int n;
};

template <typename P>
__device__ __forceinline__ void find_group(const Groups<P>& g, int c, P& ptr, int& cc, int& width) {
  int lo = 0;
#pragma unroll
  for (int i = 0; i < kMaxGroups; ++i) {
    if (i < g.n && c >= lo && c < g.end[i]) {
      ptr = g.ptr[i];
      cc = c - lo;
      width = g.end[i] - lo;
    }
    if (i < g.n) lo = g.end[i];
  }
}

struct Shape {
  int B, T, C, K;
  const int64_t* start;  // nullptr: no document starts
  long start_stride;     // between sequences
  long offset;
};

// x at local position s ≥ −(K−1) (s < 0: the halo, or 0 without one).
template <typename TX>
__device__ __forceinline__ float load_x(const TX* __restrict__ x, const TX* __restrict__ halo, const Shape& d, int b,
                                        int s, int c) {
  if (s >= 0) return to_f(x[((long)b * d.T + s) * d.C + c]);
  if (!halo) return 0.f;
  return to_f(halo[((long)b * (d.K - 1) + (d.K - 1 + s)) * d.C + c]);
}

// Tap j of output t counts iff j ≥ first_tap (packed documents; INT_MIN without).
__device__ __forceinline__ int first_tap(const Shape& d, int b, int t) {
  if (!d.start) return INT_MIN;
  const long st = d.start[(long)b * d.start_stride + t];
  const long f = st - d.offset - t + d.K - 1;
  return f < -kMaxTaps ? -kMaxTaps : (f > kMaxTaps ? kMaxTaps : (int)f);
}

// The pre-activation from the window win[j] = x[t−K+1+j], in ATen's order and rounding.
__device__ __forceinline__ float taps(const float* w, const float* win, int K, int first) {
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxTaps; ++j)
    if (j < K && j >= first) acc = __fadd_rn(acc, __fmul_rn(win[j], w[j]));
  return acc;
}

__device__ __forceinline__ void shift(float* a, int K, float fill) {
#pragma unroll
  for (int j = 0; j < kMaxTaps - 1; ++j)
    if (j < K - 1) a[j] = a[j + 1];
#pragma unroll
  for (int j = 0; j < kMaxTaps; ++j)
    if (j == K - 1) a[j] = fill;
}

__device__ __forceinline__ float sigmoid_f(float a) { return 1.f / (1.f + expf(-a)); }

// V consecutive channels of one row in fp32 (loaded and stored as one Pack of V·sizeof(T) bytes).
template <int V>
struct Row {
  float v[V];
};
template <int V, typename T>
__device__ __forceinline__ Row<V> load_row(const T* __restrict__ p) {
  const Pack<T, V> q = *reinterpret_cast<const Pack<T, V>*>(p);
  Row<V> r;
#pragma unroll
  for (int i = 0; i < V; ++i) r.v[i] = to_f(q.v[i]);
  return r;
}
template <int V, typename T>
__device__ __forceinline__ void store_row(T* __restrict__ p, const Row<V>& r) {
  if constexpr (std::is_same_v<T, float> && V % 4 == 0) {
#pragma unroll
    for (int i = 0; i < V; i += 4)
      reinterpret_cast<float4*>(p)[i / 4] = make_float4(r.v[i], r.v[i + 1], r.v[i + 2], r.v[i + 3]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16> && V % 2 == 0) {
    // Pairs packed into 32-bit words (round to nearest, as from_f), stored as one V·2-byte vector.
    struct alignas(2 * V) Words {
      __nv_bfloat162 w[V / 2];
    } q;
#pragma unroll
    for (int i = 0; i < V; i += 2) q.w[i / 2] = __floats2bfloat162_rn(r.v[i], r.v[i + 1]);
    *reinterpret_cast<Words*>(p) = q;
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) p[i] = from_f<T>(r.v[i]);
  }
}

// One thread: V consecutive channels c0.. (one channel group; the launcher checks alignment) and a run
// of kRun tokens. KT: the taps at compile time (0: d.K at run time; a run-time K turns the window's
// updates into indexed stores to local memory, so the V > 1 forms take K = kMaxTaps only). Each channel's arithmetic is the one-channel form's, in the same order; the V channels
// only share the loads (V·sizeof bytes each) and the token loop, which loads the next row before it
// computes the current one.
template <typename TX, typename TY, int V, int KT>
__global__ void __launch_bounds__(kThreads) conv_fwd_kernel(const TX* __restrict__ x, const TX* __restrict__ halo,
                                                            const float* __restrict__ w, Shape d, Groups<TY*> y,
                                                            bool silu) {
  const int c0 = (blockIdx.x * kThreads + threadIdx.x) * V;
  if (c0 >= d.C) return;
  const int b = blockIdx.z, t0 = blockIdx.y * kRun, t1 = min(t0 + kRun, d.T), K = KT ? KT : d.K;
  TY* out = nullptr;
  int cc = 0, width = 1;
  find_group(y, c0, out, cc, width);
  float wc[V][kMaxTaps], win[V][kMaxTaps];
#pragma unroll
  for (int i = 0; i < V; ++i)
#pragma unroll
    for (int j = 0; j < kMaxTaps; ++j) {
      wc[i][j] = j < K ? w[(long)(c0 + i) * K + j] : 0.f;
      win[i][j] = j < K - 1 ? load_x(x, halo, d, b, t0 - K + 1 + j, c0 + i) : 0.f;
    }
  Row<V> nx{};
  if (t0 < t1) nx = load_row<V>(x + ((long)b * d.T + t0) * d.C + c0);
  for (int t = t0; t < t1; ++t) {
    const Row<V> xt = nx;
    if (t + 1 < t1) nx = load_row<V>(x + ((long)b * d.T + t + 1) * d.C + c0);
    const int first = first_tap(d, b, t);
    Row<V> a;
#pragma unroll
    for (int i = 0; i < V; ++i) {
#pragma unroll
      for (int j = 0; j < kMaxTaps; ++j)
        if (j == K - 1) win[i][j] = xt.v[i];
      float y = taps(wc[i], win[i], K, first);
      if (silu) y = y / (1.f + expf(-y));  // as ATen's silu
      a.v[i] = y;
      shift(win[i], K, 0.f);
    }
    store_row<V>(out + ((long)b * d.T + t) * width + cc, a);
  }
}

// dx, dhalo, and the weight gradient's partial sums over this run: partial[(b·runs + run)·C + c][j].
template <typename TX, typename TY, int V, int KT>
__global__ void __launch_bounds__(kThreads) conv_bwd_kernel(const TX* __restrict__ x, const TX* __restrict__ halo,
                                                            const float* __restrict__ w, Shape d,
                                                            Groups<const TY*> dy, bool silu, TX* __restrict__ dx,
                                                            TX* __restrict__ dhalo, float* __restrict__ partial) {
  const int c0 = (blockIdx.x * kThreads + threadIdx.x) * V;
  if (c0 >= d.C) return;
  const int b = blockIdx.z, t0 = blockIdx.y * kRun, t1 = min(t0 + kRun, d.T), K = KT ? KT : d.K;
  const TY* g = nullptr;
  int cc = 0, width = 1;
  find_group(dy, c0, g, cc, width);
  float wc[V][kMaxTaps], win[V][kMaxTaps], acc[V][kMaxTaps], pw[V][kMaxTaps];
#pragma unroll
  for (int i = 0; i < V; ++i)
#pragma unroll
    for (int j = 0; j < kMaxTaps; ++j) {
      wc[i][j] = j < K ? w[(long)(c0 + i) * K + j] : 0.f;
      win[i][j] = j < K - 1 ? load_x(x, halo, d, b, t0 - K + 1 + j, c0 + i) : 0.f;
      acc[i][j] = 0.f;  // acc[i][j]: the gradient of x[t−K+1+j] in channel c0 + i
      pw[i][j] = 0.f;
    }
  const int tend = min(t0 + kRun, d.T) + K - 1;
  const int tlast = min(tend, d.T);  // rows t < tlast are read
  Row<V> nx{}, ng{};
  auto load = [&](int t) {
    nx = load_row<V>(x + ((long)b * d.T + t) * d.C + c0);
    if (g) ng = load_row<V>(g + ((long)b * d.T + t) * width + cc);
  };
  if (t0 < tlast) load(t0);
  for (int t = t0; t < tend; ++t) {
    if (t < d.T) {
      float xt[V], gt[V];
#pragma unroll
      for (int i = 0; i < V; ++i) xt[i] = nx.v[i], gt[i] = g ? ng.v[i] : 0.f;
      if (t + 1 < tlast) load(t + 1);
      const int first = first_tap(d, b, t);
#pragma unroll
      for (int i = 0; i < V; ++i) {
#pragma unroll
        for (int j = 0; j < kMaxTaps; ++j)
          if (j == K - 1) win[i][j] = xt[i];
        if (silu) {
          const float a = taps(wc[i], win[i], K, first), s = sigmoid_f(a);
          gt[i] = gt[i] * (s * (1.f + a * (1.f - s)));
        }
#pragma unroll
        for (int j = 0; j < kMaxTaps; ++j) {
          if (j < K && j >= first) {
            acc[i][j] += wc[i][j] * gt[i];
            if (t < t1) pw[i][j] += gt[i] * win[i][j];
          }
        }
      }
    }
    const int s = t - K + 1;  // its gradient is complete: every output reading it is done
    Row<V> done;
#pragma unroll
    for (int i = 0; i < V; ++i) done.v[i] = acc[i][0];
    if (s >= t0 && s < t1) {
      store_row<V>(dx + ((long)b * d.T + s) * d.C + c0, done);
    } else if (s < 0 && dhalo) {
      store_row<V>(dhalo + ((long)b * (K - 1) + (K - 1 + s)) * d.C + c0, done);
    }
#pragma unroll
    for (int i = 0; i < V; ++i) {
      shift(acc[i], K, 0.f);
      shift(win[i], K, 0.f);
    }
  }
  float* p = partial + ((long)(b * gridDim.y + blockIdx.y) * d.C + c0) * K;
#pragma unroll
  for (int i = 0; i < V; ++i)
#pragma unroll
    for (int j = 0; j < kMaxTaps; ++j)
      if (j < K) p[i * K + j] = pw[i][j];
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The L2 norm on this lane's N values v of a row (g: their incoming gradient, zeros in the forward), the
// row's sums over the warp, in i order within the lane: o = y = v·r (forward) or dx = r·g − v·r³·(g·v).
template <int N>
__device__ __forceinline__ void l2_lane(const float (&v)[N], const float (&g)[N], bool bwd, float (&o)[N]) {
  float ss = 0.f, dot = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    ss += v[i] * v[i];
    dot += v[i] * g[i];
  }
  ss = warp_sum(ss);
  const float r = rsqrtf(ss + 1e-6f);
  if (bwd) dot = warp_sum(dot);
  const float r3dot = r * r * r * dot;
#pragma unroll
  for (int i = 0; i < N; ++i) o[i] = bwd ? r * g[i] - v[i] * r3dot : v[i] * r;
}

// One warp a row (m, h); dy == nullptr: forward (y = x·r), else backward (dx = r·dy − x·r³·(dy·x)).
template <typename T>
__global__ void l2norm_kernel(const T* __restrict__ x, long stride_m, const T* __restrict__ dy, T* __restrict__ out,
                              long rows, int H, int D) {
  const long row = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const T* xr = x + (row / H) * stride_m + (row % H) * (long)D;
  float v[kMaxD / 32], gv[kMaxD / 32], o[kMaxD / 32];
#pragma unroll
  for (int i = 0; i < kMaxD / 32; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < D ? to_f(xr[e]) : 0.f;
    gv[i] = dy && e < D ? to_f(dy[row * D + e]) : 0.f;
  }
  l2_lane(v, gv, dy != nullptr, o);
#pragma unroll
  for (int i = 0; i < kMaxD / 32; ++i) {
    const int e = lane + 32 * i;
    if (e < D) out[row * D + e] = from_f<T>(o[i]);
  }
}

// The same with each lane's VL elements adjacent (one VL·sizeof(T)-byte access: 8 or 16 bytes in bf16) where
// D ≤ 32·VL is a multiple of VL and every row is aligned to it: one load instruction a lane for x (and
// dy) instead of D/32 two-byte ones. The warp's sums run over other partials, so the bits differ from
// the strided kernel's (each within fp32 rounding of ATen's). Measured: README, "Training on GPUs".
template <typename T, int VL>
__global__ void l2norm_vec_kernel(const T* __restrict__ x, long stride_m, const T* __restrict__ dy,
                                  T* __restrict__ out, long rows, int H, int D) {
  const long row = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int e0 = (threadIdx.x % 32) * VL;
  if (row >= rows) return;
  const bool on = e0 < D;
  using P = Pack<T, VL>;
  float v[VL] = {}, gv[VL] = {}, o[VL];
  if (on) {
    const P xp = *reinterpret_cast<const P*>(x + (row / H) * stride_m + (row % H) * (long)D + e0);
#pragma unroll
    for (int i = 0; i < VL; ++i) v[i] = to_f(xp.v[i]);
    if (dy) {
      const P gp = *reinterpret_cast<const P*>(dy + row * D + e0);
#pragma unroll
      for (int i = 0; i < VL; ++i) gv[i] = to_f(gp.v[i]);
    }
  }
  l2_lane(v, gv, dy != nullptr, o);
  if (on) {
    P po;
#pragma unroll
    for (int i = 0; i < VL; ++i) po.v[i] = from_f<T>(o[i]);
    *reinterpret_cast<P*>(out + row * D + e0) = po;
  }
}

// ---- host ----

template <typename T>
struct Cuda;
template <>
struct Cuda<float> {
  using type = float;
};
template <>
struct Cuda<at::BFloat16> {
  using type = __nv_bfloat16;
};

template <typename T>
typename Cuda<T>::type* ptr(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<typename Cuda<T>::type*>(t.data_ptr<T>()) : nullptr;
}

Shape check_conv(const char* who, const at::Tensor& x, const at::Tensor& w, const at::Tensor& halo,
                 const at::Tensor& start, int64_t offset, at::IntArrayRef widths) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && x.is_contiguous(), who, ": x must be a contiguous CUDA tensor [B,T,C], got ",
              x.sizes(), " on ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, who, ": x must be bf16 or fp32, got ",
              x.scalar_type());
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  TORCH_CHECK(w.is_cuda() && w.dim() == 2 && w.size(0) == C && w.size(1) >= 1 && w.size(1) <= kMaxTaps &&
                  w.scalar_type() == at::kFloat && w.is_contiguous(),
              who, ": weight must be fp32 contiguous [", C, ", K] with 1 <= K <= ", kMaxTaps, ", got ", w.scalar_type(),
              " ", w.sizes());
  const int64_t K = w.size(1);
  if (halo.defined())
    TORCH_CHECK(halo.is_cuda() && halo.sizes() == at::IntArrayRef({B, K - 1, C}) && halo.is_contiguous() &&
                    halo.scalar_type() == x.scalar_type(),
                who, ": halo must be contiguous [", B, ", ", K - 1, ", ", C, "] in x's dtype, got ", halo.scalar_type(),
                " ", halo.sizes());
  if (start.defined())
    TORCH_CHECK(start.is_cuda() && start.dim() == 2 && start.size(0) == B && start.size(1) >= T &&
                    start.stride(1) == 1 && start.scalar_type() == at::kLong,
                who, ": document starts must be int64 [", B, ", >=", T, "] with unit stride, got ", start.scalar_type(),
                " ", start.sizes());
  TORCH_CHECK(!widths.empty() && (int64_t)widths.size() <= kMaxGroups, who, ": 1 to ", kMaxGroups,
              " channel groups, got ", widths.size());
  int64_t sum = 0;
  for (auto v : widths) sum += v;
  TORCH_CHECK(sum == C, who, ": the channel groups ", widths, " must sum to C = ", C);
  TORCH_CHECK(T < INT_MAX && C < INT_MAX && B <= 65535 && (T + kRun - 1) / kRun <= 65535, who,
              ": shape out of range: ", x.sizes());
  return Shape{(int)B, (int)T, (int)C, (int)K, start.defined() ? start.data_ptr<int64_t>() : nullptr,
               start.defined() ? (long)start.stride(0) : 0, (long)offset};
}

dim3 conv_grid(const Shape& d, int v) {
  return dim3((d.C / v + kThreads - 1) / kThreads, (d.T + kRun - 1) / kRun, d.B);
}

// The channels a thread takes: v = min(16 / sizeof(X), cap) (16-byte rows of x) where C, every channel
// group's boundary and every pointer's alignment allow it (xs: x-typed, ys: y-typed); else 1.
template <typename X, typename Y>
int channels_a_thread(const Shape& d, const int* ends, int n, std::initializer_list<const void*> xs,
                      std::initializer_list<const void*> ys, int cap) {
  const int v = std::min<int>(16 / sizeof(X), cap);
  bool ok = d.C % v == 0;
  for (int i = 0; i < n; ++i) ok = ok && ends[i] % v == 0;
  for (const void* p : xs) ok = ok && reinterpret_cast<uintptr_t>(p) % (v * sizeof(X)) == 0;
  for (const void* p : ys) ok = ok && reinterpret_cast<uintptr_t>(p) % (v * sizeof(Y)) == 0;
  return ok ? v : 1;
}

template <typename TX, typename TY>
void launch_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& halo, const Shape& d, bool silu,
                std::vector<at::Tensor>& y) {
  using X = typename Cuda<TX>::type;
  using Y = typename Cuda<TY>::type;
  Groups<Y*> g{};
  g.n = (int)y.size();
  int end = 0;
  for (int i = 0; i < g.n; ++i) {
    g.ptr[i] = ptr<TY>(y[i]);
    end += (int)y[i].size(2);
    g.end[i] = end;
  }
  if (d.T == 0 || d.B == 0 || d.C == 0) return;
  // 16 bytes of x a thread: V = 8 for bf16 x (fp32 outputs: two 16-byte stores), 4 for fp32.
  constexpr int kV = 16 / sizeof(X);
  const int v = channels_a_thread<X, Y>(d, g.end, g.n, {x.data_ptr()},
                                        {g.ptr[0], g.ptr[1 < g.n ? 1 : 0], g.ptr[2 < g.n ? 2 : 0]}, kV);
  auto stream = at::cuda::getCurrentCUDAStream();
  const X* xp = ptr<TX>(x);
  const X* hp = ptr<TX>(halo);
  if (v == kV && d.K == kMaxTaps)
    conv_fwd_kernel<X, Y, kV, kMaxTaps><<<conv_grid(d, kV), kThreads, 0, stream>>>(xp, hp, w.data_ptr<float>(), d, g, silu);
  else
    conv_fwd_kernel<X, Y, 1, 0><<<conv_grid(d, 1), kThreads, 0, stream>>>(xp, hp, w.data_ptr<float>(), d, g, silu);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename TX, typename TY>
void launch_bwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& halo, const Shape& d, bool silu,
                const std::vector<at::Tensor>& dy, at::IntArrayRef widths, const at::Tensor& dx, const at::Tensor& dhalo,
                const at::Tensor& partial) {
  using X = typename Cuda<TX>::type;
  using Y = typename Cuda<TY>::type;
  Groups<const Y*> g{};
  g.n = (int)widths.size();
  int end = 0;
  for (int i = 0; i < g.n; ++i) {
    g.ptr[i] = dy[i].defined() ? ptr<TY>(dy[i]) : nullptr;
    end += (int)widths[i];
    g.end[i] = end;
  }
  // Four channels a thread (16 accumulators each); V = 1 where alignment does not allow it.
  const int v = channels_a_thread<X, Y>(d, g.end, g.n, {x.data_ptr(), dx.data_ptr()},
                                        {g.ptr[0], g.ptr[1 < g.n ? 1 : 0], g.ptr[2 < g.n ? 2 : 0]}, 4) == 4 ? 4 : 1;
  auto stream = at::cuda::getCurrentCUDAStream();
  if (v == 4 && d.K == kMaxTaps)
    conv_bwd_kernel<X, Y, 4, kMaxTaps><<<conv_grid(d, 4), kThreads, 0, stream>>>(ptr<TX>(x), ptr<TX>(halo), w.data_ptr<float>(), d,
                                                                      g, silu, ptr<TX>(dx), ptr<TX>(dhalo),
                                                                      partial.data_ptr<float>());
  else
    conv_bwd_kernel<X, Y, 1, 0><<<conv_grid(d, 1), kThreads, 0, stream>>>(ptr<TX>(x), ptr<TX>(halo), w.data_ptr<float>(), d,
                                                                      g, silu, ptr<TX>(dx), ptr<TX>(dhalo),
                                                                      partial.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::vector<at::Tensor> conv_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& halo,
                                 const at::Tensor& start, int64_t offset, bool silu, at::IntArrayRef widths,
                                 at::ScalarType out) {
  const Shape d = check_conv("conv_fwd", x, w, halo, start, offset, widths);
  c10::cuda::CUDAGuard guard(x.device());
  const auto xt = x.scalar_type();
  TORCH_CHECK(out == at::kFloat || (out == at::kBFloat16 && xt == at::kBFloat16), "conv_fwd: the output dtype must "
              "be fp32, or bf16 for bf16 x; got ", out, " for ", xt);
  std::vector<at::Tensor> y;
  for (auto width : widths) y.push_back(at::empty({d.B, d.T, width}, x.options().dtype(out)));
  if (xt == at::kFloat) launch_fwd<float, float>(x, w, halo, d, silu, y);
  else if (out == at::kFloat) launch_fwd<at::BFloat16, float>(x, w, halo, d, silu, y);
  else launch_fwd<at::BFloat16, at::BFloat16>(x, w, halo, d, silu, y);
  return y;
}

std::vector<at::Tensor> conv_bwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& halo,
                                 const at::Tensor& start, int64_t offset, bool silu, const std::vector<at::Tensor>& dy,
                                 at::IntArrayRef widths) {
  const Shape d = check_conv("conv_bwd", x, w, halo, start, offset, widths);
  c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(dy.size() == widths.size(), "conv_bwd: one output gradient a channel group (", widths.size(), "), got ",
              dy.size());
  at::ScalarType gt = at::ScalarType::Undefined;
  for (size_t i = 0; i < dy.size(); ++i) {
    if (!dy[i].defined()) continue;
    TORCH_CHECK(dy[i].is_contiguous() && dy[i].sizes() == at::IntArrayRef({d.B, d.T, widths[i]}),
                "conv_bwd: output gradient ", i, " must be contiguous [", d.B, ", ", d.T, ", ", widths[i], "], got ",
                dy[i].sizes());
    TORCH_CHECK(gt == at::ScalarType::Undefined || gt == dy[i].scalar_type(),
                "conv_bwd: the output gradients must share one dtype");
    gt = dy[i].scalar_type();
  }
  const auto xt = x.scalar_type();
  if (gt == at::ScalarType::Undefined) gt = xt;
  TORCH_CHECK(gt == at::kFloat || (gt == at::kBFloat16 && xt == at::kBFloat16), "conv_bwd: output gradients must be "
              "fp32, or bf16 for bf16 x; got ", gt, " for ", xt);
  auto dx = at::empty_like(x);
  at::Tensor dhalo = halo.defined() ? at::empty_like(halo) : at::Tensor();
  const int64_t runs = (d.T + kRun - 1) / kRun;
  auto partial = at::empty({d.B * runs, (int64_t)d.C * d.K}, x.options().dtype(at::kFloat));
  auto dw = at::empty({d.C, d.K}, x.options().dtype(at::kFloat));
  if (d.T == 0 || d.B == 0 || d.C == 0) {
    dw.zero_();
    if (dhalo.defined()) dhalo.zero_();
    return {dx, dw, dhalo};
  }
  if (xt == at::kFloat) launch_bwd<float, float>(x, w, halo, d, silu, dy, widths, dx, dhalo, partial);
  else if (gt == at::kFloat) launch_bwd<at::BFloat16, float>(x, w, halo, d, silu, dy, widths, dx, dhalo, partial);
  else launch_bwd<at::BFloat16, at::BFloat16>(x, w, halo, d, silu, dy, widths, dx, dhalo, partial);
  const long n = (long)d.C * d.K;
  carry::kernels::primitives::column_sum(partial.data_ptr<float>(), dw.data_ptr<float>(), (long)(d.B * runs), n, partial.options(),
                           at::cuda::getCurrentCUDAStream());
  return {dx, dw, dhalo};
}

namespace {

void check_l2(const char* who, const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), who,
              ": x must be a CUDA tensor [M,H,D] with unit stride along D and rows of one head adjacent, got ",
              x.sizes(), " strides ", x.strides());
  TORCH_CHECK(x.size(2) >= 1 && x.size(2) <= kMaxD, who, ": D must lie in [1, ", kMaxD, "], got ", x.size(2));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, who, ": x must be bf16 or fp32, got ",
              x.scalar_type());
}

template <typename T>
void launch_l2(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& out) {
  const long rows = x.size(0) * x.size(1);
  if (rows == 0) return;
  constexpr int kWarps = 8;
  using CT = typename Cuda<T>::type;
  const int D = (int)x.size(2);
  const dim3 grid((unsigned)((rows + kWarps - 1) / kWarps));
  auto stream = at::cuda::getCurrentCUDAStream();
  // a lane's VL elements as one access when every row start is a multiple of VL elements and aligned
  auto fits = [&](int vl) {
    const uintptr_t bytes = (uintptr_t)vl * sizeof(CT);
    auto al = [&](const at::Tensor& t) {
      return !t.defined() || reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0;
    };
    return D % vl == 0 && D <= 32 * vl && x.stride(0) % vl == 0 && al(x) && al(dy) && al(out);
  };
  const CT* dyp = dy.defined() ? ptr<T>(dy) : nullptr;
  if (D <= 128 && fits(4)) {
    l2norm_vec_kernel<CT, 4><<<grid, 32 * kWarps, 0, stream>>>(ptr<T>(x), (long)x.stride(0), dyp, ptr<T>(out), rows,
                                                               (int)x.size(1), D);
  } else if (D <= 256 && fits(8)) {
    l2norm_vec_kernel<CT, 8><<<grid, 32 * kWarps, 0, stream>>>(ptr<T>(x), (long)x.stride(0), dyp, ptr<T>(out), rows,
                                                               (int)x.size(1), D);
  } else {
    l2norm_kernel<CT><<<grid, 32 * kWarps, 0, stream>>>(ptr<T>(x), (long)x.stride(0), dyp, ptr<T>(out), rows,
                                                        (int)x.size(1), D);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor l2norm_fwd(const at::Tensor& x) {
  check_l2("l2norm_fwd", x);
  c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) launch_l2<float>(x, at::Tensor(), y);
  else launch_l2<at::BFloat16>(x, at::Tensor(), y);
  return y;
}

at::Tensor l2norm_bwd(const at::Tensor& x, const at::Tensor& dy) {
  check_l2("l2norm_bwd", x);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.is_contiguous() && dy.scalar_type() == x.scalar_type(),
              "l2norm_bwd: dy must be contiguous ", x.sizes(), " in x's dtype, got ", dy.scalar_type(), " ",
              dy.sizes());
  c10::cuda::CUDAGuard guard(x.device());
  auto dx = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) launch_l2<float>(x, dy, dx);
  else launch_l2<at::BFloat16>(x, dy, dx);
  return dx;
}

}  // namespace carry::kernels::blocks
