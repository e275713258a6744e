// RMSNorm and gated RMSNorm (norm.h): per position over the last dimension, in fp32 at least. On CUDA
// (builds with CARRY_WITH_CUDA) the fused kernels (layers/kernels/blocks/norm_swiglu_op.h) run unless
// fused_ops_enabled() is false; the ATen forms below are the CPU path and the reference.
#include "layers/blocks/norm.h"

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

#ifdef CARRY_WITH_CUDA
#include "layers/core/fused_switch.h"
#include "layers/kernels/blocks/norm_swiglu_op.h"
#endif

namespace carry {

namespace {
at::ScalarType compute_dtype(const Tensor& x) { return at::promote_types(x.scalar_type(), at::kFloat); }

Tensor normalize(const Tensor& xf, double eps) {
  return xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
}

// The ATen form of rms_norm, returned in `out`.
Tensor rms_norm_aten(const Tensor& x, const Tensor& weight, double eps, at::ScalarType out) {
  auto dt = compute_dtype(x);
  return (normalize(x.to(dt), eps) * weight.to(dt)).to(out);
}

void check_weight(const char* who, const Tensor& x, const Tensor& weight) {
  TORCH_CHECK(weight.dim() == 1 && x.dim() >= 1 && x.size(-1) == weight.size(0), who, ": weight [", x.size(-1),
              "] expected for inputs of last size ", x.size(-1), ", got weight of shape ", weight.sizes());
}

#ifdef CARRY_WITH_CUDA
bool use_fused(const Tensor& x) { return x.is_cuda() && fused_ops_enabled() && fused_norm_supports(x); }
#endif
}  // namespace

at::ScalarType norm_output_dtype(const Tensor& x) {
  // Autocast casts fp32 and lower floating inputs of a matmul to its dtype, fp64 never.
  if (x.is_cuda() && at::autocast::is_autocast_enabled(at::kCUDA) && at::isFloatingType(x.scalar_type()) &&
      x.scalar_type() != at::kDouble)
    return at::autocast::get_autocast_dtype(at::kCUDA);
  return x.scalar_type();
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_weight("rms_norm", x, weight);
  const auto out = norm_output_dtype(x);
#ifdef CARRY_WITH_CUDA
  if (use_fused(x) && (out == at::kFloat || out == at::kBFloat16)) return fused_rms_norm(x, weight, eps, out);
#endif
  return rms_norm_aten(x, weight, eps, out);
}

Tensor gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& weight, double eps, GateActivation act) {
  TORCH_CHECK(z.sizes() == x.sizes(), "gated_rms_norm: the gate z must have the shape of x ", x.sizes(),
              ", got ", z.sizes());
  check_weight("gated_rms_norm", x, weight);
  const auto out = norm_output_dtype(x);
  auto dt = compute_dtype(x);
  if (act == GateActivation::sigmoid) {
#ifdef CARRY_WITH_CUDA
    // The fused norm in the compute dtype, then the gate: one product, the norm read exactly.
    if (use_fused(x) && z.device() == x.device() && (dt == at::kFloat || dt == at::kBFloat16))
      return (fused_rms_norm(x, weight, eps, dt) * at::sigmoid(z.to(dt))).to(out);
#endif
    return (rms_norm_aten(x.to(dt), weight.to(dt), eps, dt) * at::sigmoid(z.to(dt))).to(out);
  }
#ifdef CARRY_WITH_CUDA
  if (use_fused(x) && fused_norm_supports(z) && z.device() == x.device() &&
      (out == at::kFloat || out == at::kBFloat16))
    return fused_gated_rms_norm(x, z, weight, eps, out);
#endif
  auto y = rms_norm_aten(x.to(dt), weight.to(dt), eps, dt) * at::silu(z.to(dt));
  return y.to(out);
}

std::pair<Tensor, Tensor> residual_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps) {
  TORCH_CHECK(!residual.defined() || residual.sizes() == x.sizes(), "residual_rms_norm: the residual must have the shape of x ",
              x.sizes(), ", got ", residual.sizes());
#ifdef CARRY_WITH_CUDA
  if (use_fused(x) && (!residual.defined() || (fused_norm_supports(residual) && residual.device() == x.device() &&
                                               at::promote_types(x.scalar_type(), residual.scalar_type()) ==
                                                   x.scalar_type()))) {
    check_weight("residual_rms_norm", x, weight);
    const auto out = norm_output_dtype(x);
    if (out == at::kFloat || out == at::kBFloat16) return fused_residual_rms_norm(x, residual, weight, eps, out);
  }
#endif
  Tensor h = residual.defined() ? x + residual : x;
  return {h, rms_norm(h, weight, eps)};
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  check_weight("layer_norm", x, weight);
  check_weight("layer_norm (bias)", x, bias);
  auto dt = compute_dtype(x);
  return at::layer_norm(x.to(dt), {x.size(-1)}, weight.to(dt), bias.to(dt), eps).to(norm_output_dtype(x));
}

RMSNorm::RMSNorm(int64_t dim, double eps_, ParameterInit& init) : weight(init.full({dim}, 1.0)), eps(eps_) {}

BlockNorm::BlockNorm(int64_t dim, double eps_, bool layer_norm, ParameterInit& init)
    : weight(init.full({dim}, 1.0)), eps(eps_) {
  if (layer_norm) bias = init.full({dim}, 0.0);
}

Tensor BlockNorm::forward(const Tensor& x) const {
  return bias.defined() ? layer_norm(x, weight, bias, eps) : rms_norm(x, weight, eps);
}

Tensor BlockNorm::forward_in_dtype(const Tensor& x) const {
  check_weight("block norm", x, weight);
  if (!bias.defined()) return rms_norm_aten(x, weight, eps, x.scalar_type());
  auto dt = compute_dtype(x);
  return at::layer_norm(x.to(dt), {x.size(-1)}, weight.to(dt), bias.to(dt), eps).to(x.scalar_type());
}

std::pair<Tensor, Tensor> BlockNorm::forward_residual(const Tensor& x, const Tensor& residual) const {
  if (!bias.defined()) return residual_rms_norm(x, residual, weight, eps);
  TORCH_CHECK(!residual.defined() || residual.sizes() == x.sizes(), "layer_norm: the residual must have the shape of x ",
              x.sizes(), ", got ", residual.sizes());
  Tensor h = residual.defined() ? x + residual : x;
  return {h, layer_norm(h, weight, bias, eps)};
}

NamedParameters BlockNorm::parameters() const {
  if (bias.defined()) return {{"weight", weight}, {"bias", bias}};
  return {{"weight", weight}};
}

}  // namespace carry
