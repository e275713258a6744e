// The layer kinds of this family, registered for MixerLayer and the config validation
// (layers/layer_kind.h): log-linear Mamba-2 and log-linear Gated DeltaNet (level weights l = softplus(W x); Fenwick levels need a power-of-two chunk size).
#include "layers/layer_kind.h"
#include "layers/log_linear/fenwick.h"

namespace carry {
namespace {

LayerKind loglinear_mamba2_kind() {
  LayerKind k{"loglinear_mamba2", "loglinear_mamba2", 9, Decay::mamba};
  k.levels = true;
  k.silu_qkv = true;
  k.mamba2 = true;
  k.gated_norm = true;
  k.power_of_two_chunk = true;
  k.levels_needed = fenwick_levels_needed;
  k.max_levels = 64;
  return k;
}

LayerKind loglinear_gdn_kind() {
  LayerKind k{"loglinear_gdn", "loglinear_gdn", 10, Decay::mamba};
  k.beta = true;
  k.levels = true;
  k.silu_qkv = true;
  k.l2_qk = true;
  k.gated_norm = true;
  k.power_of_two_chunk = true;
  k.levels_needed = fenwick_levels_needed;
  k.max_levels = 64;
  return k;
}

const bool kRegistered = register_layer_kind(loglinear_mamba2_kind()) && register_layer_kind(loglinear_gdn_kind());

}  // namespace
}  // namespace carry
