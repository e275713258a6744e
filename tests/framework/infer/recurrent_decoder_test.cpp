// Tests of framework/infer/recurrent_decoder.*: for every mixer kind (and a hybrid with sliding-window
// attention), reading a sequence piece by piece from the recurrent state (a prompt read chunkwise with
// a misaligned tail, then one token at a time; and pieces that start inside a chunk) gives the logits
// of one full forward over the same tokens, in fp64 on the CPU. Reading past max_length and token ids
// outside the vocabulary are refused.
#include "framework/infer/recurrent_decoder.h"

#include "tests/helpers/mixer_testing.h"
#include "tests/helpers/one_thread.h"

#include <gtest/gtest.h>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace carry {
namespace {

ModelConfig tiny(const std::vector<std::string>& mixers, int64_t conv_size = 4) {
  ModelConfig m;
  m.set_vocab_size(19);
  m.set_d_model(16);
  m.set_n_layers(static_cast<int64_t>(std::max<size_t>(2, mixers.size())));
  m.set_n_heads(2);
  m.set_head_dim_k(8);
  m.set_head_dim_v(8);
  m.set_mlp_ratio(2.0);
  m.set_init_std(0.3);
  for (auto& k : mixers) m.add_mixers(k);
  auto* o = m.add_mixer_options();
  o->set_chunk_size(8);
  o->set_conv_size(conv_size);
  return m;
}

Tensor tokens_of(int64_t B, int64_t T, int64_t V, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(V, {B, T}, gen, at::TensorOptions().dtype(at::kLong));
}

double rel_err(const Tensor& a, const Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(1e-300, b.abs().max().item<double>());
}

// Reads `tokens` in pieces of the given lengths and returns the concatenated logits.
Tensor read_in_pieces(const Model& model, const Tensor& tokens, const std::vector<int64_t>& pieces) {
  RecurrentDecoder decoder(model, tokens.size(1));
  std::vector<Tensor> out;
  int64_t at = 0;
  for (int64_t n : pieces) {
    out.push_back(decoder.feed(tokens.narrow(1, at, n)));
    at += n;
  }
  EXPECT_EQ(at, tokens.size(1));
  EXPECT_EQ(decoder.position(), tokens.size(1));
  return at::cat(out, 1);
}

void expect_recurrent_equals_full(const ModelConfig& config, const std::string& what) {
  at::NoGradGuard no_grad;
  Model model = build_model(config, 5, at::TensorOptions().dtype(at::kDouble));
  // rwkv7's initialization zeroes its o_proj: noise makes every term of its layers count.
  for (const auto& k : config.mixers())
    if (k == "rwkv7") testing::perturb_parameters(model.parameters(), 13, 0.3);
  const int64_t T = 32;
  auto tokens = tokens_of(1, T, config.vocab_size(), 9);
  auto full = model.forward(tokens);
  // A prompt of 11 (8 chunkwise + 3 naive), then one token a step.
  std::vector<int64_t> steps = {11};
  for (int64_t i = 11; i < T; ++i) steps.push_back(1);
  double e1 = rel_err(read_in_pieces(model, tokens, steps), full);
  // Pieces starting inside a chunk: 3 (naive), 13 (5 naive to the boundary, then 8 chunkwise), 16.
  double e2 = rel_err(read_in_pieces(model, tokens, {3, 13, 16}), full);
  EXPECT_LT(e1, 1e-12) << what << ": prompt + one token a step";
  EXPECT_LT(e2, 1e-12) << what << ": pieces inside chunks";
  std::printf("[ errors ] recurrent decoding vs full forward, %-22s %.2e %.2e\n", what.c_str(), e1, e2);
}

TEST(RecurrentDecoder, EveryKindMatchesTheFullForward) {
  testing::OneThread one_thread;
  for (const auto& kind : mixer_layer_kinds()) {
    ModelConfig c = tiny({kind});
    if (kind == "softmax_attn" || kind == "rwkv7") c.mutable_mixer_options(0)->set_conv_size(0);
    if (kind == "linear_attn" || kind == "hla2" || kind == "ahla") c.mutable_mixer_options(0)->set_normalize(true);
    expect_recurrent_equals_full(c, kind);
  }
}

TEST(RecurrentDecoder, SlidingWindowHybridAndVariants) {
  testing::OneThread one_thread;
  ModelConfig hybrid = tiny({"gated_deltanet", "softmax_attn", "gated_deltanet", "softmax_attn"});
  auto* w = hybrid.add_mixer_options();
  w->set_kind("softmax_attn");
  w->set_window(5);
  expect_recurrent_equals_full(hybrid, "gdn + window 5");
  ModelConfig window1 = tiny({"softmax_attn"}, 0);
  window1.mutable_mixer_options(0)->set_window(1);
  expect_recurrent_equals_full(window1, "softmax window 1");
  ModelConfig patterns = tiny({"gated_deltanet", "softmax_attn"});
  auto* sp = patterns.add_mixer_options();
  sp->set_kind("softmax_attn");
  sp->set_window(4);
  sp->set_global_tokens(3);
  sp->set_stride(5);
  expect_recurrent_equals_full(patterns, "window 4, G 3, S 5");
  ModelConfig no_conv = tiny({"gated_deltanet"}, 0);
  expect_recurrent_equals_full(no_conv, "gdn without conv");
  ModelConfig conv2 = tiny({"mamba2"}, 2);
  expect_recurrent_equals_full(conv2, "mamba2 conv 2");
  ModelConfig levels = tiny({"loglinear_gdn"});
  levels.mutable_mixer_options(0)->set_levels(8);
  expect_recurrent_equals_full(levels, "loglinear_gdn levels 8");
  ModelConfig performer = tiny({"linear_attn"});
  performer.mutable_mixer_options(0)->set_normalize(true);
  performer.mutable_mixer_options(0)->set_feature_map("performer");
  performer.mutable_mixer_options(0)->set_num_features(12);
  expect_recurrent_equals_full(performer, "performer features");
  ModelConfig channel_mix = tiny({"rwkv7"}, 0);
  channel_mix.set_feed_forward("rwkv7_channel_mix");
  expect_recurrent_equals_full(channel_mix, "rwkv7 + channel mix");
  ModelConfig untied = tiny({"gla"});
  untied.set_tie_embeddings(false);
  expect_recurrent_equals_full(untied, "gla, own head");
}

TEST(RecurrentDecoder, RefusesReadingPastMaxLengthAndBadIds) {
  at::NoGradGuard no_grad;
  Model model = build_model(tiny({"gated_deltanet"}), 1, at::TensorOptions().dtype(at::kDouble));
  RecurrentDecoder decoder(model, 4);
  decoder.feed(tokens_of(1, 3, 19, 1));
  try {
    decoder.feed(tokens_of(1, 2, 19, 2));
    FAIL() << "reading past max_length was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("passes max_length 4"), std::string::npos)
        << e.what_without_backtrace();
  }
  RecurrentDecoder other(model, 8);
  try {
    other.feed(at::full({1, 2}, 19, at::kLong));
    FAIL() << "an id outside the vocabulary was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("vocab_size=19"), std::string::npos);
  }
}

}  // namespace
}  // namespace carry
