// The layer kind of this family, registered for MixerLayer and the config validation
// (layers/layer_kind.h): flash-linear-attention's GatedDeltaProduct layer with its defaults: short
// convolutions and silu on q and on the num_householder keys and values a token, L2-normalized q and
// keys, beta = 2·σ(W x) a sub-step (allow_neg_eigval: the Householder factors may reflect), the Mamba-2
// style decay of Gated DeltaNet once a token, and the gated RMS norm on the output.
#include "layers/layer_kind.h"

namespace carry {
namespace {

LayerKind gated_deltaproduct_kind() {
  LayerKind k{"gated_deltaproduct", "gated_deltaproduct", 13, Decay::mamba};
  k.beta = true;
  k.beta_scale = 2;
  k.householder = true;
  k.silu_qkv = true;
  k.l2_qk = true;
  k.gated_norm = true;
  return k;
}

const bool kRegistered = register_layer_kind(gated_deltaproduct_kind());

}  // namespace
}  // namespace carry
