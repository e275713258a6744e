// Tests of layers/log_linear/level_passes.*: log-linear Mamba-2 and Gated DeltaNet composed of one pass of
// their base model a level.
//
// CPU, fp64: log-linear Mamba-2's products, and Gated DeltaNet composed with the ATen pass (its
// chunkwise form), equal the family's chunkwise form: the output, every entry of the final state, and the gradients of q, k, v, g, l and of
// every entry of a random initial state (unset bits included), at offsets that put the slice at and
// across block boundaries of several levels and lengths that span one to many blocks.
//
// GPU (skips without one): the kernel form against the chunkwise form in
// fp32 on the same values, bf16 and fp32 inputs, half-lives from 2 to 10^5 tokens, the initial state a
// prefix of the sequence leaves, outputs poisoned first: ≤ 1e-4 relative for fp32 inputs, ≤ 1e-2 for
// bf16.
#include "layers/log_linear/level_passes.h"
#include "layers/log_linear/fenwick.h"
#include "layers/core/device.h"
#include "tests/helpers/mixer_testing.h"

#ifdef CARRY_WITH_CUDA
#include "layers/kernels/decay/api.h"
#endif

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

namespace carry::testing {
namespace {

// S0, S1, ...: the log-linear state's entries.
std::vector<std::string> entry_names(size_t n) {
  std::vector<std::string> names;
  for (size_t j = 0; j < n; ++j) names.push_back("S" + std::to_string(j));
  return names;
}

class LevelPassFamilies : public ::testing::TestWithParam<const char*> {};

TEST_P(LevelPassFamilies, ComposedChunkwiseEqualsTheFamilysChunkwiseInFp64) {
  const Mixer& m = get_mixer(GetParam());
  const int64_t C = 16;
  const bool mamba2 = m.name() == "loglinear_mamba2";
  const WithKernelForm composed(m, [&](const MixerInputs& in, const State& s, const MixerOptions& o) {
    if (mamba2) return loglinear_mamba2_by_level_products(in, s, o);
    return loglinear_gdn_by_level_passes(in, s, o, chunkwise_delta_pass(C));
  });
  const std::string how = mamba2 ? " by level products" : " by level passes";
  struct Case {
    int64_t offset, T;
  };
  // Block boundaries of levels 5 (32 tokens) and up: at 0; at a multiple of 64 but not 128; a slice
  // crossing a 256-boundary; a long slice spanning many blocks of the low levels; an offset with many
  // set bits; a slice inside the second half of a large block.
  for (const Case& c : {Case{0, 64}, Case{64, 96}, Case{224, 80}, Case{0, 512}, Case{368, 160}, Case{1536, 64},
                        Case{48, 208}}) {
    Shape s;
    s.B = 2, s.T = c.T, s.H = 2, s.dk = 8, s.dv = 6, s.offset = c.offset;
    MixerOptions opt;
    opt.chunk_size = C;
    opt.offset = c.offset;
    auto in = random_inputs(m, s, at::kDouble, 11 + c.offset + c.T);
    State s0 = random_state(m, in, opt, 3 + c.offset);
    auto ref = outputs_then_grads_as_run(m, Form::chunkwise, in, s0, opt);
    auto got = outputs_then_grads_as_run(composed, Form::kernel, in, s0, opt);
    auto names = result_names(entry_names(s0.size()), in);
    ASSERT_EQ(ref.size(), names.size());
    ASSERT_EQ(got.size(), names.size());
    double worst = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      const double e = rel_err(got[i], ref[i]);
      worst = std::max(worst, e);
      EXPECT_LE(e, 1e-11) << how << ", offset " << c.offset << " T=" << c.T << ": " << names[i];
    }
    std::cout << "[ errors   ] " << m.name() << how << ", offset " << c.offset << " T=" << c.T
              << ": worst of " << ref.size() << " results " << worst << "\n";
  }
}

TEST_P(LevelPassFamilies, KernelFormMatchesChunkwiseOnGpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  const Mixer& m = get_mixer(GetParam());
  ASSERT_TRUE(m.has_kernel());
  carry::kernels::decay::decay_set_poison(true);
  struct Case {
    int64_t B, T, H, dk, dv, offset;
  };
  std::vector<Case> cases{{1, 512, 2, 64, 64, 0}, {2, 256, 1, 128, 128, 768}, {1, 384, 2, 128, 256, 1664}};
  if (m.name() == "loglinear_mamba2") {
    cases.push_back({1, 256, 2, 96, 192, 4096});
    cases.push_back({1, 4096, 2, 128, 128, 0});  // halves of more than one segment of the level kernels
    cases.push_back({2, 2048, 1, 64, 256, 2048});
  }
  for (const Case& c : cases)
    for (bool serial : {true, false})
      for (auto dt : {at::kFloat, at::kBFloat16}) {
        MixerOptions opt;
        opt.serial_states = serial;
        opt.offset = c.offset;
        // The sequence from 0: its prefix leaves the initial state; the slice is checked.
        Shape whole;
        whole.B = c.B, whole.T = c.offset + c.T, whole.H = c.H, whole.dk = c.dk, whole.dv = c.dv;
        auto all = random_inputs(m, whole, at::kFloat, 31 + c.T);
        auto gen = at::make_generator<at::CPUGeneratorImpl>(41 + c.T);
        const double lo = std::log(2.0), hi = std::log(1e5);
        all.g = -std::log(2.0) / at::exp(at::rand({c.B, whole.T, c.H}, gen, at::kFloat) * (hi - lo) + lo);
        all.k = all.k / all.k.norm(2, -1, true);
        for (const auto& n : MixerInputs::names())
          if (all.get(n).defined()) all.get(n) = all.get(n).to(at::kCUDA);
        State s0;
        if (c.offset > 0) {
          MixerOptions pre;
          s0 = m.chunkwise(all.slice(0, c.offset), {}, pre).final_state;
        } else {
          s0 = m.zero_state(all, opt);
        }
        MixerInputs low, up;
        for (const auto& n : MixerInputs::names())
          if (all.get(n).defined()) {
            low.get(n) = all.get(n).narrow(1, c.offset, c.T).to(n == "g" ? at::kFloat : dt).contiguous();
            up.get(n) = low.get(n).to(at::kFloat);
          }
        ASSERT_TRUE(m.kernel_supports(low, opt));
        ASSERT_EQ(m.resolve_form(low, opt), Form::kernel);
        auto ref = outputs_then_grads(m, Form::chunkwise, up, s0, opt);
        auto ker = outputs_then_grads(m, Form::kernel, low, s0, opt);
        auto names = result_names(entry_names(s0.size()), low);
        ASSERT_EQ(ref.size(), names.size());
        ASSERT_EQ(ker.size(), names.size());
        double worst = 0;
        std::string worst_name;
        for (size_t i = 0; i < ref.size(); ++i) {
          const double e = rel_err(ker[i], ref[i]);
          EXPECT_TRUE(at::isfinite(ker[i]).all().item<bool>()) << names[i] << " has NaN (unwritten?)";
          EXPECT_LE(e, dt == at::kFloat ? 1e-4 : 1e-2)
              << (serial ? "serial " : "") << dt << " B=" << c.B << " T=" << c.T << " H=" << c.H << " dk=" << c.dk
              << " dv=" << c.dv << " offset " << c.offset << ": " << names[i];
          if (e > worst) worst = e, worst_name = names[i];
        }
        std::cout << "[ errors   ] " << m.name() << (serial ? " serial" : "") << " " << dt << " B=" << c.B
                  << " T=" << c.T << " H=" << c.H << " dk=" << c.dk << " dv=" << c.dv << " offset " << c.offset
                  << ": worst " << worst << " (" << worst_name << ")\n";
      }
  carry::kernels::decay::decay_set_poison(false);
#endif
}

INSTANTIATE_TEST_SUITE_P(LogLinear, LevelPassFamilies, ::testing::Values("loglinear_mamba2", "loglinear_gdn"));

}  // namespace
}  // namespace carry::testing
