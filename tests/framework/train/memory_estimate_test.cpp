// Tests for framework/train/memory_estimate.h: the counting allocator sees what stays and what peaks;
// the estimate's parameter count is the model's; a layer's activations extrapolated from three short
// lengths match a direct measurement at the run's length (a chunkwise Gated DeltaNet layer: linear in
// the length; full causal softmax attention: quadratic); recomputation needs less than keeping.
#include "framework/train/memory_estimate.h"

#include "framework/model/model.h"
#include "tests/helpers/one_thread.h"

#include <gtest/gtest.h>

#include <c10/core/CPUAllocator.h>

#include <cmath>
#include <cstring>

namespace carry {
namespace {

using testing::OneCpuThread;

TEST(MemoryEstimate, CountingAllocatorSeesWhatStaysAndThePeak) {
  at::Tensor kept;
  auto m = measure_cpu_allocation([&] {
    kept = at::ones({256, 1024}, at::kFloat);         // 1 MiB, kept
    auto temp = at::ones({1024, 1024}, at::kFloat);   // 4 MiB, freed
    kept += temp.sum();
  });
  EXPECT_NEAR(m.live_bytes, 1 << 20, 4096);
  EXPECT_GE(m.peak_bytes, 5 << 20);
  EXPECT_LT(m.peak_bytes, (5 << 20) + 65536);
  // Backward allocations count too: the gradient of a [512, 1000] log-softmax is 2 MB.
  auto x = at::randn({512, 1000}).requires_grad_(true);
  auto y = at::log_softmax(x, -1).sum();
  auto b = measure_cpu_allocation([&] { y.backward(); });
  EXPECT_GE(b.peak_bytes, 2.0 * 512 * 1000 * 4 * 0.99);
}

// ATen's raw_allocate (ATen's CPU matrix product, at::mm, reached it at the 340M preset's sizes) needs simple
// DataPtrs from the CPU allocator: under the counting allocator it works and is counted (the dry run
// of the 340M preset stopped with "dptr.get() == dptr.get_context() INTERNAL ASSERT FAILED" before).
TEST(MemoryEstimate, RawAllocationsWorkAndCount) {
  auto m = measure_cpu_allocation([&] {
    c10::Allocator* a = c10::GetCPUAllocator();
    void* p = a->raw_allocate(3 << 20);
    ASSERT_NE(p, nullptr);
    std::memset(p, 1, 3 << 20);
    a->raw_deallocate(p);
  });
  EXPECT_GE(m.peak_bytes, 3 << 20);
  EXPECT_NEAR(m.live_bytes, 0, 4096);
}

const char* kRun = R"(
name: "memory"
model { vocab_size: 96 d_model: 32 n_layers: 3 n_heads: 2 mixers: ["gated_deltanet", "softmax_attn"]
        mixer_options { chunk_size: 32 } }
data { mqar { num_kv_pairs: 4 num_queries: 4 vocab_size: 96 } seq_len: 512 batch_size: 2 }
)";

// The direct measurement of one block at batch B and length t.
double block_bytes(const Model& model, int i, int64_t B, int64_t t) {
  const auto& b = model.blocks()[i];
  auto x = at::randn({B, t, model.config().d_model()}).requires_grad_(true);
  at::Tensor y;
  return measure_cpu_allocation([&] {
           auto h = x + b.mixer->forward(b.mixer_norm.forward(x), {}, {}).y;
           y = h + b.mlp.forward(b.mlp_norm.forward(h));
         })
      .live_bytes;
}

// parallel.deferred_head_gradient_mib: at sp = 2 under the ORDERED scan the rank after the first holds
// its slice's logit gradients (up to the budget) beside the head's: the estimate's head grows by that.
TEST(MemoryEstimate, CountsTheDeferredHeadGradient) {
  OneCpuThread one_thread;
  auto cfg = run_config_from_text(kRun, "memory.textproto");
  cfg.mutable_parallel()->set_sp(2);
  cfg.mutable_parallel()->set_recompute_overlap(false);
  auto off = cfg;
  off.mutable_parallel()->set_deferred_head_gradient_mib(0);
  auto with = estimate_memory(cfg), without = estimate_memory(off);
  ASSERT_EQ(with.slice_tokens, 256);
  const double logits = 2.0 * 256 * 96 * (cfg.precision() == RunConfig::BF16 ? 2 : 4);  // all of it: under the budget
  EXPECT_NEAR(with.head_bytes - without.head_bytes, logits, 1e-6 * logits);
  EXPECT_NEAR(with.total_kept - without.total_kept, logits, 1e-6 * with.total_kept);
  // One rank: nothing deferred.
  auto one = cfg, one_off = off;
  one.mutable_parallel()->set_sp(1), one_off.mutable_parallel()->set_sp(1);
  EXPECT_EQ(estimate_memory(one).head_bytes, estimate_memory(one_off).head_bytes);
}

TEST(MemoryEstimate, ExtrapolationMatchesADirectMeasurement) {
  OneCpuThread one_thread;
  auto cfg = run_config_from_text(kRun, "memory.textproto");
  cfg.mutable_parallel()->set_recompute_overlap(false);  // one layer rebuilt at a time; the overlap below
  auto m = estimate_memory(cfg);
  Model full = build_model(cfg.model(), cfg.seed());
  EXPECT_EQ(m.parameters, full.num_parameters());
  EXPECT_EQ(m.parameter_bytes, 4.0 * full.num_parameters());
  EXPECT_EQ(m.optimizer_bytes, 2 * m.parameter_bytes);
  EXPECT_FALSE(m.moments_split);
  // At sp = 2 under the ordered scan each rank holds the moments of half the parameters (shard_update).
  auto sp2 = cfg;
  sp2.mutable_parallel()->set_sp(2);
  sp2.mutable_parallel()->set_scan_mode(config::ParallelConfig::ORDERED);
  auto half = estimate_memory(sp2);
  EXPECT_TRUE(half.moments_split);
  EXPECT_EQ(half.optimizer_bytes, m.parameter_bytes);
  sp2.mutable_parallel()->set_shard_update(false);
  EXPECT_EQ(estimate_memory(sp2).optimizer_bytes, 2 * m.parameter_bytes);
  ASSERT_EQ(m.layers.size(), 3u);
  EXPECT_EQ(m.slice_tokens, 512);
  ASSERT_EQ(m.measured_at.size(), 3u);
  EXPECT_LT(m.measured_at.back(), 512) << "the point is to extrapolate";
  for (int i = 0; i < 2; ++i) {
    const double direct = block_bytes(full, i, 2, 512);
    const double rel = std::abs(m.layers[i].kept_bytes - direct) / direct;
    std::printf("[ errors   ] memory estimate, layer %d (%s), extrapolated vs measured at T=512: %.3g (%.0f vs %.0f bytes)\n",
                i, m.layers[i].kind.c_str(), rel, m.layers[i].kept_bytes, direct);
    EXPECT_LT(rel, 0.03) << m.layers[i].kind;
    EXPECT_GT(m.layers[i].backward_bytes, 0);
  }
  EXPECT_EQ(m.layers[2].kept_bytes, m.layers[0].kept_bytes);  // layer 2 is layer 0's kind again
  // Quadratic attention costs more per token than the linear layer at this length.
  EXPECT_GT(m.layers[1].kept_bytes, m.layers[0].kept_bytes);
  // The chunked loss keeps at least the gradient of the hidden states [2, 512, 32] fp32 and of the head.
  EXPECT_GT(m.head_bytes, 2.0 * 512 * 32 * 4 + 96 * 32 * 4);
  EXPECT_LT(m.total_recomputed, m.total_kept);
  // Recomputation around kept mixer cores keeps each core's saved tensors beside the layer inputs:
  // more than full recomputation, at most what the layer keeps without recomputation.
  for (const auto& l : m.layers) {
    EXPECT_GT(l.core_bytes, 0) << l.kind;
    EXPECT_LE(l.core_bytes, l.kept_bytes) << l.kind;
  }
  EXPECT_LT(m.total_recomputed, m.total_keeps_mixer);
  EXPECT_LE(m.total_keeps_mixer, m.total_kept);
  // parallel.recompute_keep_last: with every layer kept the recomputed peak is the kept one; with none,
  // the layer inputs, the head and the largest rebuilt layer; the default (1) lies between.
  {
    auto all = cfg, none = cfg;
    all.mutable_parallel()->set_recompute_keep_last(3);
    none.mutable_parallel()->set_recompute_keep_last(0);
    auto ma = estimate_memory(all), mn = estimate_memory(none);
    // (the kept peak leaves out the embedding's output, the first layer's input)
    EXPECT_NEAR(ma.total_recomputed, ma.total_kept + ma.layers[0].input_bytes, 1e-6 * ma.total_kept);
    double rebuilt = 0;
    for (const auto& l : mn.layers) rebuilt = std::max(rebuilt, l.kept_bytes + l.backward_bytes);
    const double fixed = mn.parameter_bytes + mn.gradient_bytes + mn.optimizer_bytes;
    EXPECT_NEAR(mn.total_recomputed, fixed + 3 * mn.layers[0].input_bytes + mn.head_bytes + std::max(mn.head_backward_bytes, rebuilt),
                1e-6 * mn.total_recomputed);
    EXPECT_LE(mn.total_recomputed, m.total_recomputed);
    EXPECT_LE(m.total_recomputed, ma.total_recomputed);
    EXPECT_LT(mn.activations_recomputed, m.activations_recomputed);
    // parallel.recompute_overlap: while a layer is rebuilt and differentiated the one below is rebuilt
    // already, so the rebuilt term grows by the largest recomputed layer's activations.
    auto overlap = none;
    overlap.mutable_parallel()->set_recompute(true);
    overlap.mutable_parallel()->set_recompute_overlap(true);
    auto mo = estimate_memory(overlap);
    double largest = 0;
    for (const auto& l : mo.layers) largest = std::max(largest, l.kept_bytes);
    EXPECT_NEAR(mo.total_recomputed,
                fixed + 3 * mo.layers[0].input_bytes + mo.head_bytes + std::max(mo.head_backward_bytes, rebuilt + largest),
                1e-6 * mo.total_recomputed);
    EXPECT_NE(memory_report(mo, overlap).find("two layers rebuilt at a time"), std::string::npos);
  }
  auto report = memory_report(m, cfg);
  EXPECT_NE(report.find("peak, recomputed around kept mixers"), std::string::npos) << report;
  EXPECT_NE(report.find("layer 1 softmax_attn"), std::string::npos) << report;
  EXPECT_NE(report.find("<- this config (parallel.recompute: false)"), std::string::npos) << report;
}

}  // namespace
}  // namespace carry

namespace carry {
namespace {

// Three measurements of a linear layer, the middle one 0.4 MiB high (allocator rounding, bf16 casts): the
// parabola through them bends down and at 131072 tokens (341 times the last length) would be negative;
// the estimate stays on the line. A quadratic cost still extrapolates as its parabola.
TEST(MemoryEstimate, NearlyCollinearPointsExtrapolateOnTheLine) {
  const double MiB = 1024.0 * 1024;
  const std::vector<double> xs = {128, 256, 384};
  const double line = 170.7 * MiB + 52.2 * MiB / 128 * (131072 - 384);
  EXPECT_NEAR(extrapolate_bytes(xs, {65.9 * MiB, 118.5 * MiB, 170.7 * MiB}, 131072), line, 1e-9 * line);
  // y = t²: the parabola itself.
  EXPECT_NEAR(extrapolate_bytes(xs, {128.0 * 128, 256.0 * 256, 384.0 * 384}, 4096), 4096.0 * 4096, 1e-3);
}

// Far past the measured lengths (32 times the last) a layer whose cost is linear stays on its line:
// KDA and RWKV-7 layers at 8192 tokens against a direct measurement (three nearly collinear points
// must not give a parabola bent below the line).
TEST(MemoryEstimate, LinearLayersExtrapolateFarOnTheirLine) {
  OneCpuThread one_thread;
  for (const char* kind : {"kda", "rwkv7"}) {
    auto cfg = run_config_from_text(std::string(R"(
name: "memory"
model { vocab_size: 96 d_model: 32 n_layers: 1 n_heads: 2 head_dim_k: 16 head_dim_v: 16 mixers: ")") + kind +
                                    R"(" mixer_options { chunk_size: 32 } }
data { mqar { num_kv_pairs: 4 num_queries: 4 vocab_size: 96 } seq_len: 8192 batch_size: 1 }
)", "memory.textproto");
    auto m = estimate_memory(cfg);
    ASSERT_EQ(m.measured_at.size(), 3u);
    Model full = build_model(cfg.model(), cfg.seed());
    const double direct = block_bytes(full, 0, 1, 8192);
    const double rel = std::abs(m.layers[0].kept_bytes - direct) / direct;
    std::printf("[ errors   ] memory estimate, %s layer at T=8192 (measured at %ld..%ld): %.3g (%.0f vs %.0f bytes)\n", kind,
                static_cast<long>(m.measured_at.front()), static_cast<long>(m.measured_at.back()), rel,
                m.layers[0].kept_bytes, direct);
    EXPECT_LT(rel, 0.05) << kind;
  }
}

}  // namespace
}  // namespace carry
