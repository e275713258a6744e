// Log-linear Gated DeltaNet's chunk-piece kernels (layers/kernels/log_linear/chunk_pieces.cuh) run on the CPU
// through the warp emulation (warp_emulation.h): the forward's P, K̃, γ and the weighted intra-chunk output
// against the chunk's math in double, and the backward's gradients of q, k, v, g, β and the level weights λ
// against central differences of the double forward along random directions (two a gradient), for the
// loss Σ o·dO + W·dW + U·dU + K̃·dK̃ + P·dP + γ·dγ. B = 1, H = 2, two chunks; dk = 64 with dv = 128 (the dv loop's
// two tiles) and dk = 128 with dv = 64. Realistic inputs: unit keys, β in (0.05, 0.95), log decays of half-lives
// from 2 to 10^5 tokens, level weights in (0.2, 1.2). The kernels take the delta rule's preparation (G, T and W)
// as its kernel writes them (fp32 G, bf16 T and W), here from the double forward. Outputs are poisoned (NaN)
// first. bf16 products: the outputs within 1e-2 of their largest entry, each directional derivative within
// 2e-2 of the gradient's norm (the size of a sum over ±1 directions of independent errors).
// The walk pieces' level-reading gradients (piece_grads.cuh): dP, dλ and the written levels' sum D of random
// states at an offset where the chunks read some levels and write others, against their sums in double.
#include "tests/emulation/warp_emulation.h"

#include "layers/kernels/log_linear/chunk_pieces.cuh"
#include "layers/kernels/log_linear/piece_grads.cuh"
#include "tests/emulation/compare.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace {

using carry::kernels::primitives::bf16;
namespace lp = carry::kernels::log_linear::pieces;
constexpr int C = 64, NL = lp::kLevels;

int level(int t, int s) {
  int x = t ^ s, l = 0;
  while (x) ++l, x >>= 1;
  return l;
}

// Inputs in the kernels' layouts: q, k [T,H,dk], v [T,H,dv], g, beta [T,H], lam [H,7,T] (B = 1).
struct In {
  int T, H, dk, dv;
  std::vector<double> q, k, v, g, beta, lam;
};
// The outputs of one chunk of every head: W, K̃, P [H,T,dk], U, o [H,T,dv], gamma [H,N]; G [H,T] and T [H,N,64,64].
struct Out {
  std::vector<double> W, Kt, P, U, o, gamma, G, Tm;
};

Out forward(const In& x) {
  const int T = x.T, H = x.H, dk = x.dk, dv = x.dv, N = T / C;
  Out r;
  r.W.assign((size_t)H * T * dk, 0), r.Kt = r.P = r.W, r.U.assign((size_t)H * T * dv, 0), r.o = r.U;
  r.gamma.assign((size_t)H * N, 0), r.G.assign((size_t)H * T, 0), r.Tm.assign((size_t)H * N * C * C, 0);
  auto Q = [&](int t, int h, int d) { return x.q[((size_t)t * H + h) * dk + d]; };
  auto K = [&](int t, int h, int d) { return x.k[((size_t)t * H + h) * dk + d]; };
  auto V = [&](int t, int h, int e) { return x.v[((size_t)t * H + h) * dv + e]; };
  for (int h = 0; h < H; ++h)
    for (int n = 0; n < N; ++n) {
      const int t0 = n * C;
      std::vector<double> G(C), b(C), Tm(C * C, 0), L(C * C, 0), A(C * C, 0);
      double acc = 0;
      for (int t = 0; t < C; ++t) {
        acc += x.g[(size_t)(t0 + t) * H + h];
        G[t] = acc;
        b[t] = x.beta[(size_t)(t0 + t) * H + h];
        r.G[(size_t)h * T + t0 + t] = acc;
      }
      for (int t = 0; t < C; ++t)
        for (int s = 0; s <= t; ++s) {
          double kk = 0, qk = 0;
          for (int d = 0; d < dk; ++d) kk += K(t0 + t, h, d) * K(t0 + s, h, d), qk += Q(t0 + t, h, d) * K(t0 + s, h, d);
          const double gm = std::exp(G[t] - G[s]);
          if (s < t) L[t * C + s] = b[t] * kk * gm;
          A[t * C + s] = qk * gm;
        }
      for (int col = 0; col < C; ++col)  // (I + L)·T = I, forward substitution
        for (int t = 0; t < C; ++t) {
          double s = t == col ? 1.0 : 0.0;
          for (int j = 0; j < t; ++j) s -= L[t * C + j] * Tm[j * C + col];
          Tm[t * C + col] = s;
        }
      std::copy(Tm.begin(), Tm.end(), r.Tm.begin() + ((size_t)h * N + n) * C * C);
      r.gamma[(size_t)h * N + n] = std::exp(G[C - 1]);
      std::vector<double> Wc(C * dk, 0), Mx(C * C, 0);
      for (int t = 0; t < C; ++t) {
        for (int d = 0; d < dk; ++d) {
          double w = 0;
          for (int s = 0; s < C; ++s) w += Tm[t * C + s] * b[s] * std::exp(G[s]) * K(t0 + s, h, d);
          Wc[t * dk + d] = w;
          r.W[((size_t)h * T + t0 + t) * dk + d] = w;
          r.Kt[((size_t)h * T + t0 + t) * dk + d] = std::exp(G[C - 1] - G[t]) * K(t0 + t, h, d);
        }
        for (int e = 0; e < dv; ++e) {
          double u = 0;
          for (int s = 0; s < C; ++s) u += Tm[t * C + s] * b[s] * V(t0 + s, h, e);
          r.U[((size_t)h * T + t0 + t) * dv + e] = u;
        }
      }
      for (int t = 0; t < C; ++t) {
        for (int d = 0; d < dk; ++d) {
          double aw = 0;
          for (int s = 0; s <= t; ++s) aw += A[t * C + s] * Wc[s * dk + d];
          r.P[((size_t)h * T + t0 + t) * dk + d] = std::exp(G[t]) * Q(t0 + t, h, d) - aw;
        }
        for (int s = 0; s <= t; ++s) {
          double m = 0;
          for (int j = s; j <= t; ++j) m += A[t * C + j] * Tm[j * C + s] * b[s];
          Mx[t * C + s] = m * x.lam[((size_t)h * NL + level(t, s)) * T + t0 + t];
        }
        for (int e = 0; e < dv; ++e) {
          double o = 0;
          for (int s = 0; s <= t; ++s) o += Mx[t * C + s] * V(t0 + s, h, e);
          r.o[((size_t)h * T + t0 + t) * dv + e] = o;
        }
      }
    }
  return r;
}

// The cotangents: dO, dU [H,T,dv], dW, dKt, dP [H,T,dk], dgamma [H,N].
struct Cot {
  std::vector<double> dO, dW, dU, dKt, dP, dgamma;
};
double loss(const In& x, const Cot& c) {
  const Out r = forward(x);
  auto dot = [](const std::vector<double>& a, const std::vector<double>& b) {
    double s = 0;
    for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
    return s;
  };
  return dot(r.o, c.dO) + dot(r.W, c.dW) + dot(r.U, c.dU) + dot(r.Kt, c.dKt) + dot(r.P, c.dP) + dot(r.gamma, c.dgamma);
}

struct Rng {
  uint64_t s;
  double uniform() {  // [0, 1)
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return (double)((s >> 40) & 0xFFFFFF) / 16777216.0;
  }
  double sym() { return 2 * uniform() - 1; }
};

double round_bf16(double x) { return (double)__bfloat162float(__float2bfloat16((float)x)); }
std::vector<bf16> to_bf16(const std::vector<double>& x) {
  std::vector<bf16> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = __float2bfloat16((float)x[i]);
  return y;
}
std::vector<float> to_f32(const std::vector<double>& x) { return std::vector<float>(x.begin(), x.end()); }

using carry_emu::rel_err;
std::vector<double> from_bf16(const std::vector<bf16>& x) {
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = __bfloat162float(x[i]);
  return y;
}

template <int DK, int DV>
void check(int H, uint64_t seed) {
  const int T = 2 * C, N = T / C;
  Rng rng{seed};
  In x{T, H, DK, DV, {}, {}, {}, {}, {}, {}};
  x.q.resize((size_t)T * H * DK), x.k.resize(x.q.size()), x.v.resize((size_t)T * H * DV);
  for (auto& e : x.q) e = round_bf16(rng.sym());
  for (size_t r = 0; r < (size_t)T * H; ++r) {  // unit keys
    double ss = 0, row[128];
    for (int d = 0; d < DK; ++d) ss += (row[d] = rng.sym()) * row[d];
    for (int d = 0; d < DK; ++d) x.k[r * DK + d] = round_bf16(row[d] / std::sqrt(ss));
  }
  for (auto& e : x.v) e = round_bf16(rng.sym());
  x.g.resize((size_t)T * H), x.beta.resize(x.g.size()), x.lam.resize((size_t)H * NL * T);
  for (auto& e : x.g) e = -std::log(2.0) / std::exp(std::log(2.0) + rng.uniform() * (std::log(1e5) - std::log(2.0)));
  for (auto& e : x.beta) e = 0.05 + 0.9 * rng.uniform();
  for (auto& e : x.lam) e = 0.2 + rng.uniform();
  Cot ct;
  auto fill = [&](std::vector<double>& v, size_t n, bool bf) {
    v.resize(n);
    for (auto& e : v) e = bf ? round_bf16(rng.sym()) : rng.sym();
  };
  fill(ct.dO, (size_t)H * T * DV, true), fill(ct.dU, (size_t)H * T * DV, true);
  fill(ct.dW, (size_t)H * T * DK, true), fill(ct.dKt, (size_t)H * T * DK, true), fill(ct.dP, (size_t)H * T * DK, true);
  fill(ct.dgamma, (size_t)H * N, false);
  for (auto& e : ct.dgamma) e = (double)(float)e;

  const Out R = forward(x);
  const auto q = to_bf16(x.q), k = to_bf16(x.k), v = to_bf16(x.v), Tm = to_bf16(R.Tm), W = to_bf16(R.W);
  const auto G = to_f32(R.G), beta = to_f32(x.beta), lam = to_f32(x.lam);
  const auto dO = to_bf16(ct.dO), dU = to_bf16(ct.dU), dW = to_bf16(ct.dW), dKt = to_bf16(ct.dKt), dP = to_bf16(ct.dP);
  const auto dgamma = to_f32(ct.dgamma);
  const bf16 nan = __ushort_as_bfloat16((unsigned short)0xFFFF);
  const float fnan = NAN;
  std::vector<bf16> P((size_t)H * T * DK, nan), Kt(P.size(), nan);
  std::vector<float> gamma((size_t)H * N, fnan), o((size_t)H * T * DV, fnan);
  carry_emu::launch(N, H, 1, lp::NT, lp::FwdSmem<DK>::bytes, [&] {
    lp::fwd_kernel<DK, DV>(q.data(), k.data(), v.data(), G.data(), beta.data(), Tm.data(), W.data(), lam.data(),
                           P.data(), Kt.data(), gamma.data(), o.data(), T, H);
  });
  const std::string where = "dk " + std::to_string(DK) + ", dv " + std::to_string(DV);
  EXPECT_LE(rel_err(from_bf16(P), R.P), 1e-2) << where << ": P";
  EXPECT_LE(rel_err(from_bf16(Kt), R.Kt), 1e-2) << where << ": K̃";
  EXPECT_LE(rel_err(gamma, R.gamma), 1e-6) << where << ": gamma";
  EXPECT_LE(rel_err(o, R.o), 1e-2) << where << ": o";

  std::vector<float> dq(x.q.size(), fnan), dk(x.k.size(), fnan), dv(x.v.size(), fnan), dg(x.g.size(), fnan),
      db(x.beta.size(), fnan), dl(x.lam.size(), fnan);
  carry_emu::launch(N, H, 1, lp::NT, lp::BwdSmem<DK>::bytes, [&] {
    lp::bwd_kernel<DK, DV>(q.data(), k.data(), v.data(), G.data(), beta.data(), Tm.data(), W.data(), lam.data(),
                           dO.data(), dW.data(), dU.data(), dKt.data(), dP.data(), dgamma.data(), dq.data(), dk.data(),
                           dv.data(), dg.data(), db.data(), dl.data(), T, H);
  });
  struct Grad {
    const char* name;
    std::vector<double>* input;
    const std::vector<float>* grad;
    double step;
  };
  const Grad grads[] = {{"q", &x.q, &dq, 1e-4}, {"k", &x.k, &dk, 1e-4}, {"v", &x.v, &dv, 1e-4},
                        {"g", &x.g, &dg, 1e-6},  {"beta", &x.beta, &db, 1e-5}, {"lam", &x.lam, &dl, 1e-4}};
  for (const Grad& gr : grads) {
    double norm = 0;
    bool finite = true;
    for (float e : *gr.grad) norm += (double)e * e, finite = finite && std::isfinite(e);
    EXPECT_TRUE(finite) << where << ": d" << gr.name << " has NaN (unwritten?)";
    for (int rep = 0; rep < 2; ++rep) {
      std::vector<double> dir(gr.input->size());
      for (auto& e : dir) e = rng.uniform() < 0.5 ? -1.0 : 1.0;
      double kernel_dir = 0;
      for (size_t i = 0; i < dir.size(); ++i) kernel_dir += (double)(*gr.grad)[i] * dir[i];
      const std::vector<double> at = *gr.input;
      for (size_t i = 0; i < dir.size(); ++i) (*gr.input)[i] = at[i] + gr.step * dir[i];
      const double up = loss(x, ct);
      for (size_t i = 0; i < dir.size(); ++i) (*gr.input)[i] = at[i] - gr.step * dir[i];
      const double down = loss(x, ct);
      *gr.input = at;
      const double fd = (up - down) / (2 * gr.step), scale = std::sqrt(norm);
      EXPECT_LE(std::fabs(kernel_dir - fd), 2e-2 * scale)
          << where << ": d" << gr.name << " along a random direction: kernel " << kernel_dir << ", differences " << fd;
      std::cout << "[ errors   ] " << where << ": d" << gr.name << " " << std::fabs(kernel_dir - fd) / scale << "\n";
    }
  }
}

TEST(LogLinearChunkPiecesEmulated, ForwardAndBackwardMatchTheChunkMath) {
  check<64, 128>(2, 7);
  check<128, 64>(2, 11);
}

template <int DK, int DV>
void check_piece_grads(uint64_t seed) {
  namespace gr = carry::kernels::log_linear::grads;
  const int BH = 2, N = 3, J = 4, T = N * C, first = 7;
  const long offset = 64 * 5;  // chunks at 320, 384, 448: levels 7..10 read where bit level − 1 is set
  Rng rng{seed};
  auto rand_bf = [&](size_t n) {
    std::vector<double> x(n);
    for (auto& e : x) e = round_bf16(rng.sym());
    return x;
  };
  const auto St = rand_bf((size_t)BH * N * J * DV * DK), dSt = rand_bf(St.size());
  const auto dO = rand_bf((size_t)BH * T * DV), P = rand_bf((size_t)BH * T * DK);
  std::vector<double> lam((size_t)BH * J * T);
  for (auto& e : lam) e = (double)(float)(0.2 + rng.uniform());
  std::vector<double> dP((size_t)BH * T * DK, 0), dl(lam.size(), 0), D((size_t)BH * N * DV * DK, 0);
  auto reads = [&](int n, int j) { return ((offset + 64 * n) >> (first + j - 1)) & 1; };
  for (int bh = 0; bh < BH; ++bh)
    for (int n = 0; n < N; ++n)
      for (int j = 0; j < J; ++j) {
        const double* S = St.data() + (((size_t)bh * N + n) * J + j) * DV * DK;
        if (!reads(n, j)) {
          const double* dS = dSt.data() + (((size_t)bh * N + n) * J + j) * DV * DK;
          for (int i = 0; i < DV * DK; ++i) D[((size_t)bh * N + n) * DV * DK + i] += dS[i];
          continue;
        }
        for (int t = 0; t < C; ++t) {
          const size_t row = (size_t)bh * T + n * C + t;
          double dot = 0;
          const double l = lam[((size_t)bh * J + j) * T + n * C + t];
          for (int b = 0; b < DK; ++b) {
            double z = 0;
            for (int e = 0; e < DV; ++e) z += dO[row * DV + e] * S[e * DK + b];
            dot += z * P[row * DK + b];
            dP[row * DK + b] += l * z;
          }
          dl[((size_t)bh * J + j) * T + n * C + t] = dot;
        }
      }
  const auto Sb = to_bf16(St), dSb = to_bf16(dSt), dOb = to_bf16(dO), Pb = to_bf16(P);
  const auto lamf = to_f32(lam);
  std::vector<float> kdP(dP.size(), NAN), kdl(dl.size(), NAN);
  std::vector<bf16> kD(D.size(), __ushort_as_bfloat16((unsigned short)0xFFFF));
  carry_emu::launch(N, BH, 1, gr::NT, gr::ReadSmem<DK, DV>::bytes, [&] {
    gr::read_grads_kernel<DK, DV>(Sb.data(), dOb.data(), Pb.data(), lamf.data(), kdP.data(), kdl.data(), T, J, offset,
                                  first);
  });
  const long E = (long)DV * DK;
  carry_emu::launch((int)(E / (8 * gr::NT)), N, BH, gr::NT, 0,
                    [&] { gr::write_sum_kernel(dSb.data(), kD.data(), N, J, E, offset, first); });
  const std::string where = "piece grads, dk " + std::to_string(DK) + ", dv " + std::to_string(DV);
  EXPECT_LE(rel_err(kdP, dP), 1e-5) << where << ": dP";
  EXPECT_LE(rel_err(kdl, dl), 1e-5) << where << ": dlam";
  EXPECT_LE(rel_err(from_bf16(kD), D), 1e-2) << where << ": D";
}

TEST(LogLinearChunkPiecesEmulated, LevelReadingGradientsAndWrittenSumMatchTheirSums) {
  check_piece_grads<64, 128>(3);
  check_piece_grads<128, 64>(5);
}

}  // namespace
