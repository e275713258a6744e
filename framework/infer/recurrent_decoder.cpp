// The recurrent decoder (recurrent_decoder.h): pieces of a sequence through the model's blocks with
// per-layer caches handed to MixerLayer through its context hooks.
#include "framework/infer/recurrent_decoder.h"

#include "layers/blocks/norm.h"
#include "layers/layer_kind.h"

#include <c10/util/Exception.h>

#include <limits>
#include <numeric>

namespace carry {
namespace {

const Tensor& parameter(const NamedParameters& params, const std::string& name) {
  for (const auto& [n, t] : params)
    if (n == name) return t;
  static const Tensor none;
  return none;
}

// Softmax attention of the piece's queries over the cached keys and values plus the piece's own, at
// absolute positions [position, position + n); the cache keeps what later queries can reach.
MixerOutput attend(Tensor& keys, Tensor& values, const MixerInputs& in, const MixerOptions& opt, int64_t position) {
  const int64_t n = in.q.size(1), dk = in.q.size(3);
  Tensor k = keys.defined() ? at::cat({keys, in.k}, 1) : in.k;
  Tensor v = values.defined() ? at::cat({values, in.v}, 1) : in.v;
  const int64_t m = k.size(1);  // keys at positions [position + n - m, position + n)
  auto q = in.q.transpose(1, 2) * opt.scale_for(dk);                             // [B,H,n,dk]
  auto scores = at::matmul(q, k.transpose(1, 2).transpose(-1, -2));              // [B,H,n,m]
  auto long_opts = at::TensorOptions().dtype(at::kLong).device(in.q.device());
  auto qpos = at::arange(position, position + n, long_opts).unsqueeze(1);
  auto kpos = at::arange(position + n - m, position + n, long_opts).unsqueeze(0);
  auto excluded = kpos > qpos;
  // The sparse patterns (layers/softmax_attn/softmax_attn.h): global tokens and summary columns stay
  // visible beyond the window, so their cache keeps every key.
  const bool patterns = opt.global_tokens > 0 || opt.stride > 0;
  if (opt.window > 0) {
    auto outside = kpos <= qpos - opt.window;
    if (patterns) {
      auto key = kpos < opt.global_tokens;
      if (opt.stride > 0) key = key.logical_or(kpos.remainder(opt.stride) == opt.stride - 1);
      outside = outside.logical_and(key.logical_not());
    }
    excluded = excluded.logical_or(outside);
  }
  scores = scores.masked_fill(excluded, -std::numeric_limits<double>::infinity());
  auto o = at::matmul(at::softmax(scores, -1), v.transpose(1, 2)).transpose(1, 2).contiguous();  // [B,n,H,dv]
  const int64_t keep = opt.window > 0 && !patterns ? std::min(m, opt.window - 1) : m;
  keys = k.narrow(1, m - keep, keep).clone();
  values = v.narrow(1, m - keep, keep).clone();
  return {o, {}};
}

}  // namespace

RecurrentDecoder::RecurrentDecoder(const Model& model, int64_t max_length)
    : model_(&model), max_length_(max_length), caches_(model.blocks().size()) {
  TORCH_CHECK(max_length > 0, "decoder: max_length must be positive, got ", max_length);
  auto params = model.parameters();
  embedding_ = parameter(params, "embedding.weight").detach();
  head_ = parameter(params, "lm_head.weight");
  head_ = head_.defined() ? head_.detach() : embedding_;
  for (const auto& b : model.blocks()) alignment_ = std::lcm(alignment_, b.mixer->spec().chunk_size);
}

Tensor RecurrentDecoder::feed(const Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong, "decoder: tokens must be [B, n] int64, got ",
              tokens.sizes(), " ", tokens.scalar_type());
  const int64_t n = tokens.size(1), V = model_->config().vocab_size();
  TORCH_CHECK(position_ + n <= max_length_, "decoder: reading ", n, " more tokens at position ", position_,
              " passes max_length ", max_length_);
  if (n == 0) return at::empty({tokens.size(0), 0, V}, embedding_.options());
  auto cpu = tokens.cpu();
  auto lo = cpu.min().item<int64_t>(), hi = cpu.max().item<int64_t>();
  TORCH_CHECK(lo >= 0 && hi < V, "decoder: token ids must lie in [0, vocab_size=", V, "), found [", lo, ", ", hi, "]");
  // Up to the next chunk boundary, then whole chunks, then the rest.
  const int64_t misaligned = position_ % alignment_;
  const int64_t head = misaligned ? std::min(n, alignment_ - misaligned) : 0;
  const int64_t body = (n - head) / alignment_ * alignment_;
  std::vector<Tensor> logits;
  int64_t done = 0;
  for (auto [len, form] : {std::pair<int64_t, Form>{head, Form::naive}, {body, Form::automatic},
                           {n - head - body, Form::naive}}) {
    if (len == 0) continue;
    logits.push_back(run_piece(tokens.narrow(1, done, len), form));
    done += len;
  }
  return logits.size() == 1 ? logits[0] : at::cat(logits, 1);
}

Tensor RecurrentDecoder::run_piece(const Tensor& tokens, Form form) {
  const int64_t n = tokens.size(1);
  Tensor h = at::embedding(embedding_, tokens.to(embedding_.device()));
  if (model_->pre_norm().defined()) h = model_->pre_norm().forward_in_dtype(h);
  const auto& blocks = model_->blocks();
  Tensor value_first;  // RWKV-7's value residual: the first rwkv7 layer's values over this piece
  for (size_t i = 0; i < blocks.size(); ++i) {
    const ModelBlock& b = blocks[i];
    LayerCache& cache = caches_[i];
    const MixerLayer& layer = *b.mixer;
    // RWKV-7's token shift reads one token before the piece, as a convolution of width 2 does.
    const bool time_mix = layer_kind(layer.spec().kind).time_mix;
    const int64_t K = time_mix ? 2 : layer.spec().conv_size;
    const bool attention = !layer.mixer().has_summary();  // softmax attention: a KV cache, no state
    int halo_calls = 0;
    MixerLayerContext ctx;
    ctx.offset = position_;
    ctx.sequence_length = max_length_;
    // The layer asks for the convolutions' halo first (when K > 1), then, for a sliding window, for
    // the window's: the first is served from the cache, the second is the KV cache's business.
    ctx.halo = [&](const Tensor& x, int64_t halo) -> Tensor {
      if (!(K > 1 && halo_calls++ == 0)) return Tensor();
      TORCH_INTERNAL_ASSERT(halo == K - 1, "decoder: the convolution asked for ", halo, " tokens, K-1 = ", K - 1);
      Tensor before = cache.conv_tail.defined() ? cache.conv_tail.to(x.scalar_type())
                                                : at::zeros({x.size(0), K - 1, x.size(2)}, x.options());
      auto all = at::cat({before, x}, 1);
      cache.conv_tail = all.narrow(1, all.size(1) - (K - 1), K - 1).clone();
      return before;
    };
    ctx.run_mixer = [&](const Mixer& mixer, const MixerInputs& in, const State& s0, const MixerOptions& opt) {
      if (attention) return attend(cache.keys, cache.values, in, opt, position_);
      MixerOptions o = opt;
      o.form = form;
      return mixer.forward(in, s0, o);
    };
    const Tensor x = b.mixer_norm.forward(h);
    if (time_mix && !value_first.defined()) {
      // The first rwkv7 layer's values: its token shift reads the cached token without moving the cache on
      // (the layer's forward does that).
      MixerLayerContext peek = ctx;
      peek.halo = [&](const Tensor& t, int64_t halo) -> Tensor {
        return cache.conv_tail.defined() ? cache.conv_tail.to(t.scalar_type())
                                         : at::zeros({t.size(0), halo, t.size(2)}, t.options());
      };
      value_first = layer.value_first(x, peek);
    }
    auto out = layer.forward(x, cache.state, ctx, time_mix ? value_first : Tensor());
    if (!attention) {
      cache.state.clear();
      for (auto& s : out.final_state) cache.state.push_back(s.detach());
    }
    auto y = h + out.y;
    MixerLayerContext ffn;  // the channel mix's token shift reads the cached token before the piece
    ffn.offset = position_;
    ffn.halo = [&](const Tensor& x, int64_t halo) -> Tensor {
      Tensor before = cache.ffn_tail.defined() ? cache.ffn_tail.to(x.scalar_type())
                                               : at::zeros({x.size(0), halo, x.size(2)}, x.options());
      cache.ffn_tail = x.narrow(1, x.size(1) - 1, 1).clone();
      return before;
    };
    h = y + b.feed_forward(b.mlp_norm.forward(y), ffn);
  }
  position_ += n;
  return at::linear(model_->final_norm().forward(h), head_);
}

}  // namespace carry
