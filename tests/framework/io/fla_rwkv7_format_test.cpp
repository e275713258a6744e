// rwkv7 models in FLA folders (framework/io/fla_format.h): a carry rwkv7 model with LayerNorm blocks, the
// pre-norm and the channel mix exports as FLA's RWKV7ForCausalLM (its state-dict names, RWKV7Config's keys, the
// LoRA widths written) and imports back bit for bit, with and without the pre-norm, tied or not, with LoRA
// widths of its own; a folder as FLA writes it (no carry metadata, RWKV7Config's default LoRA widths and
// intermediate_size from hidden_ratio) imports; what carry does not compute is refused, named; the shipped
// preset configs/models/rwkv7_125m.textproto is such a model.
#include "framework/io/fla_format.h"

#include "framework/config/config.h"
#include "framework/io/safetensors.h"
#include "framework/model/model.h"
#include "tests/helpers/temp_dir.h"
#include "tests/paths.h"

#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <sstream>
#include <string>

namespace carry {
namespace {

using testing::make_temp_dir;
using testing::remove_tree;

// FLA's RWKV7 model at a small size: d = 32, 2 heads of 16.
ModelConfig fla_rwkv7(bool pre_norm, bool tie) {
  ModelConfig m;
  m.set_vocab_size(40);
  m.set_d_model(32);
  m.set_n_layers(2);
  m.set_n_heads(2);
  m.set_head_dim_k(16);
  m.set_head_dim_v(16);
  m.set_mlp_ratio(4.0);
  m.set_norm_eps(1e-5);
  m.set_tie_embeddings(tie);
  m.set_init_std(0.05);
  m.set_feed_forward("rwkv7_channel_mix");
  m.set_norm("layer_norm");
  m.set_pre_norm(pre_norm);
  m.add_mixers("rwkv7");
  m.add_mixer_options()->set_chunk_size(16);
  return m;
}

std::string read(const std::string& path) {
  std::ifstream f(path);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

void write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

void expect_imports_as(const std::string& dir, const ModelConfig& config, const Model& model) {
  ImportedModel back = import_fla_folder(dir);
  EXPECT_EQ(config_to_text(back.model), config_to_text(config));
  auto params = model.parameters();
  ASSERT_EQ(back.weights.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(back.weights[i].first, params[i].first);
    EXPECT_TRUE(at::equal(back.weights[i].second, params[i].second.detach())) << params[i].first;
  }
}

// A model of `config` (initialized from `seed`) exported into `dir` imports back as itself; returns the
// exported tensors by name (one a parameter).
std::map<std::string, at::Tensor> export_and_import(const std::string& dir, const ModelConfig& config, uint64_t seed) {
  Model model = build_model(config, seed);
  export_fla_folder(dir, config, model.parameters(), {});
  expect_imports_as(dir, config, model);
  auto tensors = load_safetensors(dir + "/model.safetensors", nullptr);
  EXPECT_EQ(tensors.size(), model.parameters().size());
  return tensors;
}

TEST(FlaRwkv7Format, ExportImportRoundTripIsBitExact) {
  for (auto [pre_norm, tie, ranks] : {std::tuple<bool, bool, bool>{true, false, false}, {false, true, false},
                                      {true, false, true}}) {
    SCOPED_TRACE(std::string("pre_norm ") + (pre_norm ? "true" : "false") + (tie ? ", tied" : ", untied") +
                 (ranks ? ", LoRA widths set" : ""));
    ModelConfig config = fla_rwkv7(pre_norm, tie);
    if (ranks) {
      auto* o = config.mutable_mixer_options(0);
      o->set_decay_low_rank_dim(8), o->set_a_low_rank_dim(16), o->set_v_low_rank_dim(4), o->set_gate_low_rank_dim(24);
    }
    ASSERT_TRUE(fla_export_errors(config).empty()) << fla_export_errors(config)[0];
    auto dir = make_temp_dir("carry_fla_rwkv7");
    auto tensors = export_and_import(dir, config, 5);
    for (const char* name : {"model.embeddings.weight", "model.layers.0.attn_norm.weight", "model.layers.0.attn_norm.bias",
                             "model.layers.1.ffn_norm.bias", "model.layers.0.attn.x_r", "model.layers.0.attn.w_lora.lora.0.weight",
                             "model.layers.1.attn.v_lora.lora.2.bias", "model.layers.1.attn.g_norm.bias",
                             "model.layers.1.ffn.x_k", "model.layers.1.ffn.key.weight", "model.norm.weight", "model.norm.bias"})
      EXPECT_TRUE(tensors.count(name)) << name;
    EXPECT_EQ(tensors.count("model.layers.0.pre_norm.weight"), pre_norm ? 1u : 0u);
    EXPECT_EQ(tensors.count("model.layers.0.pre_norm.bias"), pre_norm ? 1u : 0u);
    EXPECT_EQ(tensors.count("model.layers.0.attn.v_lora.lora.0.weight"), 0u);  // the first layer's values are v_first
    EXPECT_EQ(tensors.count("lm_head.weight"), tie ? 0u : 1u);
    EXPECT_EQ(tensors["model.layers.0.attn.x_r"].sizes(), (std::vector<int64_t>{1, 1, 32}));
    EXPECT_EQ(tensors["model.layers.0.attn.v_proj.weight"].sizes(), (std::vector<int64_t>{32, 32}));
    EXPECT_EQ(tensors["model.layers.0.attn.w_lora.lora.0.weight"].sizes(), (std::vector<int64_t>{ranks ? 8 : 32, 32}));
    const std::string json = read(dir + "/config.json");
    for (std::string field : {"\"architectures\": [\n    \"RWKV7ForCausalLM\"\n  ]", "\"model_type\": \"rwkv7\"",
                              "\"hidden_size\": 32", "\"intermediate_size\": 128", "\"head_dim\": 16", "\"num_heads\": 2",
                              "\"value_dim\": 32", "\"hidden_act\": \"sqrelu\"", "\"norm_bias\": true", "\"norm_eps\": 1e-05",
                              "\"attn\": null", "\"use_l2warp\": false", "\"fuse_norm\": false"})
      EXPECT_NE(json.find(field), std::string::npos) << field << " in\n" << json;
    EXPECT_NE(json.find(std::string("\"norm_first\": ") + (pre_norm ? "true" : "false")), std::string::npos) << json;
    EXPECT_NE(json.find(std::string("\"tie_word_embeddings\": ") + (tie ? "true" : "false")), std::string::npos) << json;
    // RWKV7Attention's defaults at d = 32, dk = 16 are 32 for all four (max(32, ...)); set ones are written.
    EXPECT_NE(json.find(ranks ? "\"decay_low_rank_dim\": 8" : "\"decay_low_rank_dim\": 32"), std::string::npos) << json;
    EXPECT_NE(json.find(ranks ? "\"gate_low_rank_dim\": 24" : "\"gate_low_rank_dim\": 32"), std::string::npos) << json;
    EXPECT_NE(json.find(ranks ? "\"v_low_rank_dim\": 4" : "\"v_low_rank_dim\": 32"), std::string::npos) << json;
    remove_tree(dir);
  }
}

// The shipped preset configs/models/rwkv7_125m.textproto is FLA's RWKV7ForCausalLM: at full size it has no export
// errors and its config.json says LayerNorms, norm_first and an untied head; at a small width (every other field the
// preset's) it exports and imports back bit for bit.
TEST(FlaRwkv7Format, ThePresetExports) {
  const ModelConfig preset = load_model_config(std::string(CARRY_SOURCE_DIR) + "/configs/models/rwkv7_125m.textproto");
  const auto errors = fla_export_errors(preset);
  ASSERT_TRUE(errors.empty()) << errors[0];
  const std::string json = fla_config_json(preset);
  for (const char* field : {"\"model_type\": \"rwkv7\"", "\"hidden_size\": 768", "\"num_hidden_layers\": 12",
                            "\"num_heads\": 12", "\"head_dim\": 64", "\"intermediate_size\": 3072", "\"norm_first\": true",
                            "\"norm_bias\": true", "\"norm_eps\": 1e-05", "\"tie_word_embeddings\": false",
                            "\"vocab_size\": 32000"})
    EXPECT_NE(json.find(field), std::string::npos) << field << " in\n" << json;

  ModelConfig small = preset;
  small.set_vocab_size(40);
  small.set_d_model(32);
  small.set_n_layers(2);
  small.set_n_heads(2);
  small.set_head_dim_k(16);
  small.set_head_dim_v(16);
  small.mutable_mixer_options(0)->set_chunk_size(16);
  ASSERT_TRUE(fla_export_errors(small).empty()) << fla_export_errors(small)[0];
  auto dir = make_temp_dir("carry_fla_rwkv7_preset");
  auto tensors = export_and_import(dir, small, 7);
  for (const char* name : {"model.layers.0.pre_norm.weight", "model.layers.0.pre_norm.bias", "model.layers.1.ffn_norm.bias",
                           "model.norm.bias", "lm_head.weight"})
    EXPECT_TRUE(tensors.count(name)) << name;
  remove_tree(dir);
}

// A folder as FLA's RWKV7ForCausalLM.save_pretrained writes it from an RWKV7Config with its defaults: no LoRA
// width keys (64, 128, 64, 16), intermediate_size null (int(32 · 4) rounded up to 32 = 128), bf16 weights.
TEST(FlaRwkv7Format, ImportsAFolderAsFlaWritesIt) {
  ModelConfig expected = fla_rwkv7(true, false);
  auto* o = expected.mutable_mixer_options(0);
  o->set_chunk_size(64);
  o->set_decay_low_rank_dim(64), o->set_gate_low_rank_dim(128), o->set_a_low_rank_dim(64), o->set_v_low_rank_dim(16);
  Model model = build_model(expected, 3);
  auto dir = make_temp_dir("carry_fla_rwkv7_native");
  std::map<std::string, at::Tensor> tensors;
  for (auto& [name, t] : model.parameters()) {
    std::string fla = fla_parameter_name(expected, name);
    ASSERT_FALSE(fla.empty()) << name;
    tensors[fla] = t.detach().to(at::kBFloat16);
  }
  save_safetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}});
  const std::string config = R"({"model_type": "rwkv7", "architectures": ["RWKV7ForCausalLM"], "hidden_size": 32,
    "num_hidden_layers": 2, "head_dim": 16, "num_heads": 2, "value_dim": [32, 32], "hidden_ratio": 4,
    "intermediate_size": null, "hidden_act": "sqrelu", "norm_first": true, "norm_bias": true, "norm_eps": 1e-05,
    "vocab_size": 40, "tie_word_embeddings": false, "initializer_range": 0.05, "attn": null, "fuse_norm": true)";
  write(dir + "/config.json", config + "}");
  ImportedModel m = import_fla_folder(dir);
  EXPECT_EQ(config_to_text(m.model), config_to_text(expected));
  auto params = model.parameters();
  ASSERT_EQ(m.weights.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(at::equal(m.weights[i].second, params[i].second.detach().to(at::kBFloat16).to(at::kFloat)))
        << params[i].first;

  // What carry does not compute, named by its key.
  auto changed = [&](const std::string& from, const std::string& to) {
    std::string text = config;
    text.replace(text.find(from), from.size(), to);
    return text + "}";
  };
  for (auto [text, want] :
       {std::pair<std::string, const char*>{changed(R"("sqrelu")", R"("relu")"), "\"hidden_act\": \"relu\""},
        {changed(R"("norm_bias": true)", R"("norm_bias": false)"), "\"norm_bias\": false: carry's layer_norm blocks have a bias"},
        {changed("1e-05", "1e-06"), "\"norm_eps\": 1e-06"},
        {changed("[32, 32]", "[32, 64]"), "\"value_dim\": (a list or object): carry's rwkv7 layers have one value width"},
        {config + R"(, "v_low_rank_dim": 0})", "\"v_low_rank_dim\": 0: a LoRA width is a positive integer"}}) {
    write(dir + "/config.json", text);
    EXPECT_NE(message_of([&] { import_fla_folder(dir); }).find(want), std::string::npos)
        << text << ": " << message_of([&] { import_fla_folder(dir); });
  }
  // A tensor of the wrong LoRA width: the config's widths decide the shapes.
  write(dir + "/config.json", config + R"(, "decay_low_rank_dim": 32})");
  EXPECT_NE(message_of([&] { import_fla_folder(dir); }).find("'model.layers.0.attn.w_lora.lora.0.weight' has shape [64, 32]; "
                                                             "config.json implies [32, 32]"),
            std::string::npos)
      << message_of([&] { import_fla_folder(dir); });
  remove_tree(dir);
}

TEST(FlaRwkv7Format, RefusesWhatFlasRwkv7CannotRepresent) {
  auto errors_of = [](const ModelConfig& m) {
    std::string all;
    for (auto& e : fla_export_errors(m)) all += e + "\n";
    return all;
  };
  ModelConfig eps = fla_rwkv7(true, false);
  eps.set_norm_eps(1e-6);
  EXPECT_NE(errors_of(eps).find("model.norm_eps: 1e-06; FLA's RWKV7 has one norm_eps"), std::string::npos) << errors_of(eps);
  ModelConfig narrow = fla_rwkv7(true, false);
  narrow.set_head_dim_k(8);
  narrow.set_head_dim_v(32);
  EXPECT_EQ(errors_of(narrow),
            "model.head_dim_k: FLA's RWKV7Attention has keys as wide as hidden_size (32), but n_heads * head_dim_k = 16\n"
            "model.head_dim_v: FLA 0.6.0's RWKV7 model builds only with values as wide as hidden_size (32; its "
            "initialization fills v_lora's bias from a hidden_size-long profile), but n_heads * head_dim_v = 64\n");
  ModelConfig hybrid = fla_rwkv7(true, false);
  hybrid.add_mixers("gla");
  EXPECT_NE(errors_of(hybrid).find("mix kinds (rwkv7, gla)"), std::string::npos) << errors_of(hybrid);
  // Validation: the LoRA widths are rwkv7's.
  ModelConfig gla = fla_rwkv7(false, false);
  gla.set_mixers(0, "gla");
  gla.set_feed_forward("swiglu");
  gla.mutable_mixer_options(0)->set_gate_low_rank_dim(8);
  std::string e = errors_of(gla);
  EXPECT_NE(e.find("mixer_options[0].gate_low_rank_dim: only rwkv7 use"), std::string::npos) << e;
}

}  // namespace
}  // namespace carry
