// The ATen chunkwise form of every family on a CUDA device equals the same form on the CPU (fp64,
// outputs, final state and summaries). Skips itself when no GPU is present.
#include "layers/core/device.h"
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

// A timing mark names its device: marks on the last GPU, made while the first is current, span the work
// queued on the last GPU between them (a rank's phase marks on device 0's stream measured nothing).
TEST(Gpu, TimingMarksAreOnTheNamedDevice) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices, found " << cuda_device_count();
  const int last = cuda_device_count() - 1;
  cuda_make_current(0);
  auto a = at::randn({4096, 4096}, at::TensorOptions().device(at::Device(at::kCUDA, last)));
  cuda_synchronize();
  const TimingMark from = timing_mark(last);
  for (int i = 0; i < 20; ++i) a = at::matmul(a, a).tanh_();  // ~2.7 TFLOP in fp32: well over a millisecond
  const TimingMark to = timing_mark(last);
  const double ms = timing_mark_ms(from, to);
  std::cout << "[ timing   ] 20 matmuls of 4096 on device " << last << ": " << ms << " ms\n";
  EXPECT_GT(ms, 0.5);
  EXPECT_TRUE(at::isfinite(a).all().item<bool>());
}

}  // namespace
}  // namespace carry::testing
