// Tests of layers/common/cpu_determinism.*: the CPU math carry runs is pinned (MKL's reproducibility
// mode, ATen's capability), and with it every family's chunkwise form gives bit-identical outputs,
// final states and gradients whatever the alignment of its inputs in memory. Without the pinning, MKL's AVX-512 code path on AMD
// EPYC (AVX-512) rounded differently for misaligned operands and the `ordered` scan stopped being
// bitwise; on AVX2-only machines both checks pass with or without the pinning.
#include "framework/cli/mixer_check.h"
#include "layers/common/cpu_determinism.h"
#include "layers/mixer.h"

#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

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

// Outputs, final state and the gradients of every input and of the initial state for a fixed
// random functional, with every input placed `shift` elements off alignment.
std::vector<Tensor> run_placed(const Mixer& m, const MixerInputs& in, const State& state,
                               const MixerOptions& opt, int64_t shift) {
  MixerInputs leaves;
  std::vector<Tensor> xs;
  for (const auto& n : MixerInputs::names())
    if (in.get(n).defined()) xs.push_back(leaves.get(n) = placed(in.get(n), shift));
  State s0;
  for (auto& t : state) xs.push_back(placed(t, shift)), s0.push_back(xs.back());
  auto out = m.forward(leaves, s0, opt);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  Tensor f = (out.o * at::randn(out.o.sizes(), gen, out.o.options())).sum();
  for (auto& t : out.final_state) f = f + (t * at::randn(t.sizes(), gen, t.options())).sum();
  auto grads = torch::autograd::grad({f}, xs);
  std::vector<Tensor> all{out.o.detach()};
  for (auto& t : out.final_state) all.push_back(t.detach());
  all.insert(all.end(), grads.begin(), grads.end());
  return all;
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
    auto a = run_placed(m, in, state, opt, 0);
    for (int64_t shift : {1, 3, 8}) {
      auto b = run_placed(m, in, state, opt, shift);
      for (size_t i = 0; i < a.size(); ++i)
        EXPECT_TRUE(at::equal(a[i], b[i])) << name << ": result " << i << " (o, final state, then the gradients) "
                                           << "differs with inputs " << shift << " elements off alignment";
    }
  }
}

}  // namespace
}  // namespace carry
