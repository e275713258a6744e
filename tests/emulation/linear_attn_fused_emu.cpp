// Linear attention's fused kernels (layers/linear_attn/kernel_fused.cuh) run on the CPU through the warp
// emulation (warp_emulation.h), so the kernels' tiling, fragment and segment indexing are checked on
// every build, GPU or not: o, dq, dk, dv, the final state and the initial state's gradient against the
// token recurrence in double, with an initial state and a final-state gradient, B = 2 sequences of 256
// tokens (4 chunks) in 1 and 2 segments, outputs poisoned (NaN) first. bf16 products: relative max error
// ≤ 1e-2 for the bf16 outputs (3–4e-3 measured), ≤ 1e-5 for the fp32 states. The GPU test of the same
// kernels (tests/layers/linear_attn/fused_kernel_test.cpp) checks them against the chunkwise form.
#include "tests/emulation/warp_emulation.h"

#include "layers/linear_attn/kernel_fused.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace {

using carry_la::bf16;

struct Data {
  int B, T, H;
  std::vector<bf16> q, k, v, dO;
  std::vector<float> S0, dSf;
};

Data make(int B, int T, int H, uint64_t seed) {
  Data x{B, T, H, {}, {}, {}, {}, {}, {}};
  const size_t n = (size_t)B * T * H * 128, ns = (size_t)B * H * 128 * 128;
  uint64_t st = seed;
  auto rnd = [&] {  // uniform in [-1, 1)
    st = st * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((st >> 40) & 0xFFFFFF) / 8388608.f - 1.f;
  };
  x.q.resize(n), x.k.resize(n), x.v.resize(n), x.dO.resize(n), x.S0.resize(ns), x.dSf.resize(ns);
  for (auto& e : x.q) e = __float2bfloat16(rnd());
  for (size_t t = 0; t < n / 128; ++t) {  // k rows of unit norm
    float r[128], ss = 0.f;
    for (int d = 0; d < 128; ++d) ss += (r[d] = rnd()) * r[d];
    for (int d = 0; d < 128; ++d) x.k[t * 128 + d] = __float2bfloat16(r[d] / std::sqrt(ss));
  }
  for (auto& e : x.v) e = __float2bfloat16(rnd());
  for (auto& e : x.dO) e = __float2bfloat16(rnd());
  for (auto& e : x.S0) e = 0.5f * rnd();
  for (auto& e : x.dSf) e = 0.5f * rnd();
  return x;
}

struct Ref {
  std::vector<double> o, dq, dk, dv, Sf, dS0;
};

// S_t = S_{t−1} + k_t v_tᵀ, o_t = scale·q_tᵀS_t; dq_t = scale·S_t do_t; D_t = D_{t+1} + scale·q_t do_tᵀ
// (D after the last token: the final state's gradient), dk_t = D_t v_t, dv_t = D_tᵀ k_t, dS0 = D_0.
Ref reference(const Data& x, float scale) {
  const size_t n = x.q.size();
  Ref R{std::vector<double>(n), std::vector<double>(n), std::vector<double>(n), std::vector<double>(n),
        std::vector<double>(x.S0.size()), std::vector<double>(x.S0.size())};
  auto f = [](bf16 a) { return (double)__bfloat162float(a); };
  for (int bh = 0; bh < x.B * x.H; ++bh) {
    const int b = bh / x.H, h = bh % x.H;
    auto row = [&](int t) { return ((size_t)(b * x.T + t) * x.H + h) * 128; };
    std::vector<double> S(x.S0.begin() + bh * 16384, x.S0.begin() + (bh + 1) * 16384);
    for (int t = 0; t < x.T; ++t) {
      const size_t r = row(t);
      for (int d = 0; d < 128; ++d)
        for (int e = 0; e < 128; ++e) S[d * 128 + e] += f(x.k[r + d]) * f(x.v[r + e]);
      for (int e = 0; e < 128; ++e) {
        double a = 0;
        for (int d = 0; d < 128; ++d) a += f(x.q[r + d]) * S[d * 128 + e];
        R.o[r + e] = scale * a;
      }
      for (int d = 0; d < 128; ++d) {
        double a = 0;
        for (int e = 0; e < 128; ++e) a += S[d * 128 + e] * f(x.dO[r + e]);
        R.dq[r + d] = scale * a;
      }
    }
    std::copy(S.begin(), S.end(), R.Sf.begin() + bh * 16384);
    std::vector<double> D(x.dSf.begin() + bh * 16384, x.dSf.begin() + (bh + 1) * 16384);
    for (int t = x.T - 1; t >= 0; --t) {
      const size_t r = row(t);
      for (int d = 0; d < 128; ++d)
        for (int e = 0; e < 128; ++e) D[d * 128 + e] += scale * f(x.q[r + d]) * f(x.dO[r + e]);
      for (int d = 0; d < 128; ++d) {
        double a = 0;
        for (int e = 0; e < 128; ++e) a += D[d * 128 + e] * f(x.v[r + e]);
        R.dk[r + d] = a;
      }
      for (int e = 0; e < 128; ++e) {
        double a = 0;
        for (int d = 0; d < 128; ++d) a += D[d * 128 + e] * f(x.k[r + d]);
        R.dv[r + e] = a;
      }
    }
    std::copy(D.begin(), D.end(), R.dS0.begin() + bh * 16384);
  }
  return R;
}

// max |x − ref| / max |ref|; NaN counts as an error of infinity.
template <class T>
double rel_err(const std::vector<T>& x, const std::vector<double>& ref) {
  double e = 0, m = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double xi = (double)x[i], d = std::fabs(xi - ref[i]);
    m = std::max(m, std::fabs(ref[i]));
    e = std::isnan(d) ? INFINITY : std::max(e, d);
    if (std::isinf(e)) break;
  }
  return e / m;
}
std::vector<float> to_float(const std::vector<bf16>& x) {
  std::vector<float> f(x.size());
  for (size_t i = 0; i < x.size(); ++i) f[i] = __bfloat162float(x[i]);
  return f;
}

TEST(LinearAttnFusedEmulated, MatchesTheTokenRecurrence) {
  const int B = 2, T = 256, H = 1, BH = B * H;
  const float scale = 1.f / std::sqrt(128.f);
  const Data x = make(B, T, H, 12345);
  const Ref R = reference(x, scale);
  const size_t n = x.q.size(), ns = x.S0.size();
  const int scan_blocks = (int)((ns + 255) / 256);
  for (int NS : {1, 2}) {
    const bf16 nan = __ushort_as_bfloat16((unsigned short)0xFFFF);
    std::vector<bf16> o(n, nan), dq(n, nan), dk(n, nan), dv(n, nan);
    std::vector<float> Sin(NS * ns), Dout(NS * ns), Sfin(ns), dS0(ns);
    using namespace carry_la;
    carry_emu::launch(2, NS, BH, 128, 49152, [&] { seg_sum(x.k.data(), x.v.data(), Sin.data(), T, B, H, 128, NS); });
    carry_emu::launch(scan_blocks, 1, 1, 256, 0, [&] { seg_scan(Sin.data(), x.S0.data(), Sfin.data(), BH, 128, NS); });
    carry_emu::launch(2, NS, BH, 128, 2 * 40960 + 16384, [&] {
      fused(x.q.data(), x.k.data(), x.v.data(), Sin.data(), o.data(), scale, T, B, H, 128, NS);
    });
    carry_emu::launch(NS, BH, 1, 256, 65536, [&] { seg_sum_full(x.q.data(), x.dO.data(), Dout.data(), T, B, H, NS); });
    carry_emu::launch(scan_blocks, 1, 1, 256, 0,
                      [&] { seg_scan_rev(Dout.data(), x.dSf.data(), dS0.data(), scale, BH, NS); });
    carry_emu::launch(NS, BH, 1, 256, 2 * 49152 + 32768, [&] {
      bwd_dq(x.k.data(), x.v.data(), x.dO.data(), Sin.data(), dq.data(), scale, T, B, H, NS);
    });
    carry_emu::launch(NS, BH, 1, 256, 2 * 65536 + 32768, [&] {
      bwd_dkdv(x.q.data(), x.k.data(), x.v.data(), x.dO.data(), Dout.data(), dk.data(), dv.data(), scale, T, B, H, NS);
    });
    const std::string where = "segments " + std::to_string(NS);
    EXPECT_LE(rel_err(to_float(o), R.o), 1e-2) << where << ": o";
    EXPECT_LE(rel_err(to_float(dq), R.dq), 1e-2) << where << ": dq";
    EXPECT_LE(rel_err(to_float(dk), R.dk), 1e-2) << where << ": dk";
    EXPECT_LE(rel_err(to_float(dv), R.dv), 1e-2) << where << ": dv";
    EXPECT_LE(rel_err(Sfin, R.Sf), 1e-5) << where << ": final state";
    EXPECT_LE(rel_err(dS0, R.dS0), 1e-5) << where << ": initial state's gradient";
    std::printf("[ errors   ] emulated fused linear attention, %s: o %.1e dq %.1e dk %.1e dv %.1e final %.1e dS0 %.1e\n",
                where.c_str(), rel_err(to_float(o), R.o), rel_err(to_float(dq), R.dq), rel_err(to_float(dk), R.dk),
                rel_err(to_float(dv), R.dv), rel_err(Sfin, R.Sf), rel_err(dS0, R.dS0));
  }
}

}  // namespace
