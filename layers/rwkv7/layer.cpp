// The layer kind of this family, registered for MixerLayer and the config validation
// (layers/layer_kind.h): RWKV-7's time mixing, FLA's RWKV7Attention (time_mix.h: token shift, LoRA decay,
// in-context learning rate and gate, value residual, group norm and bonus term; no short convolutions).
#include "layers/layer_kind.h"

namespace carry {
namespace {

LayerKind rwkv7_kind() {
  LayerKind k{"rwkv7", "rwkv7", 14, Decay::none};
  k.time_mix = true;
  return k;
}

const bool kRegistered = register_layer_kind(rwkv7_kind());

}  // namespace
}  // namespace carry
