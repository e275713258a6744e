// The layer kind of this family, registered for MixerLayer and the config validation
// (layers/layer_kind.h): KDA with short convolutions, L2-normalized q and k, beta = σ(W x), the decay
// per key dimension gk = −e^{A_log}·softplus(low-rank W x + dt_bias) (Decay::kda), and the gated RMS norm
// on the output with FLA's KimiDeltaAttention gate: sigmoid(W₂ W₁ x + b), rank head_dim_v.
#include "layers/layer_kind.h"

namespace carry {
namespace {

LayerKind kda_kind() {
  LayerKind k{"kda", "kda", 12, Decay::kda};
  k.beta = true;
  k.silu_qkv = true;
  k.l2_qk = true;
  k.gated_norm = true;
  k.low_rank_gate = true;
  k.sigmoid_gate = true;
  return k;
}

const bool kRegistered = register_layer_kind(kda_kind());

}  // namespace
}  // namespace carry
