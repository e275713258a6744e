// RWKV-7's channel mix, the feed-forward of `model.feed_forward: "rwkv7_channel_mix"`: FLA's RWKV7FeedForward
// (fla/models/rwkv7/modeling_rwkv7.py). x [B,T,d] -> y [B,T,d]:
//
//   δ_t = x_{t−1} − x_t        the token shift of the time mixing (time_mix.h: one token of halo before the
//                              slice through MixerLayerContext::halo, zero at sequence and document starts)
//   y   = value(relu(key(x + δ ⊙ x_k))²)
//
// Parameters, FLA's names: x_k [d], key.weight [hidden, d], value.weight [d, hidden]. Initialization as FLA's
// `_initialize_weights` for layer i of L: x_k = 1 − (n/d)^((1 − i/L)^4), key orthogonal (gain 1), value 0.
#pragma once

#include "layers/blocks/mixer_layer.h"
#include "layers/blocks/parameters.h"

namespace carry {

struct Rwkv7ChannelMix {
  Rwkv7ChannelMix() = default;
  Rwkv7ChannelMix(int64_t d_model, int64_t hidden, int64_t layer, int64_t n_layers, ParameterInit& init);
  // context: the slice's halo and document starts for the token shift (default: the whole sequence).
  Tensor forward(const Tensor& x, const MixerLayerContext& context = {}) const;
  // "x_k", "key.weight", "value.weight".
  NamedParameters parameters() const;
  bool defined() const { return key.defined(); }

  Tensor x_k, key, value;
};

}  // namespace carry
