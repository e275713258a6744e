// Tests for framework/config/config.h: parse errors with file:line:column and a caret, unknown fields and
// enum values, validation errors naming field paths and locations, the parallel layout, --set
// overrides and their errors, model presets, printing and re-reading the resolved config, and every
// file under configs/ loading and validating.
#include <cmath>
#include "tests/paths.h"
#include "framework/config/config.h"

#include "tests/helpers/temp_dir.h"

#include <gtest/gtest.h>
#include <google/protobuf/text_format.h>
#include <google/protobuf/util/message_differencer.h>

#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <chrono>
#include <fstream>
#include <stdexcept>
#include <string>

namespace carry {
namespace {

using testing::exists;
using testing::make_dirs;
using testing::make_temp_dir;
using testing::remove_tree;

class ConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = make_temp_dir("carry_config_test");
  }
  void TearDown() override { remove_tree(dir_); }

  std::string write(const std::string& name, const std::string& text) {
    auto path = dir_ + "/" + name;
    make_dirs(path.substr(0, path.find_last_of('/')));
    std::ofstream(path) << text;
    return path;
  }

  // The message of the ConfigError that loading `text` (written to run.textproto) throws.
  std::string load_error(const std::string& text, const std::vector<std::string>& overrides = {}) {
    auto path = write("run.textproto", text);
    try {
      load_run_config(path, overrides);
    } catch (const ConfigError& e) {
      return e.what();
    }
    ADD_FAILURE() << "loading did not throw:\n" << text;
    return "";
  }

  std::string dir_;
};

// A small valid run; tests change one thing at a time.
const char* kValid = R"(name: "t"
model {
  vocab_size: 256
  d_model: 64
  n_layers: 2
  n_heads: 4
  mixers: "gla"
}
data {
  mqar { num_kv_pairs: 4 num_queries: 4 vocab_size: 64 }
  seq_len: 128
  batch_size: 2
}
parallel { dp: 1 sp: 2 }
)";

TEST_F(ConfigTest, ValidConfigLoadsWithDefaultsFilled) {
  auto cfg = load_run_config(write("run.textproto", kValid));
  EXPECT_EQ(cfg.model().d_model(), 64);
  EXPECT_TRUE(cfg.optimizer().has_lr());  // filled from the declared default
  EXPECT_DOUBLE_EQ(cfg.optimizer().lr(), 3e-4);
  EXPECT_TRUE(cfg.parallel().has_scan_mode());
  EXPECT_EQ(cfg.parallel().scan_mode(), config::ParallelConfig::ORDERED);
  EXPECT_TRUE(cfg.data().mqar().has_vocab_size());
  EXPECT_FALSE(cfg.data().has_needle());  // unselected oneof members stay unset
  EXPECT_FALSE(cfg.model().has_head_dim_k());  // no declared default: stays "derived"
  EXPECT_EQ(head_dim_k(cfg.model()), 16);
  EXPECT_EQ(mlp_hidden_size(cfg.model()), 192);  // 8/3 * 64 = 170.7 -> 192
}

TEST_F(ConfigTest, ParseErrorNamesFileLineColumnAndShowsCaret) {
  auto msg = load_error("name: \"t\"\nmodel {\n  d_model: abc\n}\n");
  auto path = (dir_ + "/run.textproto");
  EXPECT_EQ(msg.rfind(path + ":3:12: ", 0), 0u) << msg;
  EXPECT_NE(msg.find("\n      d_model: abc\n    " + std::string(11, ' ') + "^"), std::string::npos) << msg;
}

TEST_F(ConfigTest, ParseErrorCaretSitsOnTheRepeatedFieldAndMissingBraceIsNamed) {
  auto path = (dir_ + "/run.textproto");
  auto msg = load_error("name: \"x\"\nname: \"y\"\n");
  EXPECT_EQ(msg, path + ":2:1: Non-repeated field \"name\" is specified multiple times.\n    name: \"y\"\n    ^");
  msg = load_error("model {\n  d_model: 100\n");
  EXPECT_EQ(msg, path + ":3:1: unexpected end of file (a '}' is missing?)\n    \n    ^");
}

TEST_F(ConfigTest, ParseErrorColumnCountsCharactersNotTabStops) {
  // Protobuf counts a tab as reaching the next multiple of 8; the reported column is in characters.
  auto msg = load_error("model {\n\td_model: abc\n}\n");
  auto path = (dir_ + "/run.textproto");
  EXPECT_EQ(msg.rfind(path + ":2:11: ", 0), 0u) << msg;
  EXPECT_NE(msg.find("\n     d_model: abc\n    " + std::string(10, ' ') + "^"), std::string::npos) << msg;
}

// A value missing at the end of a line is reported there, where it is missing (protobuf finds it at
// the next token, lines later), with the caret after the field and where that token was.
TEST_F(ConfigTest, MissingValueAtTheEndOfALineIsReportedOnThatLine) {
  auto m = load_error("name: \"t\"\nseed:   # the seed\n\n  model { d_model: 64 }\n");
  EXPECT_EQ(m, dir_ + "/run.textproto:2:6: Expected integer, got: model (on line 4)\n"
                      "    seed:   # the seed\n"
                      "         ^");
  m = load_error("optimizer {\n  lr:\n}\n");
  EXPECT_EQ(m.rfind(dir_ + "/run.textproto:2:6: Expected double, got: } (on line 3)", 0), 0u) << m;
}

// A binary file is refused naming the first byte that is not text, without writing raw bytes to the
// terminal; a directory or a device that never ends is refused instead of read as empty or forever.
TEST_F(ConfigTest, FilesThatAreNotTextConfigsAreRefused) {
  std::string binary = "name: \"t\"\nseed: 1\x01\x02\xff\n";
  auto m = load_error(binary);
  EXPECT_EQ(m, dir_ + "/run.textproto:2:8: not a text file: byte \\x01 is a control character; a config is a "
                      "textproto file (text), e.g. configs/demo_mqar.textproto");
  m = load_error("name: \"caf\xc3\xa9 \xe9t\xe9\"\n");
  EXPECT_EQ(m.rfind(dir_ + "/run.textproto:1:13: not a text file: byte \\xe9 is not UTF-8", 0), 0u) << m;
  auto must_fail = [](const std::string& path, const std::string& part) {
    try {
      load_run_config(path);
      ADD_FAILURE() << path << " was read as a config";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  must_fail(dir_, "cannot read config file '" + dir_ + "': it is a directory; expected a .textproto file");
  must_fail("/dev/zero", "config file '/dev/zero' is larger than 16 MiB");
  must_fail(dir_ + "/none.textproto", "cannot read config file '" + dir_ + "/none.textproto': No such file");
  // The same for a --set: its bytes are shown as \xNN, not echoed raw.
  EXPECT_EQ(load_error(kValid, {"name=a\x01\xff"}), "--set name=a\\x01\\xff: not text: byte \\x01 is a control character");
  // UTF-8 text with a tab is fine, and an error on such a line shows it as text.
  m = load_error("name: \"caf\xc3\xa9\"\tbogus: 1\n");
  EXPECT_NE(m.find("unknown field \"bogus\""), std::string::npos) << m;
  EXPECT_NE(m.find("    name: \"caf\xc3\xa9\" bogus: 1\n                 ^"), std::string::npos) << m;
}

TEST_F(ConfigTest, UnknownFieldIsAnErrorListingValidFields) {
  auto msg = load_error("name: \"t\"\nmodel { d_modl: 5 }\n");
  auto path = (dir_ + "/run.textproto");
  EXPECT_EQ(msg.rfind(path + ":2:9: unknown field \"d_modl\" in ModelConfig (valid fields: vocab_size, d_model,", 0),
            0u)
      << msg;
  msg = load_error("nmae: \"t\"\n");
  EXPECT_EQ(msg.rfind(path + ":1:1: unknown field \"nmae\" in RunConfig", 0), 0u) << msg;
}

TEST_F(ConfigTest, UnknownEnumValueListsValidValues) {
  auto msg = load_error("parallel { scan_mode: FAST }\n");
  auto path = (dir_ + "/run.textproto");
  EXPECT_EQ(msg.rfind(path + ":1:23: ", 0), 0u) << msg;
  EXPECT_NE(msg.find("FAST"), std::string::npos) << msg;
  EXPECT_NE(msg.find("(valid values: ALLGATHER, ORDERED, TREE)"), std::string::npos) << msg;
}

TEST_F(ConfigTest, ValidationErrorsNameFieldPathAndLocation) {
  std::string text = kValid;
  text.replace(text.find("n_heads: 4"), 10, "n_heads: 10");
  auto msg = load_error(text);
  auto path = (dir_ + "/run.textproto");
  EXPECT_EQ(msg, path + ":6:3: model.n_heads: must divide d_model (64), got 10 (or set head_dim_k and head_dim_v)");

  text = std::string(kValid) + "optimizer { lr: -0.001 warmup_steps: 5000 }\n";
  msg = load_error(text);
  EXPECT_NE(msg.find(path + ":15:13: optimizer.lr: must be positive, got -0.001"), std::string::npos) << msg;
  EXPECT_NE(msg.find(path + ":15:24: optimizer.warmup_steps: must not exceed total_steps (1000), got 5000"),
            std::string::npos)
      << msg;

  text = kValid;
  text.replace(text.find("seq_len: 128"), 12, "seq_len: 96");
  msg = load_error(text);
  EXPECT_NE(msg.find(path + ":11:3: data.seq_len: must be a multiple of chunk_size*sp = 64*2 = 128 (gla layers), "
                     "got 96"),
            std::string::npos)
      << msg;

  // A value that comes from a default has no location: the file and the path.
  text = kValid;
  text.replace(text.find(" vocab_size: 64 }"), 17, " }");
  msg = load_error(text);
  EXPECT_EQ(msg, path + ": data.mqar.vocab_size: 8192 exceeds model.vocab_size (256)");
}

// The learning-rate schedule: an unset one is the cosine; WSD's fields are checked against the run's
// length, with the field's location.
TEST_F(ConfigTest, LearningRateScheduleFieldsAreChecked) {
  const std::string path = dir_ + "/run.textproto";
  auto cfg = load_run_config(write("run.textproto", kValid));
  EXPECT_EQ(cfg.optimizer().schedule(), config::OptimizerConfig::COSINE);
  EXPECT_EQ(cfg.optimizer().decay_fraction(), 0.2);
  EXPECT_EQ(cfg.optimizer().decay_shape(), config::LrDecay::ONE_MINUS_SQRT);
  cfg = load_run_config(write("run.textproto", std::string(kValid) +
                                                   "optimizer { schedule: WSD decay_fraction: 0.1 decay_shape: COSINE }\n"));
  EXPECT_EQ(cfg.optimizer().schedule(), config::OptimizerConfig::WSD);
  EXPECT_EQ(cfg.optimizer().decay_shape(), config::LrDecay::COSINE);
  cfg = load_run_config(write("run.textproto", kValid), {"optimizer.schedule=linear", "optimizer.decay_shape=linear"});
  EXPECT_EQ(cfg.optimizer().schedule(), config::OptimizerConfig::LINEAR);
  EXPECT_EQ(cfg.optimizer().decay_shape(), config::LrDecay::LINEAR);

  auto msg = load_error(std::string(kValid) + "optimizer { schedule: STEP }\n");
  EXPECT_EQ(msg.rfind(path + ":15:23: ", 0), 0u) << msg;
  EXPECT_NE(msg.find("(valid values: CONSTANT, COSINE, LINEAR, WSD)"), std::string::npos) << msg;
  msg = load_error(std::string(kValid) + "optimizer { decay_shape: SQRT }\n");
  EXPECT_NE(msg.find("(valid values: COSINE, LINEAR, ONE_MINUS_SQRT)"), std::string::npos) << msg;
  msg = load_error(std::string(kValid) + "optimizer { schedule: WSD decay_fraction: 1.5 }\n");
  EXPECT_EQ(msg, path + ":15:27: optimizer.decay_fraction: must lie in (0, 1] (the share of total_steps the WSD "
                        "decay takes), got 1.5");
  msg = load_error(std::string(kValid) + "optimizer { schedule: LINEAR decay_fraction: 0 }\n");
  EXPECT_NE(msg.find("optimizer.decay_fraction: must lie in (0, 1]"), std::string::npos) << msg;
  msg = load_error(std::string(kValid) + "optimizer { schedule: WSD total_steps: 100 warmup_steps: 90 }\n");
  EXPECT_EQ(msg, path + ": optimizer.decay_fraction: makes a WSD decay of 20 steps (round(0.2 x total_steps 100)), "
                        "which overlaps the 90 warmup steps: warmup_steps + decay steps must not exceed total_steps");
  msg = load_error(std::string(kValid) + "optimizer { schedule: WSD total_steps: 4 decay_fraction: 0.1 }\n");
  EXPECT_EQ(msg, path + ":15:42: optimizer.decay_fraction: leaves the WSD decay no step: round(0.1 x total_steps 4) "
                        "= 0; give at least 1 / total_steps");
  // The same fractions are fine for schedules without a WSD decay stage.
  load_run_config(write("run.textproto", std::string(kValid) + "optimizer { total_steps: 100 warmup_steps: 90 }\n"));
}

TEST_F(ConfigTest, BadValuesOfManyKinds) {
  RunConfig c;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kValid, &c));
  c.mutable_model()->add_mixers("glaa");
  c.mutable_model()->add_mixer_options()->set_window(128);
  c.mutable_data()->mutable_mqar()->set_num_queries(100);
  c.mutable_data()->mutable_mqar()->set_min_kv_pairs(c.data().mqar().num_kv_pairs() + 1);
  c.mutable_optimizer()->set_beta2(1.0);
  c.mutable_checkpoint()->set_every_steps(10);
  c.set_name("a b");
  auto errors = run_config_errors(c);
  auto has = [&](const std::string& s) {
    for (auto& e : errors)
      if (e == s) return true;
    return false;
  };
  std::string all;
  for (auto& e : errors) all += e + "\n";
  EXPECT_TRUE(has("name: must be non-empty and use only letters, digits, '.', '_' and '-' (it names directories), "
                  "got 'a b'")) << all;
  EXPECT_TRUE(has("model.mixers[1]: unknown mixer kind 'glaa'; known kinds: linear_attn, retnet, gla, deltanet, "
                  "gated_deltanet, mamba1, mamba2, hla2, ahla, loglinear_mamba2, loglinear_gdn, softmax_attn, kda, "
                  "gated_deltaproduct, rwkv7")) << all;
  EXPECT_TRUE(has("model.mixer_options[0].window: only softmax_attn uses 'window', but this entry applies to gla "
                  "layers (give the entry a kind)")) << all;
  EXPECT_TRUE(has("data.mqar: 2*(num_kv_pairs + num_queries) = 208 tokens do not fit in data.seq_len (128)")) << all;
  EXPECT_TRUE(has("data.mqar.min_kv_pairs: must be 0 (every sequence holds num_kv_pairs) or in [1, num_kv_pairs "
                  "= 4], got 5")) << all;
  EXPECT_TRUE(has("optimizer.beta2: must lie in [0, 1), got 1")) << all;
  EXPECT_TRUE(has("checkpoint.dir: is needed when checkpoint.every_steps > 0 (10)")) << all;
}

// Linear attention's feature map options: the names it knows, the ranges, and only on linear_attn layers.
TEST_F(ConfigTest, FeatureMapOptions) {
  RunConfig c;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kValid, &c));
  c.mutable_model()->clear_mixers();
  c.mutable_model()->add_mixers("linear_attn");
  c.mutable_model()->add_mixers("gla");
  auto* o = c.mutable_model()->add_mixer_options();
  o->set_kind("linear_attn");
  o->set_feature_map("performer");
  o->set_num_features(64);
  o->set_feature_seed(3);
  EXPECT_TRUE(run_config_errors(c).empty()) << run_config_errors(c)[0];
  o->set_feature_map("relu");
  o->set_num_features(0);
  o->set_feature_seed(-1);
  auto* all_layers = c.mutable_model()->add_mixer_options();
  all_layers->set_feature_map("performer");
  auto errors = run_config_errors(c);
  std::string all;
  for (auto& e : errors) all += e + "\n";
  for (const char* want : {"model.mixer_options[0].feature_map: must be \"elu\" or \"performer\", got \"relu\"",
                           "model.mixer_options[0].num_features: must lie in [1, 65536], got 0",
                           "model.mixer_options[0].feature_seed: must be >= 0, got -1",
                           "model.mixer_options[1].feature_map: only linear_attn uses 'feature_map', but this entry "
                           "applies to gla layers (give the entry a kind)"})
    EXPECT_NE(all.find(want), std::string::npos) << "missing: " << want << "\nerrors:\n" << all;
}

// Gated DeltaProduct's steps a token: in [1, 16], and only on gated_deltaproduct layers.
TEST_F(ConfigTest, NumHouseholderOption) {
  RunConfig c;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kValid, &c));
  c.mutable_model()->clear_mixers();
  c.mutable_model()->add_mixers("gated_deltaproduct");
  c.mutable_model()->add_mixers("gated_deltanet");
  auto* o = c.mutable_model()->add_mixer_options();
  o->set_kind("gated_deltaproduct");
  o->set_num_householder(3);
  EXPECT_TRUE(run_config_errors(c).empty()) << run_config_errors(c)[0];
  EXPECT_EQ(layer_mixer(c.model(), 0).options.num_householder(), 3);
  EXPECT_EQ(layer_mixer(c.model(), 1).options.num_householder(), 2);  // the default, unread by gated_deltanet
  o->set_num_householder(0);
  auto* all_layers = c.mutable_model()->add_mixer_options();
  all_layers->set_num_householder(2);
  auto errors = run_config_errors(c);
  std::string all;
  for (auto& e : errors) all += e + "\n";
  for (const char* want : {"model.mixer_options[0].num_householder: must lie in [1, 16], got 0",
                           "model.mixer_options[1].num_householder: only gated_deltaproduct uses 'num_householder', "
                           "but this entry applies to gated_deltanet layers (give the entry a kind)"})
    EXPECT_NE(all.find(want), std::string::npos) << "missing: " << want << "\nerrors:\n" << all;
}

// KDA's bounded gate: lower_bound in [-1000, 0], NaN refused, and only on kda layers.
TEST_F(ConfigTest, LowerBoundOption) {
  RunConfig c;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kValid, &c));
  c.mutable_model()->clear_mixers();
  c.mutable_model()->add_mixers("kda");
  c.mutable_model()->add_mixers("gated_deltanet");
  auto* o = c.mutable_model()->add_mixer_options();
  o->set_kind("kda");
  o->set_lower_bound(-3.5);
  EXPECT_TRUE(run_config_errors(c).empty()) << run_config_errors(c)[0];
  EXPECT_EQ(layer_mixer(c.model(), 0).options.lower_bound(), -3.5);
  for (double bad : {0.5, -2000.0, std::nan("")}) {
    o->set_lower_bound(bad);
    auto errors = run_config_errors(c);
    ASSERT_EQ(errors.size(), 1u) << bad;
    const char* want = std::isnan(bad) ? "model.mixer_options[0].lower_bound: must be a finite number"
                                       : "model.mixer_options[0].lower_bound: must lie in [-1000, 0]";
    EXPECT_NE(errors[0].find(want), std::string::npos) << errors[0];
  }
  o->set_lower_bound(-3.5);
  c.mutable_model()->add_mixer_options()->set_lower_bound(-1);
  auto errors = run_config_errors(c);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].find("model.mixer_options[1].lower_bound: only kda uses 'lower_bound', but this entry "
                           "applies to gated_deltanet layers"),
            std::string::npos)
      << errors[0];
}

// rwkv7 layers take no short convolutions (their token shift reads the token before each): conv_size
// on them is one error naming the entry, and a valid rwkv7 hybrid passes; feed_forward is "swiglu" or
// "rwkv7_channel_mix".
TEST_F(ConfigTest, Rwkv7RefusesConvolutions) {
  RunConfig c;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kValid, &c));
  c.mutable_model()->clear_mixers();
  c.mutable_model()->add_mixers("rwkv7");
  c.mutable_model()->add_mixers("gated_deltanet");
  auto* gdn = c.mutable_model()->add_mixer_options();
  gdn->set_kind("gated_deltanet");
  gdn->set_conv_size(4);
  EXPECT_TRUE(run_config_errors(c).empty()) << run_config_errors(c)[0];
  auto* all_layers = c.mutable_model()->add_mixer_options();
  all_layers->set_conv_size(4);
  auto errors = run_config_errors(c);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0], "model.mixer_options[1].conv_size: rwkv7 layers have no short convolutions (their token shift "
                       "reads the token before each); expected 0 or unset, got 4 in an entry for all layers (give the "
                       "entry a kind)");
  all_layers->set_kind("rwkv7");
  all_layers->set_conv_size(2);
  errors = run_config_errors(c);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0], "model.mixer_options[1].conv_size: rwkv7 layers have no short convolutions (their token shift "
                       "reads the token before each); expected 0 or unset, got 2");
  all_layers->clear_conv_size();
  all_layers->set_normalize(true);
  errors = run_config_errors(c);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].find("model.mixer_options[1].normalize: only "), std::string::npos) << errors[0];
  all_layers->clear_normalize();
  c.mutable_model()->set_feed_forward("rwkv7_channel_mix");
  EXPECT_TRUE(run_config_errors(c).empty()) << run_config_errors(c)[0];
  c.mutable_model()->set_feed_forward("channel_mix");
  errors = run_config_errors(c);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0], "model.feed_forward: must be \"swiglu\" or \"rwkv7_channel_mix\", got \"channel_mix\"");
}

// Grouped value heads: a multiple of n_heads, on deltanet and gated_deltanet layers only.
TEST_F(ConfigTest, GroupedValueHeads) {
  RunConfig c;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kValid, &c));
  c.mutable_model()->clear_mixers();
  c.mutable_model()->add_mixers("gated_deltanet");
  c.mutable_model()->set_n_v_heads(2 * c.model().n_heads());
  EXPECT_TRUE(run_config_errors(c).empty()) << run_config_errors(c)[0];
  c.mutable_model()->set_n_v_heads(c.model().n_heads() + 1);
  c.mutable_model()->add_mixers("gla");
  std::string all;
  for (auto& e : run_config_errors(c)) all += e + "\n";
  const std::string H = std::to_string(c.model().n_heads()), Hv = std::to_string(c.model().n_heads() + 1);
  for (const std::string want : {"model.n_v_heads: must be a multiple of n_heads (" + H + "), got " + Hv,
                                 "model.n_v_heads: grouped value heads (n_v_heads " + Hv + " != n_heads " + H +
                                     ") apply to deltanet, gated_deltanet layers only, but the model has gla layers"})
    EXPECT_NE(all.find(want), std::string::npos) << "missing: " << want << "\nerrors:\n" << all;
}

TEST_F(ConfigTest, SequenceParallelConstraints) {
  RunConfig c;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kValid, &c));
  c.mutable_model()->add_mixers("softmax_attn");
  auto errors = run_config_errors(c);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].rfind("parallel.sp: softmax_attn layers with window 0 (full causal attention) cannot be "
                            "sequence-parallel (sp = 2)", 0), 0u) << errors[0];
  auto* o = c.mutable_model()->add_mixer_options();
  o->set_kind("softmax_attn");
  o->set_window(65);
  errors = run_config_errors(c);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0], "model.mixer_options[0].window: window 65 exceeds the 64 tokens each of the 2 sp ranks holds "
                       "(the halo comes from the previous rank only)");
  o->set_window(64);
  EXPECT_TRUE(run_config_errors(c).empty());

  c.mutable_model()->clear_mixer_options();
  c.mutable_model()->clear_mixers();
  c.mutable_model()->add_mixers("loglinear_gdn");
  auto* l = c.mutable_model()->add_mixer_options();
  l->set_chunk_size(48);
  l->set_levels(3);
  errors = run_config_errors(c);
  std::string all;
  for (auto& e : errors) all += e + "\n";
  EXPECT_NE(all.find("model.mixer_options: loglinear_gdn needs a power-of-two chunk_size, got 48"), std::string::npos)
      << all;
  EXPECT_NE(all.find("model.mixer_options[0].levels: loglinear_gdn over data.seq_len = 128 needs levels >= 9"),
            std::string::npos)
      << all;
}

TEST_F(ConfigTest, LayoutMustMatchTheLaunch) {
  RunConfig c;
  c.mutable_parallel()->set_dp(3);
  c.mutable_parallel()->set_sp(2);
  try {
    validate_layout(c, 4);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), "parallel: dp*sp = 6 but the launch has 4 ranks (dp = 3, sp = 2)");
  }
  EXPECT_NO_THROW(validate_layout(c, 6));
}

TEST_F(ConfigTest, OverridesSetFieldsOfEveryKind) {
  auto cfg = load_run_config(write("run.textproto", kValid),
                             {"optimizer.lr=1e-3", "parallel.scan_mode=tree", "model.mixers=gla,softmax_attn",
                              "model.mixer_options[0]={kind: \"softmax_attn\" window: 64}",
                              "model.mixer_options[0].window=32", "model.tie_embeddings=false", "precision=bf16",
                              "name=\"renamed\"", "data.mqar={num_kv_pairs: 2 vocab_size: 64}", "data.batch_size=3", "seed=42"});
  EXPECT_DOUBLE_EQ(cfg.optimizer().lr(), 1e-3);
  EXPECT_EQ(cfg.parallel().scan_mode(), config::ParallelConfig::TREE);
  ASSERT_EQ(cfg.model().mixers_size(), 2);
  EXPECT_EQ(cfg.model().mixers(1), "softmax_attn");
  EXPECT_EQ(cfg.model().mixer_options(0).window(), 32);
  EXPECT_FALSE(cfg.model().tie_embeddings());
  EXPECT_EQ(cfg.precision(), RunConfig::BF16);
  EXPECT_EQ(cfg.name(), "renamed");
  EXPECT_EQ(cfg.data().mqar().num_kv_pairs(), 2);
  EXPECT_EQ(cfg.data().mqar().num_queries(), 16);  // the message was replaced; default filled
  EXPECT_EQ(cfg.data().batch_size(), 3);
  EXPECT_EQ(cfg.seed(), 42u);

  // Switching the oneof and clearing a list.
  cfg = load_run_config(write("run.textproto", kValid),
                        {"data.token_files.paths=a.tok,b.tok", "model.mixer_options=", "model.mixers[0]=gated_deltanet"});
  ASSERT_TRUE(cfg.data().has_token_files());
  EXPECT_EQ(cfg.data().token_files().paths(1), "b.tok");
  EXPECT_EQ(cfg.model().mixers(0), "gated_deltanet");
}

TEST_F(ConfigTest, OverrideErrorsNameThePath) {
  RunConfig c;
  auto error = [&](const std::string& assignment) {
    try {
      apply_override(c, assignment);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error("model.d_modl=5"),
            "--set model.d_modl=5: unknown field 'd_modl' in model (ModelConfig; valid fields: vocab_size, d_model, "
            "n_layers, n_heads, head_dim_k, head_dim_v, mlp_ratio, norm_eps, tie_embeddings, mixers, mixer_options, "
            "init_std, n_v_heads, feed_forward, norm, pre_norm)");
  EXPECT_EQ(error("modle.d_model=5").rfind("--set modle.d_model=5: unknown field 'modle' in the top level (RunConfig; "
                                           "valid fields: name, seed, model_preset, model,", 0), 0u);
  EXPECT_EQ(error("optimizer.lr=fast"), "--set optimizer.lr=fast: lr expects a number, got 'fast'");
  EXPECT_EQ(error("parallel.dp=1.5"), "--set parallel.dp=1.5: dp expects an integer, got '1.5'");
  EXPECT_EQ(error("parallel.recompute=maybe"), "--set parallel.recompute=maybe: recompute expects true or false, got 'maybe'");
  EXPECT_EQ(error("parallel.scan_mode=fast"),
            "--set parallel.scan_mode=fast: scan_mode expects an enum value, got 'fast' (valid values: ORDERED, TREE, "
            "ALLGATHER)");
  EXPECT_EQ(error("seed=-1"), "--set seed=-1: seed expects a non-negative integer, got '-1'");
  EXPECT_EQ(error("model.d_model.x=1"), "--set model.d_model.x=1: model.d_model is an integer, not a message: it has no "
                                        "field 'x'");
  EXPECT_EQ(error("model.mixer_options[3].window=1"),
            "--set model.mixer_options[3].window=1: index 3 of model.mixer_options is out of range: expected 0 "
            "(model.mixer_options has 0 elements; [0] appends one)");
  EXPECT_EQ(error("model.mixer_options.window=1"),
            "--set model.mixer_options.window=1: model.mixer_options is a list; pick an element with mixer_options[i]");
  EXPECT_EQ(error("model.d_model[0]=1"), "--set model.d_model[0]=1: model.d_model is not a list; drop the [0]");
  EXPECT_EQ(error("optimizer.lr"), "--set optimizer.lr: expected field.path=value, e.g. optimizer.lr=1e-3");
  EXPECT_EQ(error("data.mqar={num_kv: 1}").rfind("--set data.mqar={num_kv: 1}: the value is not a valid MqarTask: "
                                                  "unknown field \"num_kv\" in MqarTask", 0), 0u);
  EXPECT_EQ(error("a..b=1").rfind("--set a..b=1: 'a..b' is not a field path", 0), 0u);
}

// An index too large for any list (even for an int) is out of range, named with the digits as given,
// the field path and the valid range; it once ended in "stoi".
TEST_F(ConfigTest, HugeOverrideIndexNamesThePathAndTheRange) {
  EXPECT_EQ(load_error(kValid, {"model.mixers[99999999999]=gla"}),
            "--set model.mixers[99999999999]=gla: index 99999999999 of model.mixers is out of range: expected 0 to 1 "
            "(model.mixers has 1 element; [1] appends one)");
  EXPECT_EQ(load_error(kValid, {"model.mixers=gla,gla,gla", "model.mixers[3000000000000000000000000000]=gla"}),
            "--set model.mixers[3000000000000000000000000000]=gla: index 3000000000000000000000000000 of model.mixers "
            "is out of range: expected 0 to 3 (model.mixers has 3 elements; [3] appends one)");
  EXPECT_EQ(load_error(kValid, {"model.mixer_options[2147483648].window=4"}),
            "--set model.mixer_options[2147483648].window=4: index 2147483648 of model.mixer_options is out of range: "
            "expected 0 (model.mixer_options has 0 elements; [0] appends one)");
  EXPECT_EQ(load_error(kValid, {"model.d_model[99999999999]=1"}),
            "--set model.d_model[99999999999]=1: model.d_model is not a list; drop the [99999999999]");
}

// Values whose products overflow int64 are refused by bounds and overflow-checked arithmetic, each
// error naming the field, what was expected and what was found (they once crashed with SIGFPE, or
// passed and failed later).
TEST_F(ConfigTest, OverflowingValuesAreRefused) {
  auto path = dir_ + "/run.textproto";
  // chunk_size 2^62 with sp = 4: chunk_size*sp wrapped to 0, then seq_len % 0.
  EXPECT_EQ(load_error(kValid, {"model.mixer_options[0].chunk_size=4611686018427387904", "parallel.sp=4"}),
            path + ": model.mixer_options[0].chunk_size: must lie in [1, 65536], got 4611686018427387904 (set by --set "
                   "model.mixer_options[0].chunk_size=4611686018427387904)");
  // num_queries 2^62: 2*(num_kv_pairs + num_queries) wrapped below seq_len.
  EXPECT_EQ(load_error(kValid, {"data.mqar.num_queries=4611686018427387904"}),
            path + ": data.mqar.num_queries: must not exceed data.seq_len (128), got 4611686018427387904 (set by --set "
                   "data.mqar.num_queries=4611686018427387904)");
  // dp*sp = 7*7905747460161236407 wraps to 1.
  EXPECT_EQ(load_error(kValid, {"parallel.dp=7", "parallel.sp=7905747460161236407"}),
            path + ": parallel: dp*sp must be at most 2^20 = 1048576 ranks, got dp = 7, sp = 7905747460161236407 "
                   "(dp*sp overflows int64) (set by --set parallel.sp=7905747460161236407)");
  EXPECT_EQ(load_error(kValid, {"parallel.dp=1048576"}),
            path + ": parallel: dp*sp must be at most 2^20 = 1048576 ranks, got dp = 1048576, sp = 2 (dp*sp = 2097152) "
                   "(set by --set parallel.dp=1048576)");
  EXPECT_EQ(load_error(kValid, {"data.seq_len=2199023255552"}),
            path + ": data.seq_len: must lie in [1, 2^40 = 1099511627776], got 2199023255552 (set by --set "
                   "data.seq_len=2199023255552)");
  EXPECT_EQ(load_error(kValid, {"data.needle={value_len: 4611686018427387904 num_distractors: 3}", "model.vocab_size=8192"}),
            path + ": data.needle.value_len: must not exceed data.seq_len (128), got 4611686018427387904 (set by --set "
                   "data.needle={value_len: 4611686018427387904 num_distractors: 3})");
  // Model shapes beyond any weight's int64 element count, or layers that could not even be listed
  // (found by tests/framework/readers_fuzz_test.cpp: n_layers 2^63-1 ran for ever, mlp_ratio 1e20
  // passed and failed in ATen).
  EXPECT_EQ(load_error(kValid, {"model.n_layers=9223372036854775807"}),
            path + ": model.n_layers: must lie in [1, 4096], got 9223372036854775807 (set by --set "
                   "model.n_layers=9223372036854775807)");
  EXPECT_EQ(load_error(kValid, {"model.mlp_ratio=99999999999999999999"}),
            path + ": model.mlp_ratio: must lie in (0, 1024], got 1e+20 (set by --set model.mlp_ratio=99999999999999999999)");
  EXPECT_EQ(load_error(kValid, {"model.vocab_size=8589934592"}),
            path + ": model.vocab_size: must lie in [1, 4294967296], got 8589934592 (set by --set "
                   "model.vocab_size=8589934592)");
  EXPECT_EQ(load_error(kValid, {"model.head_dim_k=2097152", "model.head_dim_v=16"}),
            path + ": model.head_dim_k: must lie in [1, 1048576], got 2097152 (set by --set model.head_dim_k=2097152)");
  EXPECT_EQ(load_error(kValid, {"model.mixer_options[0].conv_size=1000000"})
                .rfind(path + ": model.mixer_options[0].conv_size: must lie in [0, 4096] (0 = none), got 1000000 (set "
                       "by --set model.mixer_options[0].conv_size=1000000)\n", 0),
            0u);
  // The layout check against the launch does not wrap either.
  RunConfig c;
  c.mutable_parallel()->set_dp(7);
  c.mutable_parallel()->set_sp(7905747460161236407);
  try {
    validate_layout(c, 1);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "parallel: dp*sp overflows int64 (dp = 7, sp = 7905747460161236407); the launch has 1 ranks");
  }
}

// inf and nan pass "> 0" style checks; every floating field of the schema (optimizer and model
// hyperparameters alike) must be finite, reported once, from --set and from a file alike.
TEST_F(ConfigTest, NonFiniteHyperparametersAreRefused) {
  auto path = dir_ + "/run.textproto";
  // Every double and float field reachable from RunConfig through singular messages.
  std::vector<std::string> fields;
  std::function<void(const google::protobuf::Descriptor*, const std::string&)> walk =
      [&](const google::protobuf::Descriptor* d, const std::string& prefix) {
        for (int i = 0; i < d->field_count(); ++i) {
          auto* f = d->field(i);
          if (f->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE && !f->is_repeated())
            walk(f->message_type(), prefix + f->name() + ".");
          else if (f->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_DOUBLE ||
                   f->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_FLOAT)
            fields.push_back(prefix + f->name());
        }
      };
  walk(RunConfig::descriptor(), "");
  for (const char* f : {"optimizer.lr", "optimizer.eps", "optimizer.weight_decay", "optimizer.grad_clip",
                        "model.norm_eps", "model.init_std", "model.mlp_ratio"})
    EXPECT_NE(std::find(fields.begin(), fields.end(), f), fields.end()) << f;
  for (auto& field : fields)
    for (std::string v : {"inf", "-inf", "nan"}) {
      std::string set = field + "=" + v;
      EXPECT_EQ(load_error(kValid, {set}), path + ": " + field + ": must be a finite number, got " + v +
                                               " (set by --set " + set + ")");
    }
  // From the file, with its location; a model preset on its own too.
  auto msg = load_error(std::string(kValid) + "optimizer { weight_decay: inf }\n");
  EXPECT_EQ(msg, path + ":15:13: optimizer.weight_decay: must be a finite number, got inf");
  auto preset = write("m.textproto", "vocab_size: 256\nd_model: 64\nn_layers: 2\nn_heads: 4\nmixers: \"gla\"\n"
                                     "norm_eps: nan\n");
  try {
    load_model_config(preset);
    ADD_FAILURE() << "a NaN norm_eps was accepted";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), preset + ":6:1: norm_eps: must be a finite number, got nan");
  }
  // A finite value still gets its own check.
  EXPECT_EQ(load_error(kValid, {"optimizer.eps=0"}),
            path + ": optimizer.eps: must be positive, got 0 (set by --set optimizer.eps=0)");
}

// parallel.recompute_overlap applies with recompute and without recompute_keeps_mixer; unset, at sp = 1 only
// (sp > 1 spreads long contexts for memory); set, at any sp.
TEST(RecomputeOverlap, UnsetAppliesAtSp1SetAppliesAnywhere) {
  RunConfig c;
  EXPECT_FALSE(c.parallel().has_recompute_overlap()) << "no declared default: unset means automatic";
  EXPECT_FALSE(recompute_overlap_applies(c)) << "recompute is off";
  EXPECT_TRUE(recompute_overlap_applies(c, /*if_recomputed=*/true));
  c.mutable_parallel()->set_recompute(true);
  EXPECT_TRUE(recompute_overlap_applies(c));
  c.mutable_parallel()->set_sp(2);
  EXPECT_FALSE(recompute_overlap_applies(c)) << "unset at sp = 2";
  c.mutable_parallel()->set_recompute_overlap(true);
  EXPECT_TRUE(recompute_overlap_applies(c)) << "set at sp = 2";
  c.mutable_parallel()->set_sp(1);
  c.mutable_parallel()->set_recompute_keeps_mixer(true);
  EXPECT_FALSE(recompute_overlap_applies(c)) << "recompute_keeps_mixer";
  c.mutable_parallel()->set_recompute_keeps_mixer(false);
  c.mutable_parallel()->set_recompute_overlap(false);
  EXPECT_FALSE(recompute_overlap_applies(c)) << "switched off";
}

// 30,000 repeated mixer_options entries: the first repeat is reported (with how many follow), the rest
// are not walked, and the whole load stays linear in the file (well under a second here).
TEST_F(ConfigTest, RepeatedEntriesAreReportedOnceAndQuickly) {
  std::string text = kValid;
  std::string entries;
  for (int i = 0; i < 30000; ++i) entries += "  mixer_options { chunk_size: 16 }\n";
  text.replace(text.find("  mixers: \"gla\"\n"), 0, entries);
  const auto start = std::chrono::steady_clock::now();
  const std::string m = load_error(text);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 3.0) << m.substr(0, 400);
  EXPECT_NE(m.find("model.mixer_options[1]: a second entry for all layers (no kind) (the first is mixer_options[0]); "
                   "29998 more entries follow it, not checked"), std::string::npos) << m.substr(0, 400);
  EXPECT_LT(m.size(), 2000u) << m.substr(0, 400);
}

// 100,000 bad entries, each its own error (unknown mixer kinds; mixer_options naming kinds the model
// does not have): the first 20 are listed where they were written, the rest counted in one line, and
// the load stays linear in the file (only the listed errors are located in the text).
TEST_F(ConfigTest, ManyBadEntriesListTheFirstTwentyAndCountTheRest) {
  for (const char* kind : {"mixers", "mixer_options"}) {
    std::string text = kValid, entries;
    for (int i = 0; i < 100000; ++i)
      entries += std::string(kind) == "mixers" ? "  mixers: \"nope\"\n"
                                               : "  mixer_options { kind: \"k" + std::to_string(i) + "\" }\n";
    text.replace(text.find("  mixers: \"gla\"\n"), 0, entries);
    const auto start = std::chrono::steady_clock::now();
    const std::string m = load_error(text);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(seconds, 3.0) << kind;
    const std::string first = std::string(kind) == "mixers"
                                  ? ":7:3: model.mixers[0]: unknown mixer kind 'nope'; known kinds: "
                                  : ":7:19: model.mixer_options[0].kind: 'k0' is not one of the model's mixers (";
    EXPECT_NE(m.find(first), std::string::npos) << m.substr(0, 400);
    EXPECT_NE(m.find("[19]"), std::string::npos) << kind;
    EXPECT_EQ(m.find("[20]"), std::string::npos) << kind;
    const std::string last = m.substr(m.rfind('\n') + 1);
    EXPECT_EQ(last.rfind("... and ", 0), 0u) << last;
    EXPECT_NE(last.find(" more errors, not listed (the first 20 are above; fix them and run again)"), std::string::npos)
        << last;
    EXPECT_LT(m.size(), 8000u) << kind;
  }
}

TEST_F(ConfigTest, ValidationErrorFromAnOverrideSaysSo) {
  auto msg = load_error(kValid, {"model.n_heads=10"});
  auto path = (dir_ + "/run.textproto");
  EXPECT_EQ(msg, path + ": model.n_heads: must divide d_model (64), got 10 (or set head_dim_k and head_dim_v) (set by "
                        "--set model.n_heads=10)");
  EXPECT_EQ(load_error(kValid, {"parallel.recompute=false", "parallel.recompute_overlap=true"}),
            path + ": parallel.recompute_overlap: true needs parallel.recompute: true (it overlaps the recomputation "
                   "with the backward); got recompute: false (set by --set parallel.recompute_overlap=true)");
  EXPECT_EQ(load_error(kValid, {"parallel.recompute=false", "parallel.recompute_keeps_mixer=true"}),
            path + ": parallel.recompute_keeps_mixer: true needs parallel.recompute: true (it chooses what the "
                   "recomputation keeps); got recompute: false (set by --set parallel.recompute_keeps_mixer=true)");
  EXPECT_EQ(load_error(kValid, {"parallel.recompute_keep_last=-1"}),
            path + ": parallel.recompute_keep_last: expected 0 or more layers that keep their activations under "
                   "parallel.recompute; got -1 (set by --set parallel.recompute_keep_last=-1)");
  for (const char* bad : {"-1", "1048577"})
    EXPECT_EQ(load_error(kValid, {std::string("parallel.deferred_head_gradient_mib=") + bad}),
              path + ": parallel.deferred_head_gradient_mib: expected 0 (off) to 1048576 MiB of logit gradients a "
                     "rank after the first holds for its head's gradient; got " + bad +
                     " (set by --set parallel.deferred_head_gradient_mib=" + bad + ")");
}

// Ordered segments: the ORDERED scan only, sp times a power of two, and the sequence cut into them
// whole chunks (the same checks as for sp slices, naming the segments).
// parallel.cuda_graph captures one rank's step of one micro-batch without packed documents: every
// other layout is refused in one message listing what does not fit.
TEST_F(ConfigTest, CudaGraphNeedsOneRankOneMicroBatch) {
  auto path = (dir_ + "/run.textproto");
  EXPECT_EQ(load_error(kValid, {"parallel.cuda_graph=true", "optimizer.grad_accum_steps=2"}),
            path + ": parallel.cuda_graph: true captures one rank's step of one micro-batch without packed documents; "
                   "this run has dp = 1, sp = 2 (needs one rank); optimizer.grad_accum_steps = 2 (set by --set "
                   "parallel.cuda_graph=true)");
  EXPECT_EQ(load_error(kValid, {"parallel.sp=1", "parallel.segments=2", "parallel.cuda_graph=true"}),
            path + ": parallel.cuda_graph: true captures one rank's step of one micro-batch without packed documents; "
                   "this run has parallel.segments = 2 (set by --set parallel.cuda_graph=true)");
  EXPECT_NO_THROW(load_run_config(write("ok.textproto", kValid), {"parallel.sp=1", "parallel.cuda_graph=true"}));
}

TEST_F(ConfigTest, SegmentsAreCheckedLikeSlices) {
  auto path = (dir_ + "/run.textproto");
  EXPECT_EQ(load_error(kValid, {"parallel.segments=6"}),
            path + ": parallel.segments: must be sp times a power of two (each rank holds a power of two of them), "
                   "got 6 with sp = 2 (set by --set parallel.segments=6)");
  EXPECT_EQ(load_error(kValid, {"parallel.scan_mode=TREE", "parallel.segments=2"}),
            path + ": parallel.segments: needs parallel.scan_mode: ORDERED (segments make the ordered chain "
                   "reproducible across layouts); got TREE (set by --set parallel.segments=2)");
  EXPECT_EQ(load_error(kValid, {"parallel.segments=4"}),
            path + ":11:3: data.seq_len: must be a multiple of chunk_size*segments = 64*4 = 256 (gla layers), got 128");
  EXPECT_NO_THROW(load_run_config(write("ok.textproto", kValid), {"parallel.segments=2"}));
}

TEST_F(ConfigTest, ModelPresetIsOverlaidByTheRunsModel) {
  write("models/m.textproto",
        "vocab_size: 256\nd_model: 64\nn_layers: 4\nn_heads: 4\nmixers: [\"gla\", \"gla\"]\n"
        "mixer_options { chunk_size: 32 }\n");
  auto run = write("runs/r.textproto",
                   "model_preset: \"../models/m.textproto\"\nmodel { n_layers: 2 mixers: \"gated_deltanet\" }\n"
                   "data { mqar { num_kv_pairs: 4 num_queries: 4 vocab_size: 64 } seq_len: 128 batch_size: 2 }\n");
  auto cfg = load_run_config(run, {"model.d_model=128"});
  EXPECT_EQ(cfg.model().vocab_size(), 256);   // from the preset
  EXPECT_EQ(cfg.model().n_layers(), 2);       // the run's
  EXPECT_EQ(cfg.model().d_model(), 128);      // --set
  ASSERT_EQ(cfg.model().mixers_size(), 1);    // a list written in the run replaces the preset's
  EXPECT_EQ(cfg.model().mixers(0), "gated_deltanet");
  EXPECT_EQ(cfg.model().mixer_options(0).chunk_size(), 32);
  EXPECT_FALSE(cfg.has_model_preset());       // the resolved config stands alone

  // An error in a field the preset wrote points into the preset.
  try {
    load_run_config(run, {"model.d_model=62"});
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), dir_ + "/runs/../models/m.textproto:4:1: model.n_heads: must divide d_model "
                                            "(62), got 4 (or set head_dim_k and head_dim_v)");
  }
  write("models/bad.textproto", "vocab_size: 256\nn_heads: 7\nmixers: \"gla\"\n");
  auto run2 = write("runs/r2.textproto", "model_preset: \"../models/bad.textproto\"\n"
                                         "data { mqar { vocab_size: 64 } seq_len: 128 }\n");
  try {
    load_run_config(run2);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    auto preset = (dir_ + "/runs/../models/bad.textproto");
    EXPECT_EQ(std::string(e.what()), preset + ":2:1: model.n_heads: must divide d_model (768), got 7 (or set "
                                              "head_dim_k and head_dim_v)");
  }
  // A missing preset names the line of model_preset.
  auto run3 = write("runs/r3.textproto", "name: \"x\"\nmodel_preset: \"nope.textproto\"\n");
  try {
    load_run_config(run3);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()).rfind(run3 + ":2:1: model_preset: cannot read config file '" +
                                          (dir_ + "/runs/nope.textproto") + "'", 0), 0u)
        << e.what();
  }
}

TEST_F(ConfigTest, ResolvedConfigPrintsAndReadsBack) {
  auto cfg = load_run_config(write("run.textproto", kValid), {"optimizer.lr=0.00123"});
  auto text = config_to_text(cfg);
  EXPECT_NE(text.find("lr: 0.00123"), std::string::npos) << text;
  EXPECT_NE(text.find("mixers: \"gla\""), std::string::npos) << text;
  EXPECT_NE(text.find("scan_mode: ORDERED"), std::string::npos) << text;
  auto again = run_config_from_text(text, "resolved");
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(cfg, again)) << config_to_text(again);
}

TEST_F(ConfigTest, LayerMixerResolvesOptionsPerKind) {
  ModelConfig m;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      "mixers: [\"gated_deltanet\", \"gated_deltanet\", \"softmax_attn\"]\n"
      "mixer_options { chunk_size: 32 conv_size: 2 }\n"
      "mixer_options { kind: \"softmax_attn\" window: 512 conv_size: 0 }\n",
      &m));
  auto l0 = layer_mixer(m, 0), l2 = layer_mixer(m, 2), l5 = layer_mixer(m, 5), l4 = layer_mixer(m, 4);
  EXPECT_EQ(l0.kind, "gated_deltanet");
  EXPECT_EQ(l0.options.chunk_size(), 32);
  EXPECT_EQ(l0.options.conv_size(), 2);
  EXPECT_EQ(l0.options.window(), 0);
  EXPECT_TRUE(l0.options.has_levels());  // every field set
  EXPECT_EQ(l2.kind, "softmax_attn");
  EXPECT_EQ(l2.options.window(), 512);
  EXPECT_EQ(l2.options.conv_size(), 0);
  EXPECT_EQ(l2.options.chunk_size(), 32);
  EXPECT_EQ(l5.kind, "softmax_attn");
  EXPECT_EQ(l4.kind, "gated_deltanet");
}

TEST_F(ConfigTest, ClusterConfig) {
  auto c = load_cluster_config(write("c.textproto", "hosts { name: \"a\" gpus: 8 }\nhosts { name: \"b\" gpus: 8 }\n"
                                                     "network_interface: \"ib0\"\nenv { key: \"X\" value: \"1\" }\n"));
  EXPECT_EQ(c.hosts_size(), 2);
  EXPECT_EQ(c.env().at("X"), "1");
  auto path = write("bad.textproto", "hosts { name: \"a\" gpus: 8 }\nhosts { name: \"a\" gpus: 0 }\n");
  try {
    load_cluster_config(path);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), path + ":2:9: hosts[1].name: 'a' is listed twice (also hosts[0])\n" + path +
                                         ":2:19: hosts[1].gpus: must be >= 1, got 0");
  }
  auto parse = write("p.textproto", "hosts { name: \"a\" gpu: 8 }\n");
  try {
    load_cluster_config(parse);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()).rfind(parse + ":1:19: unknown field \"gpu\" in Host (valid fields: name, gpus)", 0),
              0u)
        << e.what();
  }
}

// Every file under configs/ loads and validates: models/ as model presets, clusters/ as cluster
// configs, everything else as runs (whose layout is then checked against dp*sp ranks).
TEST(Configs, EveryFileLoadsAndValidates) {
  static std::vector<std::string> files;
  files.clear();
  std::string root = std::string(CARRY_SOURCE_DIR) + "/configs/";
  ASSERT_TRUE(exists(root)) << root;
  ::nftw(root.c_str(), [](const char* p, const struct stat*, int type, struct FTW*) {
    std::string path = p;
    if (type == FTW_F && path.size() > 10 && path.compare(path.size() - 10, 10, ".textproto") == 0)
      files.push_back(path);
    return 0;
  }, 16, FTW_PHYS);
  int runs = 0, models = 0, clusters = 0;
  for (auto& path : files) {
    auto rel = path.substr(root.size());
    SCOPED_TRACE(rel);
    try {
      if (rel.rfind("models/", 0) == 0) {
        auto m = load_model_config(path);
        EXPECT_GT(head_dim_k(m), 0);
        ++models;
      } else if (rel.rfind("clusters/", 0) == 0) {
        load_cluster_config(path);
        ++clusters;
      } else {
        auto cfg = load_run_config(path);
        validate_layout(cfg, cfg.parallel().dp() * cfg.parallel().sp());
        ++runs;
      }
    } catch (const ConfigError& e) {
      ADD_FAILURE() << e.what();
    }
  }
  EXPECT_GE(runs, 2);
  EXPECT_GE(models, 5);
  EXPECT_GE(clusters, 2);
}

}  // namespace
}  // namespace carry
