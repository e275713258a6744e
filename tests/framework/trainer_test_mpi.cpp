// The trainer across ranks (CPU, fp64, 5 steps of MQAR on a tiny Gated DeltaNet with short
// convolutions): sp = world size (every scan mode) gives the losses and parameters of sp = 1 within
// 1e-10; dp = world size with batch B/dp gives those of dp = 1 with batch B (the same global batch);
// on 4 ranks dp=2 × sp=2 too; a hybrid with sliding-window softmax attention under sp. The serial
// reference runs in-process on every rank. Skipped when the world size does not fit.
#include "framework/trainer.h"
#include "parallel/process_group.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>

namespace carry::testing {
namespace {

const char* kTiny = R"(
name: "trainer_test_mpi"
seed: 11
model {
  vocab_size: 32 d_model: 32 n_layers: 2 n_heads: 2
  mixers: "gated_deltanet"
  mixer_options { chunk_size: 16 conv_size: 4 }
}
data { mqar { num_kv_pairs: 4 num_queries: 4 vocab_size: 32 } seq_len: 64 batch_size: 4 eval_batches: 1 }
optimizer { lr: 1e-2 warmup_steps: 2 total_steps: 5 }
)";

struct Run {
  std::vector<double> losses;
  std::vector<at::Tensor> params;
  EvalStats eval;
};

Run train(const RunConfig& cfg, bool distributed) {
  TrainerOptions o;
  o.log = nullptr;
  o.force_cpu = true;
  o.dtype = at::kDouble;
  std::shared_ptr<parallel::ProcessGroups> groups;
  if (distributed) {
    parallel::CommOptions copt;
    copt.timeout_s = 120;
    copt.on_timeout = parallel::CommOptions::OnTimeout::throw_error;
    groups = std::make_shared<parallel::ProcessGroups>(parallel::make_process_groups(
        {static_cast<int>(cfg.parallel().dp()), static_cast<int>(cfg.parallel().sp())},
        parallel::Backend::mpi, copt));
  }
  Trainer t(cfg, groups, o);
  Run r;
  for (int i = 0; i < 5; ++i) r.losses.push_back(t.train_step().loss);
  for (auto& [n, p] : t.model().parameters()) r.params.push_back(p.detach().clone());
  r.eval = t.evaluate();
  return r;
}

double max_over_ranks(double x) {
  double y = 0;
  MPI_Allreduce(&x, &y, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return y;
}

// Worst relative difference of losses and parameters, over all ranks.
double compare(const Run& a, const Run& b) {
  double worst = 0;
  for (size_t i = 0; i < a.losses.size(); ++i)
    worst = std::max(worst, std::abs(a.losses[i] - b.losses[i]) / std::abs(b.losses[i]));
  for (size_t i = 0; i < a.params.size(); ++i) {
    double scale = b.params[i].abs().max().item<double>();
    worst = std::max(worst, (a.params[i] - b.params[i]).abs().max().item<double>() / std::max(scale, 1e-30));
  }
  worst = std::max(worst, std::abs(a.eval.loss - b.eval.loss) / std::abs(b.eval.loss));
  return max_over_ranks(worst);
}

RunConfig config(const std::vector<std::string>& overrides) {
  return run_config_from_text(kTiny, "trainer_test_mpi.textproto", overrides);
}

class TrainerSp : public ::testing::TestWithParam<std::string> {};

TEST_P(TrainerSp, SequenceParallelEqualsSerial) {
  const int P = parallel::world_info().size;
  if (P < 2) GTEST_SKIP() << "needs 2 or more ranks";
  auto serial = train(config({}), false);
  auto sp = train(config({"parallel.sp=" + std::to_string(P), "parallel.scan_mode=" + GetParam()}), true);
  double err = compare(sp, serial);
  if (parallel::world_info().rank == 0)
    std::printf("[ errors   ] trainer sp=%d %s vs sp=1 (fp64, 5 steps): %.3e\n", P, GetParam().c_str(), err);
  EXPECT_LE(err, 1e-10);
  EXPECT_DOUBLE_EQ(sp.eval.accuracy, serial.eval.accuracy);
}

INSTANTIATE_TEST_SUITE_P(Modes, TrainerSp, ::testing::Values("ordered", "tree", "allgather"));

TEST(Trainer, DataParallelEqualsOneRankWithTheGlobalBatch) {
  const int P = parallel::world_info().size;
  if (P < 2 || 4 % P != 0) GTEST_SKIP() << "needs 2 or 4 ranks (global batch 4)";
  auto serial = train(config({}), false);
  auto dp = train(config({"parallel.dp=" + std::to_string(P), "data.batch_size=" + std::to_string(4 / P)}), true);
  double err = compare(dp, serial);
  if (parallel::world_info().rank == 0)
    std::printf("[ errors   ] trainer dp=%d vs dp=1 (fp64, 5 steps, global batch 4): %.3e\n", P, err);
  EXPECT_LE(err, 1e-10);
}

TEST(Trainer, DataAndSequenceParallelEqualSerial) {
  if (parallel::world_info().size != 4) GTEST_SKIP() << "needs 4 ranks";
  auto serial = train(config({}), false);
  auto both = train(config({"parallel.dp=2", "parallel.sp=2", "data.batch_size=2"}), true);
  double err = compare(both, serial);
  if (parallel::world_info().rank == 0)
    std::printf("[ errors   ] trainer dp=2 x sp=2 vs serial (fp64, 5 steps): %.3e\n", err);
  EXPECT_LE(err, 1e-10);
}

TEST(Trainer, HybridWithSlidingWindowUnderSp) {
  const int P = parallel::world_info().size;
  if (P != 2) GTEST_SKIP() << "needs 2 ranks";
  std::vector<std::string> hybrid{"model.mixers=gated_deltanet,softmax_attn",
                                  "model.mixer_options[1]={kind: \"softmax_attn\" window: 8}"};
  auto serial = train(config(hybrid), false);
  hybrid.push_back("parallel.sp=2");
  auto sp = train(config(hybrid), true);
  double err = compare(sp, serial);
  if (parallel::world_info().rank == 0)
    std::printf("[ errors   ] trainer hybrid gdn+swa sp=2 vs sp=1 (fp64, 5 steps): %.3e\n", err);
  EXPECT_LE(err, 1e-10);
}

TEST(Trainer, LayoutMustMatchTheWorld) {
  const int P = parallel::world_info().size;
  auto cfg = config({"parallel.dp=" + std::to_string(P + 1)});
  EXPECT_THROW(validate_layout(cfg, P), ConfigError);
}

}  // namespace
}  // namespace carry::testing
