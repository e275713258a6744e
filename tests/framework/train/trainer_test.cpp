// The trainer on one process (CPU, fp32): 10 steps straight equal 5 steps + checkpoint + resume + 5
// steps bit for bit (losses, learning rates and parameters; cosine and WSD schedules); the loss falls on
// MQAR; AdamW against a hand-computed update (decay only on 2+-dim parameters); gradient clipping;
// layout errors. Multi-rank equality (sp, dp) is in trainer_test_mpi.cpp.
#include "framework/train/optimizer.h"
#include "framework/io/checkpoint.h"
#include "framework/cli/train_command.h"
#include "framework/train/trainer.h"
#include "layers/core/device.h"
#include "tests/helpers/temp_dir.h"

#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <iterator>

#include <signal.h>

namespace carry::testing {
namespace {

const char* kTinyMqar = R"(
name: "trainer_test"
seed: 7
model {
  vocab_size: 32 d_model: 32 n_layers: 2 n_heads: 2
  mixers: "gated_deltanet"
  mixer_options { chunk_size: 16 conv_size: 4 }
}
data { mqar { num_kv_pairs: 4 num_queries: 4 vocab_size: 32 } seq_len: 64 batch_size: 4 eval_batches: 2 }
optimizer { lr: 1e-2 warmup_steps: 2 total_steps: 10 }
logging { every_steps: 1 }
)";

RunConfig tiny_config(const std::vector<std::string>& overrides = {}) {
  return run_config_from_text(kTinyMqar, "trainer_test.textproto", overrides);
}

TrainerOptions quiet() {
  TrainerOptions o;
  o.log = nullptr;
  o.force_cpu = true;
  return o;
}

// first + rest steps straight against `first`, a checkpoint, a resume and `rest` more, under
// `overrides`: the same losses and learning rates bit for bit, then the same parameters and optimizer
// state.
void check_resume_continues_bit_identically(const std::vector<std::string>& overrides, int first, int rest) {
  auto dir = make_temp_dir("carry_trainer_resume");
  std::vector<double> straight, resumed, straight_lr, resumed_lr;
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), overrides.begin(), overrides.end());
    return tiny_config(more);
  };
  Trainer a(with({}), nullptr, quiet());
  for (int i = 0; i < first + rest; ++i) {
    auto s = a.train_step();
    straight.push_back(s.loss), straight_lr.push_back(s.lr);
  }
  auto cfg = with({"checkpoint.dir=" + dir});
  {
    Trainer b(cfg, nullptr, quiet());
    EXPECT_FALSE(b.resume());
    for (int i = 0; i < first; ++i) {
      auto s = b.train_step();
      resumed.push_back(s.loss), resumed_lr.push_back(s.lr);
    }
    b.save_checkpoint();
  }
  Trainer c(cfg, nullptr, quiet());
  ASSERT_TRUE(c.resume());
  EXPECT_EQ(c.step(), first);
  EXPECT_EQ(c.tokens_seen(), first * 4 * 64);
  for (int i = 0; i < rest; ++i) {
    auto s = c.train_step();
    resumed.push_back(s.loss), resumed_lr.push_back(s.lr);
  }
  ASSERT_EQ(straight.size(), resumed.size());
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_EQ(std::memcmp(&straight[i], &resumed[i], sizeof(double)), 0)
        << "step " << i + 1 << ": " << straight[i] << " vs " << resumed[i];
    EXPECT_EQ(std::memcmp(&straight_lr[i], &resumed_lr[i], sizeof(double)), 0)
        << "step " << i + 1 << ": lr " << straight_lr[i] << " vs " << resumed_lr[i];
    EXPECT_EQ(straight_lr[i], learning_rate(cfg.optimizer(), static_cast<int64_t>(i))) << "step " << i + 1;
  }
  auto pa = a.model().parameters(), pc = c.model().parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(at::equal(pa[i].second, pc[i].second)) << pa[i].first;
  auto sa = a.optimizer().state(), sc = c.optimizer().state();
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_TRUE(at::equal(sa[i].second, sc[i].second)) << sa[i].first;
  EXPECT_NE(straight.front(), straight.back());
  remove_tree(dir);
}

TEST(Trainer, ResumeContinuesBitIdentically) { check_resume_continues_bit_identically({}, 5, 5); }

// WSD over 6 steps: warmup 1 (step 0), stable (1..2), decay (3..5); the resume after step 4 falls in the
// decay.
TEST(Trainer, ResumeContinuesBitIdenticallyUnderWsd) {
  check_resume_continues_bit_identically({"optimizer.schedule=WSD", "optimizer.total_steps=6", "optimizer.warmup_steps=1",
                                          "optimizer.decay_fraction=0.5", "optimizer.decay_shape=ONE_MINUS_SQRT"},
                                         4, 2);
}

TEST(Trainer, LossFallsOnMqar) {
  auto cfg = tiny_config({"optimizer.total_steps=40", "optimizer.warmup_steps=5"});
  Trainer t(cfg, nullptr, quiet());
  double first = 0, last = 0;
  for (int i = 0; i < 40; ++i) {
    auto s = t.train_step();
    ASSERT_TRUE(std::isfinite(s.loss) && std::isfinite(s.grad_norm));
    if (i == 0) first = s.loss;
    last = s.loss;
  }
  EXPECT_LT(last, first - 0.3) << "loss " << first << " -> " << last;
  auto e = t.evaluate();
  EXPECT_EQ(e.positions, 2 * 4 * 4);  // eval_batches × batch × queries
  EXPECT_GE(e.accuracy, 0.0);
  EXPECT_LE(e.accuracy, 1.0);
}

TEST(Trainer, RunWritesMetricsAndCheckpoints) {
  auto dir = make_temp_dir("carry_trainer_run");
  auto cfg = tiny_config({"checkpoint.dir=" + dir + "/ck", "checkpoint.every_steps=4",
                          "logging.metrics_file=" + dir + "/m/metrics.jsonl", "logging.eval_every_steps=5"});
  {
    Trainer t(cfg, nullptr, quiet());
    EXPECT_EQ(t.run(), 0);
    EXPECT_EQ(t.step(), 10);
  }
  std::FILE* f = std::fopen((dir + "/m/metrics.jsonl").c_str(), "r");
  ASSERT_TRUE(f);
  int lines = 0, evals = 0;
  char buf[1024];
  while (std::fgets(buf, sizeof buf, f)) {
    ++lines;
    if (std::strstr(buf, "eval_accuracy")) ++evals;
  }
  std::fclose(f);
  EXPECT_EQ(lines, 13);  // the start marker, 10 steps, 2 evaluations
  EXPECT_EQ(evals, 2);
  EXPECT_TRUE(exists(dir + "/ck/latest"));
  // A finished run resumes at its last step and does nothing more.
  Trainer again(cfg, nullptr, quiet());
  ASSERT_TRUE(again.resume());
  EXPECT_EQ(again.step(), 10);
  remove_tree(dir);
}

// Per-layer recomputation changes what is kept, not what is computed: losses, gradients and so the
// parameters after 4 steps equal those without it bit for bit (fp64; a hybrid with short
// convolutions, Gated DeltaNet and sliding-window softmax attention).
TEST(Trainer, RecomputeGivesTheSameSteps) {
  std::vector<std::string> hybrid{"model.mixers=gated_deltanet,softmax_attn",
                                  "model.mixer_options[1]={kind: \"softmax_attn\" window: 8}"};
  auto o = quiet();
  o.dtype = at::kDouble;
  Trainer kept(tiny_config(hybrid), nullptr, o);
  hybrid.push_back("parallel.recompute=true");
  Trainer recomputed(tiny_config(hybrid), nullptr, o);
  double worst = 0;
  for (int i = 0; i < 4; ++i) {
    auto a = kept.train_step(), b = recomputed.train_step();
    EXPECT_EQ(a.loss, b.loss) << "step " << i + 1;
    EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << i + 1;
    worst = std::max(worst, std::abs(a.loss - b.loss));
  }
  auto pa = kept.model().parameters(), pb = recomputed.model().parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    worst = std::max(worst, (pa[i].second - pb[i].second).abs().max().item<double>());
    EXPECT_TRUE(at::equal(pa[i].second, pb[i].second)) << pa[i].first;
  }
  std::printf("[ errors   ] trainer recompute vs kept activations (fp64, 4 steps, gdn+swa): %.3e\n", worst);
}

// `steps` steps of three recomputed layers (extra settings added) with and without
// parallel.recompute_overlap: the same losses, gradient norms and parameters, bit for bit.
void expect_overlap_gives_the_same_steps(std::vector<std::string> settings, const TrainerOptions& o, int steps) {
  for (const char* s : {"model.n_layers=3", "parallel.recompute=true", "parallel.recompute_keep_last=0"})
    settings.push_back(s);
  settings.push_back("parallel.recompute_overlap=false");
  Trainer in_turn(tiny_config(settings), nullptr, o);
  settings.back() = "parallel.recompute_overlap=true";
  Trainer overlapped(tiny_config(settings), nullptr, o);
  for (int i = 0; i < steps; ++i) {
    auto a = in_turn.train_step(), b = overlapped.train_step();
    EXPECT_EQ(a.loss, b.loss) << "step " << i + 1;
    EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << i + 1;
  }
  auto pa = in_turn.model().parameters(), pb = overlapped.model().parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(at::equal(pa[i].second, pb[i].second)) << pa[i].first;
}

// Overlapped recomputation (parallel.recompute_overlap: each recomputed layer's second forward starts when
// the backward of the layer above starts) changes when a layer is recomputed, not what: 4 fp64 steps (on
// the CPU the layer below is recomputed in place; the GPU run, on side streams, is GpuTrainer's).
TEST(Trainer, OverlappedRecomputeGivesTheSameSteps) {
  auto o = quiet();
  o.dtype = at::kDouble;
  expect_overlap_gives_the_same_steps({}, o, 4);
  // Ordered segments run the model once a segment: each run's layers form a chain of their own (linked
  // across runs, the first layer of segment 2 recomputed segment 1's last layer ahead, in segment 2's
  // context: another gradient norm at step 1 on an H200, and here).
  expect_overlap_gives_the_same_steps({"parallel.scan_mode=ORDERED", "parallel.segments=2"}, o, 3);
}

// On a GPU (skipped without one): overlapped recomputation runs each layer's second forward on a side
// stream beside the backward of the layer above; 5 bf16 steps, bit for bit.
TEST(GpuTrainer, OverlappedRecomputeGivesTheSameSteps) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto on_gpu = quiet();
  on_gpu.force_cpu = false;
  expect_overlap_gives_the_same_steps({"precision=BF16"}, on_gpu, 5);
}

// precision BF16 (CPU autocast here; the GPU run is in gpu_test / the README): master weights and the
// optimizer state stay fp32, the losses follow the fp32 run closely but not bit for bit (the
// projections really ran in bf16), and recomputation under autocast repeats the bf16 forward exactly.
TEST(Trainer, Bf16AutocastKeepsFp32MastersAndTracksFp32) {
  Trainer fp32(tiny_config(), nullptr, quiet());
  Trainer bf16(tiny_config({"precision=BF16"}), nullptr, quiet());
  Trainer bf16_recompute(tiny_config({"precision=BF16", "parallel.recompute=true"}), nullptr, quiet());
  double worst = 0;
  bool any_differs = false;
  for (int i = 0; i < 5; ++i) {
    auto a = fp32.train_step(), b = bf16.train_step(), c = bf16_recompute.train_step();
    worst = std::max(worst, std::abs(a.loss - b.loss) / std::abs(a.loss));
    any_differs = any_differs || a.loss != b.loss;
    EXPECT_EQ(b.loss, c.loss) << "step " << i + 1 << ": recomputation under autocast";
  }
  std::printf("[ errors   ] trainer bf16 autocast vs fp32 (5 steps, loss, relative): %.3e\n", worst);
  EXPECT_LE(worst, 2e-2);
  EXPECT_TRUE(any_differs) << "bf16 autocast gave the fp32 losses bit for bit: it did not run";
  for (auto& [name, p] : bf16.model().parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat) << name;
  for (auto& [name, t] : bf16.optimizer().state()) EXPECT_EQ(t.scalar_type(), at::kFloat) << name;
  auto pb = bf16.model().parameters(), pc = bf16_recompute.model().parameters();
  for (size_t i = 0; i < pb.size(); ++i) EXPECT_TRUE(at::equal(pb[i].second, pc[i].second)) << pb[i].first;
  EXPECT_GT(bf16.evaluate().positions, 0);
}

// On a GPU (skipped without one): fp32 training on CUDA follows the CPU run to rounding; bf16
// autocast keeps fp32 masters and follows fp32; recomputation under bf16 gives the same steps.
TEST(GpuTrainer, Fp32Bf16AndRecomputeOnCuda) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto on_gpu = quiet();
  on_gpu.force_cpu = false;
  Trainer cpu(tiny_config(), nullptr, quiet());
  Trainer fp32(tiny_config(), nullptr, on_gpu);
  Trainer bf16(tiny_config({"precision=BF16"}), nullptr, on_gpu);
  Trainer bf16_recompute(tiny_config({"precision=BF16", "parallel.recompute=true"}), nullptr, on_gpu);
  Trainer bf16_keep(tiny_config({"precision=BF16", "parallel.recompute=true", "parallel.recompute_keeps_mixer=true"}),
                    nullptr, on_gpu);
  double e_fp32 = 0, e_bf16 = 0, e_recompute = 0, e_keep = 0;
  for (int i = 0; i < 5; ++i) {
    auto c = cpu.train_step(), a = fp32.train_step(), b = bf16.train_step(), r = bf16_recompute.train_step();
    auto k = bf16_keep.train_step();
    e_fp32 = std::max(e_fp32, std::abs(a.loss - c.loss) / c.loss);
    e_bf16 = std::max(e_bf16, std::abs(b.loss - a.loss) / a.loss);
    e_recompute = std::max(e_recompute, std::abs(r.loss - b.loss) / b.loss);
    e_keep = std::max(e_keep, std::abs(k.loss - b.loss) / b.loss);
  }
  std::printf("[ errors   ] gpu trainer (5 steps, losses): fp32 cuda vs cpu %.3e, bf16 vs fp32 %.3e, "
              "bf16 recomputed vs kept %.3e, recomputed around kept mixer cores vs kept %.3e\n", e_fp32, e_bf16,
              e_recompute, e_keep);
  EXPECT_LE(e_fp32, 1e-4);
  EXPECT_LE(e_bf16, 2e-2);
  EXPECT_LE(e_recompute, 1e-6);
  EXPECT_LE(e_keep, 1e-6);
  for (auto& [name, p] : bf16.model().parameters()) {
    EXPECT_TRUE(p.is_cuda()) << name;
    EXPECT_EQ(p.scalar_type(), at::kFloat) << name;
  }
}

// CARRY_SYNC_DEBUG=error turns every synchronizing CUDA call inside a training step into an error,
// except the batch upload and the step's one sanctioned read (loss sums, stop flag, gradient norm):
// fp32 and bf16 steps on CUDA, with gradient accumulation too, run through. The switch is read once a
// process, so this test runs only when the caller set it (skipped otherwise, and without a GPU):
//   CARRY_SYNC_DEBUG=error bin/carry_tests --gtest_filter='GpuTrainer.StepsRunWithoutHiddenSyncs'
// logging.comm_timing PHASES times the steps' phases: on a CPU by the host clock, so the four phases inside a
// step cover nearly all of train_step's time (on a GPU by CUDA events); every phase takes time; a second take starts from zero;
// without the switch nothing is timed. Three steps of each path: one batch, accumulated micro-batches,
// ordered segments.
void check_phase_times(bool on_cuda) {
  auto o = quiet();
  o.force_cpu = !on_cuda;
  for (auto extra : std::vector<std::vector<std::string>>{{}, {"optimizer.grad_accum_steps=2"}, {"parallel.segments=2"}}) {
    std::string what;
    for (auto& e : extra) what += e + " ";
    extra.push_back("logging.comm_timing=PHASES");
    Trainer t(tiny_config(extra), nullptr, o);
    double stepped = 0;
    for (int i = 0; i < 3; ++i) stepped += t.train_step().seconds;
    const auto phases = t.take_phase_seconds();
    std::vector<std::string> names;
    double inside = 0;
    for (auto& [phase, sec] : phases) {
      names.push_back(phase);
      EXPECT_GT(sec, 0.0) << what << phase;
      if (phase != "between steps") inside += sec;
    }
    EXPECT_EQ(names, (std::vector<std::string>{"forward", "backward", "gradient sum and clip", "update", "between steps"}))
        << what;
    if (!on_cuda) {  // on a GPU the last step's update runs after train_step has returned
      EXPECT_LE(inside, stepped) << what;
      EXPECT_GE(inside, 0.8 * stepped) << what;
    }
    t.train_step();
    const auto again = t.take_phase_seconds();
    EXPECT_EQ(again.size(), 5u) << what << ": one step, its five phases";
  }
  Trainer off(tiny_config(), nullptr, o);
  off.train_step();
  off.train_step();
  EXPECT_TRUE(off.take_phase_seconds().empty());
}

TEST(Trainer, PhaseTimesCoverTheStep) { check_phase_times(false); }

TEST(GpuTrainer, PhaseTimesCoverTheStep) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  check_phase_times(true);
}

TEST(GpuTrainer, StepsRunWithoutHiddenSyncs) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const char* v = std::getenv("CARRY_SYNC_DEBUG");
  if (!v || std::string(v) != "error") GTEST_SKIP() << "run with CARRY_SYNC_DEBUG=error";
  auto on_gpu = quiet();
  on_gpu.force_cpu = false;
  for (auto extra : std::vector<std::vector<std::string>>{{}, {"precision=BF16"}, {"optimizer.grad_accum_steps=2"}}) {
    Trainer t(tiny_config(extra), nullptr, on_gpu);
    for (int i = 0; i < 3; ++i) {
      auto s = t.train_step();
      EXPECT_TRUE(std::isfinite(s.loss));
      EXPECT_GT(s.grad_norm, 0);
    }
  }
}

// No allocation churn (on a GPU; skipped without one): once two steps have run, further steps take
// every buffer from the caching allocator's cache, with no new cudaMalloc and no retry, in fp32 and
// bf16, with recomputation (whole, around kept mixer cores, and overlapped with the backward) and with gradient
// accumulation.
TEST(GpuTrainer, SteadyStepsMallocNothing) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto on_gpu = quiet();
  on_gpu.force_cpu = false;
  for (auto extra : std::vector<std::vector<std::string>>{
           {}, {"precision=BF16"}, {"precision=BF16", "parallel.recompute=true"},
           {"precision=BF16", "parallel.recompute=true", "parallel.recompute_keeps_mixer=true"},
           {"precision=BF16", "parallel.recompute=true", "parallel.recompute_overlap=true", "model.n_layers=3",
            "parallel.recompute_keep_last=0"},
           {"optimizer.grad_accum_steps=2"}}) {
    Trainer t(tiny_config(extra), nullptr, on_gpu);
    for (int i = 0; i < 2; ++i) t.train_step();
    const CudaAllocatorCounts before = cuda_allocator_counts(0);
    for (int i = 0; i < 3; ++i) t.train_step();
    const CudaAllocatorCounts after = cuda_allocator_counts(0);
    std::string what;
    for (auto& e : extra) what += e + " ";
    EXPECT_EQ(after.mallocs, before.mallocs) << what << ": steps 3-5 called cudaMalloc";
    EXPECT_EQ(after.retries, before.retries) << what;
  }
}

// parallel.cuda_graph on a CPU (or in a build without CUDA) stops at the trainer's start, saying why.
TEST(Trainer, CudaGraphNeedsAGpu) {
  try {
    Trainer t(tiny_config({"parallel.cuda_graph=true"}), nullptr, quiet());
    ADD_FAILURE() << "a CPU trainer took parallel.cuda_graph";
  } catch (const c10::Error& e) {
    const std::string m = e.what_without_backtrace();
    EXPECT_EQ(m.rfind("parallel.cuda_graph: true needs ", 0), 0u) << m;
  }
}

// The step as a CUDA graph (parallel.cuda_graph: captured at the second step, replayed from then on)
// computes what the eager step does: 6 steps, the same losses, gradient norms and parameters bit for
// bit, in fp32 (ATen forms; RetNet too), bf16, on the kernel forms (dk = 64, chunks of 64), and with overlapped
// recomputation (its side streams inside the capture), with an evaluation (eager) between two steps.
// On a GPU; skipped without one.
TEST(GpuTrainer, CudaGraphGivesTheSameSteps) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto on_gpu = quiet();
  on_gpu.force_cpu = false;
  const std::vector<std::string> kernels{"precision=BF16", "model.d_model=128", "model.mixer_options[0]={chunk_size: 64 "
                                         "conv_size: 4}", "data.seq_len=256"};
  std::vector<std::vector<std::string>> cases{{}, {"precision=BF16"}, {"model.mixers=retnet"}, kernels, kernels};
  for (const char* s : {"parallel.recompute=true", "parallel.recompute_overlap=true", "model.n_layers=3",
                        "parallel.recompute_keep_last=0"})
    cases.back().push_back(s);
  for (auto settings : cases) {
    std::string what;
    for (auto& e : settings) what += e + " ";
    Trainer eager(tiny_config(settings), nullptr, on_gpu);
    settings.push_back("parallel.cuda_graph=true");
    Trainer graphed(tiny_config(settings), nullptr, on_gpu);
    for (int i = 0; i < 6; ++i) {
      auto a = eager.train_step(), b = graphed.train_step();
      EXPECT_EQ(a.loss, b.loss) << what << "step " << i + 1;
      EXPECT_EQ(a.grad_norm, b.grad_norm) << what << "step " << i + 1;
      if (i == 3) EXPECT_EQ(eager.evaluate().loss, graphed.evaluate().loss) << what << "evaluation between steps";
    }
    auto pa = eager.model().parameters(), pb = graphed.model().parameters();
    int differ = 0;
    for (size_t i = 0; i < pa.size(); ++i) differ += !at::equal(pa[i].second, pb[i].second);
    EXPECT_EQ(differ, 0) << what << ": parameters differ after 6 steps";
    std::printf("[ errors   ] cuda graph vs eager (%s6 steps): %d of %zu parameters differ\n", what.c_str(), differ,
                pa.size());
  }
}

// A stop signal during run() (here SIGUSR1 raised after step 3, as mpirun forwards it): the step
// finishes, a checkpoint of step 3 is written, run() returns kExitStoppedBySignal and the previous
// handler is back; running again resumes at step 3 and ends at total_steps with the losses of a run
// that never stopped, bit for bit.
TEST(Trainer, StopSignalCheckpointsAndTheRunContinues) {
  auto dir = make_temp_dir("carry_trainer_stop");
  auto cfg = tiny_config({"checkpoint.dir=" + dir, "optimizer.total_steps=6"});
  std::vector<double> straight, stopped;
  {
    auto o = quiet();
    o.on_step = [&](const StepStats& s) { straight.push_back(s.loss); };
    Trainer t(tiny_config({"optimizer.total_steps=6"}), nullptr, o);
    EXPECT_EQ(t.run(), 0);
  }
  struct sigaction before {};
  ::sigaction(SIGUSR1, nullptr, &before);
  {
    auto o = quiet();
    o.on_step = [&](const StepStats& s) {
      stopped.push_back(s.loss);
      if (s.step == 3) std::raise(SIGUSR1);
    };
    Trainer t(cfg, nullptr, o);
    EXPECT_EQ(t.run(), kExitStoppedBySignal);
    EXPECT_EQ(t.step(), 4) << "the signal came after step 3; step 4's loss sum carried it";
  }
  struct sigaction after {};
  ::sigaction(SIGUSR1, nullptr, &after);
  EXPECT_EQ(after.sa_handler, before.sa_handler) << "run() left its handler installed";
  auto saved = load_latest_checkpoint(dir);
  ASSERT_TRUE(saved.has_value());
  EXPECT_EQ(saved->step, 4);
  {
    auto o = quiet();
    o.on_step = [&](const StepStats& s) { stopped.push_back(s.loss); };
    Trainer t(cfg, nullptr, o);
    EXPECT_EQ(t.run(), 0);
    EXPECT_EQ(t.step(), 6);
  }
  ASSERT_EQ(stopped.size(), straight.size());
  for (size_t i = 0; i < straight.size(); ++i) EXPECT_EQ(stopped[i], straight[i]) << "step " << i + 1;
  remove_tree(dir);
}

// max_steps and max_minutes end one invocation like a stop signal, without touching the schedule:
// 2 steps (--max-steps 2), then a time limit that has passed after the first step (the flag rides on
// the second step's loss sum), then the rest: the losses of 6 straight steps, bit for bit.
TEST(Trainer, MaxStepsAndMaxMinutesEndAnInvocationAndTheRunContinues) {
  auto dir = make_temp_dir("carry_trainer_limits");
  auto cfg = tiny_config({"checkpoint.dir=" + dir, "optimizer.total_steps=6"});
  std::vector<double> straight, pieces;
  {
    auto o = quiet();
    o.on_step = [&](const StepStats& s) { straight.push_back(s.loss); };
    Trainer t(tiny_config({"optimizer.total_steps=6"}), nullptr, o);
    EXPECT_EQ(t.run(), 0);
  }
  auto o = quiet();
  o.on_step = [&](const StepStats& s) { pieces.push_back(s.loss); };
  {
    auto limited = o;
    limited.max_steps = 2;
    Trainer t(cfg, nullptr, limited);
    EXPECT_EQ(t.run(), kExitStoppedBySignal);
    EXPECT_EQ(t.step(), 2);
  }
  {
    auto limited = o;
    limited.max_minutes = 1e-9;
    Trainer t(cfg, nullptr, limited);
    EXPECT_EQ(t.run(), kExitStoppedBySignal);
    EXPECT_EQ(t.step(), 4) << "resumed at 2; the limit passed during step 3, step 4 carried it";
  }
  {
    Trainer t(cfg, nullptr, o);
    EXPECT_EQ(t.run(), 0);
    EXPECT_EQ(t.step(), 6);
  }
  ASSERT_EQ(pieces.size(), straight.size());
  for (size_t i = 0; i < straight.size(); ++i) EXPECT_EQ(pieces[i], straight[i]) << "step " << i + 1;
  remove_tree(dir);
}

// A non-finite loss stops the step before the update, with the step, the value and what to try.
TEST(Trainer, NonFiniteLossThrowsBeforeTheUpdate) {
  Trainer t(tiny_config(), nullptr, quiet());
  t.train_step();
  auto params = t.model().parameters();
  {
    at::NoGradGuard no_grad;  // the final norm: after every mixer, whose inputs are checked on their own
    for (auto& [n, p] : params)
      if (n == "norm.weight") p.view({-1})[0].fill_(std::nan(""));
  }
  std::vector<at::Tensor> before;
  for (auto& [n, p] : params) before.push_back(p.detach().clone());
  try {
    t.train_step();
    ADD_FAILURE() << "a NaN loss was accepted";
  } catch (const c10::Error& e) {
    std::string m = e.what_without_backtrace();
    EXPECT_NE(m.find("step 2: the loss is NaN;"), std::string::npos) << m;
    EXPECT_NE(m.find("optimizer.lr"), std::string::npos) << m;
  }
  EXPECT_EQ(t.step(), 1);
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(at::allclose(params[i].second, before[i], 0, 0, /*equal_nan=*/true)) << params[i].first;
}

// A gradient that turns infinite while the loss stays finite (a hook on one parameter's gradient,
// from step 2 on) stops the step before the update, naming the step and the finite loss.
TEST(Trainer, NonFiniteGradientThrowsBeforeTheUpdate) {
  Trainer t(tiny_config(), nullptr, quiet());
  t.train_step();
  auto params = t.model().parameters();
  bool hooked = false;
  for (auto& [n, p] : params)
    if (n == "norm.weight") {
      p.register_hook([](const at::Tensor& g) { return g * std::numeric_limits<double>::infinity(); });
      hooked = true;
    }
  ASSERT_TRUE(hooked);
  std::vector<at::Tensor> before;
  for (auto& [n, p] : params) before.push_back(p.detach().clone());
  try {
    t.train_step();
    ADD_FAILURE() << "an infinite gradient was accepted";
  } catch (const c10::Error& e) {
    std::string m = e.what_without_backtrace();
    EXPECT_NE(m.find("trainer: step 2: the gradient norm is "), std::string::npos) << m;
    EXPECT_NE(m.find("; the parameters were not updated. "), std::string::npos) << m;
    EXPECT_EQ(m.find("the loss is"), std::string::npos) << "the loss was finite: " << m;
  }
  EXPECT_EQ(t.step(), 1);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i].second, before[i])) << params[i].first;
}

// A loss that turns NaN mid-run (a parameter poisoned after step 3, checkpoints every 2 steps) ends
// Trainer::run with an error naming step 4 and the newest checkpoint, step 2; nothing newer is written,
// `latest` still names step 2, which loads with finite parameters.
TEST(Trainer, NonFiniteLossMidRunStopsTheRunAndKeepsTheLastGoodCheckpoint) {
  auto dir = make_temp_dir("carry_trainer_nan_mid_run");
  const std::string ck = dir + "/ck";
  TrainerOptions o = quiet();
  Trainer* self = nullptr;
  o.on_step = [&](const StepStats& s) {
    if (s.step != 3) return;
    at::NoGradGuard no_grad;
    for (auto& [n, p] : self->model().parameters())
      if (n == "norm.weight") p.view({-1})[0].fill_(std::nan(""));
  };
  Trainer t(tiny_config({"checkpoint.dir=" + ck, "checkpoint.every_steps=2"}), nullptr, o);
  self = &t;
  try {
    t.run();
    ADD_FAILURE() << "the run went on past a NaN loss";
  } catch (const c10::Error& e) {
    std::string m = e.what_without_backtrace();
    EXPECT_NE(m.find("trainer: step 4: the loss is NaN; the parameters were not updated. The newest checkpoint is " +
                     ck + "/step_00000002 (step 2); try a lower optimizer.lr"), std::string::npos) << m;
  }
  EXPECT_EQ(t.step(), 3);
  EXPECT_EQ(list_checkpoint_steps(ck), (std::vector<int64_t>{2}));
  std::ifstream latest(ck + "/latest");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(latest), std::istreambuf_iterator<char>()), "step_00000002\n");
  auto loaded = load_latest_checkpoint(ck);
  ASSERT_TRUE(loaded);
  for (auto& [n, w] : loaded->model) EXPECT_TRUE(at::isfinite(w).all().item<bool>()) << n;
  remove_tree(dir);
}

// Without a checkpoint yet, the divergence message says so instead of pointing at one.
TEST(Trainer, DivergenceBeforeAnyCheckpointSaysThereIsNone) {
  auto dir = make_temp_dir("carry_trainer_nan_first");
  Trainer t(tiny_config({"checkpoint.dir=" + dir + "/ck", "optimizer.lr=1e308", "optimizer.warmup_steps=0"}), nullptr,
            quiet());
  try {
    for (int i = 0; i < 3; ++i) t.train_step();
    ADD_FAILURE() << "lr 1e308 did not diverge in 3 steps";
  } catch (const c10::Error& e) {
    std::string m = e.what_without_backtrace();
    EXPECT_NE(m.find("checkpoint.dir " + dir + "/ck holds no checkpoint yet; try a lower optimizer.lr"),
              std::string::npos) << m;
  }
  remove_tree(dir);
}

// A checkpoint is never written with a non-finite parameter: the trainer refuses, naming the step and
// the first such tensor, writes nothing and leaves `latest` on the previous checkpoint.
TEST(Trainer, NonFiniteParameterIsNeverCheckpointed) {
  auto dir = make_temp_dir("carry_trainer_nonfinite");
  const std::string ck = dir + "/ck";
  Trainer t(tiny_config({"checkpoint.dir=" + ck}), nullptr, quiet());
  t.train_step();
  t.save_checkpoint();
  auto read = [](const std::string& path) {
    std::ifstream f(path);
    return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  };
  ASSERT_EQ(read(ck + "/latest"), "step_00000001\n");
  t.train_step();
  auto params = t.model().parameters();
  ASSERT_GE(params.size(), 2u);
  std::string first = params[0].first;
  {
    at::NoGradGuard no_grad;
    params[0].second.view({-1})[1].fill_(std::nan(""));
    for (auto& [n, p] : params)
      if (n == "norm.weight") p.view({-1})[0].fill_(INFINITY);
  }
  try {
    t.save_checkpoint();
    ADD_FAILURE() << "a checkpoint with non-finite parameters was written";
  } catch (const c10::Error& e) {
    std::string m = e.what_without_backtrace();
    EXPECT_EQ(m.find("trainer: step 2: refusing to write a checkpoint to " + ck + ": parameter '" + first +
                     "' is not finite (1 NaN and 0 infinite of its " + std::to_string(params[0].second.numel()) +
                     " values; non-finite parameter tensors: 2 of " + std::to_string(params.size()) +
                     "); nothing was written and 'latest' still names the previous checkpoint."),
              0u)
        << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  EXPECT_EQ(read(ck + "/latest"), "step_00000001\n");
  EXPECT_EQ(list_checkpoint_steps(ck), std::vector<int64_t>{1});
  auto loaded = load_latest_checkpoint(ck);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->step, 1);
  remove_tree(dir);
}

TEST(Trainer, WithoutProcessGroupsNeedsOneRank) {
  try {
    Trainer t(tiny_config({"parallel.sp=2"}), nullptr, quiet());
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("dp=1 sp=2"), std::string::npos) << e.what();
  }
}

// carry train on GPUs gives each rank of a host its own GPU; more ranks than GPUs is refused with
// the host, both counts and the ways out.
TEST(TrainCommand, MoreRanksThanGpusOnAHostIsRefused) {
  EXPECT_EQ(gpu_rank_layout_error("node0", 4, 4), "");
  EXPECT_EQ(gpu_rank_layout_error("node0", 2, 8), "");
  auto m = gpu_rank_layout_error("node0", 8, 4);
  EXPECT_NE(m.find("host node0 runs 8 ranks but has 4 GPUs"), std::string::npos) << m;
  EXPECT_NE(m.find("CUDA_VISIBLE_DEVICES"), std::string::npos) << m;
  EXPECT_NE(gpu_rank_layout_error("a", 2, 1).find("has 1 GPU:"), std::string::npos);
}

// Under a plain Open MPI mpirun a SIGTERM or SIGINT kills the ranks odls_base_sigkill_timeout seconds
// after they receive it: rank 0 warns when that setting is missing or short, and not under the
// launchers (which forward a stop as SIGUSR1) or without mpirun.
TEST(TrainCommand, PlainMpirunWithoutALongSigkillTimeoutWarns) {
  auto m = mpirun_stop_warning(nullptr, "0", nullptr);
  EXPECT_NE(m.find("carry train: warning: mpirun runs with odls_base_sigkill_timeout 1 (the default): a SIGTERM"),
            std::string::npos) << m;
  EXPECT_NE(m.find("--mca odls_base_sigkill_timeout 300"), std::string::npos) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  EXPECT_NE(mpirun_stop_warning(nullptr, "0", "5").find("odls_base_sigkill_timeout 5:"), std::string::npos);
  EXPECT_NE(mpirun_stop_warning(nullptr, "0", "lots").find("odls_base_sigkill_timeout lots:"), std::string::npos);
  EXPECT_EQ(mpirun_stop_warning(nullptr, "0", "300"), "");
  EXPECT_EQ(mpirun_stop_warning(nullptr, "0", std::to_string(kMinSigkillTimeoutS).c_str()), "");
  EXPECT_EQ(mpirun_stop_warning("launcher/train", "0", nullptr), "");
  EXPECT_EQ(mpirun_stop_warning(nullptr, nullptr, nullptr), "");
}

TEST(Optimizer, AdamWMatchesHandComputedSteps) {
  auto opts = at::TensorOptions().dtype(at::kDouble);
  auto w = at::tensor({1.0, -2.0, 0.5, 3.0}, opts).view({2, 2}).set_requires_grad(true);
  auto b = at::tensor({0.25, -0.75}, opts).set_requires_grad(true);
  config::OptimizerConfig o;
  o.set_beta1(0.9), o.set_beta2(0.95), o.set_eps(1e-8), o.set_weight_decay(0.1);
  AdamW adam({{"w", w}, {"b", b}}, o);
  auto w_ref = w.detach().clone(), b_ref = b.detach().clone();
  auto mw = at::zeros_like(w_ref), vw = at::zeros_like(w_ref), mb = at::zeros_like(b_ref), vb = at::zeros_like(b_ref);
  for (int t = 1; t <= 3; ++t) {
    auto gw = at::tensor({0.1 * t, -0.3, 0.7, -0.2 * t}, opts).view({2, 2});
    auto gb = at::tensor({-0.4, 0.05 * t}, opts);
    w.mutable_grad() = gw.clone(), b.mutable_grad() = gb.clone();
    const double lr = 0.01 * t;
    adam.step(lr);
    auto ref = [&](at::Tensor& p, at::Tensor& m, at::Tensor& v, const at::Tensor& g, bool decay) {
      if (decay) p = p * (1 - lr * 0.1);
      m = 0.9 * m + 0.1 * g;
      v = 0.95 * v + 0.05 * g * g;
      auto mh = m / (1 - std::pow(0.9, t)), vh = v / (1 - std::pow(0.95, t));
      p = p - lr * mh / (vh.sqrt() + 1e-8);
    };
    ref(w_ref, mw, vw, gw, true);
    ref(b_ref, mb, vb, gb, false);
  }
  EXPECT_LT((w.detach() - w_ref).abs().max().item<double>(), 1e-14);
  EXPECT_LT((b.detach() - b_ref).abs().max().item<double>(), 1e-14);
  EXPECT_EQ(adam.steps(), 3);
  auto st = adam.state();
  ASSERT_EQ(st.size(), 4u);
  EXPECT_EQ(st[0].first, "exp_avg.w");
  EXPECT_EQ(st[3].first, "exp_avg_sq.b");
  EXPECT_LT((st[0].second - mw).abs().max().item<double>(), 1e-15);
  // Restoring the state into a fresh optimizer copies it (and refuses a missing tensor).
  AdamW other({{"w", w}, {"b", b}}, o);
  other.load_state(st, 3);
  EXPECT_TRUE(at::equal(other.state()[3].second, st[3].second));
  EXPECT_EQ(other.steps(), 3);
  auto partial = st;
  partial.pop_back();
  EXPECT_THROW(other.load_state(partial, 3), c10::Error);
}

TEST(Optimizer, ClipGradNormScalesToTheLimit) {
  auto a = at::zeros({2}, at::kDouble).set_requires_grad(true);
  auto b = at::zeros({1}, at::kDouble).set_requires_grad(true);
  a.mutable_grad() = at::tensor({3.0, 0.0}, at::kDouble);
  b.mutable_grad() = at::tensor({4.0}, at::kDouble);
  NamedParameters ps{{"a", a}, {"b", b}};
  EXPECT_DOUBLE_EQ(clip_grad_norm(ps, 10.0), 5.0);
  EXPECT_DOUBLE_EQ(a.grad()[0].item<double>(), 3.0);  // under the limit: untouched
  EXPECT_DOUBLE_EQ(clip_grad_norm(ps, 1.0), 5.0);
  double n = std::sqrt(std::pow(a.grad()[0].item<double>(), 2) + std::pow(b.grad()[0].item<double>(), 2));
  EXPECT_NEAR(n, 1.0, 1e-6);
}

}  // namespace
}  // namespace carry::testing
