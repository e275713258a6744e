// Model assembly (model.h): config → per-layer MixerLayerSpec → blocks; forward, losses, parameters.
#include "framework/model/model.h"

#include "layers/core/nvtx.h"
#include "layers/blocks/recompute.h"
#include "layers/layer_kind.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <map>
#include <tuple>
#include <sstream>

namespace carry {

Tensor ModelBlock::feed_forward(const Tensor& x, const MixerLayerContext& context, bool result_only) const {
  return channel_mix.defined() ? channel_mix.forward(x, context) : mlp.forward(x, result_only);
}

NamedParameters ModelBlock::feed_forward_parameters() const {
  return channel_mix.defined() ? channel_mix.parameters() : mlp.parameters();
}

MixerLayerSpec mixer_layer_spec(const ModelConfig& model, int64_t layer) {
  auto lm = layer_mixer(model, layer);
  std::string family = mixer_layer_family(lm.kind);
  if (family.empty()) {
    std::ostringstream os;
    os << "model.mixers: layer " << layer << " has mixer kind '" << lm.kind
       << "', for which no mixer layer exists; kinds with a layer: ";
    for (size_t i = 0; i < mixer_layer_kinds().size(); ++i) os << (i ? ", " : "") << mixer_layer_kinds()[i];
    throw ConfigError(os.str());
  }
  auto names = mixer_names();
  if (std::find(names.begin(), names.end(), family) == names.end())
    throw ConfigError("model.mixers: mixer kind '" + lm.kind + "' needs the family '" + family +
                      "', which is not registered in this build");
  MixerLayerSpec s;
  s.kind = lm.kind;
  s.d_model = model.d_model();
  s.n_heads = model.n_heads();
  s.n_v_heads = model.has_n_v_heads() ? model.n_v_heads() : 0;
  s.head_dim_k = head_dim_k(model);
  s.head_dim_v = head_dim_v(model);
  s.chunk_size = lm.options.chunk_size();
  s.window = lm.options.window();
  s.global_tokens = lm.options.global_tokens();
  s.stride = lm.options.stride();
  s.conv_size = lm.options.conv_size();
  s.normalize = lm.options.normalize();
  s.levels = lm.options.levels();
  s.num_householder = lm.options.num_householder();
  s.lower_bound = lm.options.lower_bound();
  s.feature_map = lm.options.feature_map();
  s.num_features = lm.options.num_features();
  s.feature_seed = static_cast<uint64_t>(lm.options.feature_seed());
  s.layer = layer;
  s.norm_eps = model.norm_eps();
  s.init_std = model.init_std();
  s.n_layers = model.n_layers();
  s.decay_low_rank_dim = lm.options.decay_low_rank_dim();
  s.a_low_rank_dim = lm.options.a_low_rank_dim();
  s.v_low_rank_dim = lm.options.v_low_rank_dim();
  s.gate_low_rank_dim = lm.options.gate_low_rank_dim();
  // RWKV-7's value residual: every rwkv7 layer after the model's first lerps toward that one's values.
  if (layer_kind(lm.kind).time_mix)
    for (int64_t j = 0; j < layer && !s.value_residual; ++j) s.value_residual = layer_kind(layer_mixer(model, j).kind).time_mix;
  return s;
}

Model build_model(const ModelConfig& model, uint64_t seed, at::TensorOptions options) {
  auto errors = model_config_errors(model);
  if (!errors.empty()) {
    std::string msg = "build_model: invalid model config:";
    for (auto& e : errors) msg += "\n  " + e;
    throw ConfigError(msg);
  }
  Model m;
  m.config_ = model;
  ParameterInit init(seed, options);
  const int64_t V = model.vocab_size(), d = model.d_model(), L = model.n_layers();
  const double eps = model.norm_eps(), std = model.init_std();
  m.embedding_ = init.normal({V, d}, std);
  const bool layer_norm = model.norm() == "layer_norm";
  if (model.pre_norm()) m.pre_norm_ = BlockNorm(d, eps, layer_norm, init);
  for (int64_t i = 0; i < L; ++i) {
    ModelBlock b;
    b.mixer_norm = BlockNorm(d, eps, layer_norm, init);
    b.mixer = std::make_unique<MixerLayer>(mixer_layer_spec(model, i), init);
    b.mlp_norm = BlockNorm(d, eps, layer_norm, init);
    if (model.feed_forward() == "rwkv7_channel_mix") b.channel_mix = Rwkv7ChannelMix(d, mlp_hidden_size(model), i, L, init);
    else b.mlp = SwiGLU(d, mlp_hidden_size(model), std, L, init);
    m.blocks_.push_back(std::move(b));
  }
  m.norm_ = BlockNorm(d, eps, layer_norm, init);
  if (!model.tie_embeddings()) m.lm_head_ = init.normal({V, d}, std);
  return m;
}

Tensor Model::hidden(const Tensor& tokens, const ModelContext& ctx,
                    const std::shared_ptr<DeferredHeadGradient>& deferred) const {
  TORCH_CHECK(tokens.dim() == 2, "model: tokens must be [B, T], got ", tokens.sizes());
  TORCH_CHECK(tokens.scalar_type() == at::kLong, "model: tokens must be int64, got ", tokens.scalar_type());
  const int64_t V = config_.vocab_size();
  // The range check reads the ids back: on the CPU always, on a GPU only with CARRY_CHECK_VALUES=1
  // (the trainer checks token files as it reads them on the host; synthetic tasks are in range).
  if (tokens.numel() > 0 && (!tokens.is_cuda() || check_values_requested())) {
    auto lo = tokens.min().item<int64_t>(), hi = tokens.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < V, "model: token ids must lie in [0, vocab_size=", V, "), found [", lo,
                ", ", hi, "]");
  }
  if (ctx.before_block) ctx.before_block(-1);
  auto h = at::embedding(embedding_, tokens.to(embedding_.device()));
  if (deferred) h = anchor_deferred_head_gradient(h, head_weight(), deferred);
  // The context is shared by value with each layer's closure: a recomputation in backward runs after
  // the caller's context is gone.
  auto with_documents = std::make_shared<ModelContext>(ctx);
  if (ctx.document_starts.defined()) {
    const int64_t total = ctx.slice.sequence_length > 0 ? ctx.slice.sequence_length : ctx.slice.offset + tokens.size(1);
    TORCH_CHECK(ctx.document_starts.dim() == 2 && ctx.document_starts.size(0) == tokens.size(0) &&
                    ctx.document_starts.size(1) == total && ctx.document_starts.scalar_type() == at::kBool,
                "model: document_starts must be bool [B, sequence length] = [", tokens.size(0), ", ", total, "], got ",
                ctx.document_starts.scalar_type(), " ", ctx.document_starts.sizes());
    with_documents->slice.document_starts = ctx.document_starts.cpu();
    // Once per call: what every layer reads of the documents (no per-layer host work or copies).
    index_documents(with_documents->slice, tokens.size(1), embedding_.device());
  }
  std::shared_ptr<const ModelContext> shared = with_documents;
  // RWKV-7's value residual: the first rwkv7 layer's values, computed from that layer's input outside its
  // block and read by every rwkv7 layer. A recomputed rwkv7 block takes them beside its input, [h, v_first]
  // along the channels, so that the recomputation differentiates to them as to h and their own graph (to
  // the first layer's parameters) runs once, in the model's backward.
  Tensor value_first;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const ModelBlock* b = &blocks_[i];
    if (ctx.before_block) ctx.before_block(static_cast<int64_t>(i));
    // The pre-norm's output is the first block's input and residual, in the residual stream's dtype.
    if (i == 0 && pre_norm_.defined()) h = pre_norm_.forward_in_dtype(h);
    const bool time_mix = layer_kind(b->mixer->spec().kind).time_mix;
    if (time_mix && !value_first.defined())
      value_first = b->mixer->value_first(b->mixer_norm.forward_residual(h, Tensor()).second, shared->slice);
    const Tensor block_value_first = time_mix ? value_first : Tensor();
    // NVTX names (layers/core/nvtx.h): "layer i kind" around the block, "mixer kind" and "mlp" inside;
    // a recomputed block shows them again in the backward.
    auto names = std::make_shared<const std::array<std::string, 2>>(
        std::array<std::string, 2>{"layer " + std::to_string(i) + " " + b->mixer->spec().kind, "mixer " + b->mixer->spec().kind});
    // Selective recomputation: this layer's own context, with a stash for its core (layers/blocks/recompute.h).
    std::shared_ptr<const MixerLayerContext> slice(shared, &shared->slice);
    const bool recomputed = ctx.recompute && static_cast<int64_t>(i) + ctx.recompute_keep_last < static_cast<int64_t>(blocks_.size());
    if (recomputed && ctx.recompute_keeps_mixer && at::GradMode::is_enabled()) {
      auto own = std::make_shared<MixerLayerContext>(shared->slice);
      own->core_stash = std::make_shared<MixerCoreStash>();
      slice = own;
    }
    auto block = [b, slice, names](const Tensor& x, const Tensor& value_first) {
      NvtxRange layer((*names)[0]);
      // y = x + mixer(norm(x)), then y + mlp(norm(y)); each residual add goes with the norm after it (one
      // pass each way on CUDA), and x passes through the first norm so that its two gradients are summed there.
      Tensor y, n;
      {
        NvtxRange mixer((*names)[1]);
        auto [x1, n1] = b->mixer_norm.forward_residual(x, Tensor());
        std::tie(y, n) = b->mlp_norm.forward_residual(x1, b->mixer->forward(n1, {}, *slice, value_first).y);
      }
      NvtxRange mlp("mlp");
      // Recomputed in the backward, the block's result is only differentiated: its last product and the
      // residual add build their graph without computing values (layers/blocks/recompute.h).
      const bool values = !recomputing_in_backward();
      return graph_only_add(y, b->feed_forward(n, *slice, /*result_only=*/!values), values);
    };
    if (!recomputed) {
      h = block(h, block_value_first);
      continue;
    }
    std::vector<Tensor> params;
    for (const auto& part : {b->mixer_norm.parameters(), b->mixer->parameters(), b->mlp_norm.parameters(),
                             b->feed_forward_parameters()})
      for (auto& [name, p] : part) params.push_back(p);
    if (!block_value_first.defined()) {
      h = recompute_in_backward([block](const Tensor& x) { return block(x, Tensor()); }, h, params, ctx.recompute_overlap);
      continue;
    }
    const int64_t d = h.size(-1);
    auto packed = [block, d](const Tensor& x_and_values) {
      return block(x_and_values.narrow(-1, 0, d), x_and_values.narrow(-1, d, x_and_values.size(-1) - d));
    };
    h = recompute_in_backward(packed, at::cat({h, block_value_first.to(h.scalar_type())}, -1), params,
                              ctx.recompute_overlap);
  }
  if (ctx.before_block) ctx.before_block(static_cast<int64_t>(blocks_.size()));
  return norm_.forward(h);
}

Tensor Model::forward(const Tensor& tokens, const ModelContext& ctx) const {
  return at::linear(hidden(tokens, ctx), head_weight());
}

namespace {
void check_targets(const Tensor& tokens, const Tensor& targets) {
  TORCH_CHECK(targets.sizes() == tokens.sizes(), "model: targets must have the shape of tokens ",
              tokens.sizes(), ", got ", targets.sizes());
  TORCH_CHECK(targets.scalar_type() == at::kLong, "model: targets must be int64, got ", targets.scalar_type());
}
}  // namespace

Tensor Model::token_losses(const Tensor& tokens, const Tensor& targets, const ModelContext& ctx) const {
  check_targets(tokens, targets);
  if (!at::GradMode::is_enabled()) return loss_sum(tokens, targets, {}, ctx).token_losses;
  auto logits = forward(tokens, ctx);
  auto dt = at::promote_types(logits.scalar_type(), at::kFloat);
  auto logp = at::log_softmax(logits.to(dt), -1);
  return -logp.gather(-1, targets.to(logits.device()).unsqueeze(-1)).squeeze(-1);
}

LinearCrossEntropy Model::loss_sum(const Tensor& tokens, const Tensor& targets, const Tensor& weights,
                                   const ModelContext& ctx, bool predictions, int64_t defer_head_bytes) const {
  check_targets(tokens, targets);
  TORCH_CHECK(!weights.defined() || weights.sizes() == tokens.sizes(), "model: loss weights must have the shape of tokens ",
              tokens.sizes(), ", got ", weights.sizes());
  auto deferred = defer_head_bytes > 0 && at::GradMode::is_enabled() ? std::make_shared<DeferredHeadGradient>() : nullptr;
  return linear_cross_entropy(hidden(tokens, ctx, deferred), head_weight(), targets, weights, ctx.loss_chunk_tokens,
                              predictions, defer_head_bytes, deferred);
}

Tensor Model::loss(const Tensor& tokens, const Tensor& targets, const Tensor& mask, const ModelContext& ctx) const {
  TORCH_CHECK(!mask.defined() || mask.sizes() == tokens.sizes(), "model: mask must have the shape of tokens ",
              tokens.sizes(), ", got ", mask.sizes());
  auto r = loss_sum(tokens, targets, mask, ctx);
  if (!mask.defined()) return r.loss / static_cast<double>(std::max<int64_t>(1, targets.numel()));
  // The count stays on the device; an empty mask gives 0 / 1.
  auto count = mask.to(r.loss.device(), r.loss.scalar_type()).sum().clamp_min(1);
  return r.loss / count;
}

NamedParameters Model::parameters() const {
  NamedParameters out{{"embedding.weight", embedding_}};
  if (pre_norm_.defined()) append_parameters(out, "layers.0.pre_norm.", pre_norm_.parameters());
  for (size_t i = 0; i < blocks_.size(); ++i) {
    std::string p = "layers." + std::to_string(i) + ".";
    const auto& b = blocks_[i];
    append_parameters(out, p + "mixer_norm.", b.mixer_norm.parameters());
    append_parameters(out, p + "mixer.", b.mixer->parameters());
    append_parameters(out, p + "mlp_norm.", b.mlp_norm.parameters());
    append_parameters(out, p + b.feed_forward_prefix(), b.feed_forward_parameters());
  }
  append_parameters(out, "norm.", norm_.parameters());
  if (lm_head_.defined()) out.emplace_back("lm_head.weight", lm_head_);
  return out;
}

int64_t Model::num_parameters() const {
  int64_t n = 0;
  for (auto& [name, t] : parameters()) n += t.numel();
  return n;
}

std::string Model::summary() const {
  std::vector<std::pair<std::string, int>> kinds;
  for (auto& b : blocks_) {
    auto& k = b.mixer->spec().kind;
    auto it = std::find_if(kinds.begin(), kinds.end(), [&](auto& e) { return e.first == k; });
    if (it == kinds.end()) kinds.emplace_back(k, 1);
    else ++it->second;
  }
  std::ostringstream os;
  auto millions = [](int64_t n) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2fM", static_cast<double>(n) / 1e6);
    return std::string(buf);
  };
  os << "model: " << blocks_.size() << " layers (";
  for (size_t i = 0; i < kinds.size(); ++i) os << (i ? ", " : "") << kinds[i].first << " x" << kinds[i].second;
  os << "), d_model " << config_.d_model() << ", vocab " << config_.vocab_size() << ", "
     << millions(num_parameters()) << " parameters (embedding " << millions(embedding_.numel())
     << (lm_head_.defined() ? ", own head" : ", tied head") << ")";
  return os.str();
}

}  // namespace carry
