// The selective-scan kernels (their plan opens scan.cu), private to scan.cu and to their CPU run through the
// warp emulation (tests/emulation/selective_scan_emu.cpp). CARRY_LA_EMU: the includer provides threadIdx,
// blockIdx, SMEM_DECL, __syncthreads and __shfl_xor_sync (tests/emulation/warp_emulation.h); otherwise they are
// the GPU's.
#pragma once

#include "layers/kernels/selective_scan/scan.cuh"

#include <cuda_bf16.h>

#ifndef CARRY_LA_EMU
#define SMEM_DECL extern __shared__ __align__(128) unsigned char smem[]
#endif

namespace carry::kernels::selective_scan::kernels {

using namespace core;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

// A read of an input through the read-only path: the walks' stores cannot alias it, so the compiler may
// issue the reads of several tokens before their arithmetic (on the CPU emulation, a plain read).
template <typename T>
__device__ __forceinline__ T ro(const T* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

struct Dims {
  int Bs, T, D, N, L, S, P;  // sequences, tokens, channels, states, segment length, segments, channel blocks
};

// One thread's inputs: channel d of sequence b, states [n0, n0 + kGroup).
template <typename In>
struct Tokens {
  const In *u_, *delta_, *B_, *C_, *dy_;
  long D, N;
  int d, n0;
  __device__ float delta(int t) const { return to_f(ro(delta_ + t * D + d)); }
  __device__ float u(int t) const { return to_f(ro(u_ + t * D + d)); }
  __device__ float dy(int t) const { return to_f(ro(dy_ + t * D + d)); }
  __device__ void b(int t, float (&out)[kGroup]) const {
#pragma unroll
    for (int g = 0; g < kGroup; ++g) out[g] = to_f(ro(B_ + t * N + n0 + g));
  }
  __device__ void c(int t, float (&out)[kGroup]) const {
#pragma unroll
    for (int g = 0; g < kGroup; ++g) out[g] = to_f(ro(C_ + t * N + n0 + g));
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
  const int s = blockIdx.y, b = blockIdx.z, t0 = s * m.L, t1 = imin(m.T, t0 + m.L);
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
  const int s = blockIdx.y, b = blockIdx.z, t0 = s * m.L, t1 = imin(m.T, t0 + m.L);
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
  const int s = blockIdx.y + 1, b = blockIdx.z, t0 = s * m.L, t1 = imin(m.T, t0 + m.L);
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
  const int s = blockIdx.y, b = blockIdx.z, t0 = s * m.L, t1 = imin(m.T, t0 + m.L);
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
  SMEM_DECL;
  auto& red = *reinterpret_cast<float (*)[2][kSub][kWarps][N]>(smem);
  const Place<N> p(m.D);
  const int s = blockIdx.y, b = blockIdx.z, t0 = s * m.L, t1 = imin(m.T, t0 + m.L);
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

// The dynamic shared memory of bwd_main_kernel<In, N>.
constexpr size_t bwd_main_smem(int N) { return sizeof(float) * 2 * kSub * (kThreads / 32) * N; }

}  // namespace carry::kernels::selective_scan::kernels
