// RMSNorm, y = x / sqrt(mean(x²) + eps) ⊙ weight over the last dimension, and the gated RMSNorm of the
// Mamba-2 / Gated DeltaNet output, y = rms_norm(x) ⊙ silu(z). Both compute in the input dtype promoted
// to at least fp32 and return the input dtype.
#pragma once

#include "layers/parameters.h"

namespace carry {

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps);
Tensor gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& weight, double eps);

// An RMSNorm over `dim` features; weight initialized to ones. Parameter: "weight" [dim].
struct RMSNorm {
  RMSNorm() = default;
  RMSNorm(int64_t dim, double eps, ParameterInit& init);
  Tensor forward(const Tensor& x) const { return rms_norm(x, weight, eps); }
  // y = rms_norm(x) ⊙ silu(z)
  Tensor forward_gated(const Tensor& x, const Tensor& z) const { return gated_rms_norm(x, z, weight, eps); }
  NamedParameters parameters() const { return {{"weight", weight}}; }

  Tensor weight;
  double eps = 1e-6;
};

}  // namespace carry
