// KDA's kernel form (layers/kda/kernel_form.h): its algorithm (the chunk pieces, the two walks and the
// hand-written backward) on the CPU in fp64 against the family's chunkwise form differentiated by autograd,
// every output and the gradient of every input and of the initial state; its hooks; and on a GPU the form
// with its walk kernels against the chunkwise form in fp32 (bf16 and fp32 inputs, outputs poisoned first by
// the kernels' own fill), the walk kernels against the ATen walks, and a walk cut at a chunk boundary giving
// the bits of the whole. Gates are realistic: half-lives from 2 to 10^5 tokens per key dimension, β in
// (0.05, 0.95), unit keys, a nonzero initial state.
#include "layers/core/device.h"
#include "layers/kda/kernel_form.h"
#include "layers/mixer.h"
#include "tests/helpers/mixer_testing.h"

#ifdef CARRY_WITH_CUDA
#include "layers/kernels/kda/api.h"
#endif

#include <gtest/gtest.h>

#include <cmath>
#include <iostream>

namespace carry::testing {
namespace {

MixerInputs kda_inputs(int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto o = at::TensorOptions().dtype(at::kDouble);
  MixerInputs in;
  in.q = at::randn({B, T, H, dk}, gen, o);
  in.k = at::randn({B, T, H, dk}, gen, o);
  in.k = in.k / in.k.norm(2, -1, true);
  in.v = at::randn({B, T, H, dv}, gen, o);
  const double lo = std::log(2.0), hi = std::log(1e5);
  in.gk = -std::log(2.0) / at::exp(at::rand({B, T, H, dk}, gen, o) * (hi - lo) + lo);
  in.beta = at::rand({B, T, H}, gen, o) * 0.9 + 0.05;
  return in;
}

Tensor kda_state(int64_t B, int64_t H, int64_t dk, int64_t dv, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn({B, H, dk, dv}, gen, at::TensorOptions().dtype(at::kDouble)) * 0.3;
}

const WithKernelForm& composed() {
  static const WithKernelForm m(get_mixer("kda"), [](const MixerInputs& in, const State& s, const MixerOptions& o) {
    return kda_kernel_form(in, s.empty() ? Tensor() : s[0], o);
  });
  return m;
}

TEST(KdaKernelForm, AlgorithmEqualsChunkwiseInFp64) {
  const Mixer& m = get_mixer("kda");
  struct Case {
    int64_t B, T, H, dk, dv, C;
  };
  for (const Case& c : {Case{2, 64, 2, 8, 6, 16}, Case{1, 192, 3, 16, 8, 64}, Case{1, 40, 1, 4, 12, 8}}) {
    MixerOptions opt;
    opt.chunk_size = c.C;
    auto in = kda_inputs(c.B, c.T, c.H, c.dk, c.dv, 3 + c.T);
    State s0{kda_state(c.B, c.H, c.dk, c.dv, 5 + c.T)};
    auto ref = outputs_then_grads_as_run(m, Form::chunkwise, in, s0, opt);
    auto got = outputs_then_grads_as_run(composed(), Form::kernel, in, s0, opt);
    auto names = result_names({"S"}, in);
    ASSERT_EQ(ref.size(), names.size());
    ASSERT_EQ(got.size(), names.size());
    double worst = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      const double e = rel_err(got[i], ref[i]);
      worst = std::max(worst, e);
      EXPECT_LE(e, 1e-11) << "T=" << c.T << " dk=" << c.dk << " dv=" << c.dv << " C=" << c.C << ": " << names[i];
    }
    std::cout << "[ errors   ] kda kernel form's algorithm, T=" << c.T << " dk=" << c.dk << " dv=" << c.dv
              << " C=" << c.C << ": worst of " << ref.size() << " results " << worst << "\n";
  }
}

// The check can fail: a reverse walk that drops the state's own decay (dS_in without Diag(e^{G_C})·dS_out)
// gives another initial-state gradient.
TEST(KdaKernelForm, ReverseWalkCarriesTheDecay) {
  const int64_t B = 1, H = 2, N = 3, C = 4, dk = 5, dv = 3;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  auto o = at::TensorOptions().dtype(at::kDouble);
  Tensor q_s = at::randn({B, H, N, C, dk}, gen, o), d_o = at::randn({B, H, N, C, dv}, gen, o),
         w = at::randn({B, H, N, C, dk}, gen, o), k_out = at::randn({B, H, N, C, dk}, gen, o),
         decay = at::rand({B, H, N, dk}, gen, o) * 0.5 + 0.4, dv_pre = at::randn({B, H, N, C, dv}, gen, o),
         d_final = at::randn({B, H, dk, dv}, gen, o);
  // The walk's map differentiated by autograd: S0 ↦ (states, v_new, final) against the reverse walk.
  Tensor u = at::randn({B, H, N, C, dv}, gen, o);
  Tensor s0 = at::randn({B, H, dk, dv}, gen, o).requires_grad_(true);
  KdaWalk f = kda_walk(w, u, k_out, decay, s0);
  Tensor o_like = at::matmul(q_s, f.states);  // the output's state term: its gradient feeds Q_sᵀ·dO
  Tensor loss = (o_like * d_o).sum() + (f.final_state * d_final).sum() + (f.v_new * dv_pre).sum();
  Tensor want = torch::autograd::grad({loss}, {s0})[0];
  KdaReverseWalk r = kda_reverse_walk(q_s, d_o, w, k_out, decay, dv_pre, d_final);
  EXPECT_LE(rel_err(r.initial_grad, want), 1e-12);
  Tensor without = d_final;
  for (int64_t n = N - 1; n >= 0; --n) {
    Tensor dvn = dv_pre.select(2, n) + at::matmul(k_out.select(2, n), without);
    without = without + at::matmul(q_s.select(2, n).transpose(-1, -2), d_o.select(2, n)) -
              at::matmul(w.select(2, n).transpose(-1, -2), dvn);
  }
  EXPECT_GT(rel_err(without, want), 1e-3);
}

TEST(KdaKernelForm, HooksSeeTheFinalStateAndTheInitialGradient) {
  MixerOptions opt;
  opt.chunk_size = 16;
  opt.form = Form::kernel;
  auto in = kda_inputs(1, 48, 2, 8, 4, 21);
  check_state_hooks(composed(), in, {kda_state(1, 2, 8, 4, 22)}, opt, /*grad_hook_calls=*/1, "kda kernel form");
}

TEST(KdaKernelForm, KernelFormMatchesChunkwiseOnGpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  const Mixer& m = get_mixer("kda");
  const Mixer& form = composed();  // the layer does not choose the form yet (delta_rule.cpp, has_kernel)
  carry::kernels::kda::set_poison(true);
  struct Case {
    int64_t B, T, H, dk, dv;
  };
  for (const Case& c : {Case{1, 512, 2, 128, 128}, Case{2, 256, 1, 64, 64}, Case{1, 320, 2, 128, 256},
                        Case{1, 192, 3, 64, 48}})
    for (auto dt : {at::kFloat, at::kBFloat16}) {
      MixerOptions opt;
      opt.serial_states = true;
      auto all = kda_inputs(c.B, c.T, c.H, c.dk, c.dv, 31 + c.T);
      MixerInputs low, up;
      for (const auto& n : MixerInputs::names())
        if (all.get(n).defined()) {
          low.get(n) = all.get(n).to(at::kCUDA).to(dt).contiguous();
          up.get(n) = low.get(n).to(at::kFloat);
        }
      State s0{kda_state(c.B, c.H, c.dk, c.dv, 7).to(at::kCUDA).to(at::kFloat)};
      ASSERT_TRUE(m.kernel_supports(low, opt));
      auto ref = outputs_then_grads(m, Form::chunkwise, up, s0, opt);
      auto ker = outputs_then_grads(form, Form::kernel, low, s0, opt);
      auto names = result_names({"S"}, low);
      ASSERT_EQ(ref.size(), names.size());
      ASSERT_EQ(ker.size(), names.size());
      double worst = 0;
      std::string worst_name;
      for (size_t i = 0; i < ref.size(); ++i) {
        const double e = rel_err(ker[i], ref[i]);
        EXPECT_TRUE(at::isfinite(ker[i]).all().item<bool>()) << names[i] << " has NaN (unwritten?)";
        EXPECT_LE(e, dt == at::kFloat ? 1e-4 : 1e-2)
            << dt << " B=" << c.B << " T=" << c.T << " H=" << c.H << " dk=" << c.dk << " dv=" << c.dv << ": "
            << names[i];
        if (e > worst) worst = e, worst_name = names[i];
      }
      std::cout << "[ errors   ] kda kernel " << dt << " B=" << c.B << " T=" << c.T << " H=" << c.H << " dk=" << c.dk
                << " dv=" << c.dv << ": worst " << worst << " (" << worst_name << ")\n";
    }
  carry::kernels::kda::set_poison(false);
#endif
}

// The walk kernels against the ATen walks (fp32), and a walk cut at a chunk boundary, the second part from
// the first's final state, giving the bits of the whole walk (forward and reverse).
TEST(KdaKernelForm, WalkKernelsMatchTheAtenWalksAndCutsKeepTheBits) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  carry::kernels::kda::set_poison(true);
  for (int64_t dk : {64, 128})
    for (int64_t dv : {16, 64, 256}) {
      const int64_t B = 2, H = 3, N = 6, C = 64;
      auto gen = at::make_generator<at::CPUGeneratorImpl>(dk + dv);
      auto o = at::TensorOptions().dtype(at::kFloat);
      Tensor w = at::randn({B, H, N, C, dk}, gen, o) * 0.1, u = at::randn({B, H, N, C, dv}, gen, o),
             k_out = at::randn({B, H, N, C, dk}, gen, o) * 0.1, decay = at::rand({B, H, N, dk}, gen, o) * 0.5 + 0.5,
             s0 = at::randn({B, H, dk, dv}, gen, o), q_s = at::randn({B, H, N, C, dk}, gen, o) * 0.1,
             d_o = at::randn({B, H, N, C, dv}, gen, o), dv_pre = at::randn({B, H, N, C, dv}, gen, o),
             d_final = at::randn({B, H, dk, dv}, gen, o);
      auto cu = [](const Tensor& t) { return t.to(at::kCUDA).contiguous(); };
      KdaWalk want = kda_walk(w, u, k_out, decay, s0);
      KdaWalk got = kda_walk(cu(w), cu(u), cu(k_out), cu(decay), cu(s0));
      EXPECT_LE(rel_err(got.states.cpu(), want.states), 1e-5) << "dk=" << dk << " dv=" << dv;
      EXPECT_LE(rel_err(got.v_new.cpu(), want.v_new), 1e-5) << "dk=" << dk << " dv=" << dv;
      EXPECT_LE(rel_err(got.final_state.cpu(), want.final_state), 1e-5) << "dk=" << dk << " dv=" << dv;
      KdaReverseWalk rwant = kda_reverse_walk(q_s, d_o, w, k_out, decay, dv_pre, d_final);
      KdaReverseWalk rgot = kda_reverse_walk(cu(q_s), cu(d_o), cu(w), cu(k_out), cu(decay), cu(dv_pre), cu(d_final));
      EXPECT_LE(rel_err(rgot.out_grads.cpu(), rwant.out_grads), 1e-5) << "dk=" << dk << " dv=" << dv;
      EXPECT_LE(rel_err(rgot.v_new_grads.cpu(), rwant.v_new_grads), 1e-5) << "dk=" << dk << " dv=" << dv;
      EXPECT_LE(rel_err(rgot.initial_grad.cpu(), rwant.initial_grad), 1e-5) << "dk=" << dk << " dv=" << dv;
      // Cut after chunk 2.
      auto part = [&](const Tensor& t, int64_t a, int64_t n) { return cu(t).narrow(2, a, n).contiguous(); };
      KdaWalk first = kda_walk(part(w, 0, 2), part(u, 0, 2), part(k_out, 0, 2), part(decay, 0, 2), cu(s0));
      KdaWalk second = kda_walk(part(w, 2, 4), part(u, 2, 4), part(k_out, 2, 4), part(decay, 2, 4), first.final_state);
      EXPECT_TRUE(at::equal(second.final_state, got.final_state)) << "dk=" << dk << " dv=" << dv;
      EXPECT_TRUE(at::equal(at::cat({first.v_new, second.v_new}, 2), got.v_new)) << "dk=" << dk << " dv=" << dv;
      KdaReverseWalk late = kda_reverse_walk(part(q_s, 2, 4), part(d_o, 2, 4), part(w, 2, 4), part(k_out, 2, 4),
                                             part(decay, 2, 4), part(dv_pre, 2, 4), cu(d_final));
      KdaReverseWalk early = kda_reverse_walk(part(q_s, 0, 2), part(d_o, 0, 2), part(w, 0, 2), part(k_out, 0, 2),
                                              part(decay, 0, 2), part(dv_pre, 0, 2), late.initial_grad);
      EXPECT_TRUE(at::equal(early.initial_grad, rgot.initial_grad)) << "dk=" << dk << " dv=" << dv;
    }
  carry::kernels::kda::set_poison(false);
#endif
}

}  // namespace
}  // namespace carry::testing
