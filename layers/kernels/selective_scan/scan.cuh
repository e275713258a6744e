// The per-thread math of Mamba-1's selective scan (S6) kernels (scan.cu), written once for the GPU (R = float)
// and for the CPU check in double (tests/layers/kernels/selective_scan/segments_test.cpp). Per channel d and
// state n:
//   h_t[d,n] = exp(Δ_t[d]·A[d,n]) · h_{t−1}[d,n] + B_t[n] · u_t[d],   y_t[d] = Σ_n C_t[n] · h_t[d,n].
// A thread owns a tile of kChan consecutive channels d0.. of one sequence and kGroup consecutive states
// n0.. of each, over one segment of tokens [t0, t1). The exponentials are base 2: the walks take
// A2 = A·log2(e), so exp(Δ·A) = 2^(Δ·A2). What crosses threads (the sums over n for y, du, dΔ, the sums over
// d for dB, dC) is the caller's: these functions hand each thread's share to an `emit` callback, the dB, dC
// shares already summed over the thread's channels.
//
// The segment algorithm (scan.cu's plan says which kernel runs which step):
//   forward   pass 1: each segment from the zero state: its end state and ΣΔ over it (its transport is
//                     exp(A·ΣΔ), diagonal); segment scan: h_in[s+1] = exp(A·ΣΔ_s)·h_in[s] + end_s, in order;
//             pass 2: each segment again from h_in[s], writing y; the last one's end state is h_T.
//   backward  with g_t = ∂L/∂h_t = C_t·dy_t + exp(Δ_{t+1}A)·g_{t+1} (g of the last token: C·dy + dh_T):
//             pass 1: each segment from a zero gradient, last token to first: its outgoing gradient
//                     exp(Δ_{t0}A)·g_{t0} and ΣΔ; reverse scan: G_in[s−1] = exp(A·ΣΔ_s)·G_in[s] + out_s
//                     (G_in[S−1] = dh_T); checkpoints: the state entering every kSub-token sub-chunk, by the
//                     forward from h_in[s]; pass 2: each sub-chunk, last to first, its states recomputed from
//                     its checkpoint into registers, then per token (last to first)
//                       du_t = Σ_n B_t g_t,  dΔ_t = ln2·Σ_n A2·e_t·h_{t−1}·g_t,  dA += Δ_t·e_t·h_{t−1}·g_t,
//                       dB_t[n] = Σ_d u_t g_t,  dC_t[n] = Σ_d h_t dy_t,  with e_t = 2^(Δ_t A2);
//                     segment 0's outgoing gradient is dh0.
// Every token step is the same function wherever the token falls (token_step), so the checkpoints and the
// recomputed states are the forward's bits, and one segment (the serial form) gives the bits of the whole
// sequence when it is cut at any token and the second piece starts from the first's state.
#pragma once

#include <math.h>

#if defined(__CUDACC__)
#define CARRY_SS_HD __host__ __device__ __forceinline__
#define CARRY_SS_UNROLL _Pragma("unroll")
// The walkers take device lambdas on the GPU and host lambdas on the CPU: no host/device call check.
#define CARRY_SS_ANY_CALLER _Pragma("nv_exec_check_disable")
#else
#define CARRY_SS_HD inline
#define CARRY_SS_UNROLL
#define CARRY_SS_ANY_CALLER
#endif

namespace carry::kernels::selective_scan::core {

constexpr int kThreads = 128;  // threads a block
constexpr int kGroup = 4;      // states a thread carries (N ∈ {4, 8, 16}: 1, 2 or 4 threads a channel tile)
constexpr int kChan = 2;       // channels a thread carries
constexpr int kSub = 8;        // tokens of a backward sub-chunk: its recomputed states stay in registers
constexpr int kStage = kSub;   // tokens a walk's reader stages at a time (the next stage's arrive during this one's)
constexpr double kLog2e = 1.4426950408889634074;
constexpr double kLn2 = 0.69314718055994530942;

CARRY_SS_HD constexpr int threads_per_channel(int N) { return N / kGroup; }
CARRY_SS_HD constexpr int channels_per_block(int N) { return kChan * kThreads / threads_per_channel(N); }
CARRY_SS_HD int channel_blocks(int D, int N) { return (D + channels_per_block(N) - 1) / channels_per_block(N); }

// The length of the segments when `segments` (≥ 1) are asked for over T tokens: ⌈T/segments⌉ rounded up to
// a multiple of kSub, so that segments start on sub-chunk boundaries; the last one may be shorter. The
// segments made, ⌈T/L⌉, ask for the same length again: segment_length(T, segment_count(T, L)) = L.
CARRY_SS_HD int segment_length(int T, int segments) {
  const int per = (T + segments - 1) / segments;
  return (per + kSub - 1) / kSub * kSub;
}
CARRY_SS_HD int segment_count(int T, int L) { return (T + L - 1) / L; }

// 2^x: the GPU's ex2.approx (one MUFU operation; flushes results below 2^−126 to zero), the CPU's exp2.
CARRY_SS_HD float ss_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}
CARRY_SS_HD double ss_exp2(double x) { return exp2(x); }
CARRY_SS_HD float ss_fma(float a, float b, float c) { return fmaf(a, b, c); }
CARRY_SS_HD double ss_fma(double a, double b, double c) { return fma(a, b, c); }

template <class R>
using Tile = R[kChan][kGroup];

// One token for the thread's tile: h ← 2^(Δ·A2) ⊙ h + B·u.
template <class R>
CARRY_SS_HD void token_step(Tile<R>& h, const Tile<R>& A2, const R (&delta)[kChan], const R (&u)[kChan],
                            const R (&b)[kGroup]) {
  CARRY_SS_UNROLL
  for (int c = 0; c < kChan; ++c)
    CARRY_SS_UNROLL
    for (int g = 0; g < kGroup; ++g) h[c][g] = ss_fma(ss_exp2(delta[c] * A2[c][g]), h[c][g], b[g] * u[c]);
}

// The thread's shares of y_t[d0 + c]: Σ_g C_t[n0+g] h_t[c][n0+g], in order.
template <class R>
CARRY_SS_HD void output_share(const Tile<R>& h, const R (&cv)[kGroup], R (&y)[kChan]) {
  CARRY_SS_UNROLL
  for (int c = 0; c < kChan; ++c) {
    R v = cv[0] * h[c][0];
    CARRY_SS_UNROLL
    for (int g = 1; g < kGroup; ++g) v = ss_fma(cv[g], h[c][g], v);
    y[c] = v;
  }
}

// The segment scan's step, forward and backward alike: 2^(A2·ΣΔ) · x + local (one state entry).
template <class R>
CARRY_SS_HD R scan_step(R a2, R delta_sum, R x, R local) {
  return ss_fma(ss_exp2(a2 * delta_sum), x, local);
}

// Tokens [t0, t1) forward from h (updated in place), emit(t, h, view) after each token; delta_sum gets ΣΔ over
// them. Ld stages the inputs kStage tokens at a time: start(c0, c1) asks for the first stage, and
// stage(buf, c0, n0, n1) returns a view of the stage from token c0 (in buffer buf) while asking for [n0, n1)
// next (empty: none); every thread of a block walks the same tokens. A view reads the thread's inputs:
// delta(t, out[kChan]), u(t, out[kChan]), dy(t, out[kChan]), b(t, out[kGroup]), c(t, out[kGroup]).
CARRY_SS_ANY_CALLER
template <class R, class Ld, class Emit>
CARRY_SS_HD void walk_forward(Tile<R>& h, const Tile<R>& A2, const Ld& ld, int t0, int t1, R (&delta_sum)[kChan],
                              Emit&& emit) {
  CARRY_SS_UNROLL
  for (int c = 0; c < kChan; ++c) delta_sum[c] = 0;
  ld.start(t0, t1 < t0 + kStage ? t1 : t0 + kStage);
  int i = 0;
  for (int c0 = t0; c0 < t1; c0 += kStage, ++i) {
    const int c1 = c0 + kStage < t1 ? c0 + kStage : t1, n1 = c1 + kStage < t1 ? c1 + kStage : t1;
    const auto v = ld.stage(i & 1, c0, c1, n1);
    CARRY_SS_UNROLL
    for (int k = 0; k < kStage; ++k)
      if (c0 + k < c1) {
        R delta[kChan], u[kChan], b[kGroup];
        v.delta(c0 + k, delta);
        v.u(c0 + k, u);
        v.b(c0 + k, b);
        token_step(h, A2, delta, u, b);
        CARRY_SS_UNROLL
        for (int c = 0; c < kChan; ++c) delta_sum[c] += delta[c];
        emit(c0 + k, h, v);
      }
  }
}

// The stages of [t0, t1) from the last (t0 a multiple of kStage): f(view, c0, c1) for each, last to first.
CARRY_SS_ANY_CALLER
template <class Ld, class F>
CARRY_SS_HD void stages_backward(const Ld& ld, int t0, int t1, F&& f) {
  int c0 = t0 + (t1 - 1 - t0) / kStage * kStage;
  ld.start(c0, t1);
  for (int i = 0; c0 >= t0; c0 -= kStage, ++i) {
    const int c1 = c0 + kStage < t1 ? c0 + kStage : t1;
    const auto v = ld.stage(i & 1, c0, c0 > t0 ? c0 - kStage : c0, c0);
    f(v, c0, c1);
  }
}

// Tokens [t0, t1) (t0 a multiple of kStage), last to first, carrying the gradient from `carry` (the gradient
// arriving at h_{t1−1} from later tokens; updated in place to 2^(Δ_{t0}A2)·g_{t0}, what reaches h_{t0−1});
// delta_sum gets ΣΔ. The inputs are staged as in walk_forward.
CARRY_SS_ANY_CALLER
template <class R, class Ld>
CARRY_SS_HD void walk_gradient(Tile<R>& carry, const Tile<R>& A2, const Ld& ld, int t0, int t1,
                               R (&delta_sum)[kChan]) {
  CARRY_SS_UNROLL
  for (int c = 0; c < kChan; ++c) delta_sum[c] = 0;
  stages_backward(ld, t0, t1, [&](const auto& v, int c0, int c1) {
    CARRY_SS_UNROLL
    for (int k = kStage - 1; k >= 0; --k)
      if (c0 + k < c1) {
        R delta[kChan], dy[kChan], cv[kGroup];
        v.delta(c0 + k, delta);
        v.dy(c0 + k, dy);
        v.c(c0 + k, cv);
        CARRY_SS_UNROLL
        for (int c = 0; c < kChan; ++c) {
          CARRY_SS_UNROLL
          for (int g = 0; g < kGroup; ++g)
            carry[c][g] = ss_exp2(delta[c] * A2[c][g]) * ss_fma(cv[g], dy[c], carry[c][g]);
          delta_sum[c] += delta[c];
        }
      }
  });
}

// One token's gradients for the thread: du and dΔ are its shares of sums over n (one a channel), db and dc
// its shares of sums over d (one a state, summed over the thread's channels in order).
template <class R>
struct TokenGrads {
  R du[kChan], ddelta[kChan];
  R db[kGroup], dc[kGroup];
};

// Token t's gradients from the gradient arriving from later tokens (carry, updated in place to what
// reaches h_{t−1}), the state before it (h_prev) and after it (h); dA accumulates Δ·e·h_{t−1}·g.
template <class R>
CARRY_SS_HD void token_grads(Tile<R>& carry, Tile<R>& dA, const Tile<R>& A2, const Tile<R>& h_prev, const Tile<R>& h,
                             const R (&delta)[kChan], const R (&u)[kChan], const R (&dy)[kChan],
                             const R (&b)[kGroup], const R (&cv)[kGroup], TokenGrads<R>& out) {
  CARRY_SS_UNROLL
  for (int c = 0; c < kChan; ++c) {
    R du = 0, dd = 0;
    CARRY_SS_UNROLL
    for (int g = 0; g < kGroup; ++g) {
      const R e = ss_exp2(delta[c] * A2[c][g]);
      const R grad = ss_fma(cv[g], dy[c], carry[c][g]);  // ∂L/∂h_t
      const R w = e * h_prev[c][g] * grad;
      du = ss_fma(b[g], grad, du);
      dd = ss_fma(A2[c][g], w, dd);
      dA[c][g] = ss_fma(delta[c], w, dA[c][g]);
      if (c == 0) {
        out.db[g] = u[c] * grad;
        out.dc[g] = h[c][g] * dy[c];
      } else {
        out.db[g] = ss_fma(u[c], grad, out.db[g]);
        out.dc[g] = ss_fma(h[c][g], dy[c], out.dc[g]);
      }
      carry[c][g] = e * grad;
    }
    out.du[c] = du;
    out.ddelta[c] = dd * R(kLn2);
  }
}

// One sub-chunk [c0, c1) (at most kSub tokens, read through the view `ld`), last token to first: its states
// recomputed from h_start (the state before c0) into registers, then token_grads for each token, emit(t,
// grads) after each.
CARRY_SS_ANY_CALLER
template <class R, class V, class Emit>
CARRY_SS_HD void walk_backward_sub(Tile<R>& carry, Tile<R>& dA, const Tile<R>& A2, const Tile<R>& h_start,
                                   const V& ld, int c0, int c1, Emit&& emit) {
  const int n = c1 - c0;
  R hs[kSub + 1][kChan][kGroup];  // hs[k + 1] after token c0 + k; hs[0] = h_start
  CARRY_SS_UNROLL
  for (int c = 0; c < kChan; ++c)
    CARRY_SS_UNROLL
    for (int g = 0; g < kGroup; ++g) hs[0][c][g] = h_start[c][g];
  CARRY_SS_UNROLL
  for (int k = 0; k < kSub; ++k)
    if (k < n) {
      R delta[kChan], u[kChan], b[kGroup];
      ld.delta(c0 + k, delta);
      ld.u(c0 + k, u);
      ld.b(c0 + k, b);
      CARRY_SS_UNROLL
      for (int c = 0; c < kChan; ++c)
        CARRY_SS_UNROLL
        for (int g = 0; g < kGroup; ++g) hs[k + 1][c][g] = hs[k][c][g];
      token_step(hs[k + 1], A2, delta, u, b);
    }
  CARRY_SS_UNROLL
  for (int k = kSub - 1; k >= 0; --k)
    if (k < n) {
      const int t = c0 + k;
      R delta[kChan], u[kChan], dy[kChan], b[kGroup], cv[kGroup];
      ld.delta(t, delta);
      ld.u(t, u);
      ld.dy(t, dy);
      ld.b(t, b);
      ld.c(t, cv);
      TokenGrads<R> gr;
      token_grads(carry, dA, A2, hs[k], hs[k + 1], delta, u, dy, b, cv, gr);
      emit(t, gr);
    }
}

// The segment [t0, t1) (t0 a multiple of kSub), sub-chunk by sub-chunk from the last (a sub-chunk is a
// stage): checkpoint(j, h) gives the state entering sub-chunk j (tokens [j·kSub, (j+1)·kSub)); emit(t, grads)
// after each token, sub_done(c0, c1) after each sub-chunk.
CARRY_SS_ANY_CALLER
template <class R, class Ld, class Ck, class Emit, class Done>
CARRY_SS_HD void walk_backward(Tile<R>& carry, Tile<R>& dA, const Tile<R>& A2, const Ld& ld, int t0, int t1,
                               Ck&& checkpoint, Emit&& emit, Done&& sub_done) {
  static_assert(kStage == kSub, "a backward sub-chunk is one stage");
  stages_backward(ld, t0, t1, [&](const auto& v, int c0, int c1) {
    R h_start[kChan][kGroup];
    checkpoint(c0 / kSub, h_start);
    walk_backward_sub(carry, dA, A2, h_start, v, c0, c1, emit);
    sub_done(c0, c1);
  });
}

}  // namespace carry::kernels::selective_scan::core
