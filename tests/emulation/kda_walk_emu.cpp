// KDA's state walks (layers/kernels/kda/walk.cuh) run on the CPU through the warp emulation
// (warp_emulation.h), launched as walk.cu launches them (grid (DV/BV, H, B), 256 threads, the kernels'
// shared memory), against the walks written as plain loops in double on the same fp32 inputs: every
// state entering a chunk, V_new and the final state forward; every gradient of a state leaving a chunk,
// dV and the initial state's gradient in reverse; DK 64 and 128, tiles of 16 and 32 columns, DV of one and
// of several tiles; outputs poisoned (NaN) first. Max-norm relative error ≤ 1e-5. And a walk cut after its
// first chunk, continued from the state there, gives the whole walk's bits both ways.
#include "tests/emulation/warp_emulation.h"

#include "layers/kernels/kda/walk.cuh"
#include "tests/emulation/compare.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <limits>
#include <random>
#include <vector>

namespace {

namespace kw = carry::kernels::kda::walk;
constexpr int C = kw::kChunk;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Dims {
  int B, H, N, DK, DV;
  size_t chunk_k() const { return (size_t)B * H * N * C * DK; }
  size_t chunk_v() const { return (size_t)B * H * N * C * DV; }
  size_t states() const { return (size_t)B * H * N * DK * DV; }
  size_t state() const { return (size_t)B * H * DK * DV; }
};

struct Inputs {
  std::vector<float> w, u, k_out, decay, s0, q_s, d_o, dv_pre, d_final;
};

Inputs draw(const Dims& m, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> unit(0.5f, 1.0f);
  auto fill = [&](size_t n, float s) {
    std::vector<float> v(n);
    for (auto& x : v) x = s * normal(rng);
    return v;
  };
  Inputs in;
  in.w = fill(m.chunk_k(), 0.1f), in.u = fill(m.chunk_v(), 1), in.k_out = fill(m.chunk_k(), 0.1f);
  in.decay.resize((size_t)m.B * m.H * m.N * m.DK);
  for (auto& x : in.decay) x = unit(rng);
  in.s0 = fill(m.state(), 1), in.q_s = fill(m.chunk_k(), 0.1f), in.d_o = fill(m.chunk_v(), 1);
  in.dv_pre = fill(m.chunk_v(), 1), in.d_final = fill(m.state(), 1);
  return in;
}

struct Walks {
  std::vector<double> states, v_new, final_state, out_grads, dv, ds0;
};

// The walks in double, one head at a time.
Walks reference(const Dims& m, const Inputs& in) {
  Walks r;
  r.states.assign(m.states(), 0), r.out_grads = r.states;
  r.v_new.assign(m.chunk_v(), 0), r.dv = r.v_new;
  r.final_state.assign(m.state(), 0), r.ds0 = r.final_state;
  const int DK = m.DK, DV = m.DV;
  for (int bh = 0; bh < m.B * m.H; ++bh) {
    std::vector<double> S(in.s0.begin() + (size_t)bh * DK * DV, in.s0.begin() + (size_t)(bh + 1) * DK * DV);
    for (int n = 0; n < m.N; ++n) {
      const size_t ch = (size_t)bh * m.N + n;
      const float *W = &in.w[ch * C * DK], *K = &in.k_out[ch * C * DK], *U = &in.u[ch * C * DV];
      const float* dec = &in.decay[ch * DK];
      std::copy(S.begin(), S.end(), r.states.begin() + ch * DK * DV);
      std::vector<double> V(C * DV);
      for (int c = 0; c < C; ++c)
        for (int j = 0; j < DV; ++j) {
          double a = U[c * DV + j];
          for (int d = 0; d < DK; ++d) a -= (double)W[c * DK + d] * S[d * DV + j];
          V[c * DV + j] = a;
        }
      std::copy(V.begin(), V.end(), r.v_new.begin() + ch * C * DV);
      for (int d = 0; d < DK; ++d)
        for (int j = 0; j < DV; ++j) {
          double a = dec[d] * S[d * DV + j];
          for (int c = 0; c < C; ++c) a += (double)K[c * DK + d] * V[c * DV + j];
          S[d * DV + j] = a;
        }
    }
    std::copy(S.begin(), S.end(), r.final_state.begin() + (size_t)bh * DK * DV);
    std::vector<double> dS(in.d_final.begin() + (size_t)bh * DK * DV,
                           in.d_final.begin() + (size_t)(bh + 1) * DK * DV);
    for (int n = m.N - 1; n >= 0; --n) {
      const size_t ch = (size_t)bh * m.N + n;
      const float *W = &in.w[ch * C * DK], *K = &in.k_out[ch * C * DK], *Q = &in.q_s[ch * C * DK];
      const float *dO = &in.d_o[ch * C * DV], *dVp = &in.dv_pre[ch * C * DV], *dec = &in.decay[ch * DK];
      std::copy(dS.begin(), dS.end(), r.out_grads.begin() + ch * DK * DV);
      std::vector<double> dV(C * DV);
      for (int c = 0; c < C; ++c)
        for (int j = 0; j < DV; ++j) {
          double a = dVp[c * DV + j];
          for (int d = 0; d < DK; ++d) a += (double)K[c * DK + d] * dS[d * DV + j];
          dV[c * DV + j] = a;
        }
      std::copy(dV.begin(), dV.end(), r.dv.begin() + ch * C * DV);
      for (int d = 0; d < DK; ++d)
        for (int j = 0; j < DV; ++j) {
          double a = dec[d] * dS[d * DV + j];
          for (int c = 0; c < C; ++c) a += (double)Q[c * DK + d] * dO[c * DV + j] - (double)W[c * DK + d] * dV[c * DV + j];
          dS[d * DV + j] = a;
        }
    }
    std::copy(dS.begin(), dS.end(), r.ds0.begin() + (size_t)bh * DK * DV);
  }
  return r;
}

struct Run {
  std::vector<float> states, v_new, final_state, out_grads, dv, ds0;
};

template <int DK, int BV>
Run run_kernels(const Dims& m, const Inputs& in) {
  Run r;
  r.states.assign(m.states(), kNaN), r.out_grads = r.states;
  r.v_new.assign(m.chunk_v(), kNaN), r.dv = r.v_new;
  r.final_state.assign(m.state(), kNaN), r.ds0 = r.final_state;
  carry_emu::launch(m.DV / BV, m.H, m.B, kw::kThreads, kw::fwd_smem<DK, BV>(), [&] {
    kw::fwd_kernel<DK, BV>(in.w.data(), in.u.data(), in.k_out.data(), in.decay.data(), in.s0.data(), r.states.data(),
                           r.v_new.data(), r.final_state.data(), m.H, m.N, m.DV);
  });
  carry_emu::launch(m.DV / BV, m.H, m.B, kw::kThreads, kw::bwd_smem<DK, BV>(), [&] {
    kw::bwd_kernel<DK, BV>(in.q_s.data(), in.d_o.data(), in.w.data(), in.k_out.data(), in.decay.data(),
                           in.dv_pre.data(), in.d_final.data(), r.out_grads.data(), r.dv.data(), r.ds0.data(), m.H,
                           m.N, m.DV);
  });
  return r;
}

// The chunks [a, a + n) of every head of a [B,H,N,·] tensor with `per` floats a chunk.
std::vector<float> chunks(const std::vector<float>& x, const Dims& m, int a, int n, size_t per) {
  std::vector<float> out;
  for (int bh = 0; bh < m.B * m.H; ++bh)
    out.insert(out.end(), x.begin() + ((size_t)bh * m.N + a) * per, x.begin() + ((size_t)bh * m.N + a + n) * per);
  return out;
}

template <int DK, int BV>
void check(int B, int H, int N, int DV) {
  const Dims m{B, H, N, DK, DV};
  const Inputs in = draw(m, 100 * DK + 10 * BV + DV);
  const Walks want = reference(m, in);
  const Run got = run_kernels<DK, BV>(m, in);
  const char* names[] = {"states", "v_new", "final_state", "out_grads", "dv", "ds0"};
  const std::vector<float>* g[] = {&got.states, &got.v_new, &got.final_state, &got.out_grads, &got.dv, &got.ds0};
  const std::vector<double>* w[] = {&want.states, &want.v_new, &want.final_state, &want.out_grads, &want.dv, &want.ds0};
  std::string line;
  for (int i = 0; i < 6; ++i) {
    const double e = carry_emu::rel_err(*g[i], *w[i]);
    EXPECT_LE(e, 1e-5) << names[i] << " DK " << DK << " BV " << BV << " DV " << DV;
    char buf[48];
    std::snprintf(buf, sizeof buf, " %s %.1e", names[i], e);
    line += buf;
  }
  std::printf("[ errors   ] DK=%d BV=%d DV=%d N=%d:%s\n", DK, BV, DV, N, line.c_str());
  // Cut after the first chunk.
  const Dims first{B, H, 1, DK, DV}, rest{B, H, N - 1, DK, DV};
  auto part = [&](const Inputs& x, int a, int n) {
    Inputs p;
    const size_t ck = (size_t)C * DK, cv = (size_t)C * DV;
    p.w = chunks(x.w, m, a, n, ck), p.k_out = chunks(x.k_out, m, a, n, ck), p.q_s = chunks(x.q_s, m, a, n, ck);
    p.u = chunks(x.u, m, a, n, cv), p.d_o = chunks(x.d_o, m, a, n, cv), p.dv_pre = chunks(x.dv_pre, m, a, n, cv);
    p.decay = chunks(x.decay, m, a, n, DK);
    p.s0 = x.s0, p.d_final = x.d_final;
    return p;
  };
  Inputs early = part(in, 0, 1), late = part(in, 1, N - 1);
  const Run a = run_kernels<DK, BV>(first, early);
  late.s0 = a.final_state;
  const Run b = run_kernels<DK, BV>(rest, late);
  EXPECT_EQ(b.final_state, got.final_state) << "forward cut, DK " << DK << " BV " << BV;
  early.d_final = b.ds0;
  const Run c = run_kernels<DK, BV>(first, early);
  EXPECT_EQ(c.ds0, got.ds0) << "reverse cut, DK " << DK << " BV " << BV;
}

TEST(KdaWalkEmulation, WalksMatchTheLoopsAndCutsKeepTheBits) {
  check<64, 16>(1, 2, 3, 32);
  check<64, 32>(2, 1, 3, 64);
  check<128, 16>(1, 1, 2, 16);
  check<128, 32>(1, 1, 2, 32);
}

}  // namespace
