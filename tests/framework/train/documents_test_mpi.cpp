// Packed documents under sequence parallelism (CPU, fp64, 3 steps): the ordered, tree and allgather
// scans with document starts inside a rank's slice and exactly at a rank boundary (and, at 4 ranks, a
// slice without one between slices with) give the losses and parameters of one rank, for Gated
// DeltaNet with short convolutions, for a hybrid with sliding-window softmax attention (whose window and
// convolutions reach into the previous rank's slice) and for two RWKV-7 layers with RWKV-7's channel mix (whose
// token shifts read the previous rank's last token and restart at a document start). Skipped unless 2 or 4 ranks.
#include "framework/data/token_file.h"
#include "framework/train/trainer.h"
#include "parallel/process_group.h"
#include "tests/helpers/temp_dir.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>

namespace carry::testing {
namespace {

double max_over_ranks(double x) {
  double y = 0;
  MPI_Allreduce(&x, &y, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return y;
}

TEST(DocumentsSp, ScansWithDocumentStartsEqualOneRank) {
  const int P = parallel::world_info().size;
  if (P != 2 && P != 4) GTEST_SKIP() << "needs 2 or 4 ranks";
  // Every window of 64 tokens (stride 64) has end-of-document tokens at 13, 32 and 45 (and 48 with 4
  // ranks: the rank boundaries are 32 with 2 ranks, 16/32/48 with 4).
  std::string dir;
  if (parallel::world_info().rank == 0) {
    dir = make_temp_dir("carry_documents_sp");
    std::vector<uint32_t> t(64 * 12 + 1);
    for (size_t i = 0; i < t.size(); ++i) {
      size_t p = i % 64;
      t[i] = p == 13 || p == 32 || p == 45 || p == 48 ? 0 : 1 + (i * 5 + i / 3) % 31;
    }
    write_token_file(dir + "/train.tok", t);
  }
  char buf[256] = {0};
  std::snprintf(buf, sizeof buf, "%s", dir.c_str());
  MPI_Bcast(buf, sizeof buf, MPI_CHAR, 0, MPI_COMM_WORLD);
  dir = buf;
  for (const char* mode : {"ORDERED", "TREE", "ALLGATHER"})
  for (const char* mixers : {"\"gated_deltanet\" mixer_options { chunk_size: 8 conv_size: 4 }",
                             "[\"gated_deltanet\", \"softmax_attn\"] mixer_options { kind: \"softmax_attn\" window: 12 } "
                             "mixer_options { chunk_size: 8 conv_size: 4 }",
                             "[\"rwkv7\", \"rwkv7\"] mixer_options { chunk_size: 8 } feed_forward: \"rwkv7_channel_mix\""}) {
    auto cfg = [&](int sp) {
      return run_config_from_text(std::string(R"(
name: "documents_sp"
model { vocab_size: 32 d_model: 32 n_layers: 2 n_heads: 2 mixers: )") + mixers + R"( }
data { seq_len: 64 batch_size: 2 }
optimizer { lr: 1e-2 total_steps: 3 }
)",
                                  "documents_sp.textproto",
                                  {"data.token_files={paths: \"" + dir + "/train.tok\" eod_token: 0}",
                                   "parallel.sp=" + std::to_string(sp), std::string("parallel.scan_mode=") + mode});
    };
    TrainerOptions o;
    o.log = nullptr;
    o.force_cpu = true;
    o.dtype = at::kDouble;
    parallel::CommOptions copt;
    copt.timeout_s = 120;
    copt.on_timeout = parallel::CommOptions::OnTimeout::throw_error;
    auto groups = std::make_shared<parallel::ProcessGroups>(parallel::make_process_groups({1, P}, parallel::Backend::mpi, copt));
    Trainer split(cfg(P), groups, o), serial(cfg(1), nullptr, o);
    double worst = 0;
    for (int i = 0; i < 3; ++i) {
      double a = split.train_step().loss, b = serial.train_step().loss;
      worst = std::max(worst, std::abs(a - b) / std::abs(b));
    }
    auto pa = split.model().parameters(), pb = serial.model().parameters();
    for (size_t i = 0; i < pa.size(); ++i)
      worst = std::max(worst, (pa[i].second - pb[i].second).abs().max().item<double>() /
                                  std::max(pb[i].second.abs().max().item<double>(), 1e-30));
    worst = max_over_ranks(worst);
    if (parallel::world_info().rank == 0)
      std::printf("[ errors   ] documents, %s scan sp=%d vs 1 rank (%s, fp64, 3 steps): %.3g\n", mode, P, mixers, worst);
    EXPECT_LT(worst, 1e-11) << mode << " " << mixers;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (parallel::world_info().rank == 0) remove_tree(dir);
}

}  // namespace
}  // namespace carry::testing
