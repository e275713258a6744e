// Tests of framework/eval/evaluator.*: a model with zero weights predicts uniformly, so its loss is
// ln V at every position, perplexity V and bits per byte log2 V (hand-computed); a random tiny model's
// loss, accuracy and per-position sums equal a direct computation over the same windows (fp64), with
// a partial last batch scored once; on an MQAR task the evaluation equals Trainer::evaluate's; the
// curve's ranges cover every position once; the table and the plot are written; a sequence length
// the chunks do not divide is refused with what to pick.
#include "framework/eval/evaluator.h"

#include "framework/data/token_file.h"
#include "framework/train/trainer.h"
#include "tests/helpers/one_thread.h"
#include "tests/helpers/temp_dir.h"

#include <gtest/gtest.h>

#include <ATen/core/grad_mode.h>

#include <cmath>
#include <fstream>
#include <sstream>

namespace carry {
namespace {

ModelConfig tiny(int64_t vocab) {
  ModelConfig m;
  m.set_vocab_size(vocab);
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

std::string token_file(const std::string& dir, int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<uint32_t> tokens(n);
  uint64_t x = seed;
  for (auto& t : tokens) x = x * 6364136223846793005ULL + 1442695040888963407ULL, t = (x >> 33) % vocab;
  std::string path = dir + "/data.tok";
  write_token_file(path, tokens);
  return path;
}

TEST(Evaluator, UniformModelScoresLnV) {
  auto dir = testing::make_temp_dir("carry_eval_uniform");
  const int64_t V = 257;
  Model model = build_model(tiny(V), 1, at::TensorOptions().dtype(at::kDouble));
  {
    at::NoGradGuard no_grad;
    for (auto& [name, p] : model.parameters()) p.zero_();
  }
  EvalSpec spec;
  spec.token_files = {token_file(dir, 16 * 5 + 1, V, 3)};
  spec.seq_len = 16;
  spec.batch_size = 2;
  EvalResult r = evaluate_model(model, spec, nullptr);
  EXPECT_EQ(r.sequences, 5);
  EXPECT_EQ(r.positions, 80);
  EXPECT_NEAR(r.loss(), std::log(257.0), 1e-12);
  EXPECT_NEAR(r.perplexity(), 257.0, 1e-9);
  // Bits per byte: the bits of every scored target over the targets that are bytes (< 256).
  EXPECT_NEAR(r.bits_per_byte(), std::log2(257.0) * 80 / r.byte_targets, 1e-12);
  for (int64_t p = 0; p < 16; ++p) {
    EXPECT_EQ(r.position_count[p], 5);
    EXPECT_NEAR(r.position_loss[p] / 5, std::log(257.0), 1e-12);
  }
  testing::remove_tree(dir);
}

TEST(Evaluator, EqualsADirectComputationOverTheWindows) {
  testing::OneThread one_thread;
  auto dir = testing::make_temp_dir("carry_eval_direct");
  const int64_t V = 11, T = 16, windows = 5;
  Model model = build_model(tiny(V), 2, at::TensorOptions().dtype(at::kDouble));
  std::string path = token_file(dir, T * windows + 7, V, 5);
  EvalSpec spec;
  spec.token_files = {path};
  spec.seq_len = T;
  spec.batch_size = 3;  // 5 windows: batches of 3 and 2 (+1 unscored)
  EvalResult r = evaluate_model(model, spec, nullptr);

  at::NoGradGuard no_grad;
  TokenFile file(path);
  std::vector<double> loss(T, 0), right(T, 0);
  double total = 0;
  for (int64_t s = 0; s < windows; ++s) {
    auto w = file.read_tensor(s * T, T + 1);
    auto logits = model.forward(w.narrow(0, 0, T).view({1, T})).select(0, 0);  // [T, V]
    for (int64_t p = 0; p < T; ++p) {
      // -log softmax by hand: log Σ exp(z_v - z_max) + z_max - z_target.
      auto z = logits[p];
      double zmax = z.max().item<double>(), sum = 0;
      for (int64_t v = 0; v < V; ++v) sum += std::exp(z[v].item<double>() - zmax);
      double ce = std::log(sum) + zmax - z[w[p + 1].item<int64_t>()].item<double>();
      loss[p] += ce, total += ce;
      right[p] += z.argmax().item<int64_t>() == w[p + 1].item<int64_t>();
    }
  }
  EXPECT_EQ(r.sequences, windows);
  EXPECT_EQ(r.positions, windows * T);
  EXPECT_NEAR(r.loss_sum, total, 1e-10 * total);
  for (int64_t p = 0; p < T; ++p) {
    EXPECT_NEAR(r.position_loss[p], loss[p], 1e-10 * loss[p]) << p;
    EXPECT_EQ(r.position_correct[p], right[p]) << p;
  }
  spec.max_sequences = 2;
  EXPECT_EQ(evaluate_model(model, spec, nullptr).sequences, 2);
  spec.max_sequences = 0;

  // A batch size far past the data (5,000,000 sequences of 16 tokens would need gigabytes) is sized to
  // the 5 windows: the same scores, at once.
  spec.batch_size = 5000000;
  EvalResult huge = evaluate_model(model, spec, nullptr);
  EXPECT_EQ(huge.sequences, windows);
  EXPECT_NEAR(huge.loss_sum, total, 1e-10 * total);
  spec.batch_size = 3;

  // The curve covers every position once; table and plot are written.
  for (int64_t buckets : {0, 3, 24}) {
    auto rows = loss_curve(r, buckets);
    double tokens = 0;
    int64_t next = 0;
    for (auto& row : rows) {
      EXPECT_EQ(row.first, next);
      next = row.last + 1;
      tokens += row.tokens;
    }
    EXPECT_EQ(next, T);
    EXPECT_EQ(tokens, windows * T);
    if (buckets == 0) EXPECT_EQ(rows.size(), static_cast<size_t>(T));
  }
  write_curve_tsv(dir + "/c.tsv", loss_curve(r, 4));
  write_curve_svg(dir + "/c.svg", loss_curve(r, 4), "title <x>");
  std::ifstream tsv(dir + "/c.tsv"), svg(dir + "/c.svg");
  std::stringstream a, b;
  a << tsv.rdbuf(), b << svg.rdbuf();
  EXPECT_EQ(a.str().rfind("first_position\tlast_position\ttokens\tloss\taccuracy\n", 0), 0u);
  EXPECT_NE(b.str().find("<polyline"), std::string::npos);
  EXPECT_NE(b.str().find("title &lt;x&gt;"), std::string::npos);

  spec.seq_len = 12;
  try {
    evaluate_model(model, spec, nullptr);
    FAIL() << "a sequence length of 12 with chunks of 8 was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("pick a sequence length that is a multiple of 8"), std::string::npos) << e.what();
  }
  testing::remove_tree(dir);
}

TEST(Evaluator, MqarMatchesTheTrainersEvaluation) {
  testing::OneThread one_thread;
  auto cfg = run_config_from_text(R"(
    seed: 4
    model { vocab_size: 24 d_model: 16 n_layers: 2 n_heads: 2 mixers: "gated_deltanet" mixer_options { chunk_size: 8 conv_size: 4 } }
    data { mqar { num_kv_pairs: 3 num_queries: 4 vocab_size: 24 } seq_len: 32 batch_size: 3 eval_batches: 2 }
    optimizer { total_steps: 3 lr: 1e-2 })", "mqar.textproto");
  TrainerOptions o;
  o.log = nullptr;
  o.force_cpu = true;
  o.dtype = at::kDouble;
  Trainer t(cfg, nullptr, o);
  for (int i = 0; i < 3; ++i) t.train_step();
  EvalStats expected = t.evaluate();
  EvalSpec spec;
  spec.data = cfg.data();
  spec.seed = cfg.seed();
  spec.seq_len = 32;
  spec.batch_size = 3;
  EvalResult r = evaluate_model(t.model(), spec, nullptr);
  EXPECT_TRUE(r.task);
  EXPECT_EQ(r.positions, expected.positions);
  EXPECT_NEAR(r.loss(), expected.loss, 1e-12);
  EXPECT_NEAR(r.accuracy(), expected.accuracy, 1e-15);
  EXPECT_NEAR(static_cast<double>(r.sequences_all_right) / r.sequences, expected.sequence_accuracy, 1e-15);
  EXPECT_EQ(r.sequences, 6);
  // A task batch no host could hold (10^12 sequences) is refused before anything is allocated.
  spec.batch_size = 1000000000000;
  try {
    evaluate_model(t.model(), spec, nullptr);
    ADD_FAILURE() << "a batch of 10^12 sequences was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("eval: a batch of 1000000000000 sequences of 32 tokens needs at least "),
              std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("MiB available; give a smaller --batch-size"), std::string::npos) << e.what();
  }
  spec.batch_size = 3;

  // The needle task the same way: value_len scored targets a sequence.
  spec.data.mutable_needle()->set_vocab_size(24);
  spec.data.mutable_needle()->set_value_len(3);
  EvalResult needle = evaluate_model(t.model(), spec, nullptr);
  EXPECT_EQ(needle.sequences, 6);
  EXPECT_EQ(needle.positions, 6 * 3);
  EXPECT_GE(needle.accuracy(), 0.0);
}

}  // namespace
}  // namespace carry
