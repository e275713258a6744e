// Tests of layers/core/cpu_determinism.*: the CPU math carry runs is pinned (MKL's reproducibility
// mode, ATen's capability), and with it every family's chunkwise form gives bit-identical outputs,
// final states and gradients whatever the alignment of its inputs in memory. Without the pinning, MKL's AVX-512 code path on AMD
// EPYC (AVX-512) rounded differently for misaligned operands and the `ordered` scan stopped being
// bitwise; on AVX2-only machines both checks pass with or without the pinning.
#include "framework/cli/mixer_check.h"
#include "layers/core/cpu_determinism.h"
#include "layers/mixer.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

namespace carry {
namespace {

// A leaf copy of t that starts `shift` elements past an aligned allocation.
Tensor placed(const Tensor& t, int64_t shift) {
  if (!t.defined()) return t;
  auto buf = at::empty({t.numel() + shift}, t.options());
  auto v = buf.narrow(0, shift, t.numel()).view(t.sizes());
  v.copy_(t);
  return v.detach().requires_grad_(true);
}

TEST(CpuDeterminism, MklReproducibilityIsPinned) {
  at::matmul(at::randn({64, 64}), at::randn({64, 64}));  // MKL initialized
  std::string mode = cpu_math_mode();
  std::printf("[ cpu math ] %s, MKL branch %d\n", mode.c_str(), mkl_cbwr_branch());
  // CI runs the suite with MKL_CBWR=AUTO (alignment-sensitive on AVX-512): carry replaces it.
  const char* env = std::getenv("MKL_CBWR");
  ASSERT_NE(env, nullptr) << "carry sets MKL_CBWR at start";
  EXPECT_EQ(std::string(env), "COMPATIBLE");
  if (mkl_cbwr_branch() >= 0)
    EXPECT_EQ(mkl_cbwr_branch(), 3) << "MKL_CBWR_COMPATIBLE is branch 3 in MKL's service layer";
}

TEST(CpuDeterminism, ChunkwiseIsBitwiseAtAnyAlignment) {
  for (const auto& name : mixer_names()) {
    const Mixer& m = get_mixer(name);
    if (!m.has_summary()) continue;
    Shape s;
    s.B = 1, s.T = 256, s.H = 2, s.dk = 64, s.dv = 64;
    MixerOptions opt;
    opt.chunk_size = 64;
    auto in = random_inputs(m, s, at::kFloat, 11);
    auto state = random_state(m, in, opt, 12);
    auto run = [&](int64_t shift) {  // outputs, final state, then every gradient
      auto r = run_with_grads(m, Form::chunkwise, in, state, opt, 7, [shift](const Tensor& t) { return placed(t, shift); });
      r.outputs.insert(r.outputs.end(), r.grads.begin(), r.grads.end());
      return r.outputs;
    };
    auto a = run(0);
    for (int64_t shift : {1, 3, 8}) {
      auto b = run(shift);
      for (size_t i = 0; i < a.size(); ++i)
        EXPECT_TRUE(at::equal(a[i], b[i])) << name << ": result " << i << " (o, final state, then the gradients) "
                                           << "differs with inputs " << shift << " elements off alignment";
    }
  }
}

}  // namespace
}  // namespace carry
