// The layer kinds of this family, registered for MixerLayer and the config validation
// (layers/layer_kind.h): softmax attention, causal or sliding-window (`window`; the halo across ranks is the window),
// with the window also global tokens and summary columns (`global_tokens`, `stride`: softmax_attn.h).
#include "layers/layer_kind.h"

namespace carry {
namespace {

LayerKind softmax_attn_kind() {
  LayerKind k{"softmax_attn", "softmax_attn", 11, Decay::none};
  k.window = true;
  return k;
}

const bool kRegistered = register_layer_kind(softmax_attn_kind());

}  // namespace
}  // namespace carry
