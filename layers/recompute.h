// Activation recomputation (per layer): y = f(x) where the forward keeps only x and the layer's
// parameters, not f's intermediate activations. The backward runs f(x) again with autograd on (under
// the autocast setting the forward had) and back-propagates the incoming gradient of y through that
// fresh graph to x and the parameters. f must be deterministic (no dropout) and may contain
// collectives (sequence-parallel scans, halo exchanges): every rank recomputes its layers in the same
// order, so the collectives of the recomputation match across ranks.
// Without grad mode, or when neither x nor a parameter requires grad, this is plain f(x).
#pragma once

#include "layers/mixer.h"

#include <functional>
#include <vector>

namespace carry {

Tensor recompute_in_backward(std::function<Tensor(const Tensor&)> f, const Tensor& x,
                             const std::vector<Tensor>& parameters);

}  // namespace carry
