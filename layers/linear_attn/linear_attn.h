// Linear attention (Katharopoulos et al.): no decay. Feature maps are plain functions applied to q and
// k before the mixer; the mixer itself is the family "linear_attn" registered in linear_attn.cpp.
#pragma once

#include "layers/mixer.h"

namespace carry {

// φ(x) = elu(x) + 1, elementwise (positive features).
Tensor elu_feature_map(const Tensor& x);
// Performer's positive random features: φ(x) = exp(W x − |x|²/2) / sqrt(m), W: [m, d] with rows drawn
// from N(0, I) (`performer_projection`). x: [..., d] -> [..., m].
Tensor performer_feature_map(const Tensor& x, const Tensor& projection);
Tensor performer_projection(int64_t num_features, int64_t dim, uint64_t seed,
                            const at::TensorOptions& opt);

}  // namespace carry
