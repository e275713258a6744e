// The layer kinds of this family, registered for MixerLayer and the config validation
// (layers/layer_kind.h): RetNet (a fixed decay per head) and Mamba-2 (the SSD core: k = B·dt, q = C, g = dt·A, scale 1, skip D).
#include "layers/layer_kind.h"

namespace carry {
namespace {

LayerKind retnet_kind() {
  LayerKind k{"retnet", "scalar_decay", 1, Decay::retnet};
  k.gated_norm = true;
  return k;
}

LayerKind mamba2_kind() {
  LayerKind k{"mamba2", "scalar_decay", 6, Decay::mamba};
  k.silu_qkv = true;
  k.mamba2 = true;
  k.gated_norm = true;
  return k;
}

const bool kRegistered = register_layer_kind(retnet_kind()) && register_layer_kind(mamba2_kind());

}  // namespace
}  // namespace carry
