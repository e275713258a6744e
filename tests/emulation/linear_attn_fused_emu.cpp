// Linear attention's fused kernels (layers/kernels/decay/fused.cuh) run on the CPU through the warp
// emulation (warp_emulation.h), so the kernels' tiling, fragment and segment indexing are checked on
// every build, GPU or not: o, dq, dk, dv, the final state and the initial state's gradient against the
// token recurrence in double, with an initial state and a final-state gradient, B = 2 sequences of 256
// tokens (4 chunks) in 1 and 2 segments, outputs poisoned (NaN) first. bf16 products: relative max error
// ≤ 1e-2 for the bf16 outputs (3–4e-3 measured), ≤ 1e-5 for the fp32 states. The same with a scalar decay
// (the kernels' G = true path: simple GLA / RetNet / Mamba-2's core) and the decay's gradient, from log
// decays of half-lives from about 1 to 7000 tokens and from a fifth of a token (B = 2 sequences of 192
// tokens, H = 2, 1 and 3 segments); there the states too are held to 1e-2 (K and Q times their decays are rounded to bf16
// before the state products). The GPU tests of the same kernels
// (tests/layers/kernels/decay/fused_test.cpp) check them against the chunkwise forms.
#include "tests/emulation/warp_emulation.h"

#include "layers/kernels/decay/fused.cuh"
#include "tests/emulation/compare.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace {

using carry::kernels::decay::fused::bf16;

struct Data {
  int B, T, H;
  std::vector<bf16> q, k, v, dO;
  std::vector<float> S0, dSf, g;  // g: the log decay a token [B·T][H] (empty: none)
};

Data make(int B, int T, int H, uint64_t seed, double max_decay = 0) {
  Data x{B, T, H, {}, {}, {}, {}, {}, {}, {}};
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
  if (max_decay > 0) {  // −g log-uniform in [1e-4, max_decay]
    x.g.resize((size_t)B * T * H);
    const float lo = std::log(1e-4f), hi = std::log((float)max_decay);
    for (auto& e : x.g) e = -std::exp(lo + (0.5f * rnd() + 0.5f) * (hi - lo));
  }
  return x;
}

struct Ref {
  std::vector<double> o, dq, dk, dv, Sf, dS0, dg;
};

// S_t = a_t·S_{t−1} + k_t v_tᵀ (a_t = e^{g_t}, 1 without a decay), o_t = scale·q_tᵀS_t; dq_t = scale·S_t do_t;
// D_t = a_{t+1}·D_{t+1} + scale·q_t do_tᵀ (a_{t+1}·D_{t+1} after the last token: the final state's gradient),
// dk_t = D_t v_t, dv_t = D_tᵀ k_t, dS0 = a_0·D_0, dg_t = a_t·⟨D_t, S_{t−1}⟩.
Ref reference(const Data& x, float scale) {
  const size_t n = x.q.size();
  Ref R{std::vector<double>(n), std::vector<double>(n), std::vector<double>(n), std::vector<double>(n),
        std::vector<double>(x.S0.size()), std::vector<double>(x.S0.size()), std::vector<double>(x.g.size())};
  auto f = [](bf16 a) { return (double)__bfloat162float(a); };
  for (int bh = 0; bh < x.B * x.H; ++bh) {
    const int b = bh / x.H, h = bh % x.H;
    auto row = [&](int t) { return ((size_t)(b * x.T + t) * x.H + h) * 128; };
    auto a = [&](int t) { return x.g.empty() ? 1.0 : std::exp((double)x.g[(size_t)(b * x.T + t) * x.H + h]); };
    std::vector<double> S(x.S0.begin() + bh * 16384, x.S0.begin() + (bh + 1) * 16384);
    std::vector<std::vector<double>> before(x.T);  // S_{t−1}
    for (int t = 0; t < x.T; ++t) {
      const size_t r = row(t);
      before[t] = S;
      for (int d = 0; d < 128; ++d)
        for (int e = 0; e < 128; ++e) S[d * 128 + e] = a(t) * S[d * 128 + e] + f(x.k[r + d]) * f(x.v[r + e]);
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
      const double next = t + 1 < x.T ? a(t + 1) : 1.0;
      for (int d = 0; d < 128; ++d)
        for (int e = 0; e < 128; ++e) D[d * 128 + e] = next * D[d * 128 + e] + scale * f(x.q[r + d]) * f(x.dO[r + e]);
      if (!x.g.empty()) {
        double dot = 0;
        for (int i = 0; i < 16384; ++i) dot += D[i] * before[t][i];
        R.dg[(size_t)(b * x.T + t) * x.H + h] = a(t) * dot;
      }
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
    for (int i = 0; i < 16384; ++i) R.dS0[bh * 16384 + i] = a(0) * D[i];
  }
  return R;
}

using carry_emu::rel_err;
std::vector<float> to_float(const std::vector<bf16>& x) {
  std::vector<float> f(x.size());
  for (size_t i = 0; i < x.size(); ++i) f[i] = __bfloat162float(x[i]);
  return f;
}

// The kernels' forward and backward on x in NS segments (with x.g: the G path, then the decay's gradient
// from the per-token sums as the op forms it), every output checked against R.
void check_kernels(const Data& x, const Ref& R, int NS, float scale, const char* what) {
  const int B = x.B, T = x.T, H = x.H, BH = B * H;
  const size_t n = x.q.size(), ns = x.S0.size();
  const int scan_blocks = (int)((ns + 255) / 256);
  const bool G = !x.g.empty();
  const bf16 nan = __ushort_as_bfloat16((unsigned short)0xFFFF);
  std::vector<bf16> o(n, nan), dq(n, nan), dk(n, nan), dv(n, nan);
  std::vector<float> Sin(NS * ns), Dout(NS * ns), Sfin(ns), dS0(ns), gam(NS * BH), gb(x.g.size());
  std::vector<float> dgq(x.g.size(), 0.f), dgk(x.g.size(), 0.f);
  for (int b = 0; b < B; ++b)  // the log decay summed within each chunk, as the op forms it
    for (int h = 0; h < H; ++h) {
      float acc = 0.f;
      for (int t = 0; t < (G ? T : 0); ++t) {
        const size_t i = (size_t)(b * T + t) * H + h;
        acc = t % carry::kernels::decay::fused::C == 0 ? x.g[i] : acc + x.g[i];
        gb[i] = acc;
      }
    }
  using namespace carry::kernels::decay::fused;
  const float* g = G ? gb.data() : nullptr;
  float* Gam = G ? gam.data() : nullptr;
  constexpr int gate = kGateBytes;
  if (G) {
    carry_emu::launch(2, NS, BH, 128, 49152 + gate,
                      [&] { seg_sum<true>(x.k.data(), x.v.data(), Sin.data(), T, B, H, 128, NS, g, Gam); });
  } else {
    carry_emu::launch(2, NS, BH, 128, 49152, [&] { seg_sum(x.k.data(), x.v.data(), Sin.data(), T, B, H, 128, NS); });
  }
  carry_emu::launch(scan_blocks, 1, 1, 256, 0, [&] { seg_scan(Sin.data(), x.S0.data(), Sfin.data(), BH, 128, NS, Gam); });
  carry_emu::launch(2, NS, BH, 128, 2 * 40960 + 16384 + gate, [&] {
    if (G) fused<true>(x.q.data(), x.k.data(), x.v.data(), Sin.data(), o.data(), scale, T, B, H, 128, NS, g);
    else fused(x.q.data(), x.k.data(), x.v.data(), Sin.data(), o.data(), scale, T, B, H, 128, NS);
  });
  carry_emu::launch(NS, BH, 1, 256, 65536 + gate, [&] {
    if (G) seg_sum_full<true>(x.q.data(), x.dO.data(), Dout.data(), T, B, H, NS, g);
    else seg_sum_full(x.q.data(), x.dO.data(), Dout.data(), T, B, H, NS);
  });
  carry_emu::launch(scan_blocks, 1, 1, 256, 0,
                    [&] { seg_scan_rev(Dout.data(), x.dSf.data(), dS0.data(), scale, BH, NS, Gam); });
  carry_emu::launch(NS, BH, 1, 256, 2 * 65536 + 32768 + gate, [&] {
    if (G)
      bwd_dq<true>(x.k.data(), x.v.data(), x.dO.data(), Sin.data(), dq.data(), scale, T, B, H, NS, x.q.data(), g,
                   dgq.data());
    else bwd_dq(x.k.data(), x.v.data(), x.dO.data(), Sin.data(), dq.data(), scale, T, B, H, NS);
  });
  carry_emu::launch(NS, BH, 1, 256, 2 * 65536 + 32768 + gate, [&] {
    if (G)
      bwd_dkdv<true>(x.q.data(), x.k.data(), x.v.data(), x.dO.data(), Dout.data(), dk.data(), dv.data(), scale, T, B,
                     H, NS, g, dgk.data());
    else
      bwd_dkdv(x.q.data(), x.k.data(), x.v.data(), x.dO.data(), Dout.data(), dk.data(), dv.data(), scale, T, B, H, NS);
  });
  const std::string where = std::string(what) + ", segments " + std::to_string(NS);
  EXPECT_LE(rel_err(to_float(o), R.o), 1e-2) << where << ": o";
  EXPECT_LE(rel_err(to_float(dq), R.dq), 1e-2) << where << ": dq";
  EXPECT_LE(rel_err(to_float(dk), R.dk), 1e-2) << where << ": dk";
  EXPECT_LE(rel_err(to_float(dv), R.dv), 1e-2) << where << ": dv";
  // Without a decay the states sum bf16 products exactly in fp32; with one, each chunk's K (Q in the
  // backward) times its decay is rounded to bf16 first, so the states carry bf16 rounding (1.8e-3 measured).
  const double state_bound = G ? 1e-2 : 1e-5;
  EXPECT_LE(rel_err(Sfin, R.Sf), state_bound) << where << ": final state";
  EXPECT_LE(rel_err(dS0, R.dS0), state_bound) << where << ": initial state's gradient";
  double e_dg = 0;
  if (G) {
    // dG_t = ⟨q_t, dq_t⟩ − ⟨k_t, dk_t⟩, plus ⟨dS_T, S_T⟩ at the last token; dg = its sum from t to the end.
    std::vector<double> dg(x.g.size());
    for (int bh = 0; bh < BH; ++bh) {
      const int b = bh / H, h = bh % H;
      double fin = 0, acc = 0;
      for (int i = 0; i < 16384; ++i) fin += (double)x.dSf[bh * 16384 + i] * Sfin[bh * 16384 + i];
      for (int t = T - 1; t >= 0; --t) {
        const size_t i = (size_t)(b * T + t) * H + h;
        acc += (double)dgq[i] - dgk[i] + (t == T - 1 ? fin : 0.0);
        dg[i] = acc;
      }
    }
    e_dg = rel_err(dg, R.dg);
    EXPECT_LE(e_dg, 1e-2) << where << ": dg";
  }
  char dg_text[32] = "";
  if (G) std::snprintf(dg_text, sizeof dg_text, " dg %.1e", e_dg);
  std::printf("[ errors   ] emulated fused %s: o %.1e dq %.1e dk %.1e dv %.1e final %.1e dS0 %.1e%s\n",
              where.c_str(), rel_err(to_float(o), R.o), rel_err(to_float(dq), R.dq), rel_err(to_float(dk), R.dk),
              rel_err(to_float(dv), R.dv), rel_err(Sfin, R.Sf), rel_err(dS0, R.dS0),
              dg_text);
}

TEST(LinearAttnFusedEmulated, MatchesTheTokenRecurrence) {
  const float scale = 1.f / std::sqrt(128.f);
  const Data x = make(2, 256, 1, 12345);
  const Ref R = reference(x, scale);
  for (int NS : {1, 2}) check_kernels(x, R, NS, scale, "linear attention");
}

// Two sequences of two heads (the decay's and the segments' indexing by batch row and head), 3 chunks: in
// one segment (the decay carried from chunk to chunk inside a walk) and in three (across the scans); log
// decays up to 0.7 a token and up to 3 (a chunk's decay then underflows to zero in fp32).
TEST(ScalarDecayFusedEmulated, MatchesTheTokenRecurrence) {
  const float scale = 1.f / std::sqrt(128.f);
  for (double max_decay : {0.7, 3.0}) {
    const Data x = make(2, 192, 2, 777, max_decay);
    const Ref R = reference(x, scale);
    const std::string what = "scalar decay up to " + std::to_string(max_decay).substr(0, 3);
    for (int NS : {1, 3}) check_kernels(x, R, NS, scale, what.c_str());
  }
}

}  // namespace
