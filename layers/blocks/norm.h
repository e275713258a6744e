// RMSNorm, y = x / sqrt(mean(x²) + eps) ⊙ weight over the last dimension, and the gated RMSNorm of the
// Mamba-2 / Gated DeltaNet output, y = rms_norm(x) ⊙ silu(z) (KDA's: y = rms_norm(x) ⊙ sigmoid(z)). Both compute in the input dtype promoted
// to at least fp32 and return norm_output_dtype(x): x's dtype, except under autocast on CUDA, where
// they return the autocast dtype (bf16) for x in fp32 or below, since every consumer of a norm in the
// model is a matmul that would cast its input to that dtype (the values are the same, the separate
// cast pass is gone). The residual stream the norm reads stays in its own dtype (fp32).
// On CUDA tensors (fp32 or bf16, last dimension ≤ 8192) fused kernels compute both (the silu gate; the
// sigmoid gate multiplies the fused norm's output), forward and backward (layers/kernels/blocks/norm_swiglu_op.h), unless fused_ops_enabled() is false
// (layers/core/fused_switch.h, the run config's fused_ops: false); the CPU always runs the ATen forms.
// LayerNorm with bias, y = (x − mean(x)) / sqrt(var(x) + eps) ⊙ weight + bias (biased variance), the block
// norm of model.norm "layer_norm" (FLA's RWKV-7 blocks): the same dtypes, always the ATen form (at::layer_norm,
// on CUDA too).
#pragma once

#include "layers/blocks/parameters.h"

namespace carry {

// The dtype the norms return for input x (see above).
at::ScalarType norm_output_dtype(const Tensor& x);

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps);
enum class GateActivation { silu, sigmoid };
Tensor gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& weight, double eps,
                      GateActivation act = GateActivation::silu);
// The residual add and the norm after it: h = x + residual (residual undefined: h = x), and
// rms_norm(h, weight); returns {h, norm}. On CUDA one fused pass each way (the backward adds the
// gradient reaching h directly into the norm's, and writes the residual's gradient in its dtype).
std::pair<Tensor, Tensor> residual_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps);

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps);

// An RMSNorm over `dim` features; weight initialized to ones. Parameter: "weight" [dim].
struct RMSNorm {
  RMSNorm() = default;
  RMSNorm(int64_t dim, double eps, ParameterInit& init);
  Tensor forward(const Tensor& x) const { return rms_norm(x, weight, eps); }
  // y = rms_norm(x) ⊙ silu(z), or ⊙ sigmoid(z)
  Tensor forward_gated(const Tensor& x, const Tensor& z, GateActivation act = GateActivation::silu) const {
    return gated_rms_norm(x, z, weight, eps, act);
  }
  // {h, rms_norm(h)} with h = x + residual (see residual_rms_norm)
  std::pair<Tensor, Tensor> forward_residual(const Tensor& x, const Tensor& residual) const {
    return residual_rms_norm(x, residual, weight, eps);
  }
  NamedParameters parameters() const { return {{"weight", weight}}; }

  Tensor weight;
  double eps = 1e-6;
};

// A model block's norm (model.norm): an RMSNorm ("weight"), or a LayerNorm with bias ("weight", "bias";
// weight ones, bias zeros). forward_residual: {h, norm(h)} with h = x + residual (residual undefined: x).
struct BlockNorm {
  BlockNorm() = default;
  BlockNorm(int64_t dim, double eps, bool layer_norm, ParameterInit& init);
  Tensor forward(const Tensor& x) const;
  // The norm returned in x's dtype (the ATen form): for a norm whose output is a residual stream.
  Tensor forward_in_dtype(const Tensor& x) const;
  std::pair<Tensor, Tensor> forward_residual(const Tensor& x, const Tensor& residual) const;
  NamedParameters parameters() const;
  bool defined() const { return weight.defined(); }
  bool is_layer_norm() const { return bias.defined(); }

  Tensor weight, bias;  // bias: LayerNorm only
  double eps = 1e-6;
};

}  // namespace carry
