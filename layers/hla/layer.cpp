// The layer kinds of this family, registered for MixerLayer and the config validation
// (layers/layer_kind.h): HLA order 2 and AHLA (L2-normalized q and k, Mamba-2 style decay, optional normalizer).
#include "layers/layer_kind.h"

namespace carry {
namespace {

LayerKind hla2_kind() {
  LayerKind k{"hla2", "hla2", 7, Decay::mamba};
  k.l2_qk = true;
  k.gated_norm = true;
  k.normalize = true;
  return k;
}

LayerKind ahla_kind() {
  LayerKind k{"ahla", "ahla", 8, Decay::mamba};
  k.l2_qk = true;
  k.gated_norm = true;
  k.normalize = true;
  return k;
}

const bool kRegistered = register_layer_kind(hla2_kind()) && register_layer_kind(ahla_kind());

}  // namespace
}  // namespace carry
