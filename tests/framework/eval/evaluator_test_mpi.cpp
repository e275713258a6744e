// The evaluator across ranks (CPU, fp64, a tiny Gated DeltaNet + GLA with short convolutions):
// sp = world size (ordered and tree scans), dp = world size, and dp = 2 × sp = 2 on 4 ranks score the
// same sequences as one process: the same loss sum, per-position sums and counts within 1e-10 (a
// partial last batch included), on token files and on an MQAR task. The serial reference runs
// in-process on every rank. Skipped on one rank.
#include "framework/data/token_file.h"
#include "framework/eval/evaluator.h"
#include "parallel/process_group.h"
#include "tests/helpers/temp_dir.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdio>

namespace carry::testing {
namespace {

ModelConfig tiny() {
  ModelConfig m;
  m.set_vocab_size(13);
  m.set_d_model(16);
  m.set_n_layers(2);
  m.set_n_heads(2);
  m.set_init_std(0.4);
  m.add_mixers("gated_deltanet");
  m.add_mixers("gla");
  auto* o = m.add_mixer_options();
  o->set_chunk_size(8);
  o->set_conv_size(4);
  return m;
}

std::string shared_token_file(int64_t n) {
  std::string dir;
  if (parallel::world_info().rank == 0) {
    dir = make_temp_dir("carry_eval_mpi");
    std::vector<uint32_t> tokens(n);
    for (int64_t i = 0; i < n; ++i) tokens[i] = static_cast<uint32_t>((i * 7 + i / 5) % 13);
    write_token_file(dir + "/data.tok", tokens);
  }
  char buf[256] = {0};
  std::snprintf(buf, sizeof buf, "%s", dir.c_str());
  MPI_Bcast(buf, sizeof buf, MPI_CHAR, 0, MPI_COMM_WORLD);
  return std::string(buf) + "/data.tok";
}

double worst_difference(const EvalResult& a, const EvalResult& b) {
  double worst = std::abs(a.loss_sum - b.loss_sum) / b.loss_sum;
  for (size_t p = 0; p < b.position_loss.size(); ++p) {
    worst = std::max(worst, std::abs(a.position_loss[p] - b.position_loss[p]) / std::max(1e-300, b.position_loss[p]));
    EXPECT_EQ(a.position_count[p], b.position_count[p]) << p;
    EXPECT_EQ(a.position_correct[p], b.position_correct[p]) << p;
  }
  EXPECT_EQ(a.sequences, b.sequences);
  EXPECT_EQ(a.sequences_all_right, b.sequences_all_right);
  return worst;
}

TEST(EvaluatorMpi, EveryLayoutScoresWhatOneProcessScores) {
  const int world = parallel::world_info().size;
  if (world < 2) GTEST_SKIP() << "needs 2 or more ranks";
  Model model = build_model(tiny(), 6, at::TensorOptions().dtype(at::kDouble));
  const int64_t T = 64;
  EvalSpec files;
  files.token_files = {shared_token_file(T * 7 + 1)};  // 7 windows: a partial last batch at every dp
  files.seq_len = T;
  files.batch_size = 2;
  EvalSpec task;
  task.data.mutable_mqar()->set_num_kv_pairs(3);
  task.data.mutable_mqar()->set_num_queries(4);
  task.data.mutable_mqar()->set_vocab_size(13);
  task.seed = 3;
  task.seq_len = T;
  task.batch_size = 2;
  task.batches = 2;

  std::vector<std::pair<int, int>> layouts = {{1, world}, {world, 1}};
  if (world == 4) layouts.push_back({2, 2});
  for (auto [dp, sp] : layouts) {
    parallel::CommOptions copt;
    copt.timeout_s = 120;
    copt.on_timeout = parallel::CommOptions::OnTimeout::throw_error;
    auto groups = parallel::make_process_groups({dp, sp}, parallel::Backend::mpi, copt);
    for (auto mode : {parallel::ScanMode::ordered, parallel::ScanMode::tree}) {
      if (sp == 1 && mode == parallel::ScanMode::tree) continue;
      for (EvalSpec* spec : {&files, &task}) {
        spec->scan_mode = mode;
        EvalResult spread = evaluate_model(model, *spec, &groups);
        // The serial reference with the same global batch: dp ranks each take B, so one process takes dp·B
        // (token files; a task's batch b of dp rank d is its own sequences: compare totals per dp instead).
        EvalSpec serial = *spec;
        if (!spec->token_files.empty()) {
          serial.batch_size = spec->batch_size * dp;
          EvalResult one = evaluate_model(model, serial, nullptr);
          double worst = worst_difference(spread, one);
          EXPECT_LT(worst, 1e-10) << "dp " << dp << " sp " << sp;
          if (parallel::world_info().rank == 0)
            std::printf("[ errors ] eval on dp %d x sp %d (%s) vs one process, token files: %.2e\n", dp, sp,
                        parallel::scan_mode_name(mode).c_str(), worst);
        } else if (dp == 1) {
          EvalResult one = evaluate_model(model, serial, nullptr);
          double worst = worst_difference(spread, one);
          EXPECT_LT(worst, 1e-10) << "sp " << sp;
          if (parallel::world_info().rank == 0)
            std::printf("[ errors ] eval on dp 1 x sp %d (%s) vs one process, MQAR: %.2e\n", sp,
                        parallel::scan_mode_name(mode).c_str(), worst);
        } else {
          EXPECT_EQ(spread.sequences, dp * 2 * 2);
          EXPECT_EQ(spread.positions, dp * 2 * 2 * 4);
        }
      }
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (parallel::world_info().rank == 0) {
    std::string dir = files.token_files[0].substr(0, files.token_files[0].rfind('/'));
    remove_tree(dir);
  }
}

}  // namespace
}  // namespace carry::testing
