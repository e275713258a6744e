// Gated DeltaProduct's kernel form (Gated DeltaNet's kernels on the T·n_h sub-tokens,
// layers/delta_product/delta_product.h) against its chunkwise form in fp32 on the same (upcast) inputs:
// outputs, final state and the gradients of q, k, v, g, beta and the initial state for a random functional
// of (o, final state), n_h = 2 and 3. Gates with half-lives from about 2 to 7·10^4 tokens, beta in (0, 2),
// L2-normalized keys, a nonzero initial state. Relative max error ≤ 1e-4 for fp32 inputs, ≤ 1e-2 for bf16.
// Outputs are poisoned (NaN) before each kernel run so that unwritten elements show; the state hooks are
// called as the other kernel forms call them; the ordered scan's serial_states gives the bits of a
// sequence cut in two. Skips itself without a GPU (and on builds without CUDA).
#include "layers/core/device.h"
#include "tests/helpers/mixer_testing.h"

#ifdef CARRY_WITH_CUDA
#include "layers/kernels/delta_rule/api.h"
#endif

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

namespace carry::testing {
namespace {

struct Case {
  int64_t B, T, H, dk, dv, nh;
};

// Inputs in fp32 on the GPU, FLA's conventions (k, v, beta with n_h rows a token), realistic gates.
MixerInputs inputs(const Case& c, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto f = at::TensorOptions().dtype(at::kFloat);
  const int64_t R = c.T * c.nh;
  MixerInputs in;
  in.q = at::randn({c.B, c.T, c.H, c.dk}, gen, f);
  in.q = in.q / in.q.norm(2, -1, true);
  in.k = at::randn({c.B, R, c.H, c.dk}, gen, f);
  in.k = in.k / in.k.norm(2, -1, true);
  in.v = at::randn({c.B, R, c.H, c.dv}, gen, f);
  in.beta = 2 * at::sigmoid(at::randn({c.B, R, c.H}, gen, f));
  // −g = e^u, u uniform in [log 1e-5, log 0.3]: decays 0.74 ... 0.99999 a token.
  auto u = at::rand({c.B, c.T, c.H}, gen, f) * (std::log(0.3) - std::log(1e-5)) + std::log(1e-5);
  in.g = -at::exp(u);
  for (const auto& n : MixerInputs::names())
    if (in.get(n).defined()) in.get(n) = in.get(n).to(at::kCUDA);
  return in;
}

MixerOptions options(int64_t nh) {
  MixerOptions opt;
  opt.chunk_size = 64;
  opt.num_householder = nh;
  return opt;
}

TEST(GatedDeltaProductKernel, MatchesChunkwise) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  carry::kernels::delta_rule::gdn_set_poison(true);
  const Mixer& m = get_mixer("gated_deltaproduct");
  const char* names[] = {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"};
  for (const Case& c : {Case{1, 128, 2, 128, 128, 2}, Case{2, 192, 3, 128, 256, 2}, Case{1, 128, 16, 64, 128, 3},
                        Case{1, 64, 4, 128, 128, 3}}) {
    auto in = inputs(c, 17 + c.T + c.nh);
    auto s0 = at::randn({c.B, c.H, c.dk, c.dv}, at::kFloat).to(at::kCUDA) * 0.5;
    const MixerOptions opt = options(c.nh);
    for (auto dt : {at::kFloat, at::kBFloat16}) {
      const MixerInputs low = inputs_as(in, dt);
      const MixerInputs up = inputs_as(low, at::kFloat);  // the reference sees the same values, upcast
      ASSERT_TRUE(m.kernel_supports(low, opt));
      ASSERT_EQ(m.resolve_form(low, opt), Form::kernel);
      auto ref = outputs_then_grads(m, Form::chunkwise, up, {s0}, opt);
      auto ker = outputs_then_grads(m, Form::kernel, low, {s0}, opt);
      ASSERT_EQ(ref.size(), ker.size());
      const double bound = dt == at::kFloat ? 1e-4 : 1e-2;
      std::string line;
      for (size_t i = 0; i < ref.size(); ++i) {
        const double e = rel_err(ker[i], ref[i]);
        EXPECT_TRUE(at::isfinite(ker[i]).all().item<bool>()) << names[i] << " has NaN (unwritten?)";
        EXPECT_LE(e, bound) << dt << " n_h=" << c.nh << " B=" << c.B << " T=" << c.T << " H=" << c.H << " dk=" << c.dk
                            << " dv=" << c.dv << ": " << names[i];
        line += std::string(" ") + names[i] + " " + std::to_string(e);
      }
      std::cout << "[ errors   ] gated_deltaproduct " << dt << " n_h=" << c.nh << " B=" << c.B << " T=" << c.T
                << " H=" << c.H << " dk=" << c.dk << " dv=" << c.dv << ":" << line << "\n";
    }
  }
  carry::kernels::delta_rule::gdn_set_poison(false);
#endif
}

// The hooks (on_final_state inside the forward, on_initial_state_grad inside the backward: Gated
// DeltaNet's kernels call them with this family's state), and serial_states: two halves with the state
// passed along give the whole run's bits.
TEST(GatedDeltaProductKernel, HooksAndSerialStates) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  const Mixer& m = get_mixer("gated_deltaproduct");
  const Case c{1, 256, 2, 128, 128, 2};
  const MixerInputs low = inputs_as(inputs(c, 5), at::kBFloat16);
  auto s0 = at::randn({c.B, c.H, c.dk, c.dv}, at::kFloat).to(at::kCUDA) * 0.5;
  MixerOptions opt = options(c.nh);
  opt.form = Form::kernel;
  check_state_hooks(m, low, {s0}, opt, /*grad_hook_calls=*/1, "gated_deltaproduct kernel");
  opt.serial_states = true;
  auto whole = m.forward(low, {s0}, opt);
  auto first = m.forward(low.slice(0, 128), {s0}, opt);
  auto second = m.forward(low.slice(128, 128), first.final_state, opt);
  EXPECT_TRUE(at::equal(at::cat({first.o, second.o}, 1), whole.o));
  EXPECT_TRUE(at::equal(second.final_state[0], whole.final_state[0]));
#endif
}

}  // namespace
}  // namespace carry::testing
