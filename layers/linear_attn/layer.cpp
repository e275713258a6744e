// The layer kinds of this family, registered for MixerLayer and the config validation
// (layers/layer_kind.h): linear attention (φ = elu + 1 or Performer's random features on q and k;
// optional normalizer).
#include "layers/layer_kind.h"

namespace carry {
namespace {

LayerKind linear_attn_kind() {
  LayerKind k{"linear_attn", "linear_attn", 0, Decay::none};
  k.elu_qk = true;
  k.feature_map = true;
  k.gated_norm = true;
  k.normalize = true;
  return k;
}

const bool kRegistered = register_layer_kind(linear_attn_kind());

}  // namespace
}  // namespace carry
