// The per-thread math of Mamba-1's selective scan (S6) kernels (scan.cu), written once for the GPU (R = float)
// and for the CPU check in double (tests/layers/kernels/selective_scan/segments_test.cpp). Per channel d and
// state n:
//   h_t[d,n] = exp(Δ_t[d]·A[d,n]) · h_{t−1}[d,n] + B_t[n] · u_t[d],   y_t[d] = Σ_n C_t[n] · h_t[d,n].
// A thread owns one channel d of one sequence and kGroup consecutive states n0..n0+kGroup−1, over one segment
// of tokens [t0, t1); what crosses threads (the sums over n for y, du, dΔ, the sums over d for dB, dC) is the
// caller's: these functions hand each thread's share to an `emit` callback.
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
//                       du_t = Σ_n B_t g_t,  dΔ_t = Σ_n A·e_t·h_{t−1}·g_t,  dA += Δ_t·e_t·h_{t−1}·g_t,
//                       dB_t[n] = Σ_d u_t g_t,  dC_t[n] = Σ_d h_t dy_t,  with e_t = exp(Δ_t A);
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
constexpr int kGroup = 4;      // states a thread carries (N ∈ {4, 8, 16}: 1, 2 or 4 threads a channel)
constexpr int kSub = 16;       // tokens of a backward sub-chunk: its recomputed states stay in registers
constexpr int kTile = 8;       // tokens whose inputs a walk reads before their arithmetic, all in flight at once

CARRY_SS_HD int threads_per_channel(int N) { return N / kGroup; }
CARRY_SS_HD int channels_per_block(int N) { return kThreads / threads_per_channel(N); }
CARRY_SS_HD int channel_blocks(int D, int N) { return (D + channels_per_block(N) - 1) / channels_per_block(N); }

// The length of the segments when `segments` (≥ 1) are asked for over T tokens: ⌈T/segments⌉ rounded up to
// a multiple of kSub, so that segments start on sub-chunk boundaries; the last one may be shorter. The
// segments made, ⌈T/L⌉, ask for the same length again: segment_length(T, segment_count(T, L)) = L.
CARRY_SS_HD int segment_length(int T, int segments) {
  const int per = (T + segments - 1) / segments;
  return (per + kSub - 1) / kSub * kSub;
}
CARRY_SS_HD int segment_count(int T, int L) { return (T + L - 1) / L; }

CARRY_SS_HD float ss_exp(float x) { return expf(x); }
CARRY_SS_HD double ss_exp(double x) { return exp(x); }
CARRY_SS_HD float ss_fma(float a, float b, float c) { return fmaf(a, b, c); }
CARRY_SS_HD double ss_fma(double a, double b, double c) { return fma(a, b, c); }

// One token for the thread's states: h ← exp(Δ·A) ⊙ h + B·u.
template <class R>
CARRY_SS_HD void token_step(R (&h)[kGroup], const R (&A)[kGroup], R delta, R u, const R (&b)[kGroup]) {
  CARRY_SS_UNROLL
  for (int g = 0; g < kGroup; ++g) h[g] = ss_fma(ss_exp(delta * A[g]), h[g], b[g] * u);
}

// The thread's share of y_t[d]: Σ_g C_t[n0+g] h_t[n0+g], in order.
template <class R>
CARRY_SS_HD R output_share(const R (&h)[kGroup], const R (&c)[kGroup]) {
  R y = c[0] * h[0];
  CARRY_SS_UNROLL
  for (int g = 1; g < kGroup; ++g) y = ss_fma(c[g], h[g], y);
  return y;
}

// The segment scan's step, forward and backward alike: exp(A·ΣΔ) · x + local (one state entry).
template <class R>
CARRY_SS_HD R scan_step(R a, R delta_sum, R x, R local) {
  return ss_fma(ss_exp(a * delta_sum), x, local);
}

// Tokens [t0, t1) forward from h (updated in place), emit(t, h) after each token. Returns ΣΔ over them.
// Ld reads the thread's inputs: delta(t), u(t), b(t, out[kGroup]), c(t, out[kGroup]), dy(t). The inputs
// of kTile tokens are read before their arithmetic, which is the same token by token.
CARRY_SS_ANY_CALLER
template <class R, class Ld, class Emit>
CARRY_SS_HD R walk_forward(R (&h)[kGroup], const R (&A)[kGroup], const Ld& ld, int t0, int t1, Emit&& emit) {
  R delta_sum = 0;
  for (int c0 = t0; c0 < t1; c0 += kTile) {
    const int n = t1 - c0;
    R delta[kTile], u[kTile], b[kTile][kGroup];
    CARRY_SS_UNROLL
    for (int k = 0; k < kTile; ++k)
      if (k < n) {
        delta[k] = ld.delta(c0 + k);
        u[k] = ld.u(c0 + k);
        ld.b(c0 + k, b[k]);
      }
    CARRY_SS_UNROLL
    for (int k = 0; k < kTile; ++k)
      if (k < n) {
        token_step(h, A, delta[k], u[k], b[k]);
        delta_sum += delta[k];
        emit(c0 + k, h);
      }
  }
  return delta_sum;
}

// Tokens [t0, t1), last to first, carrying the gradient from `carry` (the gradient arriving at h_{t1−1}
// from later tokens; updated in place to exp(Δ_{t0}A)·g_{t0}, what reaches h_{t0−1}). Returns ΣΔ. The
// inputs are read kTile tokens at a time, as in walk_forward.
template <class R, class Ld>
CARRY_SS_HD R walk_gradient(R (&carry)[kGroup], const R (&A)[kGroup], const Ld& ld, int t0, int t1) {
  R delta_sum = 0;
  for (int e = t1; e > t0; e -= kTile) {  // tokens e − 1, e − 2, … down to max(t0, e − kTile)
    const int n = e - t0;
    R delta[kTile], dy[kTile], c[kTile][kGroup];
    CARRY_SS_UNROLL
    for (int k = 0; k < kTile; ++k)
      if (k < n) {
        delta[k] = ld.delta(e - 1 - k);
        dy[k] = ld.dy(e - 1 - k);
        ld.c(e - 1 - k, c[k]);
      }
    CARRY_SS_UNROLL
    for (int k = 0; k < kTile; ++k)
      if (k < n) {
        CARRY_SS_UNROLL
        for (int g = 0; g < kGroup; ++g) carry[g] = ss_exp(delta[k] * A[g]) * ss_fma(c[k][g], dy[k], carry[g]);
        delta_sum += delta[k];
      }
  }
  return delta_sum;
}

// One token's gradients for the thread: du and dΔ are its shares of sums over n, db and dc its entries
// of sums over d.
template <class R>
struct TokenGrads {
  R du, ddelta;
  R db[kGroup], dc[kGroup];
};

// Token t's gradients from the gradient arriving from later tokens (carry, updated in place to what
// reaches h_{t−1}), the state before it (h_prev) and after it (h); dA accumulates Δ·e·h_{t−1}·g.
template <class R>
CARRY_SS_HD void token_grads(R (&carry)[kGroup], R (&dA)[kGroup], const R (&A)[kGroup], const R* h_prev,
                             const R* h, R delta, R u, R dy, const R (&b)[kGroup], const R (&c)[kGroup],
                             TokenGrads<R>& out) {
  out.du = 0;
  out.ddelta = 0;
  CARRY_SS_UNROLL
  for (int g = 0; g < kGroup; ++g) {
    const R e = ss_exp(delta * A[g]);
    const R grad = ss_fma(c[g], dy, carry[g]);  // ∂L/∂h_t
    const R w = e * h_prev[g] * grad;
    out.du = ss_fma(b[g], grad, out.du);
    out.ddelta = ss_fma(A[g], w, out.ddelta);
    dA[g] = ss_fma(delta, w, dA[g]);
    out.db[g] = u * grad;
    out.dc[g] = h[g] * dy;
    carry[g] = e * grad;
  }
}

// One sub-chunk [c0, c1) (at most kSub tokens), last token to first: its states recomputed from h_start
// (the state before c0) into registers, then token_grads for each token, emit(t, grads) after each.
CARRY_SS_ANY_CALLER
template <class R, class Ld, class Emit>
CARRY_SS_HD void walk_backward_sub(R (&carry)[kGroup], R (&dA)[kGroup], const R (&A)[kGroup],
                                   const R (&h_start)[kGroup], const Ld& ld, int c0, int c1, Emit&& emit) {
  const int n = c1 - c0;
  R hs[kSub][kGroup];
  R h[kGroup];
  CARRY_SS_UNROLL
  for (int g = 0; g < kGroup; ++g) h[g] = h_start[g];
  CARRY_SS_UNROLL
  for (int k = 0; k < kSub; ++k)
    if (k < n) {
      R b[kGroup];
      ld.b(c0 + k, b);
      token_step(h, A, ld.delta(c0 + k), ld.u(c0 + k), b);
      CARRY_SS_UNROLL
      for (int g = 0; g < kGroup; ++g) hs[k][g] = h[g];
    }
  CARRY_SS_UNROLL
  for (int k = kSub - 1; k >= 0; --k)
    if (k < n) {
      const int t = c0 + k;
      R b[kGroup], c[kGroup];
      ld.b(t, b);
      ld.c(t, c);
      TokenGrads<R> gr;
      token_grads(carry, dA, A, k > 0 ? hs[k - 1] : h_start, hs[k], ld.delta(t), ld.u(t), ld.dy(t), b, c, gr);
      emit(t, gr);
    }
}

// The segment [t0, t1) (t0 a multiple of kSub), sub-chunk by sub-chunk from the last: checkpoint(j, h)
// gives the state entering sub-chunk j (tokens [j·kSub, (j+1)·kSub)); emit(t, grads) after each token,
// sub_done(c0, c1) after each sub-chunk.
CARRY_SS_ANY_CALLER
template <class R, class Ld, class Ck, class Emit, class Done>
CARRY_SS_HD void walk_backward(R (&carry)[kGroup], R (&dA)[kGroup], const R (&A)[kGroup], const Ld& ld, int t0,
                               int t1, Ck&& checkpoint, Emit&& emit, Done&& sub_done) {
  for (int c0 = t0 + (t1 - 1 - t0) / kSub * kSub; c0 >= t0; c0 -= kSub) {
    const int c1 = c0 + kSub < t1 ? c0 + kSub : t1;
    R h_start[kGroup];
    checkpoint(c0 / kSub, h_start);
    walk_backward_sub(carry, dA, A, h_start, ld, c0, c1, emit);
    sub_done(c0, c1);
  }
}

}  // namespace carry::kernels::selective_scan::core
