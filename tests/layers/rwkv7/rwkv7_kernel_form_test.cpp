// RWKV-7's kernel form (layers/rwkv7/kernel_form.h): its algorithm (the stacked pieces on KDA's walks, the
// reverse walk and the pieces differentiated by autograd) on the CPU in fp64 against the family's
// chunkwise form differentiated by autograd, every output and the gradient of every input and of the
// initial state; its hooks; and on a GPU the form with the walk kernels against the chunkwise form in fp32
// (bf16 and fp32 inputs, the walks' outputs poisoned first). Gates are realistic: half-lives from 2 to 10^5
// tokens per key dimension, a = −κ̂ and b = κ̂ ⊙ a_lr with κ̂ a unit key and a_lr in (0.05, 0.95), as RWKV-7
// feeds them, and a nonzero initial state.
#include "layers/core/device.h"
#include "layers/mixer.h"
#include "layers/rwkv7/kernel_form.h"
#include "tests/helpers/mixer_testing.h"

#ifdef CARRY_WITH_CUDA
#include "layers/kernels/kda/api.h"
#endif

#include <gtest/gtest.h>

#include <cmath>
#include <iostream>

namespace carry::testing {
namespace {

MixerInputs rwkv7_inputs(int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto o = at::TensorOptions().dtype(at::kDouble);
  MixerInputs in;
  in.q = at::randn({B, T, H, dk}, gen, o);
  in.k = at::randn({B, T, H, dk}, gen, o) * 0.5;
  in.v = at::randn({B, T, H, dv}, gen, o);
  const double lo = std::log(2.0), hi = std::log(1e5);
  in.gk = -std::log(2.0) / at::exp(at::rand({B, T, H, dk}, gen, o) * (hi - lo) + lo);
  Tensor kappa = at::randn({B, T, H, dk}, gen, o);
  kappa = kappa / kappa.norm(2, -1, true);
  in.a = -kappa;
  in.b = kappa * (at::rand({B, T, H, dk}, gen, o) * 0.9 + 0.05);
  return in;
}

Tensor rwkv7_state(int64_t B, int64_t H, int64_t dk, int64_t dv, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn({B, H, dk, dv}, gen, at::TensorOptions().dtype(at::kDouble)) * 0.3;
}

const WithKernelForm& composed() {
  static const WithKernelForm m(get_mixer("rwkv7"), [](const MixerInputs& in, const State& s, const MixerOptions& o) {
    return rwkv7_kernel_form(in, s.empty() ? Tensor() : s[0], o);
  });
  return m;
}

TEST(Rwkv7KernelForm, AlgorithmEqualsChunkwiseInFp64) {
  const Mixer& m = get_mixer("rwkv7");
  struct Case {
    int64_t B, T, H, dk, dv, C;
  };
  for (const Case& c : {Case{2, 64, 2, 8, 6, 16}, Case{1, 192, 3, 16, 8, 64}, Case{1, 96, 1, 4, 12, 32}}) {
    MixerOptions opt;
    opt.chunk_size = c.C;
    auto in = rwkv7_inputs(c.B, c.T, c.H, c.dk, c.dv, 3 + c.T);
    State s0{rwkv7_state(c.B, c.H, c.dk, c.dv, 5 + c.T)};
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
    std::cout << "[ errors   ] rwkv7 kernel form's algorithm, T=" << c.T << " dk=" << c.dk << " dv=" << c.dv
              << " (chunkwise C=" << c.C << "): worst of " << ref.size() << " results " << worst << "\n";
  }
}

TEST(Rwkv7KernelForm, HooksSeeTheFinalStateAndTheInitialGradient) {
  MixerOptions opt;
  opt.chunk_size = 16;
  opt.form = Form::kernel;
  auto in = rwkv7_inputs(1, 64, 2, 8, 4, 21);
  check_state_hooks(composed(), in, {rwkv7_state(1, 2, 8, 4, 22)}, opt, /*grad_hook_calls=*/1, "rwkv7 kernel form");
}

TEST(Rwkv7KernelForm, KernelFormMatchesChunkwiseOnGpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  const Mixer& m = get_mixer("rwkv7");
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
      auto all = rwkv7_inputs(c.B, c.T, c.H, c.dk, c.dv, 31 + c.T);
      MixerInputs low, up;
      for (const auto& n : MixerInputs::names())
        if (all.get(n).defined()) {
          low.get(n) = all.get(n).to(at::kCUDA).to(dt).contiguous();
          up.get(n) = low.get(n).to(at::kFloat);
        }
      State s0{rwkv7_state(c.B, c.H, c.dk, c.dv, 7).to(at::kCUDA).to(at::kFloat)};
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
      std::cout << "[ errors   ] rwkv7 kernel " << dt << " B=" << c.B << " T=" << c.T << " H=" << c.H << " dk=" << c.dk
                << " dv=" << c.dv << ": worst " << worst << " (" << worst_name << ")\n";
    }
  carry::kernels::kda::set_poison(false);
#endif
}

}  // namespace
}  // namespace carry::testing
