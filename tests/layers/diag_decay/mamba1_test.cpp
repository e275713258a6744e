// Tests of layers/diag_decay/mamba1.*: mamba1_inputs plus both forms against a direct per-channel selective scan
// written with scalar loops over S6's own tensors (x, Δ, A, B, C); gradients of S6's tensors through
// the helper, chunkwise vs naive; MixerOptions::scale has no effect; bad S6 tensors are refused. The
// contract tests run for "mamba1" in mixer_test.cpp.
#include "layers/diag_decay/mamba1.h"
#include "tests/helpers/mixer_testing.h"

#include <torch/csrc/autograd/autograd.h>

#include <gtest/gtest.h>

namespace carry::testing {
namespace {

const Mixer& mamba1() { return get_mixer("mamba1"); }

struct S6 {
  Tensor x, dt, A, B, C;  // [Bt,T,D], [Bt,T,D], [D,N], [Bt,T,N], [Bt,T,N]
};

S6 random_s6(int64_t Bt, int64_t T, int64_t D, int64_t N, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto opt = at::TensorOptions().dtype(at::kDouble);
  S6 s;
  s.x = at::randn({Bt, T, D}, gen, opt);
  s.dt = at::softplus(at::randn({Bt, T, D}, gen, opt) - 1);
  s.A = -at::exp(at::randn({D, N}, gen, opt));
  s.B = at::randn({Bt, T, N}, gen, opt);
  s.C = at::randn({Bt, T, N}, gen, opt);
  return s;
}

// h[b,d,n] = exp(Δ[b,t,d] A[d,n]) h[b,d,n] + Δ[b,t,d] B[b,t,n] x[b,t,d]; y[b,t,d] = Σ_n C[b,t,n] h[b,d,n].
std::pair<Tensor, Tensor> direct_scan(const S6& s, const Tensor& h0) {
  int64_t Bt = s.x.size(0), T = s.x.size(1), D = s.x.size(2), N = s.A.size(1);
  auto y = at::zeros({Bt, T, D}, s.x.options());
  auto h = h0.clone();  // [Bt,D,N]
  auto x = s.x.accessor<double, 3>(), dt = s.dt.accessor<double, 3>(), B = s.B.accessor<double, 3>(),
       C = s.C.accessor<double, 3>();
  auto A = s.A.accessor<double, 2>();
  auto ya = y.accessor<double, 3>(), ha = h.accessor<double, 3>();
  for (int64_t b = 0; b < Bt; ++b)
    for (int64_t d = 0; d < D; ++d)
      for (int64_t t = 0; t < T; ++t) {
        double acc = 0;
        for (int64_t n = 0; n < N; ++n) {
          ha[b][d][n] = std::exp(dt[b][t][d] * A[d][n]) * ha[b][d][n] + dt[b][t][d] * B[b][t][n] * x[b][t][d];
          acc += C[b][t][n] * ha[b][d][n];
        }
        ya[b][t][d] = acc;
      }
  return {y, h};
}

TEST(Mamba1, FormsEqualDirectSelectiveScan) {
  const int64_t Bt = 2, T = 48, D = 3, N = 5;
  auto s = random_s6(Bt, T, D, N, 3);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  auto h0 = at::randn({Bt, D, N}, gen, at::TensorOptions().dtype(at::kDouble));
  auto [y, h] = direct_scan(s, h0);
  auto in = mamba1_inputs(s.x, s.dt, s.A, s.B, s.C);
  ASSERT_EQ(in.v.sizes(), (std::vector<int64_t>{Bt, T, D, 1}));
  for (double scale : {0.0, 0.37}) {  // the scale option is ignored: y = Cᵀh exactly
    MixerOptions opt;
    opt.chunk_size = 16;
    opt.scale = scale;
    for (bool chunked : {false, true}) {
      auto out = chunked ? mamba1().chunkwise(in, {h0.unsqueeze(-1)}, opt)
                         : mamba1().naive(in, {h0.unsqueeze(-1)}, opt);
      double ey = rel_err(out.o.squeeze(-1), y), eh = rel_err(out.final_state[0].squeeze(-1), h);
      std::cout << "[ errors   ] mamba1 " << (chunked ? "chunkwise" : "naive") << " scale=" << scale
                << " vs direct scan: y " << ey << " h " << eh << "\n";
      EXPECT_LE(ey, 1e-12);
      EXPECT_LE(eh, 1e-12);
    }
  }
}

// Gradients of x, Δ, A, B, C (through mamba1_inputs, C broadcast to every channel), chunkwise vs naive.
TEST(Mamba1, S6GradientsChunkwiseEqualNaive) {
  auto s = random_s6(2, 64, 4, 8, 5);
  MixerOptions opt;
  opt.chunk_size = 16;
  std::vector<std::vector<Tensor>> grads;
  std::vector<Tensor> ys;
  for (bool chunked : {false, true}) {
    std::vector<Tensor> leaves;
    for (auto* t : {&s.x, &s.dt, &s.A, &s.B, &s.C}) leaves.push_back(t->detach().clone().requires_grad_(true));
    auto in = mamba1_inputs(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4]);
    auto out = chunked ? mamba1().chunkwise(in, {}, opt) : mamba1().naive(in, {}, opt);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
    auto loss = (out.o * at::randn(out.o.sizes(), gen, out.o.options())).sum() +
                (out.final_state[0] * at::randn(out.final_state[0].sizes(), gen, out.o.options())).sum();
    grads.push_back(torch::autograd::grad({loss}, leaves));
    ys.push_back(out.o.detach());
  }
  double eg = max_rel_err(grads[1], grads[0]);
  std::cout << "[ errors   ] mamba1 S6 gradients (x, dt, A, B, C) chunkwise vs naive: " << eg
            << ", y " << rel_err(ys[1], ys[0]) << "\n";
  EXPECT_LE(eg, 1e-10);
  for (auto& g : grads[1]) EXPECT_GT(g.abs().max().item<double>(), 0);
}

TEST(Mamba1, BadS6TensorsAreRefused) {
  auto s = random_s6(2, 16, 3, 4, 7);
  expect_error([&] { mamba1_inputs(s.x, s.dt, -s.A, s.B, s.C); }, "'A'");
  expect_error([&] { mamba1_inputs(s.x, -s.dt, s.A, s.B, s.C); }, "'dt'");
  expect_error([&] { mamba1_inputs(s.x, s.dt, s.A, s.B.narrow(2, 0, 3), s.C); }, "'B'");
  expect_error([&] { mamba1_inputs(s.x, s.dt, s.A.narrow(0, 0, 2), s.B, s.C); }, "'A'");
  expect_error([&] { mamba1_inputs(s.x, s.dt, s.A, s.B, s.C.to(at::kFloat)); }, "'C'");
}

}  // namespace
}  // namespace carry::testing
