// Mamba-1's selective scan (S6) on the GPU (api.h): the segment algorithm of scan.cuh, in plain fp32 FMAs.
//
// Tiling. A block is 128 threads; a thread owns one channel d of one sequence b and kGroup = 4 consecutive
// states (N/4 threads a channel, 128·4/N channels a block: 128 for N = 4, 32 for N = 16), for one segment
// of L tokens (L a multiple of kSub = 16). Grid (⌈D/channels⌉, S, B). The thread's states, its A entries
// and, in the backward, its gradient carry and one sub-chunk's 16 recomputed states stay in registers.
// Per token a thread reads u_t[d], Δ_t[d] (and dy_t[d]): consecutive threads read consecutive channels;
// B_t, C_t (4 entries) are the same address for every thread of a warp with the same state group.
// Sums over n (y, du, dΔ) are warp shuffles over the channel's threads; sums over d (dB, dC) are warp
// shuffles over the warp's channels, then the block's 4 warps in order through shared memory, written as
// one row a block of a [blocks, 2·B·T·N] fp32 buffer that primitives::column_sum adds in order. dA is one
// row a (b, segment) of a [B·S, D·N] buffer, added the same way. No atomics: the bits repeat.
//
// Kernels. Forward: local (segments 0..S−2 from zero: end state, ΣΔ) → scan (one thread a (b,d,n), the S
// segments in order: the state entering each, saved for the backward) → output (every segment from its
// incoming state: y; the last one writes h_T). With one segment only the output kernel runs, from h0.
// Backward: local (segments 1..S−1 from a zero gradient: outgoing gradient, ΣΔ) → reverse scan (the gradient
// arriving at each segment's last state) → checkpoints (the state entering every 16-token sub-chunk, the
// forward again from the segment states: fp32 [B,⌈T/16⌉,D,N], freed after the call) → main (every segment,
// sub-chunk by sub-chunk from the last: du, dΔ, the dB/dC and dA partials; segment 0 writes dh0) → the two
// column sums.
//
// Floor. Forward: reads u, Δ (2·B·T·D elements) twice with S > 1 and writes y; B, C are B·T·N. Backward: reads
// u, Δ, dy three to four times and writes du, dΔ; the checkpoints are 4·B·T·D·N/16 bytes each way, the dB/dC
// partials 8·B·T·N·⌈D·N/512⌉ bytes. The arithmetic is one exp and a few FMAs a (token, d, n): memory and the
// exp bound it.
#include "layers/kernels/selective_scan/api.h"
#include "layers/kernels/selective_scan/scan.cuh"

#include "layers/kernels/primitives/host.h"
#include "layers/kernels/primitives/reduce.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace carry::kernels::selective_scan {
namespace {

using namespace core;

std::atomic<bool> g_poison{false};
std::atomic<int> g_segments{0};

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

struct Dims {
  int Bs, T, D, N, L, S, P;  // sequences, tokens, channels, states, segment length, segments, channel blocks
};

// One thread's inputs: channel d of sequence b, states [n0, n0 + kGroup).
template <typename In>
struct Tokens {
  const In *u_, *delta_, *B_, *C_, *dy_;
  long D, N;
  int d, n0;
  __device__ float delta(int t) const { return to_f(delta_[t * D + d]); }
  __device__ float u(int t) const { return to_f(u_[t * D + d]); }
  __device__ float dy(int t) const { return to_f(dy_[t * D + d]); }
  __device__ void b(int t, float (&out)[kGroup]) const {
#pragma unroll
    for (int g = 0; g < kGroup; ++g) out[g] = to_f(B_[t * N + n0 + g]);
  }
  __device__ void c(int t, float (&out)[kGroup]) const {
#pragma unroll
    for (int g = 0; g < kGroup; ++g) out[g] = to_f(C_[t * N + n0 + g]);
  }
};

// The thread's place: its channel (clamped to D − 1 for the threads past the last channel, which compute
// but write nothing), whether it is a real channel, its state group.
template <int N>
struct Place {
  static constexpr int NT = N / kGroup;
  int d, grp, n0;
  bool valid;
  __device__ Place(int D) {
    const int ch = blockIdx.x * (kThreads / NT) + threadIdx.x / NT;
    valid = ch < D;
    d = valid ? ch : D - 1;
    grp = threadIdx.x % NT;
    n0 = grp * kGroup;
  }
};

template <typename In, int N>
__device__ Tokens<In> tokens_of(const In* u, const In* delta, const In* B, const In* C, const In* dy,
                                const Dims& m, int b, const Place<N>& p) {
  const long bt = (long)b * m.T;
  return Tokens<In>{u + bt * m.D, delta + bt * m.D, B + bt * N, C + bt * N, dy ? dy + bt * m.D : nullptr,
                    m.D, N, p.d, p.n0};
}

__device__ __forceinline__ void load_group(float (&x)[kGroup], const float* p) {
#pragma unroll
  for (int g = 0; g < kGroup; ++g) x[g] = p[g];
}
__device__ __forceinline__ void store_group(float* p, const float (&x)[kGroup]) {
#pragma unroll
  for (int g = 0; g < kGroup; ++g) p[g] = x[g];
}

struct Noop {
  template <class... X>
  __device__ void operator()(X&&...) const {}
};

// Index of (b, s, d, n0) in a [B, S, D, N] fp32 buffer.
__device__ __forceinline__ long bsdn(const Dims& m, int b, int s, int d, int n0) {
  return (((long)b * m.S + s) * m.D + d) * m.N + n0;
}

// Forward pass 1: segment s (< S − 1) from zero: its end state and ΣΔ.
template <typename In, int N>
__global__ void __launch_bounds__(kThreads) fwd_local_kernel(const In* u, const In* delta, const float* A,
                                                             const In* B, const In* C, Dims m, float* end_state,
                                                             float* delta_sum) {
  const Place<N> p(m.D);
  if (!p.valid) return;
  const int s = blockIdx.y, b = blockIdx.z, t0 = s * m.L, t1 = min(m.T, t0 + m.L);
  const auto ld = tokens_of<In, N>(u, delta, B, C, nullptr, m, b, p);
  float a[kGroup], h[kGroup] = {};
  load_group(a, A + (long)p.d * N + p.n0);
  const float ds = walk_forward(h, a, ld, t0, t1, Noop{});
  store_group(end_state + bsdn(m, b, s, p.d, p.n0), h);
  if (p.grp == 0) delta_sum[((long)b * m.S + s) * m.D + p.d] = ds;
}

// The segment scan over s, one thread a (b, d, n): forward, x_in[s] the state entering segment s from
// x0 = h0; reverse, x_in[s] the gradient arriving at segment s's last state from x0 = dh_T.
template <bool kReverse>
__global__ void scan_kernel(const float* x0, const float* A, const float* local, const float* delta_sum, Dims m,
                            float* x_in) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x, per = (long)m.D * m.N;
  if (i >= (long)m.Bs * per) return;
  const long b = i / per, dn = i % per, d = dn / m.N;
  const float a = A[dn];
  float x = x0[i];
  for (int k = 0; k < m.S; ++k) {
    const int s = kReverse ? m.S - 1 - k : k;
    const long at = (b * m.S + s) * per + dn;
    x_in[at] = x;
    if (k + 1 < m.S) x = scan_step(a, delta_sum[(b * m.S + s) * m.D + d], x, local[at]);
  }
}

// Forward pass 2: segment s from its incoming state, writing y; the last segment writes h_T.
template <typename In, int N>
__global__ void __launch_bounds__(kThreads) fwd_output_kernel(const In* u, const In* delta, const float* A,
                                                              const In* B, const In* C, Dims m,
                                                              const float* h_in, In* y, float* h_final) {
  constexpr int NT = N / kGroup;
  const Place<N> p(m.D);
  const int s = blockIdx.y, b = blockIdx.z, t0 = s * m.L, t1 = min(m.T, t0 + m.L);
  const auto ld = tokens_of<In, N>(u, delta, B, C, nullptr, m, b, p);
  float a[kGroup], h[kGroup];
  load_group(a, A + (long)p.d * N + p.n0);
  load_group(h, h_in + bsdn(m, b, s, p.d, p.n0));
  In* yb = y + (long)b * m.T * m.D;
  walk_forward(h, a, ld, t0, t1, [&](int t, const float (&hh)[kGroup]) {
    float c[kGroup];
    ld.c(t, c);
    float v = output_share(hh, c);
#pragma unroll
    for (int off = NT / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (p.valid && p.grp == 0) yb[(long)t * m.D + p.d] = from_f<In>(v);
  });
  if (p.valid && s == m.S - 1) store_group(h_final + ((long)b * m.D + p.d) * N + p.n0, h);
}

// Backward pass 1: segment s (≥ 1) from a zero gradient: its outgoing gradient and ΣΔ.
template <typename In, int N>
__global__ void __launch_bounds__(kThreads) bwd_local_kernel(const In* u, const In* delta, const float* A,
                                                             const In* B, const In* C, const In* dy, Dims m,
                                                             float* out_grad, float* delta_sum) {
  const Place<N> p(m.D);
  if (!p.valid) return;
  const int s = blockIdx.y + 1, b = blockIdx.z, t0 = s * m.L, t1 = min(m.T, t0 + m.L);
  const auto ld = tokens_of<In, N>(u, delta, B, C, dy, m, b, p);
  float a[kGroup], g[kGroup] = {};
  load_group(a, A + (long)p.d * N + p.n0);
  const float ds = walk_gradient(g, a, ld, t0, t1);
  store_group(out_grad + bsdn(m, b, s, p.d, p.n0), g);
  if (p.grp == 0) delta_sum[((long)b * m.S + s) * m.D + p.d] = ds;
}

// The state entering every sub-chunk of segment s, from the segment's state: ck [B, ⌈T/kSub⌉, D, N].
template <typename In, int N>
__global__ void __launch_bounds__(kThreads) checkpoint_kernel(const In* u, const In* delta, const float* A,
                                                              const In* B, const In* C, Dims m,
                                                              const float* h_in, float* ck) {
  const Place<N> p(m.D);
  if (!p.valid) return;
  const int s = blockIdx.y, b = blockIdx.z, t0 = s * m.L, t1 = min(m.T, t0 + m.L);
  const long nk = (m.T + kSub - 1) / kSub;
  const auto ld = tokens_of<In, N>(u, delta, B, C, nullptr, m, b, p);
  float a[kGroup], h[kGroup];
  load_group(a, A + (long)p.d * N + p.n0);
  load_group(h, h_in + bsdn(m, b, s, p.d, p.n0));
  auto at = [&](long j) { return ck + (((long)b * nk + j) * m.D + p.d) * N + p.n0; };
  store_group(at(t0 / kSub), h);
  walk_forward(h, a, ld, t0, t1, [&](int t, const float (&hh)[kGroup]) {
    if ((t + 1) % kSub == 0 && t + 1 < t1) store_group(at((t + 1) / kSub), hh);
  });
}

// Backward pass 2: segment s sub-chunk by sub-chunk from the last, from the gradient arriving at its last
// state: du, dΔ; the block's dB/dC partials (part [P, 2, B, T, N]); the thread's dA partial (dA_part
// [B, S, D, N]); segment 0 writes dh0.
template <typename In, int N>
__global__ void __launch_bounds__(kThreads) bwd_main_kernel(const In* u, const In* delta, const float* A,
                                                            const In* B, const In* C, const In* dy, Dims m,
                                                            const float* g_in, const float* ck, In* du,
                                                            In* ddelta, float* part, float* dA_part,
                                                            float* dh0) {
  constexpr int NT = N / kGroup, kWarps = kThreads / 32;
  __shared__ float red[2][kSub][kWarps][N];
  const Place<N> p(m.D);
  const int s = blockIdx.y, b = blockIdx.z, t0 = s * m.L, t1 = min(m.T, t0 + m.L);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const long nk = (m.T + kSub - 1) / kSub;
  const auto ld = tokens_of<In, N>(u, delta, B, C, dy, m, b, p);
  float a[kGroup], carry[kGroup], dA[kGroup] = {};
  load_group(a, A + (long)p.d * N + p.n0);
  load_group(carry, g_in + bsdn(m, b, s, p.d, p.n0));
  In* dub = du + (long)b * m.T * m.D;
  In* ddb = ddelta + (long)b * m.T * m.D;
  float* part_b = part + (long)blockIdx.x * 2 * m.Bs * m.T * N;
  auto checkpoint = [&](int j, float (&h)[kGroup]) {
    load_group(h, ck + (((long)b * nk + j) * m.D + p.d) * N + p.n0);
  };
  auto emit = [&](int t, const TokenGrads<float>& gr) {
    float vu = gr.du, vd = gr.ddelta;
#pragma unroll
    for (int off = NT / 2; off > 0; off >>= 1) {
      vu += __shfl_xor_sync(0xffffffffu, vu, off);
      vd += __shfl_xor_sync(0xffffffffu, vd, off);
    }
    if (p.valid && p.grp == 0) {
      dub[(long)t * m.D + p.d] = from_f<In>(vu);
      ddb[(long)t * m.D + p.d] = from_f<In>(vd);
    }
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      float vb = p.valid ? gr.db[g] : 0.f, vc = p.valid ? gr.dc[g] : 0.f;
#pragma unroll
      for (int off = NT; off < 32; off <<= 1) {
        vb += __shfl_xor_sync(0xffffffffu, vb, off);
        vc += __shfl_xor_sync(0xffffffffu, vc, off);
      }
      if (lane < NT) {
        red[0][t % kSub][warp][p.n0 + g] = vb;
        red[1][t % kSub][warp][p.n0 + g] = vc;
      }
    }
  };
  auto sub_done = [&](int c0, int c1) {
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * kSub * N; i += kThreads) {
      const int q = i / (kSub * N), k = i / N % kSub, n = i % N;
      if (c0 + k < c1) {
        float v = red[q][k][0][n];
#pragma unroll
        for (int w = 1; w < kWarps; ++w) v += red[q][k][w][n];
        part_b[(((long)q * m.Bs + b) * m.T + c0 + k) * N + n] = v;
      }
    }
    __syncthreads();
  };
  walk_backward(carry, dA, a, ld, t0, t1, checkpoint, emit, sub_done);
  if (!p.valid) return;
  store_group(dA_part + bsdn(m, b, s, p.d, p.n0), dA);
  if (s == 0) store_group(dh0 + ((long)b * m.D + p.d) * N + p.n0, carry);
}

at::Tensor alloc(at::IntArrayRef sizes, const at::TensorOptions& opt) {
  return carry::kernels::primitives::alloc_poisoned(sizes, opt, g_poison.load());
}

void check_inputs(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                  const at::Tensor& C) {
  TORCH_CHECK(u.is_cuda() && u.dim() == 3, "selective_scan: u must be a CUDA tensor [B,T,D]; got ", u.sizes(),
              " on ", u.device());
  const int64_t Bs = u.size(0), T = u.size(1), D = u.size(2);
  TORCH_CHECK(T >= 1 && D >= 1, "selective_scan: u [B,T,D] needs T >= 1 and D >= 1; got ", u.sizes());
  TORCH_CHECK(u.scalar_type() == at::kFloat || u.scalar_type() == at::kBFloat16,
              "selective_scan: u, delta, B, C must be bf16 or fp32; got ", u.scalar_type());
  TORCH_CHECK(delta.sizes() == u.sizes() && delta.scalar_type() == u.scalar_type(),
              "selective_scan: delta must match u (", u.sizes(), " ", u.scalar_type(), "); got ", delta.sizes(),
              " ", delta.scalar_type());
  TORCH_CHECK(A.dim() == 2 && A.size(0) == D && A.scalar_type() == at::kFloat,
              "selective_scan: A must be fp32 [D,N] with D = ", D, "; got ", A.sizes(), " ", A.scalar_type());
  const int64_t N = A.size(1);
  TORCH_CHECK(N == 4 || N == 8 || N == 16, "selective_scan: the state size N (A's second dimension) must be 4, 8 "
              "or 16; got ", N);
  for (const at::Tensor* t : {&B, &C})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == Bs && t->size(1) == T && t->size(2) == N &&
                    t->scalar_type() == u.scalar_type(),
                "selective_scan: B and C must be [", Bs, ",", T, ",", N, "] in ", u.scalar_type(), "; got ",
                t->sizes(), " ", t->scalar_type());
  for (const at::Tensor* t : {&u, &delta, &A, &B, &C})
    TORCH_CHECK(t->is_contiguous() && t->device() == u.device(),
                "selective_scan: inputs must be contiguous and on one device");
  TORCH_CHECK(Bs <= 65535 && (double)Bs * T * D * N < 9e18, "selective_scan: too many sequences (", Bs, ")");
}

Dims dims_of(const at::Tensor& u, const at::Tensor& A, int L) {
  Dims m;
  m.Bs = (int)u.size(0), m.T = (int)u.size(1), m.D = (int)u.size(2), m.N = (int)A.size(1);
  m.L = L;
  m.S = segment_count(m.T, L);
  m.P = channel_blocks(m.D, m.N);
  return m;
}

// The segments asked for: the call's, else the forced one, else by the grid: about 8 blocks an SM, at
// least 64 tokens a segment.
int segments_asked(int segments, int Bs, int T, int D, int N) {
  if (segments <= 0) segments = g_segments.load();
  if (segments > 0) return std::min(segments, T);
  const long row = (long)Bs * channel_blocks(D, N);
  const long fill = (8L * carry::kernels::primitives::sm_count() + row - 1) / row;
  return (int)std::max<long>(1, std::min<long>(fill, (T + 63) / 64));
}

template <typename In, int N>
void launch_fwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                const at::Tensor& C, const Dims& m, const at::Tensor& h0, at::Tensor& y, at::Tensor& h_final,
                at::Tensor& h_in) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto* pu = reinterpret_cast<const In*>(u.data_ptr());
  const auto* pd = reinterpret_cast<const In*>(delta.data_ptr());
  const auto* pb = reinterpret_cast<const In*>(B.data_ptr());
  const auto* pc = reinterpret_cast<const In*>(C.data_ptr());
  const float* pa = A.data_ptr<float>();
  const auto f32 = u.options().dtype(at::kFloat);
  if (m.S > 1) {
    at::Tensor end_state = alloc({m.Bs, m.S, m.D, m.N}, f32), delta_sum = alloc({m.Bs, m.S, m.D}, f32);
    fwd_local_kernel<In, N><<<dim3(m.P, m.S - 1, m.Bs), kThreads, 0, stream>>>(
        pu, pd, pa, pb, pc, m, end_state.data_ptr<float>(), delta_sum.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const long n = (long)m.Bs * m.D * m.N;
    scan_kernel<false><<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(
        h0.data_ptr<float>(), pa, end_state.data_ptr<float>(), delta_sum.data_ptr<float>(), m,
        h_in.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  fwd_output_kernel<In, N><<<dim3(m.P, m.S, m.Bs), kThreads, 0, stream>>>(
      pu, pd, pa, pb, pc, m, h_in.data_ptr<float>(), reinterpret_cast<In*>(y.data_ptr()),
      h_final.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename In, int N>
void launch_bwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                const at::Tensor& C, const Dims& m, const at::Tensor& h_in, const at::Tensor& dy,
                const at::Tensor& dh_final, std::vector<at::Tensor>& out) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto* pu = reinterpret_cast<const In*>(u.data_ptr());
  const auto* pd = reinterpret_cast<const In*>(delta.data_ptr());
  const auto* pb = reinterpret_cast<const In*>(B.data_ptr());
  const auto* pc = reinterpret_cast<const In*>(C.data_ptr());
  const auto* pdy = reinterpret_cast<const In*>(dy.data_ptr());
  const float* pa = A.data_ptr<float>();
  const auto f32 = u.options().dtype(at::kFloat);
  at::Tensor g_in = dh_final.view({m.Bs, 1, m.D, m.N});
  if (m.S > 1) {
    at::Tensor out_grad = alloc({m.Bs, m.S, m.D, m.N}, f32), delta_sum = alloc({m.Bs, m.S, m.D}, f32);
    bwd_local_kernel<In, N><<<dim3(m.P, m.S - 1, m.Bs), kThreads, 0, stream>>>(
        pu, pd, pa, pb, pc, pdy, m, out_grad.data_ptr<float>(), delta_sum.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    g_in = alloc({m.Bs, m.S, m.D, m.N}, f32);
    const long n = (long)m.Bs * m.D * m.N;
    scan_kernel<true><<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(
        dh_final.data_ptr<float>(), pa, out_grad.data_ptr<float>(), delta_sum.data_ptr<float>(), m,
        g_in.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const long nk = (m.T + kSub - 1) / kSub;
  at::Tensor ck = alloc({m.Bs, nk, m.D, m.N}, f32);
  checkpoint_kernel<In, N><<<dim3(m.P, m.S, m.Bs), kThreads, 0, stream>>>(pu, pd, pa, pb, pc, m,
                                                                          h_in.data_ptr<float>(),
                                                                          ck.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor du = alloc(u.sizes(), u.options()), ddelta = alloc(u.sizes(), u.options());
  at::Tensor part = alloc({m.P, 2, m.Bs, m.T, m.N}, f32), dA_part = alloc({m.Bs, m.S, m.D, m.N}, f32);
  at::Tensor dh0 = alloc({m.Bs, m.D, m.N}, f32);
  bwd_main_kernel<In, N><<<dim3(m.P, m.S, m.Bs), kThreads, 0, stream>>>(
      pu, pd, pa, pb, pc, pdy, m, g_in.data_ptr<float>(), ck.data_ptr<float>(),
      reinterpret_cast<In*>(du.data_ptr()), reinterpret_cast<In*>(ddelta.data_ptr()), part.data_ptr<float>(),
      dA_part.data_ptr<float>(), dh0.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor dbc = alloc({2, m.Bs, m.T, m.N}, f32), dA = alloc({m.D, m.N}, f32);
  carry::kernels::primitives::column_sum(part.data_ptr<float>(), dbc.data_ptr<float>(), m.P,
                                         2L * m.Bs * m.T * m.N, f32, stream);
  carry::kernels::primitives::column_sum(dA_part.data_ptr<float>(), dA.data_ptr<float>(), (long)m.Bs * m.S,
                                         (long)m.D * m.N, f32, stream);
  out = {du, ddelta, dA, dbc[0].to(u.scalar_type()), dbc[1].to(u.scalar_type()), dh0};
}

template <typename In, class F>
void by_state_size(int N, F&& f) {
  switch (N) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: f(std::integral_constant<int, 16>{}); break;
  }
}

template <class F>
void by_dtype(at::ScalarType dt, F&& f) {
  if (dt == at::kBFloat16)
    f(__nv_bfloat16{});
  else
    f(float{});
}

}  // namespace

std::vector<at::Tensor> selective_scan_fwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
                                           const at::Tensor& B, const at::Tensor& C,
                                           const at::Tensor& initial_state, int segments) {
  check_inputs(u, delta, A, B, C);
  const c10::cuda::CUDAGuard guard(u.device());
  const int Bs = (int)u.size(0), T = (int)u.size(1), D = (int)u.size(2), N = (int)A.size(1);
  const Dims m = dims_of(u, A, segment_length(T, segments_asked(segments, Bs, T, D, N)));
  TORCH_CHECK(m.S <= 65535, "selective_scan: ", m.S, " segments; at most 65535");
  const auto f32 = u.options().dtype(at::kFloat);
  at::Tensor h0 = initial_state.defined() ? initial_state : at::zeros({Bs, D, N}, f32);
  TORCH_CHECK(h0.sizes() == at::IntArrayRef({Bs, D, N}) && h0.scalar_type() == at::kFloat && h0.is_contiguous() &&
                  h0.device() == u.device(),
              "selective_scan: initial_state must be contiguous fp32 [", Bs, ",", D, ",", N, "] on ", u.device(),
              "; got ", h0.sizes(), " ", h0.scalar_type(), " on ", h0.device());
  at::Tensor y = alloc(u.sizes(), u.options()), h_final = alloc({Bs, D, N}, f32);
  at::Tensor h_in = m.S > 1 ? alloc({Bs, m.S, D, N}, f32) : h0.view({Bs, 1, D, N});
  by_dtype(u.scalar_type(), [&](auto in) {
    using In = decltype(in);
    by_state_size<In>(N, [&](auto n) { launch_fwd<In, decltype(n)::value>(u, delta, A, B, C, m, h0, y, h_final, h_in); });
  });
  return {y, h_final, h_in};
}

std::vector<at::Tensor> selective_scan_bwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
                                           const at::Tensor& B, const at::Tensor& C,
                                           const at::Tensor& segment_states, const at::Tensor& dy,
                                           const at::Tensor& d_final_state) {
  check_inputs(u, delta, A, B, C);
  const c10::cuda::CUDAGuard guard(u.device());
  const int Bs = (int)u.size(0), T = (int)u.size(1), D = (int)u.size(2), N = (int)A.size(1);
  TORCH_CHECK(segment_states.dim() == 4 && segment_states.size(0) == Bs && segment_states.size(2) == D &&
                  segment_states.size(3) == N && segment_states.scalar_type() == at::kFloat &&
                  segment_states.is_contiguous(),
              "selective_scan: segment_states must be selective_scan_fwd's, fp32 [", Bs, ",S,", D, ",", N,
              "]; got ", segment_states.sizes());
  const Dims m = dims_of(u, A, segment_length(T, (int)segment_states.size(1)));
  TORCH_INTERNAL_ASSERT(m.S == segment_states.size(1), "selective_scan: segments do not round-trip");
  TORCH_CHECK(dy.sizes() == u.sizes() && dy.scalar_type() == u.scalar_type() && dy.is_contiguous(),
              "selective_scan: dy must be contiguous ", u.sizes(), " ", u.scalar_type(), "; got ", dy.sizes(), " ",
              dy.scalar_type());
  TORCH_CHECK(d_final_state.sizes() == at::IntArrayRef({Bs, D, N}) && d_final_state.scalar_type() == at::kFloat &&
                  d_final_state.is_contiguous(),
              "selective_scan: d_final_state must be contiguous fp32 [", Bs, ",", D, ",", N, "]; got ",
              d_final_state.sizes(), " ", d_final_state.scalar_type());
  std::vector<at::Tensor> out;
  by_dtype(u.scalar_type(), [&](auto in) {
    using In = decltype(in);
    by_state_size<In>(N, [&](auto n) {
      launch_bwd<In, decltype(n)::value>(u, delta, A, B, C, m, segment_states, dy, d_final_state, out);
    });
  });
  return out;
}

void selective_scan_set_poison(bool on) { g_poison.store(on); }
void selective_scan_set_segments(int n) { g_segments.store(n); }

}  // namespace carry::kernels::selective_scan
