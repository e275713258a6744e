// The layer kinds of this family, registered for MixerLayer and the config validation
// (layers/layer_kind.h): GLA (a low-rank log-sigmoid gate per key dimension) and Mamba-1 (S6 through mamba1_inputs; no output norm).
#include "layers/layer_kind.h"

namespace carry {
namespace {

LayerKind gla_kind() {
  LayerKind k{"gla", "gla", 2, Decay::gla};
  k.gated_norm = true;
  return k;
}

LayerKind mamba1_kind() {
  LayerKind k{"mamba1", "mamba1", 5, Decay::none};
  k.silu_qkv = true;
  k.selective_scan = true;
  return k;
}

const bool kRegistered = register_layer_kind(gla_kind()) && register_layer_kind(mamba1_kind());

}  // namespace
}  // namespace carry
