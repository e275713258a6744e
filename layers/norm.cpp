// RMSNorm and gated RMSNorm (norm.h): per position over the last dimension, in fp32 at least.
#include "layers/norm.h"

#include <c10/util/Exception.h>

namespace carry {

namespace {
at::ScalarType compute_dtype(const Tensor& x) { return at::promote_types(x.scalar_type(), at::kFloat); }

Tensor normalize(const Tensor& xf, double eps) {
  return xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
}
}  // namespace

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  TORCH_CHECK(weight.dim() == 1 && x.dim() >= 1 && x.size(-1) == weight.size(0), "rms_norm: weight [",
              x.size(-1), "] expected for inputs of last size ", x.size(-1), ", got weight of shape ",
              weight.sizes());
  auto dt = compute_dtype(x);
  return (normalize(x.to(dt), eps) * weight.to(dt)).to(x.scalar_type());
}

Tensor gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& weight, double eps) {
  TORCH_CHECK(z.sizes() == x.sizes(), "gated_rms_norm: the gate z must have the shape of x ", x.sizes(),
              ", got ", z.sizes());
  auto dt = compute_dtype(x);
  auto y = rms_norm(x.to(dt), weight.to(dt), eps) * at::silu(z.to(dt));
  return y.to(x.scalar_type());
}

RMSNorm::RMSNorm(int64_t dim, double eps_, ParameterInit& init) : weight(init.full({dim}, 1.0)), eps(eps_) {}

}  // namespace carry
