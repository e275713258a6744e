// AdamW's two forms (framework/train/optimizer.h): on the CPU the per-parameter loop whatever `fused`
// says (bit for bit); on a GPU ATen's fused multi-tensor AdamW against the loop on the same device over
// several steps (parameters, exp_avg, exp_avg_sq), with decayed and undecayed parameters, a parameter
// without a gradient and one whose gradient is laid out unlike it. The GPU test skips without a GPU.
#include "framework/train/optimizer.h"
#include "layers/common/device.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdio>
#include <string>
#include <vector>

namespace carry {
namespace {

using at::Tensor;

config::OptimizerConfig adam_config() {
  config::OptimizerConfig o;
  o.set_beta1(0.9), o.set_beta2(0.95), o.set_eps(1e-8), o.set_weight_decay(0.1);
  return o;
}

// Parameters of every kind the model has: matrices (decayed), a conv weight [C,1,K] (decayed), a norm
// vector and a per-head scalar (not decayed).
NamedParameters make_parameters(at::ScalarType dt, at::Device device, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto o = at::TensorOptions().dtype(at::kDouble);
  NamedParameters ps;
  ps.emplace_back("w", at::randn({33, 17}, gen, o));
  ps.emplace_back("conv", at::randn({8, 1, 4}, gen, o));
  ps.emplace_back("norm", at::randn({17}, gen, o));
  ps.emplace_back("scalar", at::randn({1}, gen, o));
  ps.emplace_back("unused", at::randn({5, 3}, gen, o));  // never gets a gradient
  for (auto& [name, p] : ps) p = p.to(device, dt).set_requires_grad(true);
  return ps;
}

// Step t's gradients (the same on every copy); "w" gets a transposed (non-contiguous) gradient.
void set_gradients(NamedParameters& ps, int t) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + t);
  for (auto& [name, p] : ps) {
    if (name == "unused") continue;
    auto g = at::randn(p.sizes(), gen, at::TensorOptions().dtype(at::kDouble)) * (0.5 * t);
    if (name == "w") g = g.t().contiguous().t();
    p.mutable_grad() = g.to(p.device(), p.scalar_type());
  }
}

double rel_err(const Tensor& a, const Tensor& b) {
  auto ad = a.detach().to(at::kCPU, at::kDouble), bd = b.detach().to(at::kCPU, at::kDouble);
  return (ad - bd).abs().max().item<double>() / std::max(bd.abs().max().item<double>(), 1e-30);
}

// Runs `steps` steps of both optimizers; returns the worst relative error over parameters and state.
double compare(AdamW& a, NamedParameters& pa, AdamW& b, NamedParameters& pb, int steps) {
  for (int t = 1; t <= steps; ++t) {
    set_gradients(pa, t), set_gradients(pb, t);
    const double lr = 0.01 * t;
    a.step(lr), b.step(lr);
  }
  double worst = 0;
  for (size_t i = 0; i < pa.size(); ++i) worst = std::max(worst, rel_err(pa[i].second, pb[i].second));
  auto sa = a.state(), sb = b.state();
  EXPECT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].first, sb[i].first);
    worst = std::max(worst, rel_err(sa[i].second, sb[i].second));
  }
  return worst;
}

TEST(Optimizer, CpuParametersTakeTheLoopWhateverFusedSays) {
  auto pa = make_parameters(at::kFloat, at::kCPU, 1), pb = make_parameters(at::kFloat, at::kCPU, 1);
  AdamW fused(pa, adam_config(), /*fused=*/true), loop(pb, adam_config(), /*fused=*/false);
  EXPECT_EQ(compare(fused, pa, loop, pb, 4), 0.0);
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(at::equal(pa[i].second, pb[i].second)) << pa[i].first;
}

TEST(Optimizer, FusedAdamWOnCudaEqualsTheLoop) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
  const at::Device gpu(at::kCUDA, 0);
  for (auto dt : {at::kFloat, at::kDouble}) {
    auto pa = make_parameters(dt, gpu, 2), pb = make_parameters(dt, gpu, 2);
    auto unused_before = pa[4].second.detach().clone();
    AdamW fused(pa, adam_config(), /*fused=*/true), loop(pb, adam_config(), /*fused=*/false);
    const double e = compare(fused, pa, loop, pb, 6);
    std::printf("[ errors   ] fused AdamW vs loop on cuda (%s, 6 steps, parameters and state): %.3e\n",
                dt == at::kFloat ? "fp32" : "fp64", e);
    EXPECT_LE(e, dt == at::kFloat ? 1e-6 : 1e-13);
    EXPECT_GT(rel_err(pa[4].second, unused_before), 0.0) << "the decay of a parameter without gradient did not run";
    EXPECT_EQ(fused.steps(), 6);
    // The state restores across the forms (the checkpoint format is the same).
    AdamW again(pb, adam_config(), /*fused=*/true);
    again.load_state(fused.state(), fused.steps());
    for (size_t i = 0; i < again.state().size(); ++i)
      EXPECT_TRUE(at::equal(again.state()[i].second, fused.state()[i].second));
  }
}

}  // namespace
}  // namespace carry
