// Packed documents through the model (fp64): a sequence of three documents gives, position for
// position, the logits of each document run alone -- for a hybrid of Gated DeltaNet with short
// convolutions, sliding-window softmax attention, Mamba-2 and log-linear Gated DeltaNet -- with and
// without per-layer recomputation; and the trainer turns data.token_files.eod_token into document starts
// (a run with them differs from one without; every step finite).
#include "framework/data/token_file.h"
#include "framework/model/model.h"
#include "framework/train/trainer.h"
#include "tests/helpers/temp_dir.h"
#include "tests/helpers/one_thread.h"

#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>

namespace carry::testing {
namespace {

ModelConfig hybrid() {
  auto cfg = run_config_from_text(R"(
name: "documents"
model {
  vocab_size: 40 d_model: 32 n_layers: 4 n_heads: 2
  mixers: ["gated_deltanet", "softmax_attn", "mamba2", "loglinear_gdn"]
  mixer_options { chunk_size: 8 conv_size: 4 }
  mixer_options { kind: "softmax_attn" window: 12 conv_size: 0 }
  mixer_options { kind: "loglinear_gdn" levels: 7 }
}
data { mqar { num_kv_pairs: 2 num_queries: 2 vocab_size: 40 } seq_len: 48 batch_size: 2 }
)",
                                  "documents.textproto");
  return cfg.model();
}

TEST(ModelDocuments, EachDocumentGivesTheLogitsItGivesAlone) {
  OneCpuThread one_thread;
  auto model = build_model(hybrid(), 3, at::TensorOptions().dtype(at::kDouble));
  at::manual_seed(4);
  auto tokens = at::randint(40, {2, 48}, at::kLong);
  // Sequence 0: documents [0,16) [16,24) [24,48); sequence 1: [0,40) [40,48).
  auto starts = at::zeros({2, 48}, at::kBool);
  starts[0][16] = true, starts[0][24] = true, starts[1][40] = true;
  for (bool recompute : {false, true}) {
    ModelContext ctx;
    ctx.recompute = recompute;
    ctx.document_starts = starts;
    at::NoGradGuard no_grad;
    auto packed = model.forward(tokens, ctx);
    double worst = 0;
    for (auto [b, a, e] : {std::tuple<int64_t, int64_t, int64_t>{0, 0, 16}, {0, 16, 24}, {0, 24, 48}, {1, 0, 40}, {1, 40, 48}}) {
      auto alone = model.forward(tokens.narrow(0, b, 1).narrow(1, a, e - a));
      auto mine = packed.narrow(0, b, 1).narrow(1, a, e - a);
      worst = std::max(worst, (mine - alone).abs().max().item<double>() / alone.abs().max().item<double>());
    }
    std::printf("[ errors   ] packed documents vs each alone, 4-kind hybrid%s: %.3g\n", recompute ? ", recomputed" : "",
                worst);
    EXPECT_LT(worst, 1e-12);
    // Without the starts the documents see each other.
    auto straight = model.forward(tokens);
    EXPECT_GT((straight.narrow(1, 16, 8) - packed.narrow(1, 16, 8)).abs().max().item<double>(), 1e-6);
  }
}

TEST(TrainerDocuments, EodTokenStartsDocuments) {
  OneCpuThread one_thread;
  auto dir = make_temp_dir("carry_documents");
  std::vector<uint32_t> t(2000);
  for (size_t i = 0; i < t.size(); ++i) t[i] = i % 23 == 0 ? 0 : 1 + (i * 7 + i / 5) % 39;
  write_token_file(dir + "/train.tok", t);
  auto cfg = [&](int64_t eod) {
    return run_config_from_text(R"(
name: "documents"
model { vocab_size: 40 d_model: 32 n_layers: 2 n_heads: 2 mixers: "gated_deltanet" mixer_options { chunk_size: 8 conv_size: 4 } }
data { seq_len: 48 batch_size: 2 }
optimizer { lr: 1e-2 total_steps: 3 }
)",
                                "documents.textproto",
                                {"data.token_files={paths: \"" + dir + "/train.tok\" eod_token: " + std::to_string(eod) + "}"});
  };
  TrainerOptions o;
  o.log = nullptr;
  o.force_cpu = true;
  Trainer with(cfg(0), nullptr, o), without(cfg(-1), nullptr, o);
  for (int i = 0; i < 3; ++i) {
    auto a = with.train_step(), b = without.train_step();
    ASSERT_TRUE(std::isfinite(a.loss));
    if (i == 0) EXPECT_NE(a.loss, b.loss) << "the document starts changed nothing";
  }
  try {
    run_config_from_text(R"(
name: "documents"
model { vocab_size: 40 d_model: 32 n_layers: 2 n_heads: 2 mixers: ["gated_deltanet", "loglinear_gdn"] mixer_options { chunk_size: 8 } }
data { token_files { paths: "x.tok" eod_token: 40 } seq_len: 64 batch_size: 2 }
parallel { sp: 2 scan_mode: TREE }
)",
                         "bad.textproto");
    ADD_FAILURE() << "accepted";
  } catch (const ConfigError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("data.token_files.eod_token: must be -1 (no document resets) or an id below model.vocab_size (40), got 40"),
              std::string::npos) << m;
    // Gated DeltaNet's summaries reset at a document start in the tree scan; log-linear's do not.
    EXPECT_NE(m.find("document resets in the log-linear layer 'loglinear_gdn' under sequence parallelism need "
                     "parallel.scan_mode: ORDERED"),
              std::string::npos) << m;
    EXPECT_EQ(m.find("'gated_deltanet'"), std::string::npos) << m;
  }
  remove_tree(dir);
}

}  // namespace
}  // namespace carry::testing
