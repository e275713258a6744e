// flash-linear-attention (FLA) / Hugging Face model folders: `config.json` + `model.safetensors` in
// the names, layouts and config keys of FLA 0.6.0's model classes, which `import fla` registers with
// transformers' Auto classes (so the same folder is a Hugging Face folder). carry's model maps onto
// six of them exactly (same math, same parameters, renamed):
//
//   carry kind       FLA class (config.json model_type)          notes
//   gated_deltanet   GatedDeltaNetForCausalLM (gated_deltanet)   head_dim = dk, expand_v = dv/dk
//   deltanet         DeltaNetForCausalLM (delta_net)             use_gate, l2 qk_norm, silu
//   gla              GLAForCausalLM (gla)                        conv_size must be 0 (FLA's GLA
//                                                                applies silu after its convolution)
//   gated_deltaproduct  GatedDeltaProductForCausalLM (gated_deltaproduct)
//   kda              KDAForCausalLM (kda)                        head_dim = dk, expand_v = dv/dk; no
//                                                                lower_bound, allow_neg_eigval false
//   rwkv7            RWKV7ForCausalLM (rwkv7)                    norm "layer_norm", feed_forward
//                                                                "rwkv7_channel_mix", norm_eps 1e-5,
//                                                                n_heads·head_dim_k = d_model; pre_norm
//                                                                is norm_first, the LoRA widths are
//                                                                written (decay_low_rank_dim, ...)
//
// Names (layer i; FLA's under "model."):
//   embedding.weight                 model.embeddings.weight
//   layers.i.mixer_norm.weight       model.layers.i.attn_norm.weight
//   layers.i.mixer.{q,k,v}_conv.weight [C,K]   model.layers.i.attn.{q,k,v}_conv1d.weight [C,1,K]
//   layers.i.mixer.z_proj.weight     model.layers.i.attn.g_proj.weight (the output gate)
//   layers.i.mixer.z_proj.{0,1}.*    ...attn.g_proj.{0,1}.* (KDA's low-rank output gate)
//   layers.i.mixer.o_norm.weight     ...attn.o_norm.weight (GLA: ...attn.g_norm_swish_gate.weight)
//   layers.i.mixer.<other>           ...attn.<other> (q_proj, k_proj, v_proj, o_proj, a_proj, b_proj,
//                                    A_log, dt_bias, gk_proj.0.weight, gk_proj.1.{weight,bias},
//                                    KDA's f_proj.{0,1}.weight)
//   layers.i.mlp_norm.weight         model.layers.i.mlp_norm.weight
//   layers.i.mlp.w1 / w3 / w2        model.layers.i.mlp.gate_proj / up_proj / down_proj
//   norm.weight                      model.norm.weight
//   lm_head.weight                   lm_head.weight (written only when the head is not tied)
// rwkv7 (RWKV7Block's names): layers.i.pre_norm.* -> model.layers.i.pre_norm.*, mixer_norm.* -> attn_norm.*,
// mlp_norm.* -> ffn_norm.*, mixer.<name> -> attn.<name> (RWKV7Attention's keys, the same), ffn.* -> ffn.*,
// norm.{weight,bias} -> model.norm.{weight,bias}.
//
// Every other carry model is refused with one line per reason (fla_export_errors): softmax_attn
// layers (FLA's attention applies rotary position embeddings, carry's has none), mamba2 (FLA's Mamba-2
// blocks have no MLP), the kinds FLA 0.6.0 has no matching class for, and block norms other than the
// class's (RMSNorm; rwkv7: LayerNorm). Import reads the same model types back (sharded folders with model.safetensors.index.json too) and refuses config values
// carry does not compute (named by their config.json key).
#pragma once

#include "framework/config/config.h"
#include "layers/blocks/parameters.h"

#include <map>
#include <string>
#include <vector>

namespace carry {

// One line per reason `model` cannot be written as an FLA model; empty when it can.
std::vector<std::string> fla_export_errors(const ModelConfig& model);

// config.json for `model` (throws ConfigError listing fla_export_errors when it cannot be written).
// eos_token_id >= 0 is written as eos_token_id (else null).
std::string fla_config_json(const ModelConfig& model, int64_t eos_token_id = -1);

// The FLA name of a carry parameter of `model` ("" for none). The convolutions' layouts differ: carry
// [C,K], FLA [C,1,K]; every other tensor keeps its shape.
std::string fla_parameter_name(const ModelConfig& model, const std::string& carry_name);

struct FlaExportOptions {
  at::ScalarType dtype = at::kFloat;          // of the written tensors (fp32 keeps them bit for bit)
  std::map<std::string, std::string> metadata;  // added to the safetensors metadata (besides format)
  // A tokenizer spec (framework/data/tokenizer.h: byte or bpe:FILE) written beside the weights as
  // tokenizer.json, tokenizer_config.json and special_tokens_map.json; its end-of-document token becomes
  // eos_token_id. Empty: no tokenizer files.
  std::string tokenizer;
  // The end-of-document id for config.json and generation_config.json when no tokenizer gives it (-1: none,
  // no generation_config.json).
  int64_t eos_token_id = -1;
};

// Writes dir/config.json and dir/model.safetensors (dir is created if missing). `weights` are the
// model's parameters by carry name (Model::parameters(), or a checkpoint's model tensors); every
// parameter of the model must be there with its shape. The safetensors metadata holds
// format = "pt" (what transformers expects), carry_model_config (the carry ModelConfig as
// textproto, so that import restores carry-only fields such as chunk_size) and opt.metadata. Throws
// ConfigError when the model cannot be exported.
void export_fla_folder(const std::string& dir, const ModelConfig& model, const NamedParameters& weights,
                       const FlaExportOptions& opt = {});

struct ImportedModel {
  ModelConfig model;        // validated; carry defaults for what FLA does not store (chunk_size 64)
  NamedParameters weights;  // by carry name, fp32, in Model::parameters() order
  std::map<std::string, std::string> metadata;  // of model.safetensors (the first shard)
};

// Reads an FLA / Hugging Face folder: config.json, then model.safetensors or the shards that
// model.safetensors.index.json lists. Strict: every parameter of the carry model present with its
// shape, no tensor left over (a tied head's lm_head.weight excepted). Throws ConfigError naming the
// folder, the file or config key and what was expected.
ImportedModel import_fla_folder(const std::string& dir);

// Whether `dir` holds a config.json (an FLA / Hugging Face folder rather than a carry checkpoint).
bool is_fla_folder(const std::string& dir);

}  // namespace carry
