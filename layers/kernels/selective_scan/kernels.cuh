// The selective-scan kernels (their plan opens scan.cu), private to scan.cu and to their CPU run through the
// warp emulation (tests/emulation/selective_scan_emu.cpp). CARRY_LA_EMU: the includer provides threadIdx,
// blockIdx, SMEM_DECL, __syncthreads and __shfl_xor_sync (tests/emulation/warp_emulation.h); otherwise they are
// the GPU's.
#pragma once

#include "layers/kernels/selective_scan/scan.cuh"

#include <cuda_bf16.h>

#if defined(CARRY_LA_EMU)
#include <cstring>
#endif

#ifndef CARRY_LA_EMU
#define SMEM_DECL extern __shared__ __align__(128) unsigned char smem[]
#endif

namespace carry::kernels::selective_scan::kernels {

using namespace core;

template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

struct Dims {
  int Bs, T, D, N, L, S, P;  // sequences, tokens, channels, states, segment length, segments, channel blocks
};

// The thread's place: its tile's first channel, its channels (clamped to D − 1 past the last channel: those
// compute but write nothing), which of them are real, its state group. Thread x of a block: state group
// x % NT, channel tile x / NT; the lanes of a tile's state groups are adjacent (xor 1 … NT/2), the tiles of
// one state group 32/NT lanes apart at strides NT … 16.
template <int N>
struct Place {
  static constexpr int NT = N / kGroup;
  int d0, grp, n0, lane, warp;
  int d[kChan];
  bool valid[kChan];
  __device__ Place(int D) {
    grp = threadIdx.x % NT;
    n0 = grp * kGroup;
    lane = threadIdx.x % 32;
    warp = threadIdx.x / 32;
    d0 = blockIdx.x * channels_per_block(N) + threadIdx.x / NT * kChan;
#pragma unroll
    for (int c = 0; c < kChan; ++c) {
      valid[c] = d0 + c < D;
      d[c] = valid[c] ? d0 + c : D - 1;
    }
  }
};

#if defined(CARRY_LA_EMU)
inline void ss_cp4(void* dst, const void* src) { std::memcpy(dst, src, 4); }
inline void ss_commit() {}
inline void ss_wait_one() {}
#else
// cp.async of 4 bytes into shared memory; commit the thread's copies as a group; wait until at most one
// group is pending.
__device__ __forceinline__ void ss_cp4(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(src));
}
__device__ __forceinline__ void ss_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void ss_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::); }
#endif

// One stage's buffer in shared memory: kStage rows of the block's channels for Δ, u, dy (slots 0–2, CPB
// entries a row) and kStage rows of the states for B, C (slots 0–1, N entries a row), in the inputs' dtype.
// Channels past D read zero.
template <typename In, int N>
struct StageLayout {
  static constexpr int CPB = channels_per_block(N);
  static constexpr int kStates = 3 * kStage * CPB;  // where the state slots start
  static constexpr int kElems = kStates + 2 * kStage * N;
  static constexpr size_t kBytes = sizeof(In) * kElems;  // a multiple of 16
};

// Two consecutive entries and four from shared memory, widened to fp32.
__device__ __forceinline__ void sread2(const float* p, float (&o)[2]) {
  const float2 v = *reinterpret_cast<const float2*>(p);
  o[0] = v.x, o[1] = v.y;
}
__device__ __forceinline__ void sread2(const __nv_bfloat16* p, float (&o)[2]) {
  const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(p);
  o[0] = __low2float(v), o[1] = __high2float(v);
}
__device__ __forceinline__ void sread4(const float* p, float (&o)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  o[0] = v.x, o[1] = v.y, o[2] = v.z, o[3] = v.w;
}
__device__ __forceinline__ void sread4(const __nv_bfloat16* p, float (&o)[4]) {
  const __nv_bfloat162* q = reinterpret_cast<const __nv_bfloat162*>(p);
  const __nv_bfloat162 a = q[0], b = q[1];
  o[0] = __low2float(a), o[1] = __high2float(a), o[2] = __low2float(b), o[3] = __high2float(b);
}

// A staged stage of tokens [c0, c0 + kStage) as one thread reads it: its channel pair, its states.
template <typename In, int N>
struct StageView {
  using Lay = StageLayout<In, N>;
  const In* buf;
  int c0, l0, n0;  // first token, the thread's first channel within the block, its first state
  __device__ const In* chan(int slot, int t) const { return buf + (slot * kStage + (t - c0)) * Lay::CPB + l0; }
  __device__ const In* state(int slot, int t) const { return buf + Lay::kStates + (slot * kStage + (t - c0)) * N + n0; }
  __device__ void delta(int t, float (&out)[kChan]) const { sread2(chan(0, t), out); }
  __device__ void u(int t, float (&out)[kChan]) const { sread2(chan(1, t), out); }
  __device__ void dy(int t, float (&out)[kChan]) const { sread2(chan(2, t), out); }
  __device__ void b(int t, float (&out)[kGroup]) const { sread4(state(0, t), out); }
  __device__ void c(int t, float (&out)[kGroup]) const { sread4(state(1, t), out); }
};

// The block's reader of sequence b: copies stages of the inputs a kernel reads (the others null) into two
// shared-memory buffers with cp.async, the next stage in flight while the threads walk the current one.
template <typename In, int N>
struct Stager {
  using Lay = StageLayout<In, N>;
  const In* chan_[3];  // Δ, u, dy rows of sequence b
  const In* st_[2];    // B, C rows of sequence b
  In* smem_;           // two buffers of Lay::kElems
  long D;
  int blk_d0, l0, n0;
  bool vec;  // a row of the block's channels copies in 4-byte pieces (D·sizeof(In) a multiple of 4)

  __device__ void copy(int buf, int c0, int c1) const {
    constexpr int kPer = 4 / sizeof(In), G = Lay::CPB / kPer, GS = N / kPer;
    In* dst = smem_ + buf * Lay::kElems;
    const int rows = c1 - c0;
#pragma unroll
    for (int slot = 0; slot < 3; ++slot) {
      const In* src = chan_[slot];
      if (!src) continue;
      for (int i = threadIdx.x; i < rows * G; i += kThreads) {
        const int r = i / G, q = i % G, d = blk_d0 + q * kPer;
        In* dp = dst + (slot * kStage + r) * Lay::CPB + q * kPer;
        const In* sp = src + (long)(c0 + r) * D + d;
        if (vec) {
          if (d < D)
            ss_cp4(dp, sp);
          else
            *reinterpret_cast<unsigned*>(dp) = 0u;
        } else {
#pragma unroll
          for (int e = 0; e < kPer; ++e) dp[e] = d + e < D ? sp[e] : from_f<In>(0.f);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const In* src = st_[q];
      if (!src) continue;
      for (int i = threadIdx.x; i < rows * GS; i += kThreads) {
        const int r = i / GS, g = i % GS;
        ss_cp4(dst + Lay::kStates + (q * kStage + r) * N + g * kPer, src + (long)(c0 + r) * N + g * kPer);
      }
    }
  }
  __device__ void start(int c0, int c1) const {
    copy(0, c0, c1);
    ss_commit();
  }
  // The stage from token c0 in buffer buf, once every thread's copies of it have landed; [n0_, n1_) (if not
  // empty) goes into the other buffer meanwhile, after every thread is done with what it held.
  __device__ StageView<In, N> stage(int buf, int c0, int n0_, int n1_) const {
    __syncthreads();
    if (n1_ > n0_) copy(buf ^ 1, n0_, n1_);
    ss_commit();
    ss_wait_one();
    __syncthreads();
    return StageView<In, N>{smem_ + buf * Lay::kElems, c0, l0, n0};
  }
};

// The bytes of dynamic shared memory a kernel's stager uses (two buffers).
template <typename In, int N>
constexpr size_t stage_smem() { return 2 * StageLayout<In, N>::kBytes; }

template <typename In, int N>
__device__ Stager<In, N> stager_of(const In* u, const In* delta, const In* dy, const In* B, const In* C,
                                   const Dims& m, int b, const Place<N>& p, unsigned char* smem_at) {
  const long bt = (long)b * m.T;
  Stager<In, N> k;
  k.chan_[0] = delta ? delta + bt * m.D : nullptr;
  k.chan_[1] = u ? u + bt * m.D : nullptr;
  k.chan_[2] = dy ? dy + bt * m.D : nullptr;
  k.st_[0] = B ? B + bt * N : nullptr;
  k.st_[1] = C ? C + bt * N : nullptr;
  k.smem_ = reinterpret_cast<In*>(smem_at);
  k.D = m.D;
  k.blk_d0 = blockIdx.x * channels_per_block(N);
  k.l0 = p.d0 - k.blk_d0;
  k.n0 = p.n0;
  k.vec = (m.D * sizeof(In)) % 4 == 0;
  return k;
}

// Sums each of v[0..C) over the 2^L lanes lane ^ (M·i), i < 2^L: at each level a lane keeps half of the
// values it holds (the upper half if its bit of the level is set) and adds its partner's share of them;
// once it holds one value, the level is a plain exchange. A lane ends with max(1, C >> L) sums,
// v[0..), those of the values from sum_first<C, M, L>(lane) on.
template <int C, int M, int L, int V>
__device__ __forceinline__ void lane_sum(float (&v)[V], int lane) {
  if constexpr (L > 0) {
    if constexpr (C > 1) {
      constexpr int H = C / 2;
      const bool hi = (lane & M) != 0;
#pragma unroll
      for (int i = 0; i < H; ++i) {
        const float send = hi ? v[i] : v[i + H];
        const float keep = hi ? v[i + H] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, M);
      }
      lane_sum<H, 2 * M, L - 1>(v, lane);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], M);
      lane_sum<1, 2 * M, L - 1>(v, lane);
    }
  }
}
template <int C, int M, int L>
__device__ __forceinline__ int sum_first(int lane) {
  if constexpr (L == 0 || C == 1) {
    return 0;
  } else {
    return ((lane & M) ? C / 2 : 0) + sum_first<C / 2, 2 * M, L - 1>(lane);
  }
}
// Whether the lane is the first of those holding the same sums (the plain exchanges' lanes agree).
template <int C, int M, int L>
__device__ __forceinline__ bool sum_writer(int lane) {
  if constexpr (L == 0) {
    return true;
  } else if constexpr (C > 1) {
    return sum_writer<C / 2, 2 * M, L - 1>(lane);
  } else {
    return (lane & M) == 0 && sum_writer<1, 2 * M, L - 1>(lane);
  }
}
constexpr int log2i(int x) { return x <= 1 ? 0 : 1 + log2i(x / 2); }

template <int N>
struct Sums {
  static constexpr int NT = N / kGroup;
  static constexpr int kOverN = log2i(NT);        // levels of a sum over the states (masks 1 … NT/2)
  static constexpr int kOverD = log2i(32 / NT);   // levels of a sum over a warp's channel tiles (NT … 16)
};

template <int N>
__device__ __forceinline__ void load_tile(Tile<float>& x, const float* base, const Place<N>& p, long stride_d) {
#pragma unroll
  for (int c = 0; c < kChan; ++c) {
    const float4 v = *reinterpret_cast<const float4*>(base + p.d[c] * stride_d + p.n0);
    x[c][0] = v.x, x[c][1] = v.y, x[c][2] = v.z, x[c][3] = v.w;
  }
}
template <int N>
__device__ __forceinline__ void store_tile(float* base, const Tile<float>& x, const Place<N>& p, long stride_d) {
#pragma unroll
  for (int c = 0; c < kChan; ++c)
    if (p.valid[c]) *reinterpret_cast<float4*>(base + p.d[c] * stride_d + p.n0) = make_float4(x[c][0], x[c][1], x[c][2], x[c][3]);
}
template <int N>
__device__ __forceinline__ void load_a2(Tile<float>& a2, const float* A, const Place<N>& p) {
  load_tile(a2, A, p, N);
#pragma unroll
  for (int c = 0; c < kChan; ++c)
#pragma unroll
    for (int g = 0; g < kGroup; ++g) a2[c][g] *= float(kLog2e);
}

struct Noop {
  template <class... X>
  __device__ void operator()(X&&...) const {}
};

// Start of (b, s) in a [B, S, D, N] fp32 buffer.
__device__ __forceinline__ long bs0(const Dims& m, int b, int s) { return ((long)b * m.S + s) * m.D * m.N; }

// A segment's ΣΔ of the thread's channels into delta_sum [B, S, D] (once a channel: state group 0 writes).
template <int N>
__device__ __forceinline__ void store_delta_sum(float* delta_sum, const Dims& m, int b, int s, const Place<N>& p,
                                                const float (&ds)[kChan]) {
  if (p.grp != 0) return;
#pragma unroll
  for (int c = 0; c < kChan; ++c)
    if (p.valid[c]) delta_sum[((long)b * m.S + s) * m.D + p.d[c]] = ds[c];
}

// Forward pass 1: segment s (< S − 1) from zero: its end state and ΣΔ.
template <typename In, int N>
__global__ void __launch_bounds__(kThreads) fwd_local_kernel(const In* u, const In* delta, const float* A,
                                                             const In* B, const In* C, Dims m, float* end_state,
                                                             float* delta_sum) {
  SMEM_DECL;
  const Place<N> p(m.D);
  const int s = blockIdx.y, b = blockIdx.z, t0 = s * m.L, t1 = imin(m.T, t0 + m.L);
  const auto ld = stager_of<In, N>(u, delta, nullptr, B, nullptr, m, b, p, smem);
  Tile<float> a2, h = {};
  load_a2(a2, A, p);
  float ds[kChan];
  walk_forward(h, a2, ld, t0, t1, ds, Noop{});
  store_tile(end_state + bs0(m, b, s), h, p, N);
  store_delta_sum(delta_sum, m, b, s, p, ds);
}

// The segment scan over s, one thread a (b, d, n): forward, x_in[s] the state entering segment s from
// x0 = h0; reverse, x_in[s] the gradient arriving at segment s's last state from x0 = dh_T.
template <bool kReverse>
__global__ void scan_kernel(const float* x0, const float* A, const float* local, const float* delta_sum, Dims m,
                            float* x_in) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x, per = (long)m.D * m.N;
  if (i >= (long)m.Bs * per) return;
  const long b = i / per, dn = i % per, d = dn / m.N;
  const float a2 = A[dn] * float(kLog2e);
  float x = x0[i];
  for (int k = 0; k < m.S; ++k) {
    const int s = kReverse ? m.S - 1 - k : k;
    const long at = (b * m.S + s) * per + dn;
    x_in[at] = x;
    if (k + 1 < m.S) x = scan_step(a2, delta_sum[(b * m.S + s) * m.D + d], x, local[at]);
  }
}

// Forward pass 2: segment s from its incoming state, writing y; the last segment writes h_T.
template <typename In, int N>
__global__ void __launch_bounds__(kThreads) fwd_output_kernel(const In* u, const In* delta, const float* A,
                                                              const In* B, const In* C, Dims m,
                                                              const float* h_in, In* y, float* h_final) {
  using S = Sums<N>;
  SMEM_DECL;
  const Place<N> p(m.D);
  const int s = blockIdx.y, b = blockIdx.z, t0 = s * m.L, t1 = imin(m.T, t0 + m.L);
  const auto ld = stager_of<In, N>(u, delta, nullptr, B, C, m, b, p, smem);
  Tile<float> a2, h;
  load_a2(a2, A, p);
  load_tile(h, h_in + bs0(m, b, s), p, N);
  In* yb = y + (long)b * m.T * m.D;
  const int first = sum_first<kChan, 1, S::kOverN>(p.lane);
  const bool writer = sum_writer<kChan, 1, S::kOverN>(p.lane);
  float ds[kChan];
  walk_forward(h, a2, ld, t0, t1, ds, [&](int t, const Tile<float>& hh, const auto& v) {
    float cv[kGroup], out[kChan];
    v.c(t, cv);
    output_share(hh, cv, out);
    lane_sum<kChan, 1, S::kOverN>(out, p.lane);
    if (writer)
#pragma unroll
      for (int j = 0; j < (kChan >> S::kOverN > 0 ? kChan >> S::kOverN : 1); ++j)
        if (p.d0 + first + j < m.D) yb[(long)t * m.D + p.d0 + first + j] = from_f<In>(out[j]);
  });
  if (s == m.S - 1) store_tile(h_final + (long)b * m.D * N, h, p, N);
}

// Backward pass 1: segment s (≥ 1) from a zero gradient: its outgoing gradient and ΣΔ.
template <typename In, int N>
__global__ void __launch_bounds__(kThreads) bwd_local_kernel(const In* u, const In* delta, const float* A,
                                                             const In* B, const In* C, const In* dy, Dims m,
                                                             float* out_grad, float* delta_sum) {
  SMEM_DECL;
  const Place<N> p(m.D);
  const int s = blockIdx.y + 1, b = blockIdx.z, t0 = s * m.L, t1 = imin(m.T, t0 + m.L);
  const auto ld = stager_of<In, N>(nullptr, delta, dy, nullptr, C, m, b, p, smem);
  Tile<float> a2, g = {};
  load_a2(a2, A, p);
  float ds[kChan];
  walk_gradient(g, a2, ld, t0, t1, ds);
  store_tile(out_grad + bs0(m, b, s), g, p, N);
  store_delta_sum(delta_sum, m, b, s, p, ds);
}

// The state entering every sub-chunk of segment s, from the segment's state: ck [B, ⌈T/kSub⌉, D, N].
template <typename In, int N>
__global__ void __launch_bounds__(kThreads) checkpoint_kernel(const In* u, const In* delta, const float* A,
                                                              const In* B, const In* C, Dims m,
                                                              const float* h_in, float* ck) {
  SMEM_DECL;
  const Place<N> p(m.D);
  const int s = blockIdx.y, b = blockIdx.z, t0 = s * m.L, t1 = imin(m.T, t0 + m.L);
  const long nk = (m.T + kSub - 1) / kSub;
  const auto ld = stager_of<In, N>(u, delta, nullptr, B, nullptr, m, b, p, smem);
  Tile<float> a2, h;
  load_a2(a2, A, p);
  load_tile(h, h_in + bs0(m, b, s), p, N);
  auto at = [&](long j) { return ck + ((long)b * nk + j) * m.D * N; };
  store_tile(at(t0 / kSub), h, p, N);
  float ds[kChan];
  walk_forward(h, a2, ld, t0, t1, ds, [&](int t, const Tile<float>& hh, const auto&) {
    if ((t + 1) % kSub == 0 && t + 1 < t1) store_tile(at((t + 1) / kSub), hh, p, N);
  });
}

// The bytes of bwd_main_kernel's block sums (its dynamic shared memory starts with them, the stages after).
constexpr size_t bwd_main_red(int N) { return sizeof(float) * 2 * kSub * (kThreads / 32) * N; }

// Backward pass 2: segment s sub-chunk by sub-chunk from the last, from the gradient arriving at its last
// state: du, dΔ; the block's dB/dC partials (part [P, 2, B, T, N]); the thread's dA partial (dA_part
// [B, S, D, N]); segment 0 writes dh0.
template <typename In, int N>
__global__ void __launch_bounds__(kThreads, 3) bwd_main_kernel(const In* u, const In* delta, const float* A,
                                                            const In* B, const In* C, const In* dy, Dims m,
                                                            const float* g_in, const float* ck, In* du,
                                                            In* ddelta, float* part, float* dA_part,
                                                            float* dh0) {
  using S = Sums<N>;
  constexpr int kWarps = kThreads / 32;
  constexpr int kGv = 2 * kChan;    // du and dΔ of the thread's channels: index q·kChan + c
  constexpr int kBv = 2 * kGroup;   // db and dc of the thread's states: index q·kGroup + g
  constexpr int kGk = kGv >> S::kOverN > 0 ? kGv >> S::kOverN : 1;
  constexpr int kBk = kBv >> S::kOverD > 0 ? kBv >> S::kOverD : 1;
  SMEM_DECL;
  auto& red = *reinterpret_cast<float (*)[2][kSub][kWarps][N]>(smem);
  const Place<N> p(m.D);
  const int s = blockIdx.y, b = blockIdx.z, t0 = s * m.L, t1 = imin(m.T, t0 + m.L);
  const long nk = (m.T + kSub - 1) / kSub;
  const auto ld = stager_of<In, N>(u, delta, dy, B, C, m, b, p, smem + bwd_main_red(N));
  Tile<float> a2, carry, dA = {};
  load_a2(a2, A, p);
  load_tile(carry, g_in + bs0(m, b, s), p, N);
  In* dub = du + (long)b * m.T * m.D;
  In* ddb = ddelta + (long)b * m.T * m.D;
  float* part_b = part + (long)blockIdx.x * 2 * m.Bs * m.T * N;
  const int g_first = sum_first<kGv, 1, S::kOverN>(p.lane);
  const int b_first = sum_first<kBv, S::NT, S::kOverD>(p.lane);
  const bool b_writer = sum_writer<kBv, S::NT, S::kOverD>(p.lane);
  auto checkpoint = [&](int j, Tile<float>& h) { load_tile(h, ck + ((long)b * nk + j) * m.D * N, p, N); };
  auto emit = [&](int t, const TokenGrads<float>& gr) {
    float gv[kGv], bv[kBv];
#pragma unroll
    for (int c = 0; c < kChan; ++c) gv[c] = gr.du[c], gv[kChan + c] = gr.ddelta[c];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) bv[g] = gr.db[g], bv[kGroup + g] = gr.dc[g];
    lane_sum<kGv, 1, S::kOverN>(gv, p.lane);
    lane_sum<kBv, S::NT, S::kOverD>(bv, p.lane);
#pragma unroll
    for (int j = 0; j < kGk; ++j) {
      const int i = g_first + j, q = i / kChan, c = i % kChan;
      if (p.d0 + c < m.D) (q == 0 ? dub : ddb)[(long)t * m.D + p.d0 + c] = from_f<In>(gv[j]);
    }
    if (b_writer)
#pragma unroll
      for (int j = 0; j < kBk; ++j) {
        const int i = b_first + j, q = i / kGroup, g = i % kGroup;
        red[q][t % kSub][p.warp][p.n0 + g] = bv[j];
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
  walk_backward(carry, dA, a2, ld, t0, t1, checkpoint, emit, sub_done);
  store_tile(dA_part + bs0(m, b, s), dA, p, N);
  if (s == 0) store_tile(dh0 + (long)b * m.D * N, carry, p, N);
}

// The dynamic shared memory of bwd_main_kernel<In, N>.
template <typename In, int N>
constexpr size_t bwd_main_smem() { return bwd_main_red(N) + stage_smem<In, N>(); }

}  // namespace carry::kernels::selective_scan::kernels
