// Fused short convolution and L2 normalization (kernel_conv.cuh).
//
// conv: grid (C/128, T/kRun, B), 128 threads, one thread per channel and run of kRun tokens, channels
// fastest (coalesced rows). Each thread keeps the K−1 previous inputs in registers (a sliding
// window), so x is read once plus K−1 rows per run. The backward walks the run forward once: it
// recomputes the pre-activation (silu), accumulates each input's gradient from the K outputs that read
// it in a ring of K fp32 accumulators (an input's gradient is complete K−1 outputs later), and sums
// the weight gradient of its own outputs; carry_reduce::column_sum (kernel_reduce.cuh) sums those
// per-run partials over the runs in fixed order. Tap masks (packed documents) come from the int64
// document start of each output token.
// l2norm: one warp per row of D ≤ 256 (8 values a lane in registers), fp32, butterfly reduction.
#include "layers/common/kernel_conv.cuh"
#include "layers/common/kernel_reduce.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <climits>

namespace carry_conv {
namespace {

constexpr int kRun = 64;      // tokens a thread walks
constexpr int kThreads = 128;  // channels a block
constexpr int kMaxGroups = 3;
constexpr int kMaxD = 256;     // l2norm row length

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

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

template <typename TX, typename TY>
__global__ void __launch_bounds__(kThreads) conv_fwd_kernel(const TX* __restrict__ x, const TX* __restrict__ halo,
                                                            const float* __restrict__ w, Shape d, Groups<TY*> y,
                                                            bool silu) {
  const int c = blockIdx.x * kThreads + threadIdx.x;
  if (c >= d.C) return;
  const int b = blockIdx.z, t0 = blockIdx.y * kRun, t1 = min(t0 + kRun, d.T), K = d.K;
  TY* out = nullptr;
  int cc = 0, width = 1;
  find_group(y, c, out, cc, width);
  float wc[kMaxTaps], win[kMaxTaps];
#pragma unroll
  for (int j = 0; j < kMaxTaps; ++j) {
    wc[j] = j < K ? w[(long)c * K + j] : 0.f;
    win[j] = j < K - 1 ? load_x(x, halo, d, b, t0 - K + 1 + j, c) : 0.f;
  }
  for (int t = t0; t < t1; ++t) {
    const float xt = to_f(x[((long)b * d.T + t) * d.C + c]);
#pragma unroll
    for (int j = 0; j < kMaxTaps; ++j)
      if (j == K - 1) win[j] = xt;
    float a = taps(wc, win, K, first_tap(d, b, t));
    if (silu) a = a / (1.f + expf(-a));  // as ATen's silu
    out[((long)b * d.T + t) * width + cc] = from_f<TY>(a);
    shift(win, K, 0.f);
  }
}

// dx, dhalo, and the weight gradient's partial sums over this run: partial[(b·runs + run)·C + c][j].
template <typename TX, typename TY>
__global__ void __launch_bounds__(kThreads) conv_bwd_kernel(const TX* __restrict__ x, const TX* __restrict__ halo,
                                                            const float* __restrict__ w, Shape d,
                                                            Groups<const TY*> dy, bool silu, TX* __restrict__ dx,
                                                            TX* __restrict__ dhalo, float* __restrict__ partial) {
  const int c = blockIdx.x * kThreads + threadIdx.x;
  if (c >= d.C) return;
  const int b = blockIdx.z, t0 = blockIdx.y * kRun, t1 = min(t0 + kRun, d.T), K = d.K;
  const TY* g = nullptr;
  int cc = 0, width = 1;
  find_group(dy, c, g, cc, width);
  float wc[kMaxTaps], win[kMaxTaps], acc[kMaxTaps], pw[kMaxTaps];
#pragma unroll
  for (int j = 0; j < kMaxTaps; ++j) {
    wc[j] = j < K ? w[(long)c * K + j] : 0.f;
    win[j] = j < K - 1 ? load_x(x, halo, d, b, t0 - K + 1 + j, c) : 0.f;
    acc[j] = 0.f;  // acc[j]: the gradient of x[t−K+1+j]
    pw[j] = 0.f;
  }
  const int tend = min(t0 + kRun, d.T) + K - 1;
  for (int t = t0; t < tend; ++t) {
    if (t < d.T) {
      const float xt = to_f(x[((long)b * d.T + t) * d.C + c]);
#pragma unroll
      for (int j = 0; j < kMaxTaps; ++j)
        if (j == K - 1) win[j] = xt;
      const int first = first_tap(d, b, t);
      float gt = g ? to_f(g[((long)b * d.T + t) * width + cc]) : 0.f;
      if (silu) {
        const float a = taps(wc, win, K, first), s = sigmoid_f(a);
        gt = gt * (s * (1.f + a * (1.f - s)));
      }
#pragma unroll
      for (int j = 0; j < kMaxTaps; ++j) {
        if (j < K && j >= first) {
          acc[j] += wc[j] * gt;
          if (t < t1) pw[j] += gt * win[j];
        }
      }
    }
    const int s = t - K + 1;  // its gradient is complete: every output reading it is done
    if (s >= t0 && s < t1) {
      dx[((long)b * d.T + s) * d.C + c] = from_f<TX>(acc[0]);
    } else if (s < 0 && dhalo) {
      dhalo[((long)b * (K - 1) + (K - 1 + s)) * d.C + c] = from_f<TX>(acc[0]);
    }
    shift(acc, K, 0.f);
    shift(win, K, 0.f);
  }
  float* p = partial + ((long)(b * gridDim.y + blockIdx.y) * d.C + c) * K;
#pragma unroll
  for (int j = 0; j < kMaxTaps; ++j)
    if (j < K) p[j] = pw[j];
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One warp a row (m, h); dy == nullptr: forward (y = x·r), else backward (dx = r·dy − x·r³·(dy·x)).
template <typename T>
__global__ void l2norm_kernel(const T* __restrict__ x, long stride_m, const T* __restrict__ dy, T* __restrict__ out,
                              long rows, int H, int D) {
  const long row = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const T* xr = x + (row / H) * stride_m + (row % H) * (long)D;
  float v[kMaxD / 32], gv[kMaxD / 32];
  float ss = 0.f, dot = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxD / 32; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < D ? to_f(xr[e]) : 0.f;
    gv[i] = dy && e < D ? to_f(dy[row * D + e]) : 0.f;
    ss += v[i] * v[i];
    dot += v[i] * gv[i];
  }
  ss = warp_sum(ss);
  const float r = rsqrtf(ss + 1e-6f);
  if (dy) dot = warp_sum(dot);
  const float r3dot = r * r * r * dot;
#pragma unroll
  for (int i = 0; i < kMaxD / 32; ++i) {
    const int e = lane + 32 * i;
    if (e < D) out[row * D + e] = from_f<T>(dy ? r * gv[i] - v[i] * r3dot : v[i] * r);
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

dim3 conv_grid(const Shape& d) { return dim3((d.C + kThreads - 1) / kThreads, (d.T + kRun - 1) / kRun, d.B); }

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
  conv_fwd_kernel<X, Y><<<conv_grid(d), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      ptr<TX>(x), ptr<TX>(halo), w.data_ptr<float>(), d, g, silu);
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
  conv_bwd_kernel<X, Y><<<conv_grid(d), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      ptr<TX>(x), ptr<TX>(halo), w.data_ptr<float>(), d, g, silu, ptr<TX>(dx), ptr<TX>(dhalo),
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
  carry_reduce::column_sum(partial.data_ptr<float>(), dw.data_ptr<float>(), (long)(d.B * runs), n, partial.options(),
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
  l2norm_kernel<typename Cuda<T>::type><<<(unsigned)((rows + kWarps - 1) / kWarps), 32 * kWarps, 0,
                                          at::cuda::getCurrentCUDAStream()>>>(
      ptr<T>(x), (long)x.stride(0), dy.defined() ? ptr<T>(dy) : nullptr, ptr<T>(out), rows, (int)x.size(1),
      (int)x.size(2));
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

}  // namespace carry_conv
