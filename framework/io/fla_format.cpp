// FLA / Hugging Face folders (fla_format.h): the kind table, the name map (carry <-> FLA), config.json
// written by hand in a fixed key order and read through protobuf's JSON parser into a Struct, and the
// strict tensor matching on import. The carry model's parameter names and shapes come from a model
// built on the meta device (no values drawn), so the map always follows Model::parameters().
#include "framework/io/fla_format.h"

#include "framework/data/tokenizer.h"
#include "framework/printable.h"

#include "framework/io/json.h"
#include "framework/io/output_file.h"
#include "framework/io/safetensors.h"
#include "framework/model/model.h"
#include "framework/version.h"
#include "layers/rwkv7/time_mix.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/text_format.h>
#include <google/protobuf/util/json_util.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include <sys/stat.h>

namespace carry {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

// An FLA model class carry maps onto.
struct FlaKind {
  const char* carry_kind;
  const char* model_type;    // config.json "model_type"
  const char* architecture;  // config.json "architectures"[0]
};

const std::vector<FlaKind>& fla_kinds() {
  static const std::vector<FlaKind> kinds = {
      {"gated_deltanet", "gated_deltanet", "GatedDeltaNetForCausalLM"},
      {"gated_deltaproduct", "gated_deltaproduct", "GatedDeltaProductForCausalLM"},
      {"deltanet", "delta_net", "DeltaNetForCausalLM"},
      {"gla", "gla", "GLAForCausalLM"},
      {"rwkv7", "rwkv7", "RWKV7ForCausalLM"},
      {"kda", "kda", "KDAForCausalLM"},
  };
  return kinds;
}

const FlaKind* kind_by_carry(const std::string& k) {
  for (auto& f : fla_kinds())
    if (k == f.carry_kind) return &f;
  return nullptr;
}

const FlaKind* kind_by_model_type(const std::string& t) {
  for (auto& f : fla_kinds())
    if (t == f.model_type) return &f;
  return nullptr;
}

std::string supported_kinds_text() {
  std::string s;
  for (auto& f : fla_kinds()) s += (s.empty() ? "" : ", ") + std::string(f.carry_kind);
  return s;
}

// Something other than a directory is at `path`: a FIFO or a device there is then refused by name when
// it is read, not taken for a missing file.
bool file_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && !S_ISDIR(st.st_mode);
}

std::string join_path(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

void make_dirs(const std::string& path) {
  for (size_t i = 1; i <= path.size(); ++i) {
    if (i != path.size() && path[i] != '/') continue;
    std::string prefix = path.substr(0, i);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST)
      throw ConfigError("cannot create directory " + prefix + ": " + std::strerror(errno));
  }
}

// config.json or the weight map's index: a regular file (a FIFO is refused, never waited on) of at most
// 64 MiB (a weight map lists about 100 bytes a tensor), refused from its size before it is read.
std::string read_text(const std::string& path) {
  std::string why;
  std::optional<std::string> text = read_small_file(path, int64_t{64} << 20, &why);
  if (!text) throw ConfigError("cannot read " + path + ": " + why);
  return *text;
}

// Written to path.tmp, then renamed.
void write_text(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  write_whole_file(tmp, text, path);
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw ConfigError("cannot rename " + tmp + " to " + path + ": " + std::strerror(errno));
}

// ---- the checks of one model config ----

// The kind every layer uses, or "" when layers differ.
std::string single_kind(const ModelConfig& model) {
  std::string kind;
  for (int64_t i = 0; i < model.n_layers(); ++i) {
    std::string k = layer_mixer(model, i).kind;
    if (i == 0) kind = k;
    else if (k != kind) return "";
  }
  return kind;
}

// Python's int(a * b) == want (FLA computes widths so, e.g. head_v_dim = int(head_dim * expand_v)).
bool python_int_product_is(double a, double b, int64_t want) {
  return static_cast<int64_t>(a * b) == want;
}

// Python's round(a * b) == want and math.isclose(a * b, want).
bool python_round_product_is(double a, double b, int64_t want) {
  double p = a * b;
  return static_cast<int64_t>(std::nearbyint(p)) == want && std::fabs(p - static_cast<double>(want)) <= 1e-9 * std::fabs(p);
}

std::string kind_reason(const std::string& kind) {
  if (kind == "softmax_attn")
    return "FLA's attention layer (fla.layers.attn.Attention, the `attn` entry of an FLA config) applies "
           "rotary position embeddings and needs flash-attn; carry's softmax_attn has no position "
           "encoding, so no FLA layer computes it";
  if (kind == "mamba2")
    return "FLA's Mamba2ForCausalLM blocks are mixer-only (RMSNorm, Mamba2, residual: no MLP) and share "
           "B and C across the heads of a group through one fused in_proj; every carry block has a "
           "SwiGLU MLP, so FLA has no model class for a carry mamba2 model";
  if (kind == "mamba1")
    return "FLA's MambaForCausalLM blocks are mixer-only (no MLP); every carry block has a SwiGLU MLP";
  if (kind == "retnet")
    return "FLA's RetNet layer (MultiScaleRetention) applies rotary position embeddings; carry's retnet "
           "has none";
  return "carry export does not map this kind to an FLA model class (FLA 0.6.0's nearest layer is built "
         "differently)";
}

// What FLA's RWKV7ForCausalLM cannot represent of a carry rwkv7 model (one mixer kind, validated).
std::vector<std::string> rwkv7_export_errors(const ModelConfig& model) {
  std::vector<std::string> errors;
  const int64_t d = model.d_model(), H = model.n_heads(), dk = head_dim_k(model), dv = head_dim_v(model);
  if (model.norm() != "layer_norm")
    errors.push_back("model.norm: \"" + model.norm() + "\"; FLA's RWKV7 blocks have LayerNorms with bias, so only norm "
                     "\"layer_norm\" exports (with model.pre_norm as FLA's norm_first)");
  if (model.feed_forward() != "rwkv7_channel_mix")
    errors.push_back("model.feed_forward: \"" + model.feed_forward() + "\"; FLA's RWKV7 blocks have RWKV-7's channel "
                     "mix (RWKV7FeedForward), so only feed_forward \"rwkv7_channel_mix\" exports");
  if (model.norm_eps() != 1e-5)
    errors.push_back("model.norm_eps: " + json_number(model.norm_eps()) + "; FLA's RWKV7 has one norm_eps for its "
                     "LayerNorms and its GroupNorm (eps head_dim * norm_eps), and carry's GroupNorm eps is head_dim_k * "
                     "1e-5, so only norm_eps 1e-5 exports");
  if (H * dk != d)
    errors.push_back("model.head_dim_k: FLA's RWKV7Attention has keys as wide as hidden_size (" + std::to_string(d) +
                     "), but n_heads * head_dim_k = " + std::to_string(H * dk));
  // RWKV7Config allows value_dim a multiple of hidden_size, but RWKV7Attention's _initialize_weights copies a
  // hidden_size-long profile into v_lora's bias (value_dim long): FLA 0.6.0 builds no model with wider values.
  if (H * dv != d)
    errors.push_back("model.head_dim_v: FLA 0.6.0's RWKV7 model builds only with values as wide as hidden_size (" +
                     std::to_string(d) + "; its initialization fills v_lora's bias from a hidden_size-long profile), but "
                     "n_heads * head_dim_v = " + std::to_string(H * dv));
  return errors;
}

// The end every config.json shares: the token ids (eos_token_id null when < 0), the cache, the dtype.
std::string close_config(JsonWriter& j, int64_t eos_token_id) {
  j.key("bos_token_id").null();
  if (eos_token_id >= 0) j.member("eos_token_id", eos_token_id);
  else j.key("eos_token_id").null();
  j.key("pad_token_id").null();
  j.member("use_cache", true);
  j.member("torch_dtype", "float32");
  j.end_object();
  return j.str() + "\n";
}

// config.json of FLA's RWKV7Config for a carry rwkv7 model that rwkv7_export_errors accepts.
std::string rwkv7_config_json(const ModelConfig& model, int64_t eos_token_id) {
  const int64_t H = model.n_heads(), dk = head_dim_k(model), dv = head_dim_v(model);
  const Rwkv7LowRankDims ranks = rwkv7_low_rank_dims(mixer_layer_spec(model, 0));
  JsonWriter j(2);
  j.begin_object();
  j.key("architectures").begin_array().value("RWKV7ForCausalLM").end_array();
  j.member("model_type", "rwkv7");
  j.member("attn_mode", "chunk");
  j.member("hidden_size", model.d_model());
  j.key("hidden_ratio").null();
  j.member("intermediate_size", mlp_hidden_size(model));
  j.member("num_hidden_layers", model.n_layers());
  j.member("head_dim", dk);
  j.member("num_heads", H);
  j.member("value_dim", H * dv);
  j.member("decay_low_rank_dim", ranks.decay);
  j.member("gate_low_rank_dim", ranks.gate);
  j.member("a_low_rank_dim", ranks.a);
  j.member("v_low_rank_dim", ranks.v);
  j.member("hidden_act", "sqrelu");
  j.member("norm_first", model.pre_norm());
  j.member("norm_bias", true);
  j.key("norm_eps").float_value(model.norm_eps());
  j.key("attn").null();
  j.member("vocab_size", model.vocab_size());
  j.member("tie_word_embeddings", model.tie_embeddings());
  j.key("initializer_range").float_value(model.init_std());
  // fuse_norm false: FLA L2-normalizes κ̂ with F.normalize, as carry does (its fused l2_norm puts an eps of
  // 1e-6 under the root); its LayerNorms and GroupNorm compute the same either way, under the same names.
  j.member("fuse_norm", false);
  j.member("fuse_cross_entropy", true);
  j.member("use_l2warp", false);  // carry's loss is the plain cross entropy
  return close_config(j, eos_token_id);
}

}  // namespace

std::vector<std::string> fla_export_errors(const ModelConfig& model) {
  std::vector<std::string> errors = model_config_errors(model);
  if (!errors.empty()) return errors;
  std::string kind = single_kind(model);
  if (kind.empty()) {
    std::set<std::string> seen;
    std::string kinds;
    for (int64_t i = 0; i < model.n_layers(); ++i) {
      std::string k = layer_mixer(model, i).kind;
      if (seen.insert(k).second) kinds += (kinds.empty() ? "" : ", ") + k;
    }
    errors.push_back("model.mixers: the layers mix kinds (" + kinds + "); an FLA model has one mixer "
                     "kind in every layer (its `attn` entry adds softmax attention layers with rotary "
                     "positions, which carry's softmax_attn does not have)");
    for (const auto& k : seen)
      if (!kind_by_carry(k)) errors.push_back("model.mixers: " + k + ": " + kind_reason(k));
    return errors;
  }
  if (!kind_by_carry(kind)) {
    errors.push_back("model.mixers: " + kind + ": " + kind_reason(kind) + ". Kinds carry exports to FLA: " +
                     supported_kinds_text());
    return errors;
  }
  if (kind == "rwkv7") return rwkv7_export_errors(model);
  const auto lm = layer_mixer(model, 0);
  const int64_t d = model.d_model(), H = model.n_heads(), dk = head_dim_k(model), dv = head_dim_v(model);
  if (model.norm() != "rms_norm")
    errors.push_back("model.norm: \"" + model.norm() + "\"; FLA's " + kind + " models have RMSNorms, so only norm "
                     "\"rms_norm\" exports");
  if (model.pre_norm())
    errors.push_back("model.pre_norm: true; FLA's " + kind + " models have no norm before the first block");
  if (model.feed_forward() != "swiglu")
    errors.push_back("model.feed_forward: \"" + model.feed_forward() + "\"; FLA's " + kind +
                     " models have SwiGLU MLPs, so only feed_forward \"swiglu\" exports");
  if (kind != "gated_deltanet" && kind != "kda" && model.has_n_v_heads() && model.n_v_heads() != H)
    errors.push_back("model.n_v_heads: " + std::to_string(model.n_v_heads()) + " value heads for " + std::to_string(H) +
                     " query/key heads; FLA's " + kind + " has no grouped value heads (its gated_deltanet does)");
  if (kind == "gla" && lm.options.conv_size() > 0)
    errors.push_back("model.mixer_options.conv_size: " + std::to_string(lm.options.conv_size()) +
                     " for gla; FLA's GLA applies silu after its short convolutions and carry's gla does "
                     "not, so only gla without convolutions (conv_size 0) exports");
  if (kind == "gated_deltanet" || kind == "gated_deltaproduct" || kind == "kda") {
    double expand_v = static_cast<double>(dv) / static_cast<double>(dk);
    if (!python_int_product_is(static_cast<double>(dk), expand_v, dv))
      errors.push_back("model.head_dim_v: FLA derives the value width as int(head_dim * expand_v) = int(" +
                       std::to_string(dk) + " * " + json_number(expand_v) + "), which is not " +
                       std::to_string(dv));
  } else {
    double expand_k = static_cast<double>(H * dk) / static_cast<double>(d);
    double expand_v = static_cast<double>(H * dv) / static_cast<double>(d);
    if (!python_round_product_is(static_cast<double>(d), expand_k, H * dk))
      errors.push_back("model.head_dim_k: FLA derives the key width as round(hidden_size * expand_k), which "
                       "does not give n_heads * head_dim_k = " + std::to_string(H * dk));
    if (!python_round_product_is(static_cast<double>(d), expand_v, H * dv))
      errors.push_back("model.head_dim_v: FLA derives the value width as round(hidden_size * expand_v), "
                       "which does not give n_heads * head_dim_v = " + std::to_string(H * dv));
  }
  return errors;
}

std::string fla_config_json(const ModelConfig& model, int64_t eos_token_id) {
  auto errors = fla_export_errors(model);
  if (!errors.empty()) {
    std::string msg = "this model cannot be written as an FLA model:";
    for (auto& e : errors) msg += "\n  " + e;
    throw ConfigError(msg);
  }
  const std::string kind = single_kind(model);
  if (kind == "rwkv7") return rwkv7_config_json(model, eos_token_id);
  const FlaKind& fk = *kind_by_carry(kind);
  const auto lm = layer_mixer(model, 0);
  const int64_t d = model.d_model(), H = model.n_heads(), dk = head_dim_k(model), dv = head_dim_v(model);
  const int64_t K = lm.options.conv_size();
  // As Hugging Face writes config.json: two spaces a level; ratios and epsilons as floats (2.0, not 2).
  JsonWriter j(2);
  j.begin_object();
  j.key("architectures").begin_array().value(fk.architecture).end_array();
  j.member("model_type", fk.model_type);
  j.member("hidden_size", d);
  j.member("num_hidden_layers", model.n_layers());
  j.member("num_heads", H);
  if (kind == "gated_deltaproduct") {  // the forget gate and 2·sigmoid betas, as carry's layer always has
    j.member("head_dim", dk);
    j.key("expand_v").float_value(static_cast<double>(dv) / static_cast<double>(dk));
    j.member("use_output_gate", true);
    j.member("use_forget_gate", true);
    j.member("allow_neg_eigval", true);
    j.member("num_householder", lm.options.num_householder());
  }
  if (kind == "kda") {  // sigmoid betas in (0, 1); the softplus gate, or the bounded one with lower_bound
    j.member("head_dim", dk);
    j.key("expand_v").float_value(static_cast<double>(dv) / static_cast<double>(dk));
    j.key("num_v_heads").null();
    j.member("allow_neg_eigval", false);
    j.member("safe_gate", false);
    if (lm.options.lower_bound() < 0) j.key("lower_bound").float_value(lm.options.lower_bound());
    else j.key("lower_bound").null();
  }
  if (kind == "gated_deltanet") {
    j.member("head_dim", dk);
    j.key("expand_v").float_value(static_cast<double>(dv) / static_cast<double>(dk));
    if (model.has_n_v_heads() && model.n_v_heads() != H) j.member("num_v_heads", model.n_v_heads());
    else j.key("num_v_heads").null();
    j.member("use_gate", true);
    j.member("output_gate_activation", "swish");
    j.member("allow_neg_eigval", false);
  } else if (kind != "gated_deltaproduct" && kind != "kda") {
    j.key("expand_k").float_value(static_cast<double>(H * dk) / static_cast<double>(d));
    j.key("expand_v").float_value(static_cast<double>(H * dv) / static_cast<double>(d));
  }
  if (kind == "deltanet") {
    j.member("use_gate", true);
    j.member("use_beta", true);
    j.member("use_output_norm", true);
    j.member("qk_norm", "l2");
    j.member("qk_activation", "silu");
    j.member("allow_neg_eigval", false);
  }
  if (kind == "gla") {
    j.key("num_kv_heads").null();
    j.key("feature_map").null();
    j.member("use_output_gate", true);
    j.key("clamp_min").null();
    j.member("elementwise_affine", true);
    j.member("use_gk", true);
    j.member("use_gv", false);
  }
  j.member("use_short_conv", K > 0);
  j.member("conv_size", K > 0 ? K : 4);
  j.member("attn_mode", "chunk");
  j.key("attn").null();
  j.member("intermediate_size", mlp_hidden_size(model));
  j.member("hidden_act", "swish");
  j.key("norm_eps").float_value(model.norm_eps());
  j.member("vocab_size", model.vocab_size());
  j.member("tie_word_embeddings", model.tie_embeddings());
  j.key("initializer_range").float_value(model.init_std());
  j.member("fuse_norm", true);
  j.member("fuse_swiglu", true);
  j.member("fuse_cross_entropy", true);
  return close_config(j, eos_token_id);
}

namespace {

// carry's name -> FLA's, for a model of FLA kind `kind` ("" when the name is not mapped).
std::string map_name(const std::string& kind, const std::string& name) {
  if (name == "embedding.weight") return "model.embeddings.weight";
  if (name == "norm.weight") return "model.norm.weight";
  if (name == "norm.bias") return "model.norm.bias";
  if (name == "lm_head.weight") return "lm_head.weight";
  const std::string layers = "layers.";
  if (name.compare(0, layers.size(), layers) != 0) return "";
  size_t dot = name.find('.', layers.size());
  if (dot == std::string::npos) return "";
  const std::string prefix = "model." + name.substr(0, dot + 1);  // "model.layers.3."
  const std::string rest = name.substr(dot + 1);
  if (kind == "rwkv7") {  // RWKV7Block's names: pre_norm, attn_norm, attn, ffn_norm, ffn
    for (auto [from, to] : {std::pair<const char*, const char*>{"pre_norm.", "pre_norm."}, {"mixer_norm.", "attn_norm."},
                            {"mlp_norm.", "ffn_norm."}, {"mixer.", "attn."}, {"ffn.", "ffn."}})
      if (rest.rfind(from, 0) == 0) return prefix + to + rest.substr(std::strlen(from));
    return "";
  }
  if (rest == "mixer_norm.weight") return prefix + "attn_norm.weight";
  if (rest == "mlp_norm.weight") return prefix + "mlp_norm.weight";
  if (rest == "mlp.w1.weight") return prefix + "mlp.gate_proj.weight";
  if (rest == "mlp.w3.weight") return prefix + "mlp.up_proj.weight";
  if (rest == "mlp.w2.weight") return prefix + "mlp.down_proj.weight";
  const std::string mixer = "mixer.";
  if (rest.compare(0, mixer.size(), mixer) != 0) return "";
  std::string p = rest.substr(mixer.size());
  if (p == "q_conv.weight" || p == "k_conv.weight" || p == "v_conv.weight") p = p.substr(0, 1) + "_conv1d.weight";
  else if (p == "z_proj.weight") p = "g_proj.weight";
  else if (p.rfind("z_proj.", 0) == 0) p = "g_proj." + p.substr(std::strlen("z_proj."));  // KDA's low-rank gate
  else if (p == "o_norm.weight") p = kind == "gla" ? "g_norm_swish_gate.weight" : "o_norm.weight";
  static const std::set<std::string> same = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                                             "a_proj.weight", "b_proj.weight", "A_log", "dt_bias",
                                             "gk_proj.0.weight", "gk_proj.1.weight", "gk_proj.1.bias",
                                             "f_proj.0.weight", "f_proj.1.weight", "g_proj.0.weight",
                                             "g_proj.1.weight", "g_proj.1.bias",
                                             "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
                                             "g_proj.weight", "o_norm.weight", "g_norm_swish_gate.weight"};
  if (!same.count(p)) return "";
  return prefix + "attn." + p;
}

bool is_conv(const std::string& carry_name) {
  auto ends = [&](const char* s) {
    std::string e = s;
    return carry_name.size() >= e.size() && carry_name.compare(carry_name.size() - e.size(), e.size(), e) == 0;
  };
  return ends("_conv.weight");
}

// The carry model's parameter names and shapes (built on the meta device: nothing is drawn).
NamedParameters meta_parameters(const ModelConfig& model) {
  return build_model(model, 0, at::TensorOptions().dtype(at::kFloat).device(at::kMeta)).parameters();
}

std::string shape_text(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

std::string fla_parameter_name(const ModelConfig& model, const std::string& carry_name) {
  return map_name(single_kind(model), carry_name);
}

void export_fla_folder(const std::string& dir, const ModelConfig& model, const NamedParameters& weights,
                       const FlaExportOptions& opt) {
  // The tokenizer first: a spec that cannot be written stops the export before any file is.
  HfTokenizer tok;
  if (!opt.tokenizer.empty()) {
    try {
      tok = hf_tokenizer(opt.tokenizer);
    } catch (const std::runtime_error& e) {
      throw ConfigError(std::string("export: ") + e.what());
    }
    if (tok.eos_id >= model.vocab_size())
      throw ConfigError("export: the tokenizer's end-of-document id " + std::to_string(tok.eos_id) +
                        " is outside the model's vocabulary of " + std::to_string(model.vocab_size()));
  }
  const int64_t eos = !opt.tokenizer.empty() ? tok.eos_id : opt.eos_token_id;
  const std::string config = fla_config_json(model, eos);  // throws when the model does not map
  const std::string kind = single_kind(model);
  std::map<std::string, at::Tensor> given(weights.begin(), weights.end());
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, like] : meta_parameters(model)) {
    auto it = given.find(name);
    if (it == given.end()) throw ConfigError("export: parameter '" + name + "' of the model is missing from the weights");
    const at::Tensor& t = it->second;
    if (t.sizes() != like.sizes())
      throw ConfigError("export: parameter '" + name + "' has shape " + shape_text(t.sizes()) + ", the model's is " +
                        shape_text(like.sizes()));
    const std::string fla = map_name(kind, name);
    TORCH_INTERNAL_ASSERT(!fla.empty(), "export: no FLA name for carry parameter '", name, "'");
    at::Tensor v = t.detach().to(at::kCPU).to(opt.dtype).contiguous();
    if (is_conv(name)) v = v.unsqueeze(1).contiguous();  // [C,K] -> [C,1,K]
    out[fla] = v;
    given.erase(it);
  }
  if (!given.empty())
    throw ConfigError("export: the weights hold '" + given.begin()->first + "', which is not a parameter of the model (" +
                      std::to_string(given.size()) + " such tensors)");
  std::map<std::string, std::string> metadata = opt.metadata;
  metadata["format"] = "pt";
  metadata["carry_version"] = version();
  metadata["carry_commit"] = git_commit();
  metadata["carry_model_config"] = config_to_text(model);
  make_dirs(dir);
  write_text(join_path(dir, "config.json"), config);
  save_safetensors(join_path(dir, "model.safetensors"), out, metadata);
  if (eos >= 0) {
    JsonWriter g(2);
    g.begin_object().member("_from_model_config", true).member("eos_token_id", eos).end_object();
    write_text(join_path(dir, "generation_config.json"), g.str() + "\n");
  }
  if (!opt.tokenizer.empty()) {
    write_text(join_path(dir, "tokenizer.json"), tok.tokenizer_json);
    if (!tok.sentencepiece_model.empty()) write_text(join_path(dir, "tokenizer.model"), tok.sentencepiece_model);
    JsonWriter t(2);
    t.begin_object();
    t.member("tokenizer_class", "PreTrainedTokenizerFast");
    t.member("eos_token", tok.eos_token);
    t.member("model_max_length", int64_t{1} << 40);
    t.member("clean_up_tokenization_spaces", false);
    t.end_object();
    write_text(join_path(dir, "tokenizer_config.json"), t.str() + "\n");
    JsonWriter m(2);
    m.begin_object().member("eos_token", tok.eos_token).end_object();
    write_text(join_path(dir, "special_tokens_map.json"), m.str() + "\n");
  }
}

bool is_fla_folder(const std::string& dir) { return file_exists(join_path(dir, "config.json")); }

namespace {

// config.json's fields, read through a Struct.
class JsonConfig {
 public:
  JsonConfig(const std::string& path) : path_(path) {
    std::string text = read_text(path);
    google::protobuf::util::JsonParseOptions o;
    o.ignore_unknown_fields = true;
    auto status = google::protobuf::util::JsonStringToMessage(text, &root_, o);
    if (!status.ok())
      throw ConfigError(path + ": not a JSON object: " + std::string(status.message()));
  }
  bool has(const std::string& key) const {
    auto it = root_.fields().find(key);
    return it != root_.fields().end() && it->second.kind_case() != Value::kNullValue;
  }
  // The key is there, null or not.
  bool present(const std::string& key) const { return root_.fields().count(key) > 0; }
  const Value* get(const std::string& key) const {
    auto it = root_.fields().find(key);
    return it == root_.fields().end() || it->second.kind_case() == Value::kNullValue ? nullptr : &it->second;
  }
  std::string string(const std::string& key, const std::string& fallback = "") const {
    const Value* v = get(key);
    if (!v) return fallback;
    if (v->kind_case() != Value::kStringValue) fail(key, "a string");
    return v->string_value();
  }
  double number(const std::string& key, double fallback) const {
    const Value* v = get(key);
    if (!v) return fallback;
    if (v->kind_case() != Value::kNumberValue) fail(key, "a number");
    return v->number_value();
  }
  int64_t integer(const std::string& key, int64_t fallback) const {
    double x = number(key, static_cast<double>(fallback));
    if (x != std::floor(x) || std::fabs(x) > 9007199254740992.0) fail(key, "an integer");
    return static_cast<int64_t>(x);
  }
  int64_t required_integer(const std::string& key) const {
    if (!has(key)) throw ConfigError(path_ + ": \"" + key + "\" is required");
    return integer(key, 0);
  }
  bool boolean(const std::string& key, bool fallback) const {
    const Value* v = get(key);
    if (!v) return fallback;
    if (v->kind_case() != Value::kBoolValue) fail(key, "true or false");
    return v->bool_value();
  }
  // A config value carry cannot compute.
  [[noreturn]] void refuse(const std::string& key, const std::string& found, const std::string& why) const {
    throw ConfigError(path_ + ": \"" + key + "\": " + found + ": " + why);
  }
  const std::string& path() const { return path_; }

 private:
  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw ConfigError(path_ + ": \"" + key + "\" must be " + what);
  }
  std::string path_;
  Struct root_;
};

std::string value_text(const JsonConfig& c, const std::string& key) {
  const Value* v = c.get(key);
  if (!v) return "null";
  switch (v->kind_case()) {
    case Value::kStringValue: return "\"" + v->string_value() + "\"";
    case Value::kNumberValue: return json_number(v->number_value());
    case Value::kBoolValue: return v->bool_value() ? "true" : "false";
    default: return "(a list or object)";
  }
}

// FLA's MLP width when intermediate_size is null: int(hidden * hidden_ratio * 2/3) up to a multiple of 256.
int64_t fla_intermediate_size(const JsonConfig& c, int64_t hidden) {
  if (c.has("intermediate_size")) return c.integer("intermediate_size", 0);
  double ratio = c.number("hidden_ratio", 4);
  int64_t m = static_cast<int64_t>(static_cast<double>(hidden) * ratio * 2.0 / 3.0);
  return 256 * ((m + 255) / 256);
}

// FLA's RWKV7Config (its defaults where a key is missing) as carry's rwkv7 model: LayerNorm blocks, the
// pre-norm from norm_first, RWKV-7's channel mix.
ModelConfig rwkv7_model_from_config_json(const JsonConfig& c) {
  const int64_t d = c.required_integer("hidden_size"), L = c.required_integer("num_hidden_layers");
  if (d <= 0 || L <= 0) throw ConfigError(c.path() + ": hidden_size and num_hidden_layers must be positive");
  if (c.has("attn")) c.refuse("attn", value_text(c, "attn"), "carry imports no softmax attention layers from FLA (they apply rotary positions)");
  if (c.string("hidden_act", "sqrelu") != "sqrelu")
    c.refuse("hidden_act", value_text(c, "hidden_act"), "carry's RWKV-7 channel mix is relu(x)² (sqrelu)");
  if (!c.boolean("norm_bias", true))
    c.refuse("norm_bias", "false", "carry's layer_norm blocks have a bias");
  const double eps = c.number("norm_eps", 1e-5);
  if (eps != 1e-5)
    c.refuse("norm_eps", value_text(c, "norm_eps"), "FLA's GroupNorm eps is head_dim * norm_eps and carry's rwkv7 GroupNorm "
             "eps is head_dim * 1e-5, so carry computes norm_eps 1e-5 only");
  // RWKV7Config: head_dim 64 unless given (or null beside num_heads), num_heads = hidden_size / head_dim.
  int64_t dk = c.has("head_dim") ? c.integer("head_dim", 64) : c.has("num_heads") ? d / std::max<int64_t>(1, c.integer("num_heads", 1)) : 64;
  if (dk <= 0 || d % dk != 0)
    throw ConfigError(c.path() + ": hidden_size " + std::to_string(d) + " is not a multiple of head_dim " + std::to_string(dk));
  const int64_t H = d / dk;
  int64_t value_dim = d;
  if (const Value* v = c.get("value_dim")) {
    std::vector<double> widths;
    if (v->kind_case() == Value::kNumberValue) widths.push_back(v->number_value());
    else if (v->kind_case() == Value::kListValue)
      for (const auto& x : v->list_value().values()) widths.push_back(x.kind_case() == Value::kNumberValue ? x.number_value() : -1);
    const bool same = !widths.empty() && std::all_of(widths.begin(), widths.end(), [&](double w) { return w == widths[0]; });
    if (!same || widths[0] != std::floor(widths[0]) || widths[0] <= 0)
      c.refuse("value_dim", value_text(c, "value_dim"), "carry's rwkv7 layers have one value width, a positive integer");
    value_dim = static_cast<int64_t>(widths[0]);
  }
  if (value_dim % H != 0)
    c.refuse("value_dim", value_text(c, "value_dim"), "the value width must be a multiple of num_heads " + std::to_string(H));
  int64_t inter = 0;
  if (c.has("intermediate_size")) {
    inter = c.integer("intermediate_size", 0);
  } else {  // RWKV7FeedForward: int(hidden * hidden_ratio) up to a multiple of 32
    inter = static_cast<int64_t>(static_cast<double>(d) * c.number("hidden_ratio", 4));
    inter = 32 * ((inter + 31) / 32);
  }
  if (inter <= 0 || inter % 64 != 0)
    throw ConfigError(c.path() + ": the channel mix width (intermediate_size) is " + std::to_string(inter) +
                      "; carry's feed-forward width is a multiple of 64");

  ModelConfig m;
  m.set_vocab_size(c.required_integer("vocab_size"));
  m.set_d_model(d);
  m.set_n_layers(L);
  m.set_n_heads(H);
  m.set_head_dim_k(dk);
  m.set_head_dim_v(value_dim / H);
  m.set_mlp_ratio(static_cast<double>(inter) / static_cast<double>(d));
  m.set_norm_eps(eps);
  m.set_tie_embeddings(c.boolean("tie_word_embeddings", false));
  m.set_init_std(c.number("initializer_range", 0.02));
  m.set_feed_forward("rwkv7_channel_mix");
  m.set_norm("layer_norm");
  m.set_pre_norm(c.boolean("norm_first", true));
  m.add_mixers("rwkv7");
  auto* o = m.add_mixer_options();
  o->set_chunk_size(64);
  // The LoRA widths: RWKV7Config's defaults where the key is missing; null is RWKV7Attention's own default
  // (carry's 0).
  auto rank = [&](const std::string& key, int64_t fallback) -> int64_t {
    if (!c.present(key)) return fallback;
    if (!c.has(key)) return 0;
    const int64_t r = c.integer(key, 0);
    if (r <= 0) c.refuse(key, value_text(c, key), "a LoRA width is a positive integer");
    return r;
  };
  o->set_decay_low_rank_dim(rank("decay_low_rank_dim", 64));
  o->set_gate_low_rank_dim(rank("gate_low_rank_dim", 128));
  o->set_a_low_rank_dim(rank("a_low_rank_dim", 64));
  o->set_v_low_rank_dim(rank("v_low_rank_dim", 16));
  if (mlp_hidden_size(m) != inter)
    throw ConfigError(c.path() + ": the channel mix width " + std::to_string(inter) + " does not come out of mlp_ratio " +
                      json_number(m.mlp_ratio()) + " (carry rounds mlp_ratio * d_model up to a multiple of 64)");
  return m;
}

ModelConfig model_from_config_json(const JsonConfig& c, const FlaKind& fk) {
  const std::string kind = fk.carry_kind;
  if (kind == "rwkv7") return rwkv7_model_from_config_json(c);
  auto expect_bool = [&](const std::string& key, bool fallback, bool want, const std::string& why) {
    if (c.boolean(key, fallback) != want) c.refuse(key, value_text(c, key), why);
  };
  auto expect_null = [&](const std::string& key, const std::string& why) {
    if (c.has(key)) c.refuse(key, value_text(c, key), why);
  };
  const int64_t d = c.required_integer("hidden_size"), L = c.required_integer("num_hidden_layers");
  const int64_t H = c.required_integer("num_heads");
  if (d <= 0 || L <= 0 || H <= 0) throw ConfigError(c.path() + ": hidden_size, num_hidden_layers and num_heads must be positive");
  int64_t dk = 0, dv = 0, Hv = H, householder = 0;
  double lower_bound = 0;
  expect_null("attn", "carry imports no softmax attention layers from FLA (they apply rotary positions)");
  expect_null("attnres_block_size", "attention residuals are not part of carry's model");
  if (c.string("hidden_act", "swish") != "swish")
    c.refuse("hidden_act", value_text(c, "hidden_act"), "carry's MLP is SwiGLU (swish)");
  if (kind == "gated_deltaproduct") {
    dk = c.integer("head_dim", 256);
    dv = static_cast<int64_t>(static_cast<double>(dk) * c.number("expand_v", 2.0));
    expect_null("num_v_heads", "carry's Gated DeltaProduct has no grouped value heads");
    expect_bool("use_output_gate", true, true, "carry's Gated DeltaProduct layer always has the gated output norm");
    expect_bool("use_forget_gate", false, true, "carry's Gated DeltaProduct layer always has the forget gate");
    expect_bool("allow_neg_eigval", false, true, "carry's Gated DeltaProduct betas are 2·sigmoid(W x)");
    householder = c.integer("num_householder", 1);
    if (householder < 1 || householder > 16)
      c.refuse("num_householder", value_text(c, "num_householder"), "carry takes 1 to 16 Householder steps a token");
  } else if (kind == "kda") {
    dk = c.integer("head_dim", 128);
    dv = static_cast<int64_t>(static_cast<double>(dk) * c.number("expand_v", 1.0));
    if (c.has("num_v_heads") && c.integer("num_v_heads", H) != H)
      c.refuse("num_v_heads", value_text(c, "num_v_heads"), "carry's kda layer has no grouped value heads");
    expect_bool("allow_neg_eigval", false, false, "carry's kda beta is sigmoid(W x) in (0, 1)");
    // safe_gate changes only FLA's kernels (and its A_log initialization): the math is the lower_bound's.
    lower_bound = c.number("lower_bound", 0);
    if (!(lower_bound < 0 && lower_bound >= -1e3) && c.has("lower_bound"))
      c.refuse("lower_bound", value_text(c, "lower_bound"), "carry's kda takes a lower bound in [-1000, 0)");
  } else if (kind == "gated_deltanet") {
    dk = c.integer("head_dim", 256);
    double expand_v = c.number("expand_v", 2.0);
    dv = static_cast<int64_t>(static_cast<double>(dk) * expand_v);
    if (c.has("num_v_heads")) {
      Hv = c.integer("num_v_heads", H);
      if (Hv <= 0 || Hv % H != 0)
        c.refuse("num_v_heads", value_text(c, "num_v_heads"), "the value heads must be a positive multiple of num_heads");
    }
    expect_bool("use_gate", true, true, "carry's Gated DeltaNet layer always has the gated output norm");
    expect_bool("allow_neg_eigval", false, false, "carry's beta is sigmoid(W x) in (0, 1)");
    std::string act = c.string("output_gate_activation", "swish");
    if (act != "swish" && act != "silu")
      c.refuse("output_gate_activation", value_text(c, "output_gate_activation"), "carry's output gate is silu");
  } else {
    double expand_k = c.number("expand_k", kind == "gla" ? 0.5 : 1.0);
    double expand_v = c.number("expand_v", 1.0);
    int64_t key_dim = static_cast<int64_t>(std::nearbyint(static_cast<double>(d) * expand_k));
    int64_t value_dim = static_cast<int64_t>(std::nearbyint(static_cast<double>(d) * expand_v));
    if (key_dim % H != 0 || value_dim % H != 0)
      throw ConfigError(c.path() + ": hidden_size * expand_k and hidden_size * expand_v must be multiples of num_heads");
    dk = key_dim / H, dv = value_dim / H;
  }
  if (kind == "deltanet") {
    expect_bool("use_gate", false, true, "carry's DeltaNet layer always has the gated output norm (use_gate true)");
    expect_bool("use_beta", true, true, "carry's DeltaNet layer always has beta = sigmoid(W x)");
    expect_bool("use_output_norm", true, true, "carry's DeltaNet layer always has the output norm");
    expect_bool("allow_neg_eigval", false, false, "carry's beta is sigmoid(W x) in (0, 1)");
    if (c.string("qk_norm", "l2") != "l2") c.refuse("qk_norm", value_text(c, "qk_norm"), "carry L2-normalizes q and k");
    if (c.string("qk_activation", "silu") != "silu")
      c.refuse("qk_activation", value_text(c, "qk_activation"), "carry applies silu to q and k");
  }
  if (kind == "gla") {
    expect_bool("use_short_conv", false, false, "FLA's GLA applies silu after its convolutions, carry's gla does not");
    expect_null("feature_map", "carry's gla applies no feature map to q and k");
    expect_null("clamp_min", "carry's gla does not clamp its gate");
    if (c.has("num_kv_heads") && c.integer("num_kv_heads", H) != H)
      c.refuse("num_kv_heads", value_text(c, "num_kv_heads"), "carry has no grouped key/value heads");
    expect_bool("use_output_gate", true, true, "carry's gla always has the gated output norm");
    expect_bool("elementwise_affine", true, true, "carry's output norm has a weight");
    expect_bool("use_gk", true, true, "carry's gla has the per-key gate");
    expect_bool("use_gv", false, false, "carry's gla has no value gate");
    expect_bool("fuse_norm", true, true, "with fuse_norm false FLA names the output norm g_norm (the math is the same, "
                "but the names carry reads are those of fuse_norm true)");
  }
  if (dk <= 0 || dv <= 0) throw ConfigError(c.path() + ": the key and value widths come out as " + std::to_string(dk) +
                                            " and " + std::to_string(dv) + "; both must be positive");
  const bool conv = kind != "gla" && c.boolean("use_short_conv", true);
  const int64_t conv_size = conv ? c.integer("conv_size", 4) : 0;
  const int64_t inter = fla_intermediate_size(c, d);
  if (inter <= 0 || inter % 64 != 0)
    throw ConfigError(c.path() + ": the MLP width (intermediate_size) is " + std::to_string(inter) +
                      "; carry's MLP width is a multiple of 64");

  ModelConfig m;
  m.set_vocab_size(c.required_integer("vocab_size"));
  m.set_d_model(d);
  m.set_n_layers(L);
  m.set_n_heads(H);
  if (Hv != H) m.set_n_v_heads(Hv);
  m.set_head_dim_k(dk);
  m.set_head_dim_v(dv);
  m.set_mlp_ratio(static_cast<double>(inter) / static_cast<double>(d));
  m.set_norm_eps(c.number("norm_eps", 1e-6));
  m.set_tie_embeddings(c.boolean("tie_word_embeddings", false));
  m.set_init_std(c.number("initializer_range", 0.02));
  m.add_mixers(kind);
  auto* o = m.add_mixer_options();
  o->set_chunk_size(64);
  o->set_conv_size(conv_size);
  if (householder > 0) o->set_num_householder(householder);
  if (lower_bound < 0) o->set_lower_bound(lower_bound);
  if (mlp_hidden_size(m) != inter)
    throw ConfigError(c.path() + ": the MLP width " + std::to_string(inter) + " does not come out of mlp_ratio " +
                      json_number(m.mlp_ratio()) + " (carry rounds mlp_ratio * d_model up to a multiple of 64)");
  return m;
}

// The shard files of a folder: model.safetensors, or those model.safetensors.index.json names.
std::vector<std::string> weight_files(const std::string& dir) {
  const std::string single = join_path(dir, "model.safetensors");
  if (file_exists(single)) return {single};
  const std::string index = join_path(dir, "model.safetensors.index.json");
  if (!file_exists(index)) {
    std::string hint = file_exists(join_path(dir, "pytorch_model.bin"))
                           ? " (it holds pytorch_model.bin, a pickle, which carry does not read: save the model "
                             "with safe_serialization=True)"
                           : "";
    throw ConfigError(dir + ": neither model.safetensors nor model.safetensors.index.json is there" + hint);
  }
  Struct root;
  auto status = google::protobuf::util::JsonStringToMessage(read_text(index), &root);
  if (!status.ok()) throw ConfigError(index + ": not a JSON object: " + std::string(status.message()));
  auto it = root.fields().find("weight_map");
  if (it == root.fields().end() || it->second.kind_case() != Value::kStructValue)
    throw ConfigError(index + ": \"weight_map\" (an object of tensor name -> file) is required");
  std::set<std::string> files;
  for (const auto& [name, file] : it->second.struct_value().fields()) {
    const bool named = file.kind_case() == Value::kStringValue && !file.string_value().empty() &&
                       file.string_value() != "." && file.string_value() != ".." &&
                       file.string_value().find('/') == std::string::npos;
    if (!named)
      throw ConfigError(index + ": \"weight_map\": tensor '" + printable(name.substr(0, 200), false) +
                        "' must name a file of the folder (a name without '/', not '.' or '..'), got " +
                        (file.kind_case() == Value::kStringValue ? "'" + printable(file.string_value().substr(0, 200), false) + "'"
                                                                 : std::string("a non-string")));
    files.insert(file.string_value());
  }
  std::vector<std::string> out;
  for (const auto& f : files) out.push_back(join_path(dir, f));
  return out;
}

}  // namespace

ImportedModel import_fla_folder(const std::string& dir) {
  const JsonConfig c(join_path(dir, "config.json"));
  const std::string model_type = c.string("model_type");
  const FlaKind* fk = kind_by_model_type(model_type);
  if (!fk) {
    std::string known;
    for (auto& f : fla_kinds()) known += (known.empty() ? "" : ", ") + std::string(f.model_type);
    throw ConfigError(c.path() + ": \"model_type\": \"" + model_type + "\": carry imports the FLA model types " + known);
  }
  ImportedModel out;
  out.model = model_from_config_json(c, *fk);

  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, std::string> file_of;
  bool first = true;
  for (const auto& file : weight_files(dir)) {
    std::map<std::string, std::string> meta;
    std::map<std::string, at::Tensor> part;
    try {
      part = load_safetensors(file, &meta);
    } catch (const c10::Error& e) {
      throw ConfigError(e.what_without_backtrace());
    }
    if (first) out.metadata = meta, first = false;
    for (auto& [name, t] : part) {
      if (tensors.count(name)) throw ConfigError(file + ": tensor '" + name + "' is also in " + file_of[name]);
      tensors[name] = t, file_of[name] = file;
    }
  }
  // The carry config written by export restores carry-only fields (chunk_size, init_std) when its
  // shapes are the folder's.
  auto carry_config = out.metadata.find("carry_model_config");
  if (carry_config != out.metadata.end()) {
    ModelConfig stored;
    if (google::protobuf::TextFormat::ParseFromString(carry_config->second, &stored) &&
        model_config_errors(stored).empty() && fla_export_errors(stored).empty()) {
      auto a = meta_parameters(stored), b = meta_parameters(out.model);
      bool same = a.size() == b.size() && single_kind(stored) == single_kind(out.model) &&
                  stored.vocab_size() == out.model.vocab_size() && stored.norm_eps() == out.model.norm_eps() &&
                  stored.tie_embeddings() == out.model.tie_embeddings() &&
                  layer_mixer(stored, 0).options.conv_size() == layer_mixer(out.model, 0).options.conv_size();
      for (size_t i = 0; same && i < a.size(); ++i) same = a[i].first == b[i].first && a[i].second.sizes() == b[i].second.sizes();
      if (same) out.model = stored;
    }
  }
  const std::string kind = fk->carry_kind;
  for (const auto& [name, like] : meta_parameters(out.model)) {
    const std::string fla = map_name(kind, name);
    TORCH_INTERNAL_ASSERT(!fla.empty(), "import: no FLA name for carry parameter '", name, "'");
    auto it = tensors.find(fla);
    if (it == tensors.end())
      throw ConfigError(dir + ": tensor '" + fla + "' (carry's " + name + ") is missing from the weights");
    at::Tensor t = it->second;
    if (is_conv(name)) {
      if (t.dim() != 3 || t.size(1) != 1)
        throw ConfigError(file_of[fla] + ": tensor '" + fla + "' has shape " + shape_text(t.sizes()) +
                          "; a depthwise convolution's weight is [channels, 1, kernel]");
      t = t.squeeze(1);
    }
    if (t.sizes() != like.sizes())
      throw ConfigError(file_of[fla] + ": tensor '" + fla + "' has shape " + shape_text(it->second.sizes()) +
                        "; config.json implies " + shape_text(is_conv(name) ? like.unsqueeze(1).sizes() : like.sizes()));
    if (!at::isFloatingType(t.scalar_type()))
      throw ConfigError(file_of[fla] + ": tensor '" + fla + "' has dtype " + std::string(c10::toString(t.scalar_type())) +
                        "; weights are floating point");
    out.weights.emplace_back(name, t.to(at::kFloat).contiguous());
    tensors.erase(it);
  }
  if (out.model.tie_embeddings()) tensors.erase("lm_head.weight");  // tied: the embedding is the head
  if (!tensors.empty()) {
    std::string names;
    int shown = 0;
    for (auto& [name, t] : tensors)
      if (shown++ < 5) names += (names.empty() ? "" : ", ") + name;
    throw ConfigError(dir + ": " + std::to_string(tensors.size()) + " tensor(s) of the weights belong to no parameter of "
                      "the model config.json describes: " + names + (tensors.size() > 5 ? ", ..." : ""));
  }
  return out;
}

}  // namespace carry
