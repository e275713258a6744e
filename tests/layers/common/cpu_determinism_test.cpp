// Tests of layers/common/cpu_determinism.*: the CPU math carry runs is pinned (MKL's reproducibility
// mode, ATen's capability), and with it every family's chunkwise form gives bit-identical results
// whatever the alignment of its inputs in memory. Without the pinning, MKL's AVX-512 code path on AMD
// EPYC rounded differently for misaligned operands and the `ordered` scan stopped being bitwise.
#include "framework/cli/mixer_check.h"
#include "layers/common/cpu_determinism.h"
#include "layers/mixer.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

namespace carry {
namespace {

// A copy of t that starts one element past an aligned allocation (4 or 8 bytes off).
Tensor misaligned(const Tensor& t) {
  if (!t.defined()) return t;
  auto buf = at::empty({t.numel() + 1}, t.options());
  auto v = buf.narrow(0, 1, t.numel()).view(t.sizes());
  v.copy_(t);
  return v;
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
    auto a = m.forward(in, state, opt);
    MixerInputs shifted;
    for (const auto& n : MixerInputs::names()) shifted.get(n) = misaligned(in.get(n));
    State s2;
    for (auto& t : state) s2.push_back(misaligned(t));
    auto b = m.forward(shifted, s2, opt);
    EXPECT_TRUE(at::equal(a.o, b.o)) << name << ": outputs differ with misaligned inputs";
    for (size_t i = 0; i < a.final_state.size(); ++i)
      EXPECT_TRUE(at::equal(a.final_state[i], b.final_state[i])) << name << ": final state " << i;
  }
}

}  // namespace
}  // namespace carry
