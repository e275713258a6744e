// The ATen chunkwise form of every family on a CUDA device equals the same form on the CPU (fp64,
// outputs, final state and summaries). Skips itself when no GPU is present.
#include "layers/common/device.h"
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>

namespace carry::testing {
namespace {

TEST(Gpu, ChunkwiseOnCudaEqualsCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
  std::cout << "[ device   ] " << cuda_device_name(0) << "\n";
  for (auto& name : mixer_names()) {
    const Mixer& m = get_mixer(name);
    Shape s;
    s.T = 128;
    s.offset = 64;
    MixerOptions opt;
    opt.chunk_size = 32;
    opt.offset = s.offset;
    auto in = random_inputs(m, s, at::kDouble, 3);
    auto st = random_state(m, in, opt, 4);
    MixerInputs gin;
    for (const auto& n : MixerInputs::names())
      if (in.get(n).defined()) gin.get(n) = in.get(n).to(at::kCUDA);
    State gst;
    for (auto& t : st) gst.push_back(t.to(at::kCUDA));
    auto cpu = m.chunkwise(in, st, opt), gpu = m.chunkwise(gin, gst, opt);
    double e = rel_err(gpu.o.cpu(), cpu.o);
    for (size_t i = 0; i < cpu.final_state.size(); ++i)
      e = std::max(e, rel_err(gpu.final_state[i].cpu(), cpu.final_state[i]));
    std::cout << "[ errors   ] " << name << " cuda vs cpu " << e << "\n";
    EXPECT_LE(e, 1e-12) << name;
  }
}

}  // namespace
}  // namespace carry::testing
