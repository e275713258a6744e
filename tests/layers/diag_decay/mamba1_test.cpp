// Tests of layers/diag_decay/mamba1.*: mamba1_inputs plus both forms against a direct per-channel selective scan
// written with scalar loops over S6's own tensors (x, Δ, A, B, C); the compact inputs (q = C and k = B with
// one shared head, v = Δ⊙x, g = Δ, decay_rate = A) against GLA's dense view of S6 (q = C on every channel,
// k = Δ·B, v = x, gk = Δ·A), outputs, final states and gradients; gradients of S6's tensors and h0 through
// the helper, chunkwise vs naive; slicing keeps decay_rate; MixerOptions::scale has no effect; bad S6
// tensors and a decay_rate of the wrong shape are refused. The contract tests run for "mamba1" in
// mixer_test.cpp. On a GPU the kernel form (the selective-scan kernels) against the naive form, and its
// serial_states cuts bit for bit.
#include "layers/diag_decay/mamba1.h"
#include "layers/core/device.h"
#include "tests/helpers/mixer_testing.h"

#include <torch/csrc/autograd/autograd.h>

#include <cstdio>
#include <functional>

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

// Σ o·w + Σ h·w' and its gradients with respect to x, Δ, A, B, C and h0, `run` mapping leaves of those
// (h0 [Bt,D,N,1]) to the mixer's output.
struct S6Run {
  std::vector<Tensor> outputs;  // o, h
  std::vector<Tensor> grads;    // x, dt, A, B, C, h0
};
S6Run differentiate(const S6& s, const Tensor& h0,
                    const std::function<MixerOutput(const std::vector<Tensor>&, const State&)>& run) {
  std::vector<Tensor> leaves;
  for (auto* t : {&s.x, &s.dt, &s.A, &s.B, &s.C, &h0}) leaves.push_back(t->detach().clone().requires_grad_(true));
  auto out = run(leaves, {leaves[5]});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  auto loss = (out.o * at::randn(out.o.sizes(), gen, out.o.options())).sum() +
              (out.final_state[0] * at::randn(out.final_state[0].sizes(), gen, out.o.options())).sum();
  return {{out.o.detach(), out.final_state[0].detach()}, torch::autograd::grad({loss}, leaves)};
}

// Gradients of x, Δ, A, B, C and h0 (through mamba1_inputs: C and B shared by every channel), chunkwise vs
// naive, with realistic Δ (softplus of a normal, never zero) and A < 0.
TEST(Mamba1, S6GradientsChunkwiseEqualNaive) {
  auto s = random_s6(2, 64, 4, 8, 5);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
  auto h0 = at::randn({2, 4, 8, 1}, gen, at::TensorOptions().dtype(at::kDouble));
  MixerOptions opt;
  opt.chunk_size = 16;
  std::vector<S6Run> runs;
  for (bool chunked : {false, true})
    runs.push_back(differentiate(s, h0, [&](const std::vector<Tensor>& l, const State& init) {
      auto in = mamba1_inputs(l[0], l[1], l[2], l[3], l[4]);
      return chunked ? mamba1().chunkwise(in, init, opt) : mamba1().naive(in, init, opt);
    }));
  double eg = max_rel_err(runs[1].grads, runs[0].grads), eo = max_rel_err(runs[1].outputs, runs[0].outputs);
  std::cout << "[ errors   ] mamba1 S6 gradients (x, dt, A, B, C, h0) chunkwise vs naive: " << eg
            << ", outputs (y, h) " << eo << "\n";
  EXPECT_LE(eg, 1e-10);
  EXPECT_LE(eo, 1e-12);
  for (auto& g : runs[1].grads) EXPECT_GT(g.abs().max().item<double>(), 0);
}

// The compact inputs give what GLA's dense view of S6 gives (the mapping q = C expanded to every channel,
// k = Δ·B, v = x, gk = Δ·A, run by GLA's forms with scale 1): outputs, final states and the gradients of
// x, Δ, A, B, C and h0, in the naive and the chunkwise form.
TEST(Mamba1, CompactInputsEqualTheDenseMapping) {
  const int64_t Bt = 2, T = 48, D = 3, N = 5;
  auto s = random_s6(Bt, T, D, N, 11);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(12);
  auto h0 = at::randn({Bt, D, N, 1}, gen, at::TensorOptions().dtype(at::kDouble));
  const Mixer& gla = get_mixer("gla");
  MixerOptions opt;
  opt.chunk_size = 16;
  opt.scale = 1.0;
  for (bool chunked : {false, true}) {
    auto compact = differentiate(s, h0, [&](const std::vector<Tensor>& l, const State& init) {
      auto in = mamba1_inputs(l[0], l[1], l[2], l[3], l[4]);
      return chunked ? mamba1().chunkwise(in, init, opt) : mamba1().naive(in, init, opt);
    });
    auto dense = differentiate(s, h0, [&](const std::vector<Tensor>& l, const State& init) {
      MixerInputs in;
      auto dt = l[1].unsqueeze(-1);                  // [Bt,T,D,1]
      in.q = l[4].unsqueeze(2).expand({Bt, T, D, N});
      in.k = dt * l[3].unsqueeze(2);
      in.v = l[0].unsqueeze(-1);
      in.gk = dt * l[2];
      return chunked ? gla.chunkwise(in, init, opt) : gla.naive(in, init, opt);
    });
    double eo = max_rel_err(compact.outputs, dense.outputs), eg = max_rel_err(compact.grads, dense.grads);
    std::cout << "[ errors   ] mamba1 " << (chunked ? "chunkwise" : "naive")
              << " compact inputs vs the dense mapping: outputs (y, h) " << eo << ", gradients (x, dt, A, B, C, h0) "
              << eg << "\n";
    EXPECT_LE(eo, 1e-12);
    EXPECT_LE(eg, 1e-12);
    for (auto& g : compact.grads) EXPECT_GT(g.abs().max().item<double>(), 0);
  }
}

// The inputs' layout: q, k one shared head, decay_rate A itself; cutting tokens, sequences or heads leaves
// decay_rate whole where it has no such dimension and cuts its heads with the channels'.
TEST(Mamba1, CompactInputsAndTheirSlices) {
  const int64_t Bt = 2, T = 32, D = 4, N = 3;
  auto s = random_s6(Bt, T, D, N, 13);
  auto in = mamba1_inputs(s.x, s.dt, s.A, s.B, s.C);
  EXPECT_EQ(in.q.sizes(), (std::vector<int64_t>{Bt, T, 1, N}));
  EXPECT_EQ(in.k.sizes(), (std::vector<int64_t>{Bt, T, 1, N}));
  EXPECT_EQ(in.v.sizes(), (std::vector<int64_t>{Bt, T, D, 1}));
  EXPECT_EQ(in.g.sizes(), (std::vector<int64_t>{Bt, T, D}));
  EXPECT_FALSE(in.gk.defined());
  EXPECT_TRUE(in.decay_rate.is_same(s.A));
  EXPECT_EQ(in.num_heads(), D);
  auto part = in.slice(8, 16);
  EXPECT_TRUE(part.decay_rate.is_same(s.A));
  EXPECT_TRUE(at::equal(part.v, in.v.narrow(1, 8, 16)));
  EXPECT_TRUE(at::equal(part.q, in.q.narrow(1, 8, 16)));
  auto one = in.sequences(1, 1);
  EXPECT_TRUE(one.decay_rate.is_same(s.A));
  EXPECT_TRUE(at::equal(one.g, in.g.narrow(0, 1, 1)));
  auto heads = in.head_range(2, 2, D);
  EXPECT_TRUE(heads.q.is_same(in.q));
  EXPECT_TRUE(at::equal(heads.decay_rate, s.A.narrow(0, 2, 2)));
  EXPECT_TRUE(at::equal(heads.v, in.v.narrow(2, 2, 2)));
  // The heads run on their own give those heads of the whole run.
  MixerOptions opt;
  opt.chunk_size = 16;
  auto whole = mamba1().chunkwise(in, {}, opt), two = mamba1().chunkwise(heads, {}, opt);
  EXPECT_LE(rel_err(two.o, whole.o.narrow(2, 2, 2)), 1e-14);
  EXPECT_LE(rel_err(two.final_state[0], whole.final_state[0].narrow(1, 2, 2)), 1e-14);
}

TEST(Mamba1, BadS6TensorsAreRefused) {
  auto s = random_s6(2, 16, 3, 4, 7);
  expect_error([&] { mamba1_inputs(s.x, s.dt, -s.A, s.B, s.C); }, "'A'");
  expect_error([&] { mamba1_inputs(s.x, -s.dt, s.A, s.B, s.C); }, "'dt'");
  expect_error([&] { mamba1_inputs(s.x, s.dt, s.A, s.B.narrow(2, 0, 3), s.C); }, "'B'");
  expect_error([&] { mamba1_inputs(s.x, s.dt, s.A.narrow(0, 0, 2), s.B, s.C); }, "'A'");
  expect_error([&] { mamba1_inputs(s.x, s.dt, s.A, s.B, s.C.to(at::kFloat)); }, "'C'");
  // The mixer's own checks of the compact inputs: decay_rate must be [D, N], g (Δ) >= 0, decay_rate <= 0.
  auto in = mamba1_inputs(s.x, s.dt, s.A, s.B, s.C);
  MixerOptions opt;
  opt.chunk_size = 16;
  auto bad = in;
  bad.decay_rate = s.A.narrow(0, 0, 2);
  for (bool chunked : {false, true})
    expect_error([&] { chunked ? mamba1().chunkwise(bad, {}, opt) : mamba1().naive(bad, {}, opt); },
                 "mamba1: 'decay_rate' (a rate for each head of 'v' and key dimension) must have shape [3, 4], got [2, 4]");
  bad = in;
  bad.q = in.q.expand({2, 16, 3, 4});  // q of every channel: the family reads one shared head
  expect_error([&] { mamba1().chunkwise(bad, {}, opt); }, "'q' (H = 3, the heads of 'v') must have shape [2, 16, 1, 4]");
  opt.check_values = true;
  bad = in;
  bad.g = -in.g;
  expect_error([&] { mamba1().chunkwise(bad, {}, opt); }, "'g' is the step that scales decay_rate");
  bad = in;
  bad.decay_rate = -in.decay_rate;
  expect_error([&] { mamba1().naive(bad, {}, opt); }, "'decay_rate' is a log decay and must be <= 0");
  EXPECT_NO_THROW(mamba1().chunkwise(in, {}, opt));
}

// The kernel form (GPU; skips without one) against the naive form in fp32 on the same values (T need not be
// a multiple of the chunk): fp32
// inputs within 1e-4 relative, bf16 within 1e-2, for the output, the final state and the gradients of q
// (C), k (B), v (Δ⊙x), g (Δ), decay_rate (A) and the initial state, from a random initial state, with and
// without serial_states; then with serial_states a slice cut anywhere, its state passed on, gives the
// whole slice's bits.
TEST(Mamba1, KernelFormMatchesNaiveOnGpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  const Mixer& m = mamba1();
  ASSERT_TRUE(m.has_kernel());
  struct Case {
    int64_t B, T, D, N;
  };
  for (const Case& c : {Case{2, 200, 64, 16}, Case{1, 1000, 200, 4}, Case{2, 63, 5, 8}})
    for (bool serial : {false, true})
      for (auto dt : {at::kFloat, at::kBFloat16}) {
        S6 s = random_s6(c.B, c.T, c.D, c.N, 31 + c.T);
        MixerInputs low = inputs_as(mamba1_inputs(s.x, s.dt, s.A, s.B, s.C, false), dt), up;
        for (const auto& n : MixerInputs::names())
          if (low.get(n).defined()) low.get(n) = low.get(n).to(at::kCUDA), up.get(n) = low.get(n).to(at::kFloat);
        MixerOptions opt;
        opt.serial_states = serial;
        State s0{at::randn({c.B, c.D, c.N, 1}, at::make_generator<at::CPUGeneratorImpl>(7), at::kDouble)
                     .to(at::kFloat).to(at::kCUDA)};
        ASSERT_TRUE(m.kernel_supports(low, opt));
        ASSERT_EQ(m.resolve_form(low, opt), Form::kernel);
        auto ref = outputs_then_grads(m, Form::naive, up, s0, opt);
        auto ker = outputs_then_grads(m, Form::kernel, low, s0, opt);
        auto names = result_names(m.state_names(), low);
        ASSERT_EQ(ref.size(), names.size());
        ASSERT_EQ(ker.size(), names.size());
        std::string line;
        for (size_t i = 0; i < ref.size(); ++i) {
          const double e = rel_err(ker[i], ref[i]);
          EXPECT_TRUE(at::isfinite(ker[i]).all().item<bool>()) << names[i] << " is not finite";
          EXPECT_LE(e, dt == at::kFloat ? 1e-4 : 1e-2) << (serial ? "serial " : "") << dt << " B=" << c.B
                                                       << " T=" << c.T << " D=" << c.D << " N=" << c.N << ": " << names[i];
          char buf[64];
          std::snprintf(buf, sizeof buf, " %s %.1e", names[i].c_str(), e);
          line += buf;
        }
        std::cout << "[ errors   ] mamba1" << (serial ? " serial" : "") << " " << dt << " B=" << c.B << " T=" << c.T
                  << " D=" << c.D << " N=" << c.N << ":" << line << "\n";
      }
  // Cuts under serial_states: bit for bit.
  S6 s = random_s6(1, 300, 48, 16, 91);
  MixerInputs in = inputs_as(mamba1_inputs(s.x, s.dt, s.A, s.B, s.C, false), at::kBFloat16);
  for (const auto& n : MixerInputs::names())
    if (in.get(n).defined()) in.get(n) = in.get(n).to(at::kCUDA);
  MixerOptions opt;
  opt.serial_states = true;
  opt.form = Form::kernel;
  auto whole = m.forward(in, {}, opt);
  for (int64_t cut : {1, 64, 157}) {
    auto first = m.forward(in.slice(0, cut), {}, opt);
    auto second = m.forward(in.slice(cut, 300 - cut), first.final_state, opt);
    EXPECT_TRUE(at::equal(at::cat({first.o, second.o}, 1), whole.o)) << "cut at " << cut << ": outputs differ";
    EXPECT_TRUE(at::equal(second.final_state[0], whole.final_state[0])) << "cut at " << cut << ": final state differs";
  }
#endif
}

}  // namespace
}  // namespace carry::testing
