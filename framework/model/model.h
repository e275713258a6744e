// The language model (README.md, Design §4): token embedding → n_layers × [norm → mixer layer → residual,
// norm → feed-forward → residual] → norm → head tied to the embedding (or its own lm_head when
// tie_embeddings is false). The norms are RMSNorms, or LayerNorms with bias with model.norm "layer_norm";
// with model.pre_norm the embedding goes through one more norm before the first block (FLA's RWKV-7 model:
// the first block's input and residual are that norm's output). The feed-forward is the SwiGLU MLP, or RWKV-7's channel mix with
// feed_forward "rwkv7_channel_mix". Layer i's mixer is the config's mixers[i % mixers_size()] with the options
// layer_mixer() resolves (hybrids by a per-layer kind list); each kind is a MixerLayer around its
// registered family (layers/blocks/mixer_layer.h lists the mapping).
//
// Parameters are ATen leaves with requires_grad, listed flat by name in a fixed order:
//   embedding.weight [V,d]
//   (layers.0.pre_norm.weight, layers.0.pre_norm.bias with pre_norm)
//   layers.{i}.mixer_norm.weight, layers.{i}.mixer.<MixerLayer names>, layers.{i}.mlp_norm.weight,
//   layers.{i}.mlp.w1.weight, layers.{i}.mlp.w3.weight, layers.{i}.mlp.w2.weight
//     (RWKV-7's channel mix instead: layers.{i}.ffn.x_k, layers.{i}.ffn.key.weight, layers.{i}.ffn.value.weight)
//   norm.weight, (lm_head.weight [V,d] when untied)
//   (every norm also has its .bias after its .weight with norm "layer_norm")
// Initialization: embedding (and an untied head) ~ N(0, init_std²); the rest as MixerLayer and SwiGLU
// document (projections into the residual stream scaled by 1/sqrt(2·n_layers)); norm weights 1, biases 0. All draws
// come from one generator seeded by build_model's seed, in the order above: same seed, same bits.
#pragma once

#include "framework/config/config.h"
#include "framework/model/chunked_loss.h"
#include "layers/blocks/mixer_layer.h"
#include "layers/blocks/mlp.h"
#include "layers/blocks/norm.h"
#include "layers/blocks/parameters.h"
#include "layers/rwkv7/channel_mix.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace carry {

struct ModelBlock {
  BlockNorm mixer_norm;
  std::unique_ptr<MixerLayer> mixer;
  BlockNorm mlp_norm;
  SwiGLU mlp;                   // feed_forward "swiglu"
  Rwkv7ChannelMix channel_mix;  // feed_forward "rwkv7_channel_mix" (mlp then holds nothing)

  // The feed-forward of the normed x; context: the slice's halo and documents (the channel mix's token
  // shift). result_only: see SwiGLU::forward.
  Tensor feed_forward(const Tensor& x, const MixerLayerContext& context = {}, bool result_only = false) const;
  // Its parameters and their prefix ("mlp." or "ffn.").
  NamedParameters feed_forward_parameters() const;
  const char* feed_forward_prefix() const { return channel_mix.defined() ? "ffn." : "mlp."; }
};

// How a forward reaches the rest of the sequence: the slice context every layer runs in (sequence
// parallelism plugs in here: parallel::make_slice_context); the default is one slice holding the
// whole sequence.
struct ModelContext {
  MixerLayerContext slice;
  // Per-layer activation recomputation: each block keeps only its input and recomputes the rest in
  // backward (layers/blocks/recompute.h). Gradients equal those without it.
  bool recompute = false;
  // With recompute: each layer's mixer core runs once and keeps what its backward needs; the
  // recomputation replays the rest of the layer (layers/blocks/recompute.h, MixerCoreStash). Only where the
  // core runs on one rank (sp = 1).
  bool recompute_keeps_mixer = false;
  // With recompute: the last this many layers are not recomputed (they keep their activations; their
  // backward comes first, right after the loss). parallel.recompute_keep_last; 0 recomputes all.
  int64_t recompute_keep_last = 0;
  // With recompute: each recomputed layer's second forward runs beside the backward of the layer above
  // (recompute_in_backward's overlap; parallel.recompute_overlap).
  bool recompute_overlap = false;
  // Packed documents: [B, sequence length] bool on the CPU, true where a document starts (the whole
  // sequence, also under sequence parallelism). Every layer's state, convolutions and attention
  // restart there (MixerLayerContext::document_starts). Undefined: one document a sequence.
  Tensor document_starts;
  // Tokens per chunk of the chunked head + cross entropy (framework/model/chunked_loss.h); 0: the
  // default for the form that runs (default_loss_chunk_tokens).
  int64_t loss_chunk_tokens = 0;
  // Called before the forward reads a part of the model's parameters: with -1 before the embedding, with
  // i before block i, with the block count before the final norm and the head (the trainer's split update
  // waits there for the parameters other ranks updated, sharded_update.h). Not called again when a block
  // is recomputed in the backward. Unset: nothing.
  std::function<void(int64_t)> before_block;
};

class Model {
 public:
  // tokens [B,T] int64 -> logits [B,T,V] in the model's dtype.
  Tensor forward(const Tensor& tokens, const ModelContext& context = {}) const;
  // The final hidden states [B,T,d] (after the last norm), before the head.
  // deferred: the embedding's output goes through its anchor (chunked_loss.h,
  // anchor_deferred_head_gradient), for a loss that defers the head's gradient (loss_sum).
  Tensor hidden(const Tensor& tokens, const ModelContext& context = {},
                const std::shared_ptr<DeferredHeadGradient>& deferred = nullptr) const;
  // Cross entropy per token [B,T] (computed in fp32 at least) of targets [B,T] int64 under logits.
  // Without a gradient to take (grad mode off, e.g. evaluation) it runs chunk by chunk and never holds
  // the [B,T,V] logits; with one it builds them (per-token gradients; training uses loss_sum).
  Tensor token_losses(const Tensor& tokens, const Tensor& targets, const ModelContext& context = {}) const;
  // The head and its cross entropy chunk by chunk (chunked_loss.h): .loss = Σ weights·ce (differentiable,
  // exact for any upstream gradient, never holding the logits), .token_losses = ce [B,T] (no gradient),
  // .predictions = the argmax tokens [B,T] when asked. Targets < 0 are ignored (loss 0, no gradient);
  // weights [B,T] bool or float (undefined: all ones). Sequence-parallel and data-parallel trainers sum
  // .loss and the weights over ranks and back-propagate .loss / global count.
  // defer_head_bytes > 0: the head weight's gradient of the last chunks whose logit gradients fit in
  // it is computed at the end of the backward, right before the embedding's (linear_cross_entropy's
  // defer_bytes, anchored on the embedding's output); the same bits.
  LinearCrossEntropy loss_sum(const Tensor& tokens, const Tensor& targets, const Tensor& weights = {},
                              const ModelContext& context = {}, bool predictions = false,
                              int64_t defer_head_bytes = 0) const;
  // Masked mean cross entropy: Σ mask·ce / Σ mask; mask [B,T] (bool or float; undefined = all ones).
  // Chunked (loss_sum); no host read: a mask that selects no token gives 0 (and zero gradients).
  Tensor loss(const Tensor& tokens, const Tensor& targets, const Tensor& mask = {},
              const ModelContext& context = {}) const;

  // Every parameter by name, in a fixed order (see the top of this file).
  NamedParameters parameters() const;
  int64_t num_parameters() const;
  // One line, e.g. "model: 12 layers (gated_deltanet x9, softmax_attn x3), d_model 768, vocab 32000,
  // 125.35M parameters (embedding 24.58M, tied head)".
  std::string summary() const;

  const ModelConfig& config() const { return config_; }
  const std::vector<ModelBlock>& blocks() const { return blocks_; }
  at::TensorOptions options() const { return embedding_.options(); }
  // The head's weight [V,d]: lm_head.weight, or the embedding when tied.
  const Tensor& head_weight() const { return lm_head_.defined() ? lm_head_ : embedding_; }
  // The norm before the first block (undefined without model.pre_norm) and the final norm.
  const BlockNorm& pre_norm() const { return pre_norm_; }
  const BlockNorm& final_norm() const { return norm_; }

 private:
  friend Model build_model(const ModelConfig&, uint64_t, at::TensorOptions);
  ModelConfig config_;
  Tensor embedding_;
  std::vector<ModelBlock> blocks_;
  BlockNorm pre_norm_;  // undefined without model.pre_norm
  BlockNorm norm_;
  Tensor lm_head_;  // undefined when tied
};

// The per-layer spec of layer `layer` of a model config (kind, shapes, resolved options). Throws
// ConfigError naming the kind when no mixer layer exists for it.
MixerLayerSpec mixer_layer_spec(const ModelConfig& model, int64_t layer);

// Builds a model from a (validated, defaults filled) model config. Deterministic in `seed`; parameters
// in `options`' dtype and device (fp32 by default; fp64 for tests). Throws ConfigError on a config
// that model_config_errors() refuses or a mixer kind without a layer.
Model build_model(const ModelConfig& model, uint64_t seed,
                  at::TensorOptions options = at::TensorOptions().dtype(at::kFloat));

}  // namespace carry
