// The selective-scan kernels (layers/kernels/selective_scan/kernels.cuh) run on the CPU through the warp
// emulation (warp_emulation.h), launched as scan.cu launches them (the same grids, the segment scans, the
// dynamic shared memory of the backward's block sums), so their indexing, warp shuffles and block
// reductions are checked on every build, GPU or not. Against the token recurrence and its backward written
// as plain loops in double on the same (rounded) inputs: y, h_T, du, dΔ, dA, dB, dC, dh0 for random dy,
// dh_T. Realistic inputs (Δ a softplus, A = −exp(·), a nonzero h0), B = 2, T = 40 (five 8-token
// sub-chunks), D = 37 (odd: the channels read one by one) and 70 (read in pairs; for N = 16 two channel blocks,
// the second mostly past D), N ∈ {4, 8, 16} in three segments (the last 8 tokens) and in one; outputs and
// intermediates poisoned (NaN) first. fp32 inputs: max-norm relative error ≤ 1e-5; bf16 inputs (N = 16 and 8):
// ≤ 1e-2 (y, du, dΔ, dB, dC rounded to bf16).
#include "tests/emulation/warp_emulation.h"

#include "layers/kernels/selective_scan/kernels.cuh"
#include "tests/emulation/compare.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

namespace ss = carry::kernels::selective_scan::kernels;
namespace core = carry::kernels::selective_scan::core;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

template <class In>
std::vector<In> rounded(const std::vector<double>& x) {
  std::vector<In> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = In((float)x[i]);
  return r;
}
template <class In>
std::vector<double> widened(const std::vector<In>& x) {
  std::vector<double> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = (double)(float)x[i];
  return r;
}

struct Outputs {
  std::vector<double> y, h_final, du, ddelta, dA, dB, dC, dh0;
};

// The recurrence and its backward, token by token in double (row-major [Bs,T,D], [D,N], [Bs,T,N], [Bs,D,N]).
Outputs reference(int Bs, int T, int D, int N, const std::vector<double>& u, const std::vector<double>& dl,
                  const std::vector<double>& A, const std::vector<double>& B, const std::vector<double>& C,
                  const std::vector<double>& h0, const std::vector<double>& dy, const std::vector<double>& dh) {
  Outputs r;
  r.y.assign((size_t)Bs * T * D, 0), r.du = r.ddelta = r.y;
  r.dB.assign((size_t)Bs * T * N, 0), r.dC = r.dB;
  r.dA.assign((size_t)D * N, 0);
  r.h_final.assign((size_t)Bs * D * N, 0), r.dh0 = r.h_final;
  for (int b = 0; b < Bs; ++b)
    for (int d = 0; d < D; ++d)
      for (int n = 0; n < N; ++n) {
        const double a = A[(size_t)d * N + n];
        auto at = [&](int t, int w) { return ((size_t)b * T + t) * w; };
        std::vector<double> h(T + 1);  // h[t + 1] after token t
        h[0] = h0[((size_t)b * D + d) * N + n];
        for (int t = 0; t < T; ++t) {
          h[t + 1] = std::exp(dl[at(t, D) + d] * a) * h[t] + B[at(t, N) + n] * u[at(t, D) + d];
          r.y[at(t, D) + d] += C[at(t, N) + n] * h[t + 1];
        }
        r.h_final[((size_t)b * D + d) * N + n] = h[T];
        double g = dh[((size_t)b * D + d) * N + n];  // ∂L/∂h_t, from the last token
        for (int t = T - 1; t >= 0; --t) {
          const double e = std::exp(dl[at(t, D) + d] * a);
          g += C[at(t, N) + n] * dy[at(t, D) + d];
          r.du[at(t, D) + d] += B[at(t, N) + n] * g;
          r.ddelta[at(t, D) + d] += a * e * h[t] * g;
          r.dA[(size_t)d * N + n] += dl[at(t, D) + d] * e * h[t] * g;
          r.dB[at(t, N) + n] += u[at(t, D) + d] * g;
          r.dC[at(t, N) + n] += h[t + 1] * dy[at(t, D) + d];
          g *= e;
        }
        r.dh0[((size_t)b * D + d) * N + n] = g;
      }
  return r;
}

// scan.cu's launches, emulated; inputs in In, A, h0, dh fp32.
template <class In, int N>
Outputs run_kernels(int Bs, int T, int D, int segments, const std::vector<In>& u, const std::vector<In>& dl,
                    const std::vector<float>& A, const std::vector<In>& B, const std::vector<In>& C,
                    const std::vector<float>& h0, const std::vector<In>& dy, const std::vector<float>& dh) {
  const int L = core::segment_length(T, segments);
  const ss::Dims m{Bs, T, D, N, L, core::segment_count(T, L), core::channel_blocks(D, N)};
  const int S = m.S, P = m.P, nk = (T + core::kSub - 1) / core::kSub;
  const size_t bdn = (size_t)Bs * D * N, bsdn = (size_t)Bs * S * D * N;
  const int scan_blocks = (int)((bdn + 255) / 256);
  // Forward.
  std::vector<float> h_in = h0, end_state(bsdn, kNaN), delta_sum((size_t)Bs * S * D, kNaN);
  if (S > 1) {
    h_in.assign(bsdn, kNaN);
    carry_emu::launch(P, S - 1, Bs, core::kThreads, ss::stage_smem<In, N>(), [&] {
      ss::fwd_local_kernel<In, N>(u.data(), dl.data(), A.data(), B.data(), C.data(), m, end_state.data(),
                                  delta_sum.data());
    });
    carry_emu::launch(scan_blocks, 1, 1, 256, 0, [&] {
      ss::scan_kernel<false>(h0.data(), A.data(), end_state.data(), delta_sum.data(), m, h_in.data());
    });
  }
  std::vector<In> y((size_t)Bs * T * D, In(kNaN));
  std::vector<float> h_final(bdn, kNaN);
  carry_emu::launch(P, S, Bs, core::kThreads, ss::stage_smem<In, N>(), [&] {
    ss::fwd_output_kernel<In, N>(u.data(), dl.data(), A.data(), B.data(), C.data(), m, h_in.data(), y.data(),
                                 h_final.data());
  });
  // Backward.
  std::vector<float> g_in = dh, out_grad(bsdn, kNaN), delta_sum_b((size_t)Bs * S * D, kNaN);
  if (S > 1) {
    g_in.assign(bsdn, kNaN);
    carry_emu::launch(P, S - 1, Bs, core::kThreads, ss::stage_smem<In, N>(), [&] {
      ss::bwd_local_kernel<In, N>(u.data(), dl.data(), A.data(), B.data(), C.data(), dy.data(), m, out_grad.data(),
                                  delta_sum_b.data());
    });
    carry_emu::launch(scan_blocks, 1, 1, 256, 0, [&] {
      ss::scan_kernel<true>(dh.data(), A.data(), out_grad.data(), delta_sum_b.data(), m, g_in.data());
    });
  }
  std::vector<float> ck((size_t)Bs * nk * D * N, kNaN);
  carry_emu::launch(P, S, Bs, core::kThreads, ss::stage_smem<In, N>(), [&] {
    ss::checkpoint_kernel<In, N>(u.data(), dl.data(), A.data(), B.data(), C.data(), m, h_in.data(), ck.data());
  });
  std::vector<In> du((size_t)Bs * T * D, In(kNaN)), ddelta = du;
  std::vector<float> part((size_t)P * 2 * Bs * T * N, kNaN), dA_part(bsdn, kNaN), dh0(bdn, kNaN);
  carry_emu::launch(P, S, Bs, core::kThreads, ss::bwd_main_smem<In, N>(), [&] {
    ss::bwd_main_kernel<In, N>(u.data(), dl.data(), A.data(), B.data(), C.data(), dy.data(), m, g_in.data(),
                               ck.data(), du.data(), ddelta.data(), part.data(), dA_part.data(), dh0.data());
  });
  // The column sums (primitives::column_sum adds the rows in order).
  Outputs r{widened(y), widened(h_final), widened(du), widened(ddelta), {}, {}, {}, widened(dh0)};
  const size_t btn = (size_t)Bs * T * N;
  r.dB.assign(btn, 0), r.dC.assign(btn, 0), r.dA.assign((size_t)D * N, 0);
  for (int x = 0; x < P; ++x)
    for (size_t i = 0; i < btn; ++i) {
      r.dB[i] += part[((size_t)x * 2 + 0) * btn + i];
      r.dC[i] += part[((size_t)x * 2 + 1) * btn + i];
    }
  for (int row = 0; row < Bs * S; ++row)
    for (size_t i = 0; i < r.dA.size(); ++i) r.dA[i] += dA_part[(size_t)row * D * N + i];
  return r;
}

template <class In, int N>
void check(int segments, double bound, int D = 37) {
  const int Bs = 2, T = 40;
  std::mt19937_64 rng(17 + N + segments);
  std::normal_distribution<double> normal;
  auto draw = [&](size_t n, auto f) {
    std::vector<double> v(n);
    for (auto& x : v) x = f(normal(rng));
    return v;
  };
  auto id = [](double x) { return x; };
  const size_t btd = (size_t)Bs * T * D, btn = (size_t)Bs * T * N, bdn = (size_t)Bs * D * N;
  // Inputs rounded to the kernels' types; the reference reads the rounded values.
  const auto u = rounded<In>(draw(btd, id)), dl = rounded<In>(draw(btd, [](double x) { return std::log1p(std::exp(x - 1)); }));
  const auto A = rounded<float>(draw((size_t)D * N, [](double x) { return -std::exp(0.5 * x); }));
  const auto B = rounded<In>(draw(btn, id)), C = rounded<In>(draw(btn, id));
  const auto h0 = rounded<float>(draw(bdn, [](double x) { return 0.5 * x; }));
  const auto dy = rounded<In>(draw(btd, id));
  const auto dh = rounded<float>(draw(bdn, id));
  const Outputs ref = reference(Bs, T, D, N, widened(u), widened(dl), widened(A), widened(B), widened(C), widened(h0),
                                widened(dy), widened(dh));
  const Outputs got = run_kernels<In, N>(Bs, T, D, segments, u, dl, A, B, C, h0, dy, dh);
  const char* names[] = {"y", "h_final", "du", "ddelta", "dA", "dB", "dC", "dh0"};
  const std::vector<double>* g[] = {&got.y, &got.h_final, &got.du, &got.ddelta, &got.dA, &got.dB, &got.dC, &got.dh0};
  const std::vector<double>* w[] = {&ref.y, &ref.h_final, &ref.du, &ref.ddelta, &ref.dA, &ref.dB, &ref.dC, &ref.dh0};
  std::string line;
  for (int i = 0; i < 8; ++i) {
    const double e = carry_emu::rel_err(*g[i], *w[i]);
    EXPECT_LE(e, bound) << names[i] << " N " << N << " D " << D << " segments " << segments;
    char buf[48];
    std::snprintf(buf, sizeof buf, " %s %.1e", names[i], e);
    line += buf;
  }
  std::printf("[ errors   ] %s N=%d D=%d segments %d:%s\n", sizeof(In) == 2 ? "bf16" : "fp32", N, D, segments,
              line.c_str());
}

TEST(SelectiveScanEmulation, Fp32MatchesTheTokenRecurrence) {
  check<float, 4>(3, 1e-5);
  check<float, 8>(3, 1e-5);
  check<float, 16>(1, 1e-5);
  check<float, 16>(3, 1e-5);
  check<float, 16>(3, 1e-5, 70);
  check<float, 4>(1, 1e-5, 70);
}

TEST(SelectiveScanEmulation, Bf16MatchesTheTokenRecurrence) {
  check<__nv_bfloat16, 16>(3, 1e-2);
  check<__nv_bfloat16, 8>(2, 1e-2, 70);
}

}  // namespace
