// Tests of framework/infer/generate.*: sampling (greedy = argmax; top-k never leaves the k most likely;
// a tiny top-p keeps only the most likely; draw frequencies follow softmax(logits / temperature));
// generation is deterministic under a seed and differs across seeds; the logits of every draw equal
// those of a full forward over the generated sequence (fp64), greedy picks their argmax.
#include "framework/infer/generate.h"

#include "tests/helpers/one_thread.h"

#include <gtest/gtest.h>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <set>
#include <vector>

namespace carry {
namespace {

ModelConfig tiny() {
  ModelConfig m;
  m.set_vocab_size(23);
  m.set_d_model(16);
  m.set_n_layers(2);
  m.set_n_heads(2);
  m.set_head_dim_k(8);
  m.set_head_dim_v(8);
  m.set_init_std(0.5);
  m.add_mixers("gated_deltanet");
  m.add_mixers("softmax_attn");
  auto* o = m.add_mixer_options();
  o->set_chunk_size(8);
  o->set_conv_size(4);
  return m;
}

TEST(Sampling, GreedyTopKTopPAndFrequencies) {
  auto logits = at::tensor({0.5, 2.0, -1.0, 1.5, 2.0, 0.0}, at::kDouble);
  SamplingOptions greedy;
  greedy.temperature = 0;
  EXPECT_EQ(sample_token(logits, greedy, 0), 1);  // the first of the two maxima
  SamplingOptions top2;
  top2.top_k = 2;
  std::set<int64_t> seen;
  for (int64_t i = 0; i < 200; ++i) seen.insert(sample_token(logits, top2, i));
  EXPECT_EQ(seen, (std::set<int64_t>{1, 4}));
  SamplingOptions nucleus;
  nucleus.top_p = 0.01;
  for (int64_t i = 0; i < 50; ++i) EXPECT_EQ(sample_token(logits, nucleus, i), 1);
  // Frequencies at temperature 2 against softmax(logits / 2): within 5 standard deviations.
  SamplingOptions warm;
  warm.temperature = 2;
  warm.seed = 17;
  const int64_t draws = 20000;
  std::vector<double> count(6, 0);
  for (int64_t i = 0; i < draws; ++i) count[sample_token(logits, warm, i)] += 1;
  auto p = at::softmax(logits / 2, 0);
  for (int64_t v = 0; v < 6; ++v) {
    double pv = p[v].item<double>();
    double sd = std::sqrt(draws * pv * (1 - pv));
    EXPECT_NEAR(count[v], draws * pv, 5 * sd) << "token " << v;
  }
  SamplingOptions bad;
  bad.top_p = 0;
  EXPECT_THROW(sample_token(logits, bad, 0), c10::Error);
}

TEST(Generate, DeterministicUnderASeedAndConsistentWithTheFullForward) {
  testing::OneThread one_thread;
  at::NoGradGuard no_grad;
  Model model = build_model(tiny(), 3, at::TensorOptions().dtype(at::kDouble));
  const std::vector<int64_t> prompt = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5};
  GenerationOptions opt;
  opt.max_new_tokens = 13;
  opt.sampling.temperature = 1.5;
  opt.sampling.seed = 42;
  opt.keep_logits = true;
  auto a = generate(model, prompt, opt);
  auto b = generate(model, prompt, opt);
  ASSERT_EQ(a.tokens.size(), 13u);
  EXPECT_EQ(a.tokens, b.tokens) << "same seed, different tokens";
  EXPECT_TRUE(at::equal(a.logits, b.logits));
  int differing = 0;
  for (uint64_t seed = 43; seed < 48; ++seed) {
    opt.sampling.seed = seed;
    differing += generate(model, prompt, opt).tokens != a.tokens;
  }
  EXPECT_GE(differing, 3) << "other seeds should mostly give other samples";

  // Each draw's logits are those of a full forward over prompt + the tokens drawn so far (the sequence
  // is padded to whole chunks: the model is causal, so the padding changes no earlier position).
  std::vector<int64_t> seq = prompt;
  seq.insert(seq.end(), a.tokens.begin(), a.tokens.end());
  while (seq.size() % 8) seq.push_back(0);
  auto full = model.forward(at::tensor(seq, at::kLong).view({1, -1})).select(0, 0);
  auto expected = full.narrow(0, prompt.size() - 1, 13).to(at::kFloat);
  EXPECT_LT((a.logits - expected).abs().max().item<double>(), 1e-5);

  GenerationOptions greedy;
  greedy.max_new_tokens = 6;
  greedy.sampling.temperature = 0;
  greedy.keep_logits = true;
  auto g = generate(model, prompt, greedy);
  for (size_t i = 0; i < g.tokens.size(); ++i) EXPECT_EQ(g.tokens[i], g.logits[i].argmax().item<int64_t>());
  greedy.stop_token = g.tokens[2];
  auto stopped = generate(model, prompt, greedy);
  EXPECT_LE(stopped.tokens.size(), 3u);
  EXPECT_EQ(stopped.tokens.back(), g.tokens[2]);
}

}  // namespace
}  // namespace carry
