// Linear attention's fused kernels (layers/kernels/decay/fused*: no per-chunk states) against the
// chunkwise form in fp32 on the same upcast inputs: the output, the final state (S and the normalizer's
// z) and the gradients of q, k, v and of the initial state, for a random functional of (o, final state),
// with a nonzero initial state; bf16, relative max error ≤ 1e-2; automatic segments and 1, 2 and 4;
// B = 1 and 2. And where they do not apply (off, fp32, normalized, serial states, dv ≠ 128), the decay
// class's kernels run. The scalar decay on the same kernels likewise (ScalarDecayFused.*). Skips itself
// without a GPU (and on builds without CUDA).
#include "layers/core/device.h"
#include "tests/helpers/mixer_testing.h"

#ifdef CARRY_WITH_CUDA
#include "layers/kernels/decay/fused_op.h"
#endif

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

namespace carry::testing {
namespace {

#ifdef CARRY_WITH_CUDA
struct Case {
  int64_t B, T, H;
};

// Both fused paths' switches back to their defaults (on, the segments automatic) when a test ends,
// also when an assertion returns early.
struct FusedModeReset {
  ~FusedModeReset() { linear_attn_fused_set(-1, 0), scalar_decay_fused_set(-1); }
};

// What both fused paths refuse, switched by set(mode): anything while off; fp32 inputs, serial states and
// dv = 64 while on (left on); a mode other than -1, 0, 1.
template <class Supports, class Set>
void expect_shared_refusals(Supports supports, Set set, const MixerInputs& bf, const MixerInputs& f32,
                            const MixerInputs& narrow) {
  MixerOptions plain, serial;
  serial.serial_states = true;
  set(0);
  EXPECT_FALSE(supports(bf, plain)) << "off";
  set(1);
  EXPECT_TRUE(supports(bf, plain));
  EXPECT_FALSE(supports(f32, plain)) << "fp32";
  EXPECT_FALSE(supports(bf, serial)) << "serial states";
  EXPECT_FALSE(supports(narrow, plain)) << "dv = 64";
  EXPECT_THROW(set(2), c10::Error);
}

MixerInputs fused_inputs(const Case& c, int64_t dv, at::ScalarType dt, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto o = at::TensorOptions().dtype(at::kFloat);
  MixerInputs in;
  in.q = at::randn({c.B, c.T, c.H, 128}, gen, o).to(at::kCUDA).to(dt);
  in.k = (at::randn({c.B, c.T, c.H, 128}, gen, o) / std::sqrt(128.0)).to(at::kCUDA).to(dt);
  in.v = at::randn({c.B, c.T, c.H, dv}, gen, o).to(at::kCUDA).to(dt);
  return in;
}
#endif

TEST(LinearAttnFused, MatchesChunkwise) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  FusedModeReset reset;
  const Mixer& m = get_mixer("linear_attn");
  const char* names[] = {"o", "final_S", "final_z", "dq", "dk", "dv", "d_initial_S", "d_initial_z"};
  for (const Case& c : {Case{1, 1024, 2}, Case{2, 512, 3}}) {
    const MixerInputs low = fused_inputs(c, 128, at::kBFloat16, 31 + c.T);
    MixerInputs up;
    for (const auto& n : MixerInputs::names())
      if (low.get(n).defined()) up.get(n) = low.get(n).to(at::kFloat);
    State s0{at::randn({c.B, c.H, 128, 128}, at::kFloat).to(at::kCUDA) * 0.5,
             at::rand({c.B, c.H, 128}, at::kFloat).to(at::kCUDA)};
    MixerOptions opt;
    auto ref = outputs_then_grads(m, Form::chunkwise, up, s0, opt);
    for (int segments : {0, 1, 2, 4}) {
      linear_attn_fused_set(1, segments);
      ASSERT_TRUE(linear_attn_fused_supports(low, opt));
      auto ker = outputs_then_grads(m, Form::kernel, low, s0, opt);
      ASSERT_EQ(ref.size(), ker.size());
      ASSERT_EQ(ref.size(), std::size(names));
      std::string line;
      for (size_t i = 0; i < ref.size(); ++i) {
        const double e = rel_err(ker[i], ref[i]);
        EXPECT_TRUE(at::isfinite(ker[i]).all().item<bool>()) << names[i] << " has NaN";
        EXPECT_LE(e, 1e-2) << "segments " << segments << " B=" << c.B << " T=" << c.T << " H=" << c.H << ": "
                           << names[i];
        char buf[64];
        std::snprintf(buf, sizeof buf, " %s %.1e", names[i], e);
        line += buf;
      }
      std::cout << "[ errors   ] linear_attn fused segments " << segments << " B=" << c.B << " T=" << c.T
                << " H=" << c.H << ":" << line << "\n";
    }
  }
#endif
}

TEST(LinearAttnFused, AppliesOnlyWhereItShould) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  FusedModeReset reset;
  const Case c{1, 256, 2};
  const MixerInputs bf = fused_inputs(c, 128, at::kBFloat16, 7), f32 = fused_inputs(c, 128, at::kFloat, 7),
                    narrow = fused_inputs(c, 64, at::kBFloat16, 7);
  MixerOptions plain, normalized;
  normalized.normalize = true;
  EXPECT_TRUE(linear_attn_fused_supports(bf, plain)) << "on by default";
  expect_shared_refusals(linear_attn_fused_supports, [](int m) { linear_attn_fused_set(m); }, bf, f32, narrow);
  EXPECT_FALSE(linear_attn_fused_supports(bf, normalized)) << "normalized";
#endif
}

// The final-state hook sees the fused forward's final state (S and z), and the initial state's gradient
// comes back through autograd as from the decay class's kernels (linear attention's form calls no
// backward hook).
TEST(LinearAttnFused, FinalStateHookSeesTheFinishedState) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  FusedModeReset reset;
  linear_attn_fused_set(1);
  const Case c{1, 512, 2};
  const MixerInputs bf = fused_inputs(c, 128, at::kBFloat16, 11);
  MixerOptions opt;
  opt.form = Form::kernel;
  ASSERT_TRUE(linear_attn_fused_supports(bf, opt));
  State s0{at::randn({c.B, c.H, 128, 128}, at::kFloat).to(at::kCUDA) * 0.5,
           at::rand({c.B, c.H, 128}, at::kFloat).to(at::kCUDA)};
  check_state_hooks(get_mixer("linear_attn"), bf, s0, opt, /*grad_hook_calls=*/0, "linear_attn fused");
#endif
}

// The scalar decay on the same kernels (scalar_decay_fused_form; on by default): against the chunkwise form
// in fp32 on the same upcast inputs, with log decays drawn log-uniformly from 1e-5 to 0.3 a token (half-lives
// from about 2 to 7·10^4 tokens) and from 1e-3 to 3 (down to a fifth of a token); the output, the final
// state and the gradients of q, k, v, the decay and the initial state; bf16, relative max error ≤ 1e-2;
// automatic segments and 1, 2 and 4; B = 1 and 2.
TEST(ScalarDecayFused, MatchesChunkwise) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  FusedModeReset reset;
  const Mixer& m = get_mixer("scalar_decay");
  const char* names[] = {"o", "final_S", "dq", "dk", "dv", "dg", "d_initial_S"};
  for (double max_decay : {0.3, 3.0})
    for (const Case& c : {Case{1, 1024, 2}, Case{2, 512, 3}}) {
      MixerInputs low = fused_inputs(c, 128, at::kBFloat16, 41 + c.T);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(43 + c.T);
      auto u = at::rand({c.B, c.T, c.H}, gen, at::kFloat) * (std::log(max_decay) - std::log(1e-5)) + std::log(1e-5);
      low.g = (-at::exp(u)).to(at::kCUDA);
      MixerInputs up;
      for (const auto& n : MixerInputs::names())
        if (low.get(n).defined()) up.get(n) = low.get(n).to(at::kFloat);
      State s0{at::randn({c.B, c.H, 128, 128}, at::kFloat).to(at::kCUDA) * 0.5};
      MixerOptions opt;
      auto ref = outputs_then_grads(m, Form::chunkwise, up, s0, opt);
      for (int segments : {0, 1, 2, 4}) {
        scalar_decay_fused_set(1);
        linear_attn_fused_set(-1, segments);
        ASSERT_TRUE(scalar_decay_fused_supports(low, opt));
        auto ker = outputs_then_grads(m, Form::kernel, low, s0, opt);
        ASSERT_EQ(ref.size(), ker.size());
        std::string line;
        for (size_t i = 0; i < ref.size(); ++i) {
          const std::string name = ref.size() == std::size(names) ? names[i] : "tensor " + std::to_string(i);
          const double e = rel_err(ker[i], ref[i]);
          EXPECT_TRUE(at::isfinite(ker[i]).all().item<bool>()) << name << " has NaN";
          EXPECT_LE(e, 1e-2) << "decay up to " << max_decay << ", segments " << segments << " B=" << c.B
                             << " T=" << c.T << " H=" << c.H << ": " << name;
          char buf[64];
          std::snprintf(buf, sizeof buf, " %s %.1e", name.c_str(), e);
          line += buf;
        }
        std::cout << "[ errors   ] scalar_decay fused, decay up to " << max_decay << ", segments " << segments
                  << " B=" << c.B << " T=" << c.T << " H=" << c.H << ":" << line << "\n";
      }
    }
#endif
}

TEST(ScalarDecayFused, AppliesOnlyWhereItShould) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  FusedModeReset reset;
  const Case c{1, 256, 2};
  MixerInputs bf = fused_inputs(c, 128, at::kBFloat16, 7), f32 = fused_inputs(c, 128, at::kFloat, 7),
              narrow = fused_inputs(c, 64, at::kBFloat16, 7), ungated = bf;
  for (MixerInputs* in : {&bf, &f32, &narrow}) in->g = at::full({c.B, c.T, c.H}, -0.01, at::kFloat).to(at::kCUDA);
  MixerOptions plain;
  EXPECT_TRUE(scalar_decay_fused_supports(bf, plain)) << "on by default";
  expect_shared_refusals(scalar_decay_fused_supports, scalar_decay_fused_set, bf, f32, narrow);
  EXPECT_FALSE(scalar_decay_fused_supports(ungated, plain)) << "no decay";
#endif
}

// The final-state hook sees the fused forward's final state, and the initial state's gradient hook runs
// once in the backward with the returned gradient, as with the decay class's kernels.
TEST(ScalarDecayFused, StateHooks) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  FusedModeReset reset;
  scalar_decay_fused_set(1);
  const Case c{1, 512, 2};
  MixerInputs bf = fused_inputs(c, 128, at::kBFloat16, 13);
  bf.g = (-at::rand({c.B, c.T, c.H}, at::kFloat) * 0.1 - 1e-4).to(at::kCUDA);
  MixerOptions opt;
  opt.form = Form::kernel;
  ASSERT_TRUE(scalar_decay_fused_supports(bf, opt));
  State s0{at::randn({c.B, c.H, 128, 128}, at::kFloat).to(at::kCUDA) * 0.5};
  check_state_hooks(get_mixer("scalar_decay"), bf, s0, opt, /*grad_hook_calls=*/1, "scalar_decay fused");
#endif
}

}  // namespace
}  // namespace carry::testing
