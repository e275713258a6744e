// AdamW's two forms (framework/train/optimizer.h): on the CPU the per-parameter loop whatever `fused`
// says (bit for bit); on a GPU ATen's fused multi-tensor AdamW against the loop on the same device over
// several steps (parameters, exp_avg, exp_avg_sq), with decayed and undecayed parameters, a parameter
// without a gradient and one whose gradient is laid out unlike it; and the update split in two (each half
// of the parameters updated by its own optimizer over views of flat buffers, the gradient norm from the
// halves' parts) against the whole update, bit for bit on the CPU and on a GPU. The GPU tests skip
// without a GPU. The learning-rate schedules against their closed forms at the warmup, stable and decay
// boundaries, and the default (cosine) against the formula it has always had, bit for bit.
#include "framework/train/optimizer.h"
#include "layers/core/device.h"
#include "parallel/flat_layout.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
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

// lr 1, warmup 4, total 14 (a decay of 10 steps after the warmup), min_lr_ratio 0.1.
config::OptimizerConfig schedule_config(config::OptimizerConfig::Schedule schedule) {
  config::OptimizerConfig o;
  o.set_lr(1.0), o.set_warmup_steps(4), o.set_total_steps(14), o.set_min_lr_ratio(0.1);
  o.set_schedule(schedule);
  return o;
}

TEST(Optimizer, ScheduleWarmupThenCosine) {
  auto o = schedule_config(config::OptimizerConfig::COSINE);
  EXPECT_DOUBLE_EQ(learning_rate(o, 0), 0.25);
  EXPECT_DOUBLE_EQ(learning_rate(o, 3), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(o, 4), 1.0);
  EXPECT_NEAR(learning_rate(o, 9), 0.55, 1e-15);  // halfway: 0.1 + 0.9·0.5
  EXPECT_NEAR(learning_rate(o, 14), 0.1, 1e-15);
  EXPECT_NEAR(learning_rate(o, 100), 0.1, 1e-15);
}

// An unset schedule is the cosine, computed as it always was: the same bits for every step, so existing
// configs and checkpoints continue the same rates.
TEST(Optimizer, DefaultScheduleIsTheCosineBitForBit) {
  config::OptimizerConfig o;
  o.set_lr(3e-4), o.set_warmup_steps(7), o.set_total_steps(101), o.set_min_lr_ratio(0.1);
  EXPECT_EQ(o.schedule(), config::OptimizerConfig::COSINE);
  for (int64_t s = 0; s <= 110; ++s) {
    const double lr = 3e-4, ratio = 0.1;
    double expected;
    if (s < 7) {
      expected = lr * static_cast<double>(s + 1) / 7.0;
    } else {
      const double p = std::min(1.0, std::max(0.0, static_cast<double>(s - 7) / 94.0));
      expected = lr * (ratio + (1.0 - ratio) * 0.5 * (1.0 + std::cos(M_PI * p)));
    }
    const double got = learning_rate(o, s);
    EXPECT_EQ(std::memcmp(&got, &expected, sizeof got), 0) << "step " << s << ": " << got << " vs " << expected;
  }
}

TEST(Optimizer, ScheduleWarmupThenLinear) {
  auto o = schedule_config(config::OptimizerConfig::LINEAR);
  EXPECT_DOUBLE_EQ(learning_rate(o, 0), 0.25);
  EXPECT_DOUBLE_EQ(learning_rate(o, 3), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(o, 4), 1.0);
  EXPECT_NEAR(learning_rate(o, 6), 0.82, 1e-15);   // p = 0.2: 0.1 + 0.9·0.8
  EXPECT_NEAR(learning_rate(o, 9), 0.55, 1e-15);   // p = 0.5
  EXPECT_NEAR(learning_rate(o, 13), 0.19, 1e-15);  // p = 0.9: the last step of the run
  EXPECT_NEAR(learning_rate(o, 14), 0.1, 1e-15);
  EXPECT_NEAR(learning_rate(o, 100), 0.1, 1e-15);
}

TEST(Optimizer, ScheduleWarmupThenConstant) {
  auto o = schedule_config(config::OptimizerConfig::CONSTANT);
  EXPECT_DOUBLE_EQ(learning_rate(o, 0), 0.25);
  EXPECT_DOUBLE_EQ(learning_rate(o, 2), 0.75);
  for (int64_t s : {3, 4, 9, 13, 14, 100}) EXPECT_EQ(learning_rate(o, s), 1.0) << "step " << s;
  o.set_warmup_steps(0);
  EXPECT_EQ(learning_rate(o, 0), 1.0);
}

// WSD over 20 steps: warmup 4 (steps 0..3), stable at lr (4..15), a decay of round(0.2·20) = 4 steps
// (16..19, p = 0, 0.25, 0.5, 0.75), min_lr_ratio·lr from step 20 on.
TEST(Optimizer, ScheduleWarmupStableDecayForEveryShape) {
  auto o = schedule_config(config::OptimizerConfig::WSD);
  o.set_total_steps(20), o.set_decay_fraction(0.2);
  EXPECT_EQ(wsd_decay_steps(o), 4);
  const double r = 0.1;
  struct Case {
    config::LrDecay::Shape shape;
    double f25, f50, f75;  // the shape at p = 0.25, 0.5, 0.75
  };
  for (const Case& c : {Case{config::LrDecay::LINEAR, 0.75, 0.5, 0.25},
                        Case{config::LrDecay::COSINE, (1 + std::sqrt(0.5)) / 2, 0.5, (1 - std::sqrt(0.5)) / 2},
                        Case{config::LrDecay::ONE_MINUS_SQRT, 0.5, 1 - std::sqrt(0.5), 1 - std::sqrt(0.75)}}) {
    o.set_decay_shape(c.shape);
    SCOPED_TRACE(config::LrDecay::Shape_Name(c.shape));
    EXPECT_DOUBLE_EQ(learning_rate(o, 0), 0.25);
    EXPECT_DOUBLE_EQ(learning_rate(o, 3), 1.0);
    for (int64_t s = 4; s <= 16; ++s) EXPECT_EQ(learning_rate(o, s), 1.0) << "step " << s;  // stable, then p = 0
    EXPECT_NEAR(learning_rate(o, 17), r + (1 - r) * c.f25, 1e-15);
    EXPECT_NEAR(learning_rate(o, 18), r + (1 - r) * c.f50, 1e-15);
    EXPECT_NEAR(learning_rate(o, 19), r + (1 - r) * c.f75, 1e-15);
    EXPECT_NEAR(learning_rate(o, 20), r, 1e-15);
    EXPECT_NEAR(learning_rate(o, 1000), r, 1e-15);
  }
  // To zero: the decay ends at 0.
  o.set_min_lr_ratio(0.0), o.set_decay_shape(config::LrDecay::ONE_MINUS_SQRT);
  EXPECT_NEAR(learning_rate(o, 17), 0.5, 1e-15);
  EXPECT_EQ(learning_rate(o, 20), 0.0);
}

// The decay's length rounds to the nearest step (halves away from zero); a decay that fills all the
// steps after the warmup starts right after it.
TEST(Optimizer, WsdDecayStepsRoundAndMayFollowTheWarmup) {
  auto o = schedule_config(config::OptimizerConfig::WSD);
  o.set_total_steps(10);
  o.set_decay_fraction(0.15);
  EXPECT_EQ(wsd_decay_steps(o), 2);  // 1.5
  o.set_decay_fraction(0.14);
  EXPECT_EQ(wsd_decay_steps(o), 1);
  o.set_decay_fraction(0.6), o.set_warmup_steps(4), o.set_decay_shape(config::LrDecay::LINEAR);
  EXPECT_EQ(wsd_decay_steps(o), 6);
  EXPECT_DOUBLE_EQ(learning_rate(o, 3), 1.0);  // the warmup's last step
  EXPECT_EQ(learning_rate(o, 4), 1.0);         // p = 0
  EXPECT_NEAR(learning_rate(o, 7), 0.1 + 0.9 * 0.5, 1e-15);
  o.set_decay_fraction(1.0), o.set_warmup_steps(0);  // the whole run decays: the linear schedule
  auto linear = schedule_config(config::OptimizerConfig::LINEAR);
  linear.set_total_steps(10), linear.set_warmup_steps(0);
  for (int64_t s = 0; s <= 10; ++s) EXPECT_EQ(learning_rate(o, s), learning_rate(linear, s)) << "step " << s;
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

// The update split over two ranks as the trainer splits it (sharded_update.h), in one process: two
// copies of the parameters moved into flat buffers of a two-piece layout, each copy's optimizer limited
// to one piece and holding that piece's moments only (buffers of the piece), the clipping norm assembled
// from each piece's parts; after every step the second copy's piece of the parameters is copied into the
// first (the all-gather). Parameters, the held moments and norms equal the whole update's bit for bit,
// over steps with clipping active and not; the moments not held stay absent, and loading the whole
// update's state keeps only the piece's.
void split_update_equals_the_whole(at::Device device) {
  const int64_t sizes[][2] = {{96, 40}, {6, 1}, {40, 1}, {3, 5}, {64, 33}, {7, 1}, {130, 1}};
  auto make = [&] {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    NamedParameters ps;
    int i = 0;
    for (auto& s : sizes) {
      auto shape = s[1] == 1 ? std::vector<int64_t>{s[0]} : std::vector<int64_t>{s[0], s[1]};
      ps.emplace_back("p" + std::to_string(i++), at::randn(shape, gen, at::kFloat).to(device).set_requires_grad(true));
    }
    return ps;
  };
  auto whole = make(), a = make(), b = make();
  std::vector<int64_t> numels;
  for (auto& [n, p] : whole) numels.push_back(p.numel());
  const auto layout = parallel::FlatLayout::make(numels, 2);
  const int cut = layout.piece_first[1], n = static_cast<int>(whole.size());
  ASSERT_GT(cut, 0);
  ASSERT_LT(cut, n);
  AdamW opt_whole(whole, adam_config()), opt_a(a, adam_config()), opt_b(b, adam_config());
  std::vector<Tensor> flat_a, flat_b;  // parameters (the whole layout), exp_avg and exp_avg_sq (one piece)
  for (auto* ps : {&a, &b}) {
    auto& flats = ps == &a ? flat_a : flat_b;
    flats.push_back(at::zeros({layout.numel}, (*ps)[0].second.options()));
    for (int k = 1; k < 3; ++k) flats.push_back(at::zeros({layout.piece_numel}, (*ps)[0].second.options()));
    at::NoGradGuard no_grad;
    for (int i = 0; i < n; ++i) {
      auto& p = (*ps)[i].second;
      auto v = flats[0].narrow(0, layout.offset[i], p.numel()).view(p.sizes());
      v.copy_(p.detach());
      p.set_data(v);
    }
    if (ps == &a) opt_a.place_state(flats[1], flats[2], layout.offset, 0, cut, 0);
    else opt_b.place_state(flats[1], flats[2], layout.offset, cut, n, layout.piece_numel);
  }
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(opt_a.holds(i), i < cut) << i;
    EXPECT_EQ(opt_b.holds(i), i >= cut) << i;
  }
  opt_a.update_only(0, cut), opt_b.update_only(cut, n);
  for (int t = 1; t <= 5; ++t) {
    const double max_norm = t % 2 ? 0.5 : 1e9;  // odd steps clip
    auto gen = at::make_generator<at::CPUGeneratorImpl>(200 + t);
    std::vector<Tensor> g_whole, g_a, g_b;
    for (int i = 0; i < n; ++i) {
      auto g = (at::randn(whole[i].second.sizes(), gen, at::kFloat) * at::exp(at::randn({1}, gen, at::kFloat) * 3)).to(device);
      whole[i].second.mutable_grad() = g.clone();
      if (i < cut) a[i].second.mutable_grad() = g.clone(), g_a.push_back(a[i].second.grad());
      else b[i].second.mutable_grad() = g.clone(), g_b.push_back(b[i].second.grad());
      g_whole.push_back(whole[i].second.grad());
    }
    auto norm_whole = clip_grad_norm_on_device(whole, max_norm);
    auto parts = at::zeros({n}, at::TensorOptions().dtype(at::kDouble).device(device));
    parts.narrow(0, 0, cut).add_(gradient_norm_parts(g_a));
    parts.narrow(0, cut, n - cut).add_(gradient_norm_parts(g_b));
    auto norm = parts.sum().sqrt();
    EXPECT_TRUE(at::equal(norm, norm_whole)) << "step " << t << ": " << norm.item<double>() << " vs "
                                             << norm_whole.item<double>();
    scale_gradients(g_a, norm, max_norm), scale_gradients(g_b, norm, max_norm);
    opt_whole.step(0.01), opt_a.step(0.01), opt_b.step(0.01);
    // The all-gather: the second piece from b.
    const auto piece = [&](const Tensor& f) { return f.narrow(0, layout.piece_numel, layout.piece_numel); };
    piece(flat_a[0]).copy_(piece(flat_b[0]));
    for (int i = 0; i < n; ++i)
      EXPECT_TRUE(at::equal(a[i].second, whole[i].second)) << "step " << t << ", parameter " << i;
    auto sa = opt_a.state(), sb = opt_b.state(), sw = opt_whole.state();
    ASSERT_EQ(sa.size(), sw.size());
    for (size_t j = 0; j < sw.size(); ++j) {
      const bool in_a = static_cast<int>(j % n) < cut;
      const auto& held = in_a ? sa[j].second : sb[j].second;
      const auto& absent = in_a ? sb[j].second : sa[j].second;
      ASSERT_TRUE(held.defined()) << sw[j].first;
      EXPECT_FALSE(absent.defined()) << sw[j].first;
      EXPECT_TRUE(at::equal(held, sw[j].second)) << "step " << t << ", " << sw[j].first;
    }
  }
  // The whole state loaded: each optimizer keeps its piece's moments, checks the others, holds nothing more.
  auto again = make();
  AdamW opt_again(again, adam_config());
  auto moments = at::zeros({layout.piece_numel}, again[0].second.options()), squares = at::zeros_like(moments);
  opt_again.place_state(moments, squares, layout.offset, 0, cut, 0);
  opt_again.load_state(opt_whole.state(), opt_whole.steps());
  auto sg = opt_again.state(), sw = opt_whole.state();
  for (size_t j = 0; j < sw.size(); ++j) {
    if (static_cast<int>(j % n) < cut) EXPECT_TRUE(at::equal(sg[j].second, sw[j].second)) << sw[j].first;
    else EXPECT_FALSE(sg[j].second.defined()) << sw[j].first;
  }
  auto wrong = opt_whole.state();
  wrong.back().second = at::zeros({3}, wrong.back().second.options());  // a piece this optimizer does not hold
  EXPECT_THROW(opt_again.load_state(wrong, 1), c10::Error);
}

TEST(Optimizer, SplitUpdateEqualsTheWholeOnTheCpu) { split_update_equals_the_whole(at::kCPU); }

TEST(Optimizer, SplitUpdateEqualsTheWholeOnCuda) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
  split_update_equals_the_whole(at::Device(at::kCUDA, 0));
}

}  // namespace
}  // namespace carry
