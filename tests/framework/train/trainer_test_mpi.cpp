// The trainer across ranks (CPU, fp64, 5 steps of MQAR on a tiny Gated DeltaNet with short
// convolutions): sp = world size (every scan mode) gives the losses and parameters of sp = 1 within
// 1e-10; dp = world size with batch B/dp gives those of dp = 1 with batch B (the same global batch);
// on 4 ranks dp=2 × sp=2 too; a hybrid with sliding-window softmax attention under sp. The serial
// reference runs in-process on every rank. Skipped when the world size does not fit.
#include "framework/io/checkpoint.h"
#include "framework/train/trainer.h"
#include "parallel/process_group.h"
#include "tests/helpers/temp_dir.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <memory>

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

struct RunResult {
  std::vector<double> losses;
  std::vector<at::Tensor> params;
  EvalStats eval;
};

// A quiet CPU trainer; `distributed`: on the MPI process groups of the config's layout.
std::unique_ptr<Trainer> make_trainer(const RunConfig& cfg, bool distributed, at::ScalarType dtype = at::kDouble) {
  TrainerOptions o;
  o.log = nullptr;
  o.force_cpu = true;
  o.dtype = dtype;
  std::shared_ptr<parallel::ProcessGroups> groups;
  if (distributed) {
    parallel::CommOptions copt;
    copt.timeout_s = 120;
    copt.on_timeout = parallel::CommOptions::OnTimeout::throw_error;
    groups = std::make_shared<parallel::ProcessGroups>(parallel::make_process_groups(
        {static_cast<int>(cfg.parallel().dp()), static_cast<int>(cfg.parallel().sp())},
        parallel::Backend::mpi, copt));
  }
  return std::make_unique<Trainer>(cfg, groups, o);
}

// `steps` steps on a fresh trainer: the losses, the final parameters and an evaluation.
RunResult train(const RunConfig& cfg, bool distributed, int steps = 5, at::ScalarType dtype = at::kDouble) {
  auto t = make_trainer(cfg, distributed, dtype);
  RunResult r;
  for (int i = 0; i < steps; ++i) r.losses.push_back(t->train_step().loss);
  for (auto& [n, p] : t->model().parameters()) r.params.push_back(p.detach().clone());
  r.eval = t->evaluate();
  return r;
}

// A temporary directory made by world rank 0, its path sent to every rank (one host in these tests).
std::string shared_temp_dir(const std::string& prefix) {
  std::string dir;
  if (parallel::world_info().rank == 0) dir = make_temp_dir(prefix);
  char buf[256] = {0};
  std::snprintf(buf, sizeof buf, "%s", dir.c_str());
  MPI_Bcast(buf, sizeof buf, MPI_CHAR, 0, MPI_COMM_WORLD);
  return buf;
}

double max_over_ranks(double x) {
  double y = 0;
  MPI_Allreduce(&x, &y, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return y;
}

// Worst relative difference of losses and parameters, over all ranks.
double compare(const RunResult& a, const RunResult& b) {
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

// Per-layer recomputation under sequence parallelism (the scans and halo exchanges run again in
// backward, collectively) gives the serial run's steps; on 2 ranks with a sliding-window layer too.
TEST(Trainer, RecomputeUnderSpEqualsSerial) {
  const int P = parallel::world_info().size;
  if (P < 2) GTEST_SKIP() << "needs 2 or more ranks";
  std::vector<std::string> o;
  if (P == 2) o = {"model.mixers=gated_deltanet,softmax_attn", "model.mixer_options[1]={kind: \"softmax_attn\" window: 8}"};
  auto serial = train(config(o), false);
  o.push_back("parallel.sp=" + std::to_string(P));
  o.push_back("parallel.recompute=true");
  auto sp = train(config(o), true);
  double err = compare(sp, serial);
  if (parallel::world_info().rank == 0)
    std::printf("[ errors   ] trainer sp=%d with recomputation vs sp=1 (fp64, 5 steps%s): %.3e\n", P,
                P == 2 ? ", gdn+swa" : "", err);
  EXPECT_LE(err, 1e-10);
}

// RWKV-7 (three rwkv7 layers: the token shift's halo across ranks, the value residual from the first layer)
// under every scan mode, and with per-layer recomputation and RWKV-7's channel mix (a second token shift a
// block): the serial run's steps.
TEST(Trainer, Rwkv7UnderSpEqualsSerial) {
  const int P = parallel::world_info().size;
  if (P < 2) GTEST_SKIP() << "needs 2 or more ranks";
  const std::vector<std::string> rwkv7{"model.mixers=rwkv7", "model.n_layers=3", "model.mixer_options[0]={chunk_size: 16}"};
  auto serial = train(config(rwkv7), false);
  auto channel_mix = rwkv7;
  channel_mix.push_back("model.feed_forward=rwkv7_channel_mix");
  auto serial_channel_mix = train(config(channel_mix), false);
  for (const char* mode : {"ordered", "tree", "allgather"})
    for (bool recompute : {false, true}) {
      if (recompute && std::string(mode) != "ordered") continue;
      auto o = rwkv7;
      if (recompute) o.push_back("model.feed_forward=rwkv7_channel_mix");
      o.push_back("parallel.sp=" + std::to_string(P));
      o.push_back(std::string("parallel.scan_mode=") + mode);
      if (recompute) o.push_back("parallel.recompute=true");
      auto sp = train(config(o), true);
      const RunResult& reference = recompute ? serial_channel_mix : serial;
      double err = compare(sp, reference);
      if (parallel::world_info().rank == 0)
        std::printf("[ errors   ] trainer rwkv7 x3 sp=%d %s%s vs sp=1 (fp64, 5 steps): %.3e (losses %.6f -> %.6f)\n", P,
                    mode, recompute ? " with recomputation and the channel mix" : "", err, reference.losses.front(),
                    reference.losses.back());
      EXPECT_LE(err, 1e-10) << mode << (recompute ? " with recomputation" : "");
      EXPECT_NE(serial.losses.front(), serial.losses.back()) << "the run does not train";
    }
}

// FLA's RWKV7ForCausalLM (LayerNorm blocks, the first block's pre-norm, the channel mix, its own head) under the
// ordered and tree scans, the ordered one with recomputation: the serial run's steps.
TEST(Trainer, FlaRwkv7ModelUnderSpEqualsSerial) {
  const int P = parallel::world_info().size;
  if (P < 2) GTEST_SKIP() << "needs 2 or more ranks";
  const std::vector<std::string> fla{"model.mixers=rwkv7", "model.n_layers=3", "model.mixer_options[0]={chunk_size: 16}",
                                     "model.feed_forward=rwkv7_channel_mix", "model.norm=layer_norm", "model.pre_norm=true",
                                     "model.norm_eps=1e-5", "model.tie_embeddings=false"};
  auto serial = train(config(fla), false);
  for (auto [mode, recompute] : {std::pair<const char*, bool>{"ordered", false}, {"tree", false}, {"ordered", true}}) {
    auto o = fla;
    o.push_back("parallel.sp=" + std::to_string(P));
    o.push_back(std::string("parallel.scan_mode=") + mode);
    if (recompute) o.push_back("parallel.recompute=true");
    const double err = compare(train(config(o), true), serial);
    if (parallel::world_info().rank == 0)
      std::printf("[ errors   ] trainer FLA rwkv7 model x3 sp=%d %s%s vs sp=1 (fp64, 5 steps): %.3e (losses %.6f -> %.6f)\n",
                  P, mode, recompute ? " with recomputation" : "", err, serial.losses.front(), serial.losses.back());
    EXPECT_LE(err, 1e-10) << mode << (recompute ? " with recomputation" : "");
  }
  EXPECT_NE(serial.losses.front(), serial.losses.back()) << "the run does not train";
}

// Ordered segments (parallel/segments.h): every layout with the same segments runs the same operations on
// the same values, so the losses, gradient norms and parameters are equal bit for bit, not to rounding.
// fp32, with realistic rounding; the serial runs in-process on every rank.
struct BitRun {
  std::vector<double> losses, norms;
  std::vector<at::Tensor> params;
  int64_t deferred_head_bytes = 0;  // this rank's budget (Trainer::deferred_head_bytes)
  bool sharded = false;             // the update split over the sp ranks (Trainer::sharded_update)
  int64_t first_foreign_part = -2;  // where its forward first reads another rank's parameters
  std::vector<at::Tensor> state;    // AdamW's moments after the 5 steps, on world rank 0 (gathered there first)
  int64_t held_moments = 0;         // the moment elements this rank holds
  int64_t all_moments = 0;          // two a parameter element
};

BitRun train_bits(const RunConfig& cfg, bool distributed) {
  auto t = make_trainer(cfg, distributed, at::kFloat);
  BitRun r;
  r.deferred_head_bytes = t->deferred_head_bytes();
  for (int i = 0; i < 5; ++i) {
    auto s = t->train_step();
    r.losses.push_back(s.loss), r.norms.push_back(s.grad_norm);
  }
  for (auto& [n, p] : t->model().parameters()) r.params.push_back(p.detach().clone());
  r.sharded = t->sharded_update() != nullptr;
  if (r.sharded) r.first_foreign_part = t->sharded_update()->first_foreign_part();
  for (auto& [n, m] : t->optimizer().state()) {
    r.held_moments += m.defined() ? m.numel() : 0;
    r.all_moments += t->model().parameters()[r.state.size() % t->model().parameters().size()].second.numel();
    r.state.push_back(m.defined() ? m.clone() : at::Tensor());
  }
  if (r.sharded) {
    r.state.clear();
    for (auto& [n, m] : t->sharded_update()->whole_optimizer_state()) r.state.push_back(m.clone());
  }
  if (parallel::world_info().rank != 0) r.state.clear();  // the whole moments reach rank 0 only
  return r;
}

// Whether a and b are equal bit for bit on every rank; prints the first step that differs.
bool same_bits(const BitRun& a, const BitRun& b, const std::string& what) {
  bool same = a.losses == b.losses && a.norms == b.norms && a.params.size() == b.params.size();
  for (size_t i = 0; same && i < a.params.size(); ++i) same = at::equal(a.params[i], b.params[i]);
  same = same && a.state.size() == b.state.size();
  for (size_t i = 0; same && i < a.state.size(); ++i) same = at::equal(a.state[i], b.state[i]);
  int mine = same ? 1 : 0, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (parallel::world_info().rank == 0) {
    std::printf("[ bitwise  ] %s: %s (losses", what.c_str(), all ? "equal" : "DIFFER");
    for (size_t i = 0; i < a.losses.size(); ++i) std::printf(" %.9g/%.9g", a.losses[i], b.losses[i]);
    std::printf(")\n");
  }
  return all == 1;
}

// Performer (linear attention over random features, regenerated on every rank from the config) under
// every scan mode: the serial run's steps to rounding, and with ordered segments its bits.
TEST(Trainer, PerformerUnderSpEqualsSerial) {
  const int P = parallel::world_info().size;
  if (P < 2) GTEST_SKIP() << "needs 2 or more ranks";
  const std::vector<std::string> performer{
      "model.mixers=linear_attn",
      "model.mixer_options[0]={chunk_size: 16 normalize: true feature_map: \"performer\" num_features: 24}"};
  auto serial = train(config(performer), false);
  for (const char* mode : {"ordered", "tree", "allgather"}) {
    auto o = performer;
    o.push_back("parallel.sp=" + std::to_string(P));
    o.push_back(std::string("parallel.scan_mode=") + mode);
    double err = compare(train(config(o), true), serial);
    if (parallel::world_info().rank == 0)
      std::printf("[ errors   ] trainer performer sp=%d %s vs sp=1 (fp64, 5 steps): %.3e\n", P, mode, err);
    EXPECT_LE(err, 1e-10) << mode;
  }
  auto segmented = performer, sp = performer;
  segmented.push_back("parallel.segments=" + std::to_string(P));
  sp.push_back("parallel.sp=" + std::to_string(P));
  EXPECT_TRUE(same_bits(train_bits(config(sp), true), train_bits(config(segmented), false),
                        "performer sp=" + std::to_string(P) + " vs sp=1 with " + std::to_string(P) +
                            " segments (fp32, 5 steps)"));
}

// Mamba-1 (S6; its decay rate A, a parameter every rank reads whole, its gradient the ranks' sum) under
// every scan mode and with per-layer recomputation: the serial run's steps to rounding; with ordered
// segments its bits.
TEST(Trainer, Mamba1UnderSpEqualsSerial) {
  const int P = parallel::world_info().size;
  if (P < 2) GTEST_SKIP() << "needs 2 or more ranks";
  const std::vector<std::string> mamba1{"model.mixers=mamba1"};
  auto serial = train(config(mamba1), false);
  for (const char* mode : {"ordered", "tree", "allgather"})
    for (bool recompute : {false, true}) {
      if (recompute && std::string(mode) != "ordered") continue;
      auto o = mamba1;
      o.push_back("parallel.sp=" + std::to_string(P));
      o.push_back(std::string("parallel.scan_mode=") + mode);
      if (recompute) o.push_back("parallel.recompute=true");
      double err = compare(train(config(o), true), serial);
      if (parallel::world_info().rank == 0)
        std::printf("[ errors   ] trainer mamba1 sp=%d %s%s vs sp=1 (fp64, 5 steps): %.3e\n", P, mode,
                    recompute ? " recomputed" : "", err);
      EXPECT_LE(err, 1e-10) << mode;
    }
  auto segmented = mamba1, sp = mamba1;
  segmented.push_back("parallel.segments=" + std::to_string(P));
  sp.push_back("parallel.sp=" + std::to_string(P));
  EXPECT_TRUE(same_bits(train_bits(config(sp), true), train_bits(config(segmented), false),
                        "mamba1 sp=" + std::to_string(P) + " vs sp=1 with " + std::to_string(P) +
                            " segments (fp32, 5 steps)"));
}

TEST(Trainer, OrderedSegmentsGiveTheSameBitsOnEveryLayout) {
  const int P = parallel::world_info().size;
  if (P < 2) GTEST_SKIP() << "needs 2 or more ranks";
  std::vector<std::vector<std::string>> models{{}};
  if (P == 2)
    models.push_back({"model.mixers=gated_deltanet,softmax_attn", "model.mixer_options[1]={kind: \"softmax_attn\" window: 8}"});
  for (auto& m : models)
    for (int recompute : {0, 1, 2}) {  // kept; recomputed beside the layer above everywhere; the defaults
      auto o = m;
      o.push_back("parallel.recompute=" + std::string(recompute ? "true" : "false"));
      std::string what = std::string(m.empty() ? "gdn" : "gdn+swa") +
                         (recompute == 1 ? ", recomputed beside" : recompute == 2 ? ", recomputed in turn on sp ranks" : "");
      auto serial_o = o, sp_o = o;
      // Both layers recomputed, so the overlap has a layer below to run ahead. The defaults rebuild beside
      // the layer above on one rank and in turn on sp ranks: the overlap changes no bit either.
      if (recompute) serial_o.push_back("parallel.recompute_keep_last=0"), sp_o.push_back("parallel.recompute_keep_last=0");
      if (recompute == 1) sp_o.push_back("parallel.recompute_overlap=true");
      serial_o.push_back("parallel.segments=" + std::to_string(P));
      sp_o.push_back("parallel.sp=" + std::to_string(P));  // segments = sp by default
      auto serial = train_bits(config(serial_o), false);
      auto sp = train_bits(config(sp_o), true);
      EXPECT_TRUE(same_bits(sp, serial, "sp=" + std::to_string(P) + " vs sp=1 with " + std::to_string(P) +
                                            " segments (fp32, 5 steps, " + what + ")"));
      // The ranks after the first left their head's weight gradient to the end of the backward (the default).
      EXPECT_EQ(sp.deferred_head_bytes, parallel::world_info().rank > 0 ? int64_t{2560} << 20 : 0);
      EXPECT_EQ(serial.deferred_head_bytes, 0);
      // And each rank updated its piece of the parameters (the default, parallel.shard_update), holding
      // the moments of that piece only.
      EXPECT_TRUE(sp.sharded);
      EXPECT_FALSE(serial.sharded);
      EXPECT_EQ(serial.held_moments, serial.all_moments);
      EXPECT_GT(sp.held_moments, 0);
      EXPECT_LT(sp.held_moments, sp.all_moments);
      int64_t held_sum = 0;
      MPI_Allreduce(&sp.held_moments, &held_sum, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
      EXPECT_EQ(held_sum, sp.all_moments) << "the ranks' pieces of the moments cover every parameter once";
      // The first rank holds the embedding and the first blocks: its forward reads another rank's
      // parameters only at a later part (a block or the head); every other rank at the embedding.
      if (parallel::world_info().rank == 0) EXPECT_GE(sp.first_foreign_part, 0);
      else EXPECT_EQ(sp.first_foreign_part, -1);
    }
  {
    // Every rank updating every parameter (parallel.shard_update=false): the same bits, moments included.
    auto serial = train_bits(config({"parallel.segments=" + std::to_string(P)}), false);
    auto whole = train_bits(config({"parallel.sp=" + std::to_string(P), "parallel.shard_update=false"}), true);
    EXPECT_FALSE(whole.sharded);
    EXPECT_TRUE(same_bits(whole, serial, "sp=" + std::to_string(P) + " with every rank updating every parameter vs "
                                             "sp=1 with " + std::to_string(P) + " segments (fp32, 5 steps)"));
  }
  {
    // And without that deferral (parallel.deferred_head_gradient_mib=0): the same bits too.
    auto serial = train_bits(config({"parallel.segments=" + std::to_string(P)}), false);
    auto sp = train_bits(config({"parallel.sp=" + std::to_string(P), "parallel.deferred_head_gradient_mib=0"}), true);
    EXPECT_EQ(sp.deferred_head_bytes, 0);
    EXPECT_TRUE(same_bits(sp, serial, "sp=" + std::to_string(P) + " without the deferred head gradient vs sp=1 with " +
                                          std::to_string(P) + " segments (fp32, 5 steps)"));
  }
  {
    // The weight gradients' sum in buckets during the backward (parallel/gradient_sum.h) keeps the bits.
    const std::string sp = "parallel.sp=" + std::to_string(P);
    auto serial = train_bits(config({"parallel.segments=" + std::to_string(P)}), false);
    auto overlapped = train_bits(config({sp, "parallel.gradient_sum=BUCKETS"}), true);
    EXPECT_TRUE(same_bits(overlapped, serial, sp + ", gradients summed during the backward, vs sp=1 with " +
                                                  std::to_string(P) + " segments (fp32, 5 steps)"));
  }
  if (P != 2) return;
  // Two segments a rank, against four on one rank.
  auto serial = train_bits(config({"parallel.segments=4"}), false);
  auto sp = train_bits(config({"parallel.sp=2", "parallel.segments=4"}), true);
  EXPECT_TRUE(same_bits(sp, serial, "sp=2 with 4 segments vs sp=1 with 4 (fp32, 5 steps)"));
  // Without segments the sums over tokens are cut differently: equal to rounding only (the reason
  // segments exist; if this ever holds bit for bit, the test above proves less than it claims).
  auto plain = train_bits(config({}), false);
  EXPECT_FALSE(same_bits(plain, serial, "sp=1 without segments vs sp=1 with 4 (fp32, 5 steps)"));
}

// dp = 2 × sp = 2: the update and AdamW's moments split over all four ranks (each sp piece again over the
// two replicas) give the bits of every rank updating every parameter, and each parameter's moments live on
// one rank of the four.
TEST(Trainer, UpdateSplitOverEveryRankKeepsTheBits) {
  if (parallel::world_info().size != 4) GTEST_SKIP() << "needs 4 ranks (dp=2 x sp=2)";
  const std::vector<std::string> layout{"parallel.dp=2", "parallel.sp=2", "data.batch_size=2"};
  auto split = train_bits(config(layout), true);
  auto o = layout;
  o.push_back("parallel.shard_update=false");
  auto whole = train_bits(config(o), true);
  EXPECT_TRUE(split.sharded);
  EXPECT_FALSE(whole.sharded);
  EXPECT_TRUE(same_bits(split, whole, "dp=2 x sp=2 with the update split over the 4 ranks vs every rank updating "
                                      "every parameter (fp32, 5 steps)"));
  int64_t held_sum = 0;
  MPI_Allreduce(&split.held_moments, &held_sum, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_EQ(held_sum, split.all_moments) << "each parameter's moments on one rank of the four";
  EXPECT_LT(split.held_moments, split.all_moments);
  EXPECT_EQ(whole.held_moments, whole.all_moments);
}

// dp = 2 × sp = 2 (ordered): the bits of one rank with two segments and two micro-batches of the same
// sequences (replica d's batch is micro-batch d): each segment's gradients and loss are summed over the
// replicas as one rank sums its micro-batches, before the segments' tree.
TEST(Trainer, DataAndSequenceParallelGiveTheBitsOfOneRank) {
  if (parallel::world_info().size != 4) GTEST_SKIP() << "needs 4 ranks (dp=2 x sp=2)";
  auto serial = train_bits(config({"parallel.segments=2", "optimizer.grad_accum_steps=2", "data.batch_size=2"}), false);
  auto both = train_bits(config({"parallel.dp=2", "parallel.sp=2", "data.batch_size=2"}), true);
  EXPECT_TRUE(both.sharded);
  EXPECT_TRUE(same_bits(both, serial, "dp=2 x sp=2 vs sp=1 with 2 segments and 2 micro-batches (fp32, 5 steps)"));
  auto whole = train_bits(config({"parallel.dp=2", "parallel.sp=2", "data.batch_size=2", "parallel.shard_update=false"}),
                          true);
  EXPECT_TRUE(same_bits(whole, serial, "dp=2 x sp=2, every rank updating every parameter, vs sp=1 with 2 segments "
                                       "and 2 micro-batches (fp32, 5 steps)"));
}

// A layout: the overrides that give it (dp, sp, per-rank batch for the same global batch of 4).
struct Layout {
  std::string name;
  std::vector<std::string> overrides;
  bool distributed() const { return !overrides.empty(); }
};

// Steps 1-5 on layout `first`, a checkpoint, then steps 6-10 resumed on layout `second`, against 10
// steps straight on one rank: the losses and the final parameters agree to rounding. A serial layout
// writes its checkpoint from world rank 0 only; every rank reads it.
RunResult train_resumed(const RunConfig& base, const Layout& first, const Layout& second, const std::string& dir,
                  at::ScalarType dtype) {
  auto make = [&](const Layout& l) {
    auto o = l.overrides;
    o.push_back("checkpoint.dir=" + dir);
    return make_trainer(run_config_from_text(config_to_text(base), "trainer_test_mpi.textproto", o),
                        l.distributed(), dtype);
  };
  RunResult r;
  if (first.distributed() || parallel::world_info().rank == 0) {
    auto t = make(first);
    for (int i = 0; i < 5; ++i) r.losses.push_back(t->train_step().loss);
    t->save_checkpoint();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  auto t = make(second);
  EXPECT_TRUE(t->resume()) << first.name << " -> " << second.name;
  EXPECT_EQ(t->step(), 5);
  r.losses.resize(5);  // ranks that did not run the serial first half: compared on the second half only
  for (int i = 0; i < 5; ++i) r.losses.push_back(t->train_step().loss);
  for (auto& [n, p] : t->model().parameters()) r.params.push_back(p.detach().clone());
  r.eval = t->evaluate();
  return r;
}

TEST(Trainer, ResumeOnAnotherLayoutContinuesTheRun) {
  const int P = parallel::world_info().size;
  if (P < 2) GTEST_SKIP() << "needs 2 or more ranks";
  Layout serial{"dp=1 x sp=1", {}};
  std::vector<Layout> layouts;
  if (P == 2) {
    layouts.push_back({"dp=1 x sp=2", {"parallel.sp=2"}});
    layouts.push_back({"dp=2 x sp=1", {"parallel.dp=2", "data.batch_size=2"}});
  } else if (P == 4) {
    layouts.push_back({"dp=2 x sp=2", {"parallel.dp=2", "parallel.sp=2", "data.batch_size=2"}});
    layouts.push_back({"dp=1 x sp=4", {"parallel.sp=4", "parallel.scan_mode=tree"}});
  } else {
    GTEST_SKIP() << "layouts are listed for 2 and 4 ranks";
  }
  std::vector<std::pair<Layout, Layout>> pairs{{serial, layouts[0]}, {layouts[0], serial}, {layouts[0], layouts[1]},
                                               {layouts[1], layouts[0]}};
  for (const char* precision : {"fp64", "fp32"}) {
    const auto dtype = std::string(precision) == "fp64" ? at::kDouble : at::kFloat;
    auto base = config({"optimizer.total_steps=10"});
    // 10 steps straight, one rank (every rank runs it in-process).
    auto straight = train(base, false, 10, dtype);
    const double tol = std::string(precision) == "fp64" ? 1e-10 : 1e-5;
    for (auto& [a, b] : pairs) {
      std::string dir = shared_temp_dir("carry_resume_layout");
      auto resumed = train_resumed(base, a, b, dir, dtype);
      // Losses 6-10 and the final state (losses 1-5 are the first layout's, checked elsewhere).
      RunResult tail = straight, got = resumed;
      tail.losses.erase(tail.losses.begin(), tail.losses.begin() + 5);
      got.losses.erase(got.losses.begin(), got.losses.begin() + 5);
      // fp64: losses and parameters (the run is exact up to rounding, so 1e-10 holds for both). fp32:
      // the losses; the parameters differ by fp32 rounding of the gradient sums, which AdamW's
      // normalisation lifts to ~1e-4 relative for parameters with tiny gradients, as it does between
      // any two layouts run straight.
      double err = compare(got, tail);
      double loss_err = 0;
      for (size_t i = 0; i < tail.losses.size(); ++i)
        loss_err = std::max(loss_err, std::abs(got.losses[i] - tail.losses[i]) / std::abs(tail.losses[i]));
      loss_err = max_over_ranks(loss_err);
      if (parallel::world_info().rank == 0)
        std::printf("[ errors   ] trainer %s: 5 steps on %s + resume on %s + 5 steps vs 10 straight: "
                    "losses %.3e, losses and parameters %.3e\n", precision, a.name.c_str(), b.name.c_str(),
                    loss_err, err);
      EXPECT_LE(std::string(precision) == "fp64" ? err : loss_err, tol) << precision << " " << a.name << " -> " << b.name;
      EXPECT_LE(err, 1e-3) << precision << " " << a.name << " -> " << b.name;
      MPI_Barrier(MPI_COMM_WORLD);
      if (parallel::world_info().rank == 0) remove_tree(dir);
    }
  }
}

// Hosts without a shared filesystem: the checkpoint (written by world rank 0) is in a directory only
// rank 0 has; the other ranks are given an empty one. They resume all the same (rank 0 broadcasts
// the checkpoint) and the run continues as if it had never stopped (fp64).
TEST(Trainer, ResumeWhenOnlyRankZeroSeesTheCheckpoint) {
  const int P = parallel::world_info().size;
  if (P < 2) GTEST_SKIP() << "needs 2 or more ranks";
  const int rank = parallel::world_info().rank;
  std::string own = make_temp_dir("carry_resume_rank" + std::to_string(rank));
  auto base = config({"optimizer.total_steps=10"});
  auto straight = train(base, false, 10);
  std::vector<std::string> layout{"parallel.sp=" + std::to_string(P), "checkpoint.dir=" + own};
  auto cfg = run_config_from_text(config_to_text(base), "trainer_test_mpi.textproto", layout);
  if (rank == 0) {
    auto first = make_trainer(run_config_from_text(config_to_text(base), "x.textproto", {"checkpoint.dir=" + own}), false);
    for (int i = 0; i < 5; ++i) first->train_step();
    first->save_checkpoint();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  auto t = make_trainer(cfg, true);
  ASSERT_TRUE(t->resume());
  EXPECT_EQ(t->step(), 5);
  EXPECT_EQ(t->tokens_seen(), 5 * 4 * 64);
  RunResult r;
  r.losses.resize(5);
  for (int i = 0; i < 5; ++i) r.losses.push_back(t->train_step().loss);
  for (auto& [n, p] : t->model().parameters()) r.params.push_back(p.detach().clone());
  r.eval = t->evaluate();
  for (int i = 0; i < 5; ++i) r.losses[i] = straight.losses[i];
  double err = compare(r, straight);
  if (rank == 0)
    std::printf("[ errors   ] trainer: checkpoint only on rank 0, resumed on sp=%d + 5 steps vs 10 straight (fp64): %.3e\n",
                P, err);
  EXPECT_LE(err, 1e-10);
  MPI_Barrier(MPI_COMM_WORLD);
  remove_tree(own);
}

// A stop signal that reaches one rank only (the last, after step 2) stops every rank after step 3,
// the step whose loss sum carried the flag, with one checkpoint of step 3 and the same return value.
TEST(Trainer, StopSignalOnOneRankStopsEveryRankAtTheSameStep) {
  const int P = parallel::world_info().size;
  if (P < 2) GTEST_SKIP() << "needs 2 or more ranks";
  std::string dir = shared_temp_dir("carry_stop_mpi");
  auto cfg = config({"parallel.sp=" + std::to_string(P), "checkpoint.dir=" + dir, "optimizer.total_steps=8"});
  TrainerOptions o;
  o.log = nullptr;
  o.force_cpu = true;
  o.on_step = [&](const StepStats& s) {
    if (s.step == 2 && parallel::world_info().rank == P - 1) std::raise(SIGUSR1);
  };
  parallel::CommOptions copt;
  copt.timeout_s = 120;
  copt.on_timeout = parallel::CommOptions::OnTimeout::throw_error;
  auto groups = std::make_shared<parallel::ProcessGroups>(
      parallel::make_process_groups({1, P}, parallel::Backend::mpi, copt));
  Trainer t(cfg, groups, o);
  EXPECT_EQ(t.run(), kExitStoppedBySignal);
  EXPECT_EQ(t.step(), 3);
  auto saved = load_latest_checkpoint(dir);
  ASSERT_TRUE(saved.has_value());
  EXPECT_EQ(saved->step, 3);
  MPI_Barrier(MPI_COMM_WORLD);
  if (parallel::world_info().rank == 0) remove_tree(dir);
}

// The behaviour switches are config fields, checked with the config: a value outside a field's enum
// or type is one error naming the field, and every rank sees the same error; gather_overlap off keeps
// the split update's bits (on the CPU the gather is not overlapped either way).
TEST(Trainer, BehaviourSwitchesAreConfigFields) {
  const int P = parallel::world_info().size;
  if (P < 2 || (P & (P - 1)) != 0) GTEST_SKIP() << "needs a power of two of ranks, 2 or more";
  for (const std::string bad : {"parallel.gather_overlap=yes", "parallel.gradient_sum=SOMETIMES",
                                "parallel.sp_messages=PIGEONS", "logging.comm_timing=LOUD"}) {
    std::string message;
    try {
      config({bad});
    } catch (const std::exception& e) {
      message = e.what();
    }
    const std::string field = bad.substr(0, bad.find('='));
    EXPECT_NE(message.find(field), std::string::npos) << bad << ": " << message;
  }
  const std::string sp = "parallel.sp=" + std::to_string(P);
  auto overlapped = train_bits(config({sp}), true);
  auto at_the_end = train_bits(config({sp, "parallel.gather_overlap=false"}), true);
  EXPECT_TRUE(same_bits(at_the_end, overlapped, sp + " with parallel.gather_overlap false vs true (fp32, 5 steps)"));
}

TEST(Trainer, LayoutMustMatchTheWorld) {
  const int P = parallel::world_info().size;
  auto cfg = config({"parallel.dp=" + std::to_string(P + 1)});
  EXPECT_THROW(validate_layout(cfg, P), ConfigError);
}

}  // namespace
}  // namespace carry::testing
