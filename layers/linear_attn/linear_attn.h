// Linear attention (Katharopoulos et al.): no decay. Feature maps are plain functions applied to q and
// k before the mixer; the mixer itself is the family "linear_attn" registered in linear_attn.cpp. The
// linear_attn layer kind applies φ = elu + 1, or Performer's random features (performer.h) with
// `feature_map: "performer"`.
#pragma once

#include "layers/mixer.h"

namespace carry {

// φ(x) = elu(x) + 1, elementwise (positive features).
Tensor elu_feature_map(const Tensor& x);

}  // namespace carry
