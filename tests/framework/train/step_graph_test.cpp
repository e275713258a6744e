// StepGraph (parallel.cuda_graph's capture, framework/train/step_graph.h) on its own, on a GPU (skipped
// without one): a replay reads the batch copied into its static buffers (two batches, two results);
// a batch of other shapes is refused; work a capture cannot hold (a host read) stops with the reason and
// leaves the device usable. On a CPU the constructor refuses.
#include "framework/train/step_graph.h"
#include "layers/core/device.h"

#include <gtest/gtest.h>

namespace carry::testing {
namespace {

StepGraph::Outputs sums_of(const at::Tensor& tokens, const at::Tensor& targets, const at::Tensor& mask) {
  auto t = (tokens * 3 + targets).to(at::kDouble);
  return {at::stack({(t * mask.to(at::kDouble)).sum(), mask.to(at::kDouble).sum()}), t.abs().sum().sqrt()};
}

TEST(StepGraph, RefusesTheCpu) {
  try {
    StepGraph g(at::kCPU);
    ADD_FAILURE() << "a CPU step graph was made";
  } catch (const c10::Error& e) {
    const std::string m = e.what_without_backtrace();
    EXPECT_EQ(m.rfind("parallel.cuda_graph: true needs ", 0), 0u) << m;
  }
}

TEST(GpuStepGraph, ReplaysReadTheNewBatch) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const at::Device dev(at::kCUDA, 0);
  StepGraph g(dev);
  EXPECT_FALSE(g.captured());
  auto opt = at::TensorOptions().dtype(at::kLong).device(dev);
  for (int b = 0; b < 3; ++b) {
    auto tokens = at::arange(24, opt).view({2, 12}) * (b + 1), targets = tokens.flip(1) + b;
    auto mask = (at::arange(24, opt).view({2, 12}) % (b + 2)).ne(0);
    auto want = sums_of(tokens, targets, mask);
    auto got = g.run(tokens, targets, mask, sums_of);
    EXPECT_TRUE(g.captured());
    EXPECT_TRUE(at::equal(got.sums, want.sums)) << "batch " << b << ": " << got.sums << " vs " << want.sums;
    EXPECT_TRUE(at::equal(got.norm, want.norm)) << "batch " << b;
  }
  auto other = at::zeros({2, 8}, opt);
  try {
    g.run(other, other, other.ne(0), sums_of);
    ADD_FAILURE() << "a batch of other shapes was taken";
  } catch (const c10::Error& e) {
    const std::string m = e.what_without_backtrace();
    EXPECT_NE(m.find("parallel.cuda_graph: the step's tokens are [2, 8]"), std::string::npos) << m;
  }
}

TEST(GpuStepGraph, AHostReadInsideTheStepStopsWithTheReason) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const at::Device dev(at::kCUDA, 0);
  auto tokens = at::ones({2, 4}, at::TensorOptions().dtype(at::kLong).device(dev));
  StepGraph g(dev);
  try {
    g.run(tokens, tokens, tokens.ne(0), [](const at::Tensor& t, const at::Tensor&, const at::Tensor& m) {
      const double n = static_cast<double>(t.sum().item<int64_t>());  // a host read: not capturable
      return StepGraph::Outputs{m.to(at::kDouble).sum() * n, t.to(at::kDouble).sum()};
    });
    ADD_FAILURE() << "a host read was captured";
  } catch (const c10::Error& e) {
    const std::string m = e.what_without_backtrace();
    EXPECT_EQ(m.rfind("parallel.cuda_graph: the training step could not be captured as a CUDA graph: ", 0), 0u) << m;
    EXPECT_NE(m.find("run without parallel.cuda_graph"), std::string::npos) << m;
  }
  EXPECT_EQ(at::ones({4}, tokens.options()).sum().item<int64_t>(), 4) << "the device after the failed capture";
}

}  // namespace
}  // namespace carry::testing
