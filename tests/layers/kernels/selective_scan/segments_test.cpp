// The selective-scan kernels' segment algorithm (layers/kernels/selective_scan/scan.cuh) run on the CPU in
// double, with the kernels' own per-thread functions and their layout (threads of kChan channels × kGroup
// states, blocks of channels with the last one part empty, the dB/dC partials a block, the dA partials a segment): forward pass 1,
// the segment scan, pass 2; backward pass 1, the reverse scan, the checkpoints and pass 2, and the fixed-order
// sums. Against the token recurrence (a plain loop) and autograd of the ATen token recurrence
// (reference.h): y, h_T and the gradients of u, Δ, A, B, C and h0 for the loss Σ y·dy + Σ h_T·dh_T with random
// dy, dh_T, to 1e-12 (max-norm relative). Realistic inputs (Δ a softplus, A = −exp(·), a nonzero h0); 1, 2, 3
// and 5 segments asked for, uneven last segments, T = 1 to 100 (several 8-token sub-chunks a segment),
// N ∈ {4, 8, 16}, D = 3, 37 and 70 (two channel blocks for N = 16). One segment cut at any token, the second
// piece from the first's state (and its initial-state gradient as the first's final-state gradient), gives
// the same bits as the whole, dA (a sum over tokens split with the sequence) to rounding.
#include "layers/kernels/selective_scan/scan.cuh"
#include "tests/layers/kernels/selective_scan/reference.h"

#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <vector>

namespace carry::testing::selective_scan {
namespace {

namespace core = carry::kernels::selective_scan::core;
using core::kChan;
using core::kGroup;
using core::kSub;

// Inputs and the output gradients, row-major in the kernels' layouts.
struct Problem {
  int Bs, T, D, N;
  std::vector<double> u, delta, A, B, C, h0, dy, dh;  // [Bs,T,D] ×2, [D,N], [Bs,T,N] ×2, [Bs,D,N], [Bs,T,D], [Bs,D,N]
};

struct Result {
  std::vector<double> y, h_final, du, ddelta, dA, dB, dC, dh0;
};

std::vector<double> values(const at::Tensor& t) {
  auto c = t.to(at::kDouble).contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

using Tile = core::Tile<double>;

// A thread's tile, as kernels.cuh's Place: channels d0, d0 + 1 (clamped to D − 1 past D), states n0.. .
struct Place {
  int d0, n0;
  int d[kChan];
  bool valid[kChan];
};

// The thread's reads, as kernels.cuh's Tokens (u and dy zero past D).
struct Ld {
  const Problem* p;
  int seq;
  Place pl;
  void chans(const std::vector<double>& v, int t, double (&out)[kChan], bool zero_past) const {
    for (int c = 0; c < kChan; ++c)
      out[c] = zero_past && !pl.valid[c] ? 0.0 : v[((size_t)seq * p->T + t) * p->D + pl.d[c]];
  }
  void delta(int t, double (&out)[kChan]) const { chans(p->delta, t, out, false); }
  void u(int t, double (&out)[kChan]) const { chans(p->u, t, out, true); }
  void dy(int t, double (&out)[kChan]) const { chans(p->dy, t, out, true); }
  void states(int t, const std::vector<double>& m, double (&out)[kGroup]) const {
    for (int g = 0; g < kGroup; ++g) out[g] = m[((size_t)seq * p->T + t) * p->N + pl.n0 + g];
  }
  void b(int t, double (&out)[kGroup]) const { states(t, p->B, out); }
  void c(int t, double (&out)[kGroup]) const { states(t, p->C, out); }
  // The stages are the whole problem, read in place.
  void start(int, int) const {}
  const Ld& stage(int, int, int, int) const { return *this; }
};

// The kernels' launches, thread by thread in order.
Result segment_algorithm(const Problem& p, int segments) {
  const int Bs = p.Bs, T = p.T, D = p.D, N = p.N;
  const int L = core::segment_length(T, segments), S = core::segment_count(T, L);
  const int NT = core::threads_per_channel(N), CPB = core::channels_per_block(N), P = core::channel_blocks(D, N);
  const int nk = (T + kSub - 1) / kSub;
  auto bsdn = [&](int b, int s, int d, int n) { return (((size_t)b * S + s) * D + d) * N + n; };
  // A [B?, ·, D, N] buffer's tile at `base` (the start of its (b, s) or (b, j) block).
  auto load = [&](Tile& x, const double* base, const Place& pl) {
    for (int c = 0; c < kChan; ++c)
      for (int g = 0; g < kGroup; ++g) x[c][g] = base[(size_t)pl.d[c] * N + pl.n0 + g];
  };
  auto store = [&](double* base, const Tile& x, const Place& pl) {
    for (int c = 0; c < kChan; ++c)
      if (pl.valid[c])
        for (int g = 0; g < kGroup; ++g) base[(size_t)pl.d[c] * N + pl.n0 + g] = x[c][g];
  };
  struct A2 {
    Tile v;
  };
  auto a2_of = [&](const Place& pl) {
    A2 a2;
    load(a2.v, p.A.data(), pl);
    for (auto& row : a2.v)
      for (double& x : row) x *= core::kLog2e;
    return a2;
  };
  // Every (b, segment, block, thread) of a kernel's grid; kernels without cross-thread sums skip the tiles
  // past D (they return early).
  auto each = [&](int s_from, int s_to, bool all, auto&& f) {
    for (int b = 0; b < Bs; ++b)
      for (int s = s_from; s < s_to; ++s)
        for (int x = 0; x < P; ++x)
          for (int th = 0; th < core::kThreads; ++th) {
            Place pl;
            pl.n0 = th % NT * kGroup;
            pl.d0 = x * CPB + th / NT * kChan;
            for (int c = 0; c < kChan; ++c) pl.valid[c] = pl.d0 + c < D, pl.d[c] = std::min(pl.d0 + c, D - 1);
            if (!all && !pl.valid[0]) continue;
            f(b, s, x, pl, Ld{&p, b, pl}, s * L, std::min(T, s * L + L));
          }
  };
  Result r;
  // Forward pass 1 and the segment scan.
  std::vector<double> end_state((size_t)Bs * S * D * N), delta_sum((size_t)Bs * S * D);
  each(0, S - 1, false, [&](int b, int s, int, const Place& pl, const Ld& ld, int t0, int t1) {
    Tile h = {};
    double ds[kChan];
    core::walk_forward(h, a2_of(pl).v, ld, t0, t1, ds, [](int, const Tile&, const Ld&) {});
    store(&end_state[bsdn(b, s, 0, 0)], h, pl);
    for (int c = 0; c < kChan; ++c)
      if (pl.valid[c]) delta_sum[((size_t)b * S + s) * D + pl.d[c]] = ds[c];
  });
  auto scan = [&](const std::vector<double>& x0, const std::vector<double>& local, const std::vector<double>& dsum,
                  bool reverse) {
    std::vector<double> x_in((size_t)Bs * S * D * N);
    for (int b = 0; b < Bs; ++b)
      for (int d = 0; d < D; ++d)
        for (int n = 0; n < N; ++n) {
          double x = x0[((size_t)b * D + d) * N + n];
          for (int k = 0; k < S; ++k) {
            const int s = reverse ? S - 1 - k : k;
            x_in[bsdn(b, s, d, n)] = x;
            if (k + 1 < S)
              x = core::scan_step(p.A[(size_t)d * N + n] * core::kLog2e, dsum[((size_t)b * S + s) * D + d], x,
                                  local[bsdn(b, s, d, n)]);
          }
        }
    return x_in;
  };
  const std::vector<double> h_in = scan(p.h0, end_state, delta_sum, false);
  // Forward pass 2.
  r.y.assign((size_t)Bs * T * D, 0.0);
  r.h_final.assign((size_t)Bs * D * N, 0.0);
  each(0, S, false, [&](int b, int s, int, const Place& pl, const Ld& ld, int t0, int t1) {
    Tile h;
    load(h, &h_in[bsdn(b, s, 0, 0)], pl);
    double ds[kChan];
    core::walk_forward(h, a2_of(pl).v, ld, t0, t1, ds, [&](int t, const Tile& hh, const Ld& v) {
      double c[kGroup], y[kChan];
      v.c(t, c);
      core::output_share(hh, c, y);
      for (int ch = 0; ch < kChan; ++ch)
        if (pl.valid[ch]) r.y[((size_t)b * T + t) * D + pl.d[ch]] += y[ch];
    });
    if (s == S - 1) store(&r.h_final[(size_t)b * D * N], h, pl);
  });
  // Backward pass 1 and the reverse scan.
  std::vector<double> out_grad((size_t)Bs * S * D * N), delta_sum_b((size_t)Bs * S * D);
  each(1, S, false, [&](int b, int s, int, const Place& pl, const Ld& ld, int t0, int t1) {
    Tile g = {};
    double ds[kChan];
    core::walk_gradient(g, a2_of(pl).v, ld, t0, t1, ds);
    store(&out_grad[bsdn(b, s, 0, 0)], g, pl);
    for (int c = 0; c < kChan; ++c)
      if (pl.valid[c]) delta_sum_b[((size_t)b * S + s) * D + pl.d[c]] = ds[c];
  });
  const std::vector<double> g_in = scan(p.dh, out_grad, delta_sum_b, true);
  // Checkpoints.
  std::vector<double> ck((size_t)Bs * nk * D * N, std::nan(""));
  auto ck_at = [&](int b, int j) { return &ck[((size_t)b * nk + j) * D * N]; };
  each(0, S, false, [&](int b, int s, int, const Place& pl, const Ld& ld, int t0, int t1) {
    Tile h;
    load(h, &h_in[bsdn(b, s, 0, 0)], pl);
    store(ck_at(b, t0 / kSub), h, pl);
    double ds[kChan];
    core::walk_forward(h, a2_of(pl).v, ld, t0, t1, ds, [&](int t, const Tile& hh, const Ld&) {
      if ((t + 1) % kSub == 0 && t + 1 < t1) store(ck_at(b, (t + 1) / kSub), hh, pl);
    });
  });
  // Backward pass 2 over the blocks' threads, the tiles past D included (clamped, contributing nothing).
  r.du.assign((size_t)Bs * T * D, 0.0);
  r.ddelta = r.du;
  r.dh0.assign((size_t)Bs * D * N, 0.0);
  std::vector<double> part((size_t)P * 2 * Bs * T * N, 0.0), dA_part((size_t)Bs * S * D * N, std::nan(""));
  each(0, S, true, [&](int b, int s, int x, const Place& pl, const Ld& ld, int t0, int t1) {
    Tile carry, dA = {};
    load(carry, &g_in[bsdn(b, s, 0, 0)], pl);
    auto checkpoint = [&](int j, Tile& h) { load(h, ck_at(b, j), pl); };
    auto emit = [&](int t, const core::TokenGrads<double>& gr) {
      for (int c = 0; c < kChan; ++c)
        if (pl.valid[c]) {
          r.du[((size_t)b * T + t) * D + pl.d[c]] += gr.du[c];
          r.ddelta[((size_t)b * T + t) * D + pl.d[c]] += gr.ddelta[c];
        }
      for (int g = 0; g < kGroup; ++g)
        for (int q = 0; q < 2; ++q)
          part[((((size_t)x * 2 + q) * Bs + b) * T + t) * N + pl.n0 + g] += q == 0 ? gr.db[g] : gr.dc[g];
    };
    core::walk_backward(carry, dA, a2_of(pl).v, ld, t0, t1, checkpoint, emit, [](int, int) {});
    store(&dA_part[bsdn(b, s, 0, 0)], dA, pl);
    if (s == 0) store(&r.dh0[(size_t)b * D * N], carry, pl);
  });
  // The fixed-order sums: dB, dC over the channel blocks, dA over (b, segment).
  r.dB.assign((size_t)Bs * T * N, 0.0);
  r.dC = r.dB;
  for (int x = 0; x < P; ++x)
    for (size_t i = 0; i < r.dB.size(); ++i) {
      r.dB[i] += part[((size_t)x * 2 + 0) * r.dB.size() + i];
      r.dC[i] += part[((size_t)x * 2 + 1) * r.dB.size() + i];
    }
  r.dA.assign((size_t)D * N, 0.0);
  for (int bs = 0; bs < Bs * S; ++bs)
    for (size_t i = 0; i < r.dA.size(); ++i) r.dA[i] += dA_part[(size_t)bs * D * N + i];
  return r;
}

double rel(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return den > 0 ? num / den : num;
}

struct Reference {
  Problem p;
  Result plain;  // y, h_final by a plain loop
  Result grads;  // y, h_final and every gradient by autograd
};

Reference reference(int Bs, int T, int D, int N, uint64_t seed) {
  ScanInputs in = scan_inputs(Bs, T, D, N, seed);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + 1000);
  at::Tensor dy = at::randn({Bs, T, D}, gen, at::kDouble), dh = at::randn({Bs, D, N}, gen, at::kDouble);
  Reference ref;
  ref.p = Problem{Bs, T, D, N, values(in.u), values(in.delta), values(in.A), values(in.B), values(in.C),
                  values(in.h0), values(dy), values(dh)};
  std::vector<at::Tensor> leaves;
  for (at::Tensor* t : {&in.u, &in.delta, &in.A, &in.B, &in.C, &in.h0}) leaves.push_back(t->requires_grad_(true));
  auto [y, h] = token_recurrence(in.u, in.delta, in.A, in.B, in.C, in.h0);
  auto g = torch::autograd::grad({(y * dy).sum() + (h * dh).sum()}, leaves);
  ref.grads = Result{values(y.detach()), values(h.detach()), values(g[0]), values(g[1]), values(g[2]),
                     values(g[3]), values(g[4]), values(g[5])};
  // The plain loop.
  const Problem& p = ref.p;
  ref.plain.y.assign((size_t)Bs * T * D, 0.0);
  ref.plain.h_final = p.h0;
  for (int b = 0; b < Bs; ++b)
    for (int d = 0; d < D; ++d)
      for (int t = 0; t < T; ++t) {
        const size_t bt = (size_t)b * T + t;
        double y_t = 0;
        for (int n = 0; n < N; ++n) {
          double& hv = ref.plain.h_final[((size_t)b * D + d) * N + n];
          hv = std::exp(p.delta[bt * D + d] * p.A[(size_t)d * N + n]) * hv + p.B[bt * N + n] * p.u[bt * D + d];
          y_t += p.C[bt * N + n] * hv;
        }
        ref.plain.y[bt * D + d] = y_t;
      }
  return ref;
}

TEST(SelectiveScanSegments, SegmentLengthsRoundTrip) {
  for (int T = 1; T <= 400; ++T)
    for (int segments = 1; segments <= 40; ++segments) {
      const int L = core::segment_length(T, segments), S = core::segment_count(T, L);
      ASSERT_EQ(L % kSub, 0);
      ASSERT_GE(L, 1);
      ASSERT_LE(S, segments);
      ASSERT_GT(T, (S - 1) * L) << "T " << T << " segments " << segments;  // no empty segment
      ASSERT_EQ(core::segment_length(T, S), L) << "T " << T << " segments " << segments;
    }
}

TEST(SelectiveScanSegments, MatchTheTokenRecurrenceAndAutograd) {
  const char* names[] = {"y", "h_final", "du", "ddelta", "dA", "dB", "dC", "dh0"};
  for (int T : {1, 7, 40, 100})
    for (int D : {3, 37, 70})
      for (int N : {4, 8, 16}) {
        const Reference ref = reference(2, T, D, N, 100 + T * 7 + D + N);
        EXPECT_LE(rel(ref.plain.y, ref.grads.y), 1e-13);
        EXPECT_LE(rel(ref.plain.h_final, ref.grads.h_final), 1e-13);
        for (int segments : {1, 2, 3, 5}) {
          const Result r = segment_algorithm(ref.p, segments);
          const int S = core::segment_count(T, core::segment_length(T, segments));
          const std::vector<double>* got[] = {&r.y, &r.h_final, &r.du, &r.ddelta, &r.dA, &r.dB, &r.dC, &r.dh0};
          const std::vector<double>* want[] = {&ref.grads.y,  &ref.grads.h_final, &ref.grads.du, &ref.grads.ddelta,
                                               &ref.grads.dA, &ref.grads.dB,      &ref.grads.dC, &ref.grads.dh0};
          double worst = 0;
          for (int i = 0; i < 8; ++i) {
            const double e = rel(*got[i], *want[i]);
            worst = std::max(worst, e);
            EXPECT_LE(e, 1e-12) << names[i] << " T " << T << " D " << D << " N " << N << " segments " << segments
                                << " (" << S << " made)";
          }
          EXPECT_LE(rel(r.y, ref.plain.y), 1e-12);
          EXPECT_LE(rel(r.h_final, ref.plain.h_final), 1e-12);
          if (D == 70 && N == 16)
            std::cout << "[ errors   ] T=" << T << " D=" << D << " N=" << N << " segments " << segments << " ("
                      << S << " made): worst " << worst << "\n";
        }
      }
}

// Tokens [t0, t1) of p, from the state h0 with the final-state gradient dh.
Problem slice(const Problem& p, int t0, int t1, const std::vector<double>& h0, const std::vector<double>& dh) {
  Problem q = p;
  q.T = t1 - t0;
  auto cut = [&](const std::vector<double>& v, int w) {
    std::vector<double> o;
    for (int b = 0; b < p.Bs; ++b)
      o.insert(o.end(), v.begin() + ((size_t)b * p.T + t0) * w, v.begin() + ((size_t)b * p.T + t1) * w);
    return o;
  };
  q.u = cut(p.u, p.D), q.delta = cut(p.delta, p.D), q.dy = cut(p.dy, p.D);
  q.B = cut(p.B, p.N), q.C = cut(p.C, p.N);
  q.h0 = h0, q.dh = dh;
  return q;
}

// [Bs, T1, ·] then [Bs, T2, ·] → [Bs, T1 + T2, ·].
std::vector<double> join(const std::vector<double>& a, const std::vector<double>& b, int Bs) {
  std::vector<double> o;
  const size_t na = a.size() / Bs, nb = b.size() / Bs;
  for (int i = 0; i < Bs; ++i) {
    o.insert(o.end(), a.begin() + i * na, a.begin() + (i + 1) * na);
    o.insert(o.end(), b.begin() + i * nb, b.begin() + (i + 1) * nb);
  }
  return o;
}

TEST(SelectiveScanSegments, OneSegmentCutAnywhereGivesTheBitsOfTheWhole) {
  const int T = 53;
  for (int N : {4, 16}) {
    const Reference ref = reference(2, T, 37, N, 7 + N);
    const Result whole = segment_algorithm(ref.p, 1);
    for (int cut : {1, 16, 17, 30, 52}) {
      const Problem second_in = slice(ref.p, cut, T, std::vector<double>(ref.p.h0.size()), ref.p.dh);
      const Result first = segment_algorithm(slice(ref.p, 0, cut, ref.p.h0, std::vector<double>(ref.p.dh.size())), 1);
      Problem second_p = second_in;
      second_p.h0 = first.h_final;
      const Result second = segment_algorithm(second_p, 1);
      Problem first_p = slice(ref.p, 0, cut, ref.p.h0, second.dh0);
      const Result first_g = segment_algorithm(first_p, 1);
      const int Bs = ref.p.Bs;
      EXPECT_EQ(join(first.y, second.y, Bs), whole.y) << "cut " << cut;
      EXPECT_EQ(second.h_final, whole.h_final) << "cut " << cut;
      EXPECT_EQ(join(first_g.du, second.du, Bs), whole.du) << "cut " << cut;
      EXPECT_EQ(join(first_g.ddelta, second.ddelta, Bs), whole.ddelta) << "cut " << cut;
      EXPECT_EQ(join(first_g.dB, second.dB, Bs), whole.dB) << "cut " << cut;
      EXPECT_EQ(join(first_g.dC, second.dC, Bs), whole.dC) << "cut " << cut;
      EXPECT_EQ(first_g.dh0, whole.dh0) << "cut " << cut;
      std::vector<double> dA(whole.dA.size());
      for (size_t i = 0; i < dA.size(); ++i) dA[i] = first_g.dA[i] + second.dA[i];
      EXPECT_LE(rel(dA, whole.dA), 1e-13) << "cut " << cut;
    }
  }
}

}  // namespace
}  // namespace carry::testing::selective_scan
