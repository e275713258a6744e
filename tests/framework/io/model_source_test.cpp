// Tests of framework/io/model_source.*: a model is read from a run's checkpoint directory (its newest
// step), from one step directory and from an FLA folder, with the same weights each time; checkpoints
// carry the step and the run config in their safetensors metadata; wrong paths and mismatched weights
// give one message naming the path or the parameter.
#include "framework/io/model_source.h"

#include "framework/io/checkpoint.h"
#include "framework/io/fla_format.h"
#include "framework/io/safetensors.h"
#include "tests/helpers/temp_dir.h"

#include <gtest/gtest.h>

#include <string>

namespace carry {
namespace {

const char* kRun = R"(
name: "model_source_test"
model { vocab_size: 24 d_model: 16 n_layers: 2 n_heads: 2 mixers: "gated_deltanet" mixer_options { chunk_size: 8 conv_size: 4 } }
data { mqar { num_kv_pairs: 2 num_queries: 2 vocab_size: 24 } seq_len: 16 batch_size: 2 }
)";

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(ModelSource, CheckpointsAndFlaFoldersGiveTheSameWeights) {
  RunConfig run = run_config_from_text(kRun, "model_source_test.textproto");
  Model model = build_model(run.model(), 8);
  auto dir = testing::make_temp_dir("carry_model_source");
  for (int64_t step : {3, 7}) {
    CheckpointData d;
    d.step = step;
    d.tokens_seen = 100 * step;
    d.config_text = config_to_text(run);
    for (auto& [name, p] : model.parameters()) d.model.emplace_back(name, p.detach() * static_cast<double>(step));
    save_checkpoint(dir + "/ck", d, 0);
  }
  ModelSource latest = load_model_source(dir + "/ck");
  EXPECT_EQ(latest.step, 7);
  EXPECT_EQ(latest.kind, "carry checkpoint");
  EXPECT_EQ(latest.path, dir + "/ck/step_00000007");
  EXPECT_EQ(config_to_text(latest.model), config_to_text(run.model()));
  ModelSource three = load_model_source(dir + "/ck/step_00000003");
  EXPECT_EQ(three.step, 3);
  Model m3 = build_model_from_source(three);
  auto expected = model.parameters();
  auto got = m3.parameters();
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(at::equal(got[i].second, expected[i].second.detach() * 3.0));

  // The checkpoint's model file describes itself.
  std::map<std::string, std::string> meta;
  load_safetensors(dir + "/ck/step_00000007/model.safetensors", &meta);
  EXPECT_EQ(meta["step"], "7");
  EXPECT_EQ(meta["tokens_seen"], "700");
  EXPECT_EQ(meta["format"], "pt");
  EXPECT_EQ(meta["config"], config_to_text(run));

  export_fla_folder(dir + "/fla", latest.model, latest.weights, {});
  ModelSource fla = load_model_source(dir + "/fla");
  EXPECT_EQ(fla.kind, "FLA folder");
  for (size_t i = 0; i < fla.weights.size(); ++i) EXPECT_TRUE(at::equal(fla.weights[i].second, latest.weights[i].second));

  EXPECT_NE(message_of([&] { load_model_source(dir + "/nothing"); }).find("it does not exist"), std::string::npos);
  ::mkdir((dir + "/empty").c_str(), 0755);
  EXPECT_NE(message_of([&] { load_model_source(dir + "/empty"); }).find("no valid carry checkpoint here"), std::string::npos);

  RunConfig other = run_config_from_text(kRun, "x.textproto", {"model.d_model=32"});
  Model wrong = build_model(other.model(), 1);
  std::string msg = message_of([&] { load_weights(wrong, latest.weights, "SOURCE"); });
  EXPECT_NE(msg.find("SOURCE: parameter 'embedding.weight' has shape [24, 16], the model's is [24, 32]"), std::string::npos) << msg;
  testing::remove_tree(dir);
}

}  // namespace
}  // namespace carry
