// The layer kinds of this family, registered for MixerLayer and the config validation
// (layers/layer_kind.h): DeltaNet and Gated DeltaNet (short convolutions, L2-normalized q and k, beta = σ(W x); Gated DeltaNet adds the Mamba-2 style decay);
// both take grouped value heads (n_v_heads).
#include "layers/layer_kind.h"

namespace carry {
namespace {

LayerKind deltanet_kind() {
  LayerKind k{"deltanet", "deltanet", 3, Decay::none};
  k.beta = true;
  k.silu_qkv = true;
  k.l2_qk = true;
  k.gated_norm = true;
  k.grouped_values = true;
  return k;
}

LayerKind gated_deltanet_kind() {
  LayerKind k{"gated_deltanet", "gated_deltanet", 4, Decay::mamba};
  k.beta = true;
  k.silu_qkv = true;
  k.l2_qk = true;
  k.gated_norm = true;
  k.grouped_values = true;
  return k;
}

const bool kRegistered = register_layer_kind(deltanet_kind()) && register_layer_kind(gated_deltanet_kind());

}  // namespace
}  // namespace carry
