// Tests of framework/io/fla_format.*: export -> import is bit for bit (weights and model config) for
// every kind that maps (Gated DeltaNet with convolutions and its own head, DeltaNet without
// convolutions, GLA); the written folder has FLA's names, layouts ([C,1,K] convolutions) and config
// keys; a folder as FLA writes it (bf16 weights, intermediate_size from hidden_ratio, no carry
// metadata) imports; models that do not map are refused with their reasons; strict import refuses a
// missing, misshapen or extra tensor and config values carry does not compute, naming them.
#include "framework/io/fla_format.h"

#include "framework/data/tokenizer.h"

#include "framework/io/safetensors.h"
#include "framework/model/model.h"
#include "tests/helpers/temp_dir.h"
#include "tests/paths.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>

#include <sys/stat.h>
#include <unistd.h>

namespace carry {
namespace {

using testing::make_temp_dir;
using testing::remove_tree;

ModelConfig small(const std::string& kind, int64_t conv, bool tie) {
  ModelConfig m;
  m.set_vocab_size(40);
  m.set_d_model(32);
  m.set_n_layers(2);
  m.set_n_heads(2);
  m.set_head_dim_k(kind == "gla" ? 8 : 16);
  m.set_head_dim_v(kind == "gated_deltanet" ? 24 : 16);
  m.set_mlp_ratio(2.0);
  m.set_norm_eps(1e-5);
  m.set_tie_embeddings(tie);
  m.set_init_std(0.05);
  m.add_mixers(kind);
  auto* o = m.add_mixer_options();
  o->set_chunk_size(16);
  o->set_conv_size(conv);
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

// `model` of `config` exported into a new temporary folder: the folder and its config.json.
std::pair<std::string, std::string> export_to_temp(const ModelConfig& config, const Model& model, const char* name) {
  auto dir = make_temp_dir(name);
  export_fla_folder(dir, config, model.parameters(), {});
  return {dir, read(dir + "/config.json")};
}

// The folder `dir` imports back as `config` with `model`'s weights, name for name and bit for bit.
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

TEST(FlaFormat, ExportImportRoundTripIsBitExact) {
  for (auto [kind, conv, tie] : {std::tuple<std::string, int64_t, bool>{"gated_deltanet", 4, false},
                                 {"deltanet", 0, true}, {"gla", 0, true}}) {
    SCOPED_TRACE(kind);
    ModelConfig config = small(kind, conv, tie);
    Model model = build_model(config, 7);
    auto dir = make_temp_dir("carry_fla");
    export_fla_folder(dir, config, model.parameters(), {});
    expect_imports_as(dir, config, model);
    // FLA's names and layouts in the file.
    std::map<std::string, std::string> meta;
    auto tensors = load_safetensors(dir + "/model.safetensors", &meta);
    EXPECT_EQ(meta["format"], "pt");
    EXPECT_TRUE(tensors.count("model.embeddings.weight"));
    EXPECT_TRUE(tensors.count("model.layers.1.attn_norm.weight"));
    EXPECT_TRUE(tensors.count("model.layers.0.mlp.gate_proj.weight"));
    EXPECT_EQ(tensors.count("lm_head.weight"), tie ? 0u : 1u);
    EXPECT_TRUE(tensors.count(kind == "gla" ? "model.layers.0.attn.g_norm_swish_gate.weight"
                                            : "model.layers.0.attn.o_norm.weight"));
    if (conv > 0) {
      EXPECT_EQ(tensors["model.layers.0.attn.q_conv1d.weight"].sizes(), (std::vector<int64_t>{32, 1, 4}));
    }
    std::string json = read(dir + "/config.json");
    EXPECT_NE(json.find("\"intermediate_size\": 64"), std::string::npos) << json;
    if (kind == "gated_deltanet") {
      EXPECT_NE(json.find("\"model_type\": \"gated_deltanet\""), std::string::npos);
      EXPECT_NE(json.find("\"head_dim\": 16"), std::string::npos);
      EXPECT_NE(json.find("\"expand_v\": 1.5"), std::string::npos);
    }
    if (kind == "gla") EXPECT_NE(json.find("\"expand_k\": 0.5"), std::string::npos) << json;
    remove_tree(dir);
  }
}

// Grouped value heads export as FLA's num_v_heads and come back; DeltaNet's do not export.
TEST(FlaFormat, GroupedValueHeadsRoundTrip) {
  ModelConfig config = small("gated_deltanet", 4, false);
  config.set_n_v_heads(4);
  Model model = build_model(config, 9);
  std::string dir, json;
  std::tie(dir, json) = export_to_temp(config, model, "carry_fla_gva");
  EXPECT_NE(json.find("\"num_v_heads\": 4"), std::string::npos) << json;
  auto tensors = load_safetensors(dir + "/model.safetensors", nullptr);
  EXPECT_EQ(tensors["model.layers.0.attn.q_proj.weight"].sizes(), (std::vector<int64_t>{32, 32}));
  EXPECT_EQ(tensors["model.layers.0.attn.v_proj.weight"].sizes(), (std::vector<int64_t>{96, 32}));
  EXPECT_EQ(tensors["model.layers.0.attn.a_proj.weight"].sizes(), (std::vector<int64_t>{4, 32}));
  expect_imports_as(dir, config, model);
  remove_tree(dir);
  ModelConfig delta = small("deltanet", 0, true);
  delta.set_n_v_heads(4);
  EXPECT_NE(message_of([&] { fla_config_json(delta); }).find("model.n_v_heads: 4 value heads for 2 query/key heads; "
                                                              "FLA's deltanet has no grouped value heads"),
            std::string::npos);
}

// A self-contained export: the tokenizer files beside the weights, eos_token_id in config.json and
// generation_config.json; without a tokenizer an end-of-document id still gives both; a tokenizer whose
// end of document lies outside the vocabulary stops the export before any file is written.
TEST(FlaFormat, WritesTheTokenizerAndGenerationConfig) {
  ModelConfig config = small("gated_deltanet", 4, false);
  config.set_vocab_size(300);
  Model model = build_model(config, 3);
  auto dir = make_temp_dir("carry_fla_tok");
  FlaExportOptions opt;
  opt.tokenizer = "byte";
  export_fla_folder(dir, config, model.parameters(), opt);
  EXPECT_NE(read(dir + "/config.json").find("\"eos_token_id\": 256"), std::string::npos);
  EXPECT_NE(read(dir + "/generation_config.json").find("\"eos_token_id\": 256"), std::string::npos);
  EXPECT_NE(read(dir + "/tokenizer_config.json").find("\"tokenizer_class\": \"PreTrainedTokenizerFast\""),
            std::string::npos);
  EXPECT_NE(read(dir + "/special_tokens_map.json").find("\"eos_token\": \"<|endoftext|>\""), std::string::npos);
  EXPECT_EQ(read(dir + "/tokenizer.json"), hf_tokenizer("byte").tokenizer_json);
  ImportedModel back = import_fla_folder(dir);  // the extra files do not disturb the import
  EXPECT_EQ(config_to_text(back.model), config_to_text(config));
  remove_tree(dir);

  dir = make_temp_dir("carry_fla_eos");
  FlaExportOptions eos_only;
  eos_only.eos_token_id = 7;
  export_fla_folder(dir, config, model.parameters(), eos_only);
  EXPECT_NE(read(dir + "/config.json").find("\"eos_token_id\": 7"), std::string::npos);
  EXPECT_NE(read(dir + "/generation_config.json").find("\"eos_token_id\": 7"), std::string::npos);
  remove_tree(dir);

  ModelConfig tiny = small("gated_deltanet", 4, false);  // vocabulary 40 < 257
  Model tiny_model = build_model(tiny, 3);
  dir = make_temp_dir("carry_fla_small_vocab");
  EXPECT_NE(message_of([&] { export_fla_folder(dir + "/out", tiny, tiny_model.parameters(), opt); })
                .find("export: the tokenizer's end-of-document id 256 is outside the model's vocabulary of 40"),
            std::string::npos);
  struct stat st;
  EXPECT_NE(::stat((dir + "/out").c_str(), &st), 0) << "a refused export wrote its folder";
  remove_tree(dir);
}

// Gated DeltaProduct exports as FLA's GatedDeltaProductForCausalLM (forget gate, 2·sigmoid betas, its
// num_householder) and comes back bit for bit; an FLA config without the forget gate is refused by name.
TEST(FlaFormat, GatedDeltaProductRoundTrip) {
  ModelConfig config = small("gated_deltaproduct", 4, false);
  config.mutable_mixer_options(0)->set_num_householder(3);
  Model model = build_model(config, 5);
  std::string dir, json;
  std::tie(dir, json) = export_to_temp(config, model, "carry_fla_gdp");
  for (const char* want : {"\"model_type\": \"gated_deltaproduct\"", "\"GatedDeltaProductForCausalLM\"",
                           "\"num_householder\": 3", "\"use_forget_gate\": true", "\"allow_neg_eigval\": true",
                           "\"head_dim\": 16"})
    EXPECT_NE(json.find(want), std::string::npos) << want << "\n" << json;
  auto tensors = load_safetensors(dir + "/model.safetensors", nullptr);
  EXPECT_EQ(tensors["model.layers.0.attn.k_proj.weight"].sizes(), (std::vector<int64_t>{96, 32}));
  EXPECT_EQ(tensors["model.layers.0.attn.b_proj.weight"].sizes(), (std::vector<int64_t>{6, 32}));
  EXPECT_EQ(tensors["model.layers.0.attn.v_conv1d.weight"].sizes(), (std::vector<int64_t>{96, 1, 4}));
  expect_imports_as(dir, config, model);
  json.replace(json.find("\"use_forget_gate\": true"), 23, "\"use_forget_gate\": false");
  write(dir + "/config.json", json);
  EXPECT_NE(message_of([&] { import_fla_folder(dir); })
                .find("\"use_forget_gate\": false: carry's Gated DeltaProduct layer always has the forget gate"),
            std::string::npos)
      << message_of([&] { import_fla_folder(dir); });
  remove_tree(dir);
}

// KDA is FLA's KDAForCausalLM: a layer's tensors are KimiDeltaAttention's (fla/layers/kda.py: the low-rank
// f_proj of the gate, A_log a head, dt_bias a key dimension, the low-rank g_proj with its bias), nothing
// more; the config says what carry's layer computes and an FLA config that asks for more is refused.
TEST(FlaFormat, KdaRoundTrip) {
  ModelConfig config = small("kda", 4, false);
  config.set_head_dim_v(24);
  Model model = build_model(config, 6);
  std::string dir, json;
  std::tie(dir, json) = export_to_temp(config, model, "carry_fla_kda");
  for (const char* want : {"\"model_type\": \"kda\"", "\"KDAForCausalLM\"", "\"head_dim\": 16", "\"expand_v\": 1.5",
                           "\"num_v_heads\": null", "\"allow_neg_eigval\": false", "\"lower_bound\": null",
                           "\"conv_size\": 4"})
    EXPECT_NE(json.find(want), std::string::npos) << want << "\n" << json;
  auto tensors = load_safetensors(dir + "/model.safetensors", nullptr);
  const std::map<std::string, std::vector<int64_t>> layer = {
      {"q_proj.weight", {32, 32}},   {"k_proj.weight", {32, 32}},     {"v_proj.weight", {48, 32}},
      {"q_conv1d.weight", {32, 1, 4}}, {"k_conv1d.weight", {32, 1, 4}}, {"v_conv1d.weight", {48, 1, 4}},
      {"f_proj.0.weight", {24, 32}}, {"f_proj.1.weight", {32, 24}},   {"b_proj.weight", {2, 32}},
      {"A_log", {2}},                {"dt_bias", {32}},               {"g_proj.0.weight", {24, 32}},
      {"g_proj.1.weight", {48, 24}}, {"g_proj.1.bias", {48}},         {"o_norm.weight", {24}},
      {"o_proj.weight", {32, 48}}};
  size_t attn = 0;
  for (auto& [name, t] : tensors)
    if (name.rfind("model.layers.0.attn.", 0) == 0) ++attn;
  EXPECT_EQ(attn, layer.size());
  for (auto& [name, shape] : layer) {
    auto it = tensors.find("model.layers.0.attn." + name);
    ASSERT_TRUE(it != tensors.end()) << name;
    EXPECT_EQ(it->second.sizes(), shape) << name;
  }
  expect_imports_as(dir, config, model);
  for (auto [from, to, why] : {std::tuple<const char*, const char*, const char*>{
                                   "\"lower_bound\": null", "\"lower_bound\": 0.5", "\"lower_bound\": 0.5: carry's kda takes a lower bound"},
                               {"\"num_v_heads\": null", "\"num_v_heads\": 4", "\"num_v_heads\": 4: carry's kda layer has no grouped"},
                               {"\"allow_neg_eigval\": false", "\"allow_neg_eigval\": true", "\"allow_neg_eigval\": true: carry's kda beta"}}) {
    std::string changed = json;
    changed.replace(changed.find(from), std::strlen(from), to);
    write(dir + "/config.json", changed);
    std::string msg = message_of([&] { import_fla_folder(dir); });
    EXPECT_NE(msg.find(why), std::string::npos) << msg;
  }
  remove_tree(dir);
  // FLA's bounded gate (lower_bound) goes out and comes back.
  config.mutable_mixer_options(0)->set_lower_bound(-3.5);
  Model bounded = build_model(config, 8);
  std::tie(dir, json) = export_to_temp(config, bounded, "carry_fla_kda_lb");
  EXPECT_NE(json.find("\"lower_bound\": -3.5"), std::string::npos) << json;
  expect_imports_as(dir, config, bounded);
  remove_tree(dir);
}

TEST(FlaFormat, ImportsAFolderAsFlaWritesIt) {
  // An FLA-written folder: bf16 weights, no carry metadata, intermediate_size from hidden_ratio
  // (int(32 * 4 * 2/3) = 85, rounded up to 256), head_dim and expand_v.
  ModelConfig expected = small("gated_deltanet", 4, true);
  expected.set_mlp_ratio(8.0);  // 256 / 32
  expected.mutable_mixer_options(0)->set_chunk_size(64);
  Model model = build_model(expected, 3);
  auto dir = make_temp_dir("carry_fla_native");
  std::map<std::string, at::Tensor> tensors;
  for (auto& [name, t] : model.parameters()) {
    std::string fla = fla_parameter_name(expected, name);
    ASSERT_FALSE(fla.empty()) << name;
    auto v = t.detach().to(at::kBFloat16);
    tensors[fla] = name.find("_conv.") != std::string::npos ? v.unsqueeze(1).contiguous() : v;
  }
  tensors["lm_head.weight"] = tensors["model.embeddings.weight"];  // a tied head may be saved too
  save_safetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}});
  write(dir + "/config.json", R"({"model_type": "gated_deltanet", "hidden_size": 32, "num_hidden_layers": 2,
    "num_heads": 2, "head_dim": 16, "expand_v": 1.5, "use_short_conv": true, "conv_size": 4,
    "intermediate_size": null, "hidden_ratio": 4, "norm_eps": 1e-05, "vocab_size": 40,
    "tie_word_embeddings": true, "initializer_range": 0.05, "attn": null, "transformers_version": "4.57"})");
  ImportedModel m = import_fla_folder(dir);
  EXPECT_EQ(config_to_text(m.model), config_to_text(expected));
  auto params = model.parameters();
  ASSERT_EQ(m.weights.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(m.weights[i].first, params[i].first);
    EXPECT_EQ(m.weights[i].second.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(m.weights[i].second, params[i].second.detach().to(at::kBFloat16).to(at::kFloat)))
        << params[i].first;
  }

  // Strictness: each message names the tensor or the key.
  auto q = tensors["model.layers.1.attn.q_proj.weight"];
  tensors.erase("model.layers.1.attn.q_proj.weight");
  save_safetensors(dir + "/model.safetensors", tensors, {});
  EXPECT_NE(message_of([&] { import_fla_folder(dir); }).find("'model.layers.1.attn.q_proj.weight' (carry's "
                                                             "layers.1.mixer.q_proj.weight) is missing"),
            std::string::npos);
  tensors["model.layers.1.attn.q_proj.weight"] = q.narrow(0, 0, 16).contiguous();
  save_safetensors(dir + "/model.safetensors", tensors, {});
  EXPECT_NE(message_of([&] { import_fla_folder(dir); }).find("has shape [16, 32]; config.json implies [32, 32]"),
            std::string::npos) << message_of([&] { import_fla_folder(dir); });
  tensors["model.layers.1.attn.q_proj.weight"] = q;
  tensors["model.layers.0.attn.extra.weight"] = q;
  save_safetensors(dir + "/model.safetensors", tensors, {});
  EXPECT_NE(message_of([&] { import_fla_folder(dir); }).find("model.layers.0.attn.extra.weight"), std::string::npos);
  tensors.erase("model.layers.0.attn.extra.weight");
  save_safetensors(dir + "/model.safetensors", tensors, {});
  write(dir + "/config.json", R"({"model_type": "gated_deltanet", "hidden_size": 32, "num_hidden_layers": 2,
    "num_heads": 2, "head_dim": 16, "expand_v": 1.5, "vocab_size": 40, "allow_neg_eigval": true})");
  EXPECT_NE(message_of([&] { import_fla_folder(dir); }).find("\"allow_neg_eigval\": true"), std::string::npos);
  write(dir + "/config.json", R"({"model_type": "rwkv6", "hidden_size": 32})");
  EXPECT_NE(message_of([&] { import_fla_folder(dir); }).find("carry imports the FLA model types gated_deltanet, "
                                                             "gated_deltaproduct, delta_net, gla, rwkv7"), std::string::npos);
  write(dir + "/config.json", "{\"model_type\": ");
  EXPECT_NE(message_of([&] { import_fla_folder(dir); }).find("config.json: not a JSON object"), std::string::npos);
  remove_tree(dir);
}

TEST(FlaFormat, ShardedFolders) {
  ModelConfig config = small("gla", 0, false);
  Model model = build_model(config, 2);
  auto dir = make_temp_dir("carry_fla_shards");
  export_fla_folder(dir, config, model.parameters(), {});
  auto all = load_safetensors(dir + "/model.safetensors");
  std::map<std::string, at::Tensor> a, b;
  std::string map;
  for (auto& [name, t] : all) {
    bool first = name.find("layers.1") == std::string::npos;
    (first ? a : b)[name] = t;
    map += std::string(map.empty() ? "" : ", ") + "\"" + name + "\": \"" + (first ? "a" : "b") + ".safetensors\"";
  }
  ::remove((dir + "/model.safetensors").c_str());
  save_safetensors(dir + "/a.safetensors", a);
  save_safetensors(dir + "/b.safetensors", b);
  write(dir + "/model.safetensors.index.json", "{\"metadata\": {}, \"weight_map\": {" + map + "}}");
  ImportedModel back = import_fla_folder(dir);
  auto params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(back.weights[i].second, params[i].second.detach()));
  // A weight-map entry that is not a file of the folder ('..', '.', a path) is named as such.
  for (const char* bad : {"..", ".", "../a.safetensors"}) {
    write(dir + "/model.safetensors.index.json",
          "{\"weight_map\": {\"tok_embeddings.weight\": \"" + std::string(bad) + "\"}}");
    std::string m = message_of([&] { import_fla_folder(dir); });
    EXPECT_NE(m.find("model.safetensors.index.json: \"weight_map\": tensor 'tok_embeddings.weight' must name a file of "
                     "the folder (a name without '/', not '.' or '..'), got '" + std::string(bad) + "'"),
              std::string::npos) << m;
  }
  remove_tree(dir);
}

// A folder is read like a checkpoint: a FIFO in place of config.json, the weights or the weight map's
// index is refused at once (never waited on), and an index larger than such a file can be (64 MiB) is refused
// from its size, unread.
TEST(FlaFormat, FifosAndOversizedIndexesAreRefusedAtOnce) {
  ModelConfig config = small("gla", 0, false);
  Model model = build_model(config, 2);
  auto dir = make_temp_dir("carry_fla_fifo");
  export_fla_folder(dir, config, model.parameters(), {});
  const std::string index = dir + "/model.safetensors.index.json", weights = dir + "/model.safetensors";
  ::remove(weights.c_str());
  ASSERT_EQ(::mkfifo(weights.c_str(), 0644), 0);
  std::string m = message_of([&] { import_fla_folder(dir); });
  EXPECT_NE(m.find(weights + ": cannot open: is a FIFO, not a regular file"), std::string::npos) << m;
  ::remove(weights.c_str());
  ASSERT_EQ(::mkfifo(index.c_str(), 0644), 0);
  m = message_of([&] { import_fla_folder(dir); });
  EXPECT_NE(m.find("cannot read " + index + ": is a FIFO, not a regular file"), std::string::npos) << m;
  ::remove(index.c_str());
  write(index, "{}");
  ASSERT_EQ(::truncate(index.c_str(), (int64_t{64} << 20) + 1), 0);  // sparse: nothing written
  m = message_of([&] { import_fla_folder(dir); });
  EXPECT_NE(m.find("cannot read " + index + ": 67108865 bytes, more than the 67108864 such a file may hold"),
            std::string::npos) << m;
  const std::string config_json = dir + "/config.json";
  ::remove(config_json.c_str());
  ASSERT_EQ(::mkfifo(config_json.c_str(), 0644), 0);
  m = message_of([&] { import_fla_folder(dir); });
  EXPECT_NE(m.find("cannot read " + config_json + ": is a FIFO, not a regular file"), std::string::npos) << m;
  remove_tree(dir);
}

TEST(FlaFormat, RefusesModelsThatDoNotMapWithTheReasons) {
  auto errors_of = [](const ModelConfig& m) {
    std::string all;
    for (auto& e : fla_export_errors(m)) all += e + "\n";
    return all;
  };
  EXPECT_EQ(errors_of(small("gated_deltanet", 4, true)), "");
  EXPECT_NE(errors_of(small("mamba2", 4, true)).find("no MLP"), std::string::npos);
  EXPECT_NE(errors_of(small("gla", 4, true)).find("conv_size: 4 for gla"), std::string::npos);
  ModelConfig hybrid = small("gated_deltanet", 4, true);
  hybrid.add_mixers("softmax_attn");
  std::string h = errors_of(hybrid);
  EXPECT_NE(h.find("mix kinds (gated_deltanet, softmax_attn)"), std::string::npos) << h;
  EXPECT_NE(h.find("rotary position embeddings"), std::string::npos) << h;
  EXPECT_NE(errors_of(small("hla2", 0, true)).find("Kinds carry exports to FLA: gated_deltanet, gated_deltaproduct, deltanet, gla, rwkv7, kda"),
            std::string::npos);
  ModelConfig channel_mix = small("gated_deltanet", 4, true);
  channel_mix.set_feed_forward("rwkv7_channel_mix");
  EXPECT_EQ(errors_of(channel_mix), "model.feed_forward: \"rwkv7_channel_mix\"; FLA's gated_deltanet models have "
                                    "SwiGLU MLPs, so only feed_forward \"swiglu\" exports\n");
  // rwkv7 with carry's RMSNorms and the SwiGLU MLP is not FLA's RWKV7 model; nor are norms FLA's other
  // classes do not have.
  EXPECT_EQ(errors_of(small("rwkv7", 0, true)),
            "model.norm: \"rms_norm\"; FLA's RWKV7 blocks have LayerNorms with bias, so only norm \"layer_norm\" exports "
            "(with model.pre_norm as FLA's norm_first)\n"
            "model.feed_forward: \"swiglu\"; FLA's RWKV7 blocks have RWKV-7's channel mix (RWKV7FeedForward), so only "
            "feed_forward \"rwkv7_channel_mix\" exports\n");
  ModelConfig layer_norm = small("gated_deltanet", 4, true);
  layer_norm.set_norm("layer_norm");
  layer_norm.set_pre_norm(true);
  EXPECT_EQ(errors_of(layer_norm), "model.norm: \"layer_norm\"; FLA's gated_deltanet models have RMSNorms, so only norm "
                                   "\"rms_norm\" exports\nmodel.pre_norm: true; FLA's gated_deltanet models have no norm "
                                   "before the first block\n");
  ModelConfig odd = small("deltanet", 4, true);
  odd.set_d_model(30);
  odd.set_head_dim_k(7);
  EXPECT_EQ(errors_of(odd), "");  // 14 / 30 * 30 rounds back to 14
  auto dir = make_temp_dir("carry_fla_refused");
  Model m = build_model(small("mamba2", 4, true), 1);
  std::string msg = message_of([&] { export_fla_folder(dir, small("mamba2", 4, true), m.parameters(), {}); });
  EXPECT_NE(msg.find("cannot be written as an FLA model"), std::string::npos) << msg;
  EXPECT_FALSE(testing::exists(dir + "/config.json"));
  remove_tree(dir);
}

// Which of the shipped model presets export (README.md lists the same).
TEST(FlaFormat, PresetsThatExport) {
  const std::string dir = std::string(CARRY_SOURCE_DIR) + "/configs/models/";
  for (const char* name : {"gated_deltanet_125m", "gated_deltanet_340m", "gla_125m", "gla_340m", "gated_deltaproduct_125m",
                           "gated_deltaproduct_340m", "rwkv7_125m", "rwkv7_340m", "kda_125m", "kda_340m"})
    EXPECT_TRUE(fla_export_errors(load_model_config(dir + name + ".textproto")).empty()) << name;
  for (const char* name : {"mamba2_125m", "mamba2_340m", "hybrid_gdn_swa_125m", "hla_125m", "loglinear_gdn_125m"})
    EXPECT_FALSE(fla_export_errors(load_model_config(dir + name + ".textproto")).empty()) << name;
  // carry's Gated DeltaNet 125M preset is FLA's config of the same shapes (shared/anchors/fla_train.py).
  std::string json = fla_config_json(load_model_config(dir + "gated_deltanet_125m.textproto"));
  for (const char* field : {"\"hidden_size\": 768", "\"num_hidden_layers\": 12", "\"num_heads\": 4", "\"head_dim\": 128",
                            "\"expand_v\": 2.0", "\"conv_size\": 4", "\"vocab_size\": 32000", "\"tie_word_embeddings\": true"})
    EXPECT_NE(json.find(field), std::string::npos) << field << " in\n" << json;
}

TEST(FlaFormat, ExportsBf16WhenAsked) {
  ModelConfig config = small("deltanet", 4, true);
  Model model = build_model(config, 4);
  auto dir = make_temp_dir("carry_fla_bf16");
  FlaExportOptions opt;
  opt.dtype = at::kBFloat16;
  export_fla_folder(dir, config, model.parameters(), opt);
  for (auto& [name, t] : load_safetensors(dir + "/model.safetensors")) EXPECT_EQ(t.scalar_type(), at::kBFloat16) << name;
  remove_tree(dir);
}

}  // namespace
}  // namespace carry
