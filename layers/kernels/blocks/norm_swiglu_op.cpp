// The fused norms and SwiGLU as torch autograd Functions (see norm_swiglu_op.h). Compiled with the
// CUDA sources (CARRY_CUDA builds and the compile-and-link check). Inputs are flattened to [N, D] rows
// outside the Functions (views, differentiable); the Functions see contiguous 2-D tensors.
#include "layers/kernels/blocks/norm_swiglu_op.h"

#include "layers/kernels/blocks/norm_swiglu.h"

#include <torch/csrc/autograd/custom_function.h>

namespace carry {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// y = rms_norm(x, w) [⊙ silu(z)]; z travels as an empty tensor when `gated` is false (autograd
// Functions take no undefined tensors).
struct NormOp : public torch::autograd::Function<NormOp> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& z_or_empty, const Tensor& w,
                               bool gated, double eps, int64_t out_dtype) {
    const Tensor z = gated ? z_or_empty : Tensor();
    auto r = carry::kernels::blocks::norm_fwd(x, z, w, eps, static_cast<at::ScalarType>(out_dtype));
    ctx->save_for_backward({x, z_or_empty, w, r[1]});
    ctx->saved_data["gated"] = gated;
    return {r[0]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const bool gated = ctx->saved_data["gated"].toBool();
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    auto d = carry::kernels::blocks::norm_bwd(grads[0].contiguous(), s[0], gated ? s[1] : Tensor(), s[2], s[3]);
    return {d[0], gated ? d[1] : Tensor(), d[2], Tensor(), Tensor(), Tensor()};
  }
};

// h = x + res (or h = x when `has_res` is false: x itself comes back, so that the gradient reaching it
// there is added in the norm's backward pass), y = rms_norm(h, w). Outputs {h, y}. Backward: with dh
// the gradient of h and dy that of y, dx = dh + (the norm's gradient) in one pass, and the residual's
// gradient is the same values in its own dtype.
struct ResidualNormOp : public torch::autograd::Function<ResidualNormOp> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& res_or_empty, const Tensor& w,
                               bool has_res, double eps, int64_t out_dtype) {
    auto r = carry::kernels::blocks::norm_fwd(x, Tensor(), w, eps, static_cast<at::ScalarType>(out_dtype),
                                   has_res ? res_or_empty : Tensor());
    const Tensor h = has_res ? r[2] : x;
    ctx->save_for_backward({h, w, r[1]});
    ctx->saved_data["has_res"] = has_res;
    ctx->saved_data["res_dtype"] = static_cast<int64_t>(res_or_empty.scalar_type());
    return {h, r[0]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const bool has_res = ctx->saved_data["has_res"].toBool();
    const auto res_dtype = static_cast<at::ScalarType>(ctx->saved_data["res_dtype"].toInt());
    const Tensor dh = grads[0].defined() ? grads[0].contiguous() : Tensor();
    if (!grads[1].defined()) {
      if (!dh.defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
      return {dh, has_res ? dh.to(res_dtype) : Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    }
    auto d = carry::kernels::blocks::norm_bwd(grads[1].contiguous(), s[0], Tensor(), s[1], s[2], dh,
                                   has_res ? c10::optional<at::ScalarType>(res_dtype) : c10::nullopt);
    return {d[0], has_res ? d[3] : Tensor(), d[2], Tensor(), Tensor(), Tensor()};
  }
};

// y = silu(a) ⊙ b for two [N, H] tensors.
struct SwiGLUOp : public torch::autograd::Function<SwiGLUOp> {
  static variable_list forward(AutogradContext* ctx, const Tensor& a, const Tensor& b) {
    ctx->save_for_backward({a, b});
    return {carry::kernels::blocks::swiglu_fwd(a, b, a.scalar_type())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    if (!grads[0].defined()) return {Tensor(), Tensor()};
    auto da = at::empty_like(s[0]), db = at::empty_like(s[1]);
    carry::kernels::blocks::swiglu_bwd(grads[0].contiguous(), s[0], s[1], da, db);
    return {da, db};
  }
};

// y = silu(a) ⊙ b with [a | b] = ab [N, 2H]; the gradient of ab is written as one [N, 2H] tensor.
struct SwiGLUPackedOp : public torch::autograd::Function<SwiGLUPackedOp> {
  static variable_list forward(AutogradContext* ctx, const Tensor& ab) {
    const int64_t H = ab.size(1) / 2;
    ctx->save_for_backward({ab});
    return {carry::kernels::blocks::swiglu_fwd(ab.narrow(1, 0, H), ab.narrow(1, H, H), ab.scalar_type())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor ab = ctx->get_saved_variables()[0];
    if (!grads[0].defined()) return {Tensor()};
    const int64_t H = ab.size(1) / 2;
    auto dab = at::empty_like(ab);
    carry::kernels::blocks::swiglu_bwd(grads[0].contiguous(), ab.narrow(1, 0, H), ab.narrow(1, H, H), dab.narrow(1, 0, H),
                            dab.narrow(1, H, H));
    return {dab};
  }
};

// y = silu(a) ⊙ b · W2ᵀ with [a | b] = ab [N, 2H] and W2 [d, H]: the activation is not kept for the
// backward, which recomputes it from ab (one elementwise pass) instead of holding [N, H] per layer.
// The product runs in ab's dtype (what autocast's linear would do); W2's gradient comes back in W2's dtype,
// summed in fp32 by cuBLAS when ab is bf16 and W2 fp32.
struct SwiGLULinearOp : public torch::autograd::Function<SwiGLULinearOp> {
  static variable_list forward(AutogradContext* ctx, const Tensor& ab, const Tensor& w2, bool result_only) {
    const int64_t H = ab.size(1) / 2;
    ctx->save_for_backward({ab, w2});
    if (result_only) return {at::empty({ab.size(0), w2.size(0)}, ab.options())};
    const Tensor s = carry::kernels::blocks::swiglu_fwd(ab.narrow(1, 0, H), ab.narrow(1, H, H), ab.scalar_type());
    return {at::mm(s, w2.to(ab.scalar_type()).t())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &ab = saved[0], &w2 = saved[1];
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor()};
    const int64_t H = ab.size(1) / 2;
    const auto dt = ab.scalar_type();
    const Tensor dy = grads[0].to(dt).contiguous();
    const Tensor s = carry::kernels::blocks::swiglu_fwd(ab.narrow(1, 0, H), ab.narrow(1, H, H), dt);
    const Tensor ds = at::mm(dy, w2.to(dt));
    Tensor dw2 = dt == at::kBFloat16 && w2.scalar_type() == at::kFloat ? at::mm(dy.t(), s, at::kFloat)
                                                                       : at::mm(dy.t(), s).to(w2.scalar_type());
    auto dab = at::empty_like(ab);
    carry::kernels::blocks::swiglu_bwd(ds, ab.narrow(1, 0, H), ab.narrow(1, H, H), dab.narrow(1, 0, H), dab.narrow(1, H, H));
    return {dab, dw2, Tensor()};
  }
};

bool float_or_bf16(const Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16; }

// x as contiguous [N, D] rows.
Tensor rows(const Tensor& x) { return x.reshape({-1, x.size(-1)}).contiguous(); }

// What every fused norm entry point requires of x, its weight and the output dtype.
void check_norm_args(const char* who, const Tensor& x, const Tensor& weight, at::ScalarType out_dtype) {
  TORCH_CHECK(fused_norm_supports(x), who, ": x must be a CUDA tensor in fp32 or bf16 with a last dimension in [1, ",
              carry::kernels::blocks::kMaxNormDim, "], got ", x.scalar_type(), " ", x.sizes(), " on ", x.device());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), who, ": weight [", x.size(-1),
              "] expected for inputs of last size ", x.size(-1), ", got weight of shape ", weight.sizes());
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, who,
              ": the output dtype must be fp32 or bf16, got ", out_dtype);
}

Tensor norm(const char* who, const Tensor& x, const Tensor& z, const Tensor& weight, double eps,
            at::ScalarType out_dtype) {
  check_norm_args(who, x, weight, out_dtype);
  const bool gated = z.defined();
  if (gated)
    TORCH_CHECK(z.sizes() == x.sizes() && z.device() == x.device() && float_or_bf16(z), who,
                ": the gate z must be fp32 or bf16 of x's shape ", x.sizes(), " on ", x.device(), ", got ",
                z.scalar_type(), " ", z.sizes(), " on ", z.device());
  const Tensor w = weight.to(x.device(), at::kFloat).contiguous();
  const Tensor z2 = gated ? rows(z) : at::empty({0}, x.options());
  auto y = NormOp::apply(rows(x), z2, w, gated, eps, static_cast<int64_t>(out_dtype))[0];
  return y.view(x.sizes());
}

}  // namespace

bool fused_norm_supports(const Tensor& x) {
  if (!x.defined() || !x.is_cuda() || x.dim() < 1 || !float_or_bf16(x)) return false;
  const int64_t D = x.size(-1);
  return D >= 1 && D <= carry::kernels::blocks::kMaxNormDim && x.numel() / D <= INT32_MAX;
}

Tensor fused_rms_norm(const Tensor& x, const Tensor& weight, double eps, at::ScalarType out_dtype) {
  return norm("fused_rms_norm", x, Tensor(), weight, eps, out_dtype);
}

Tensor fused_gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& weight, double eps,
                            at::ScalarType out_dtype) {
  TORCH_CHECK(z.defined(), "fused_gated_rms_norm: the gate z is undefined");
  return norm("fused_gated_rms_norm", x, z, weight, eps, out_dtype);
}

std::pair<Tensor, Tensor> fused_residual_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                                  double eps, at::ScalarType out_dtype) {
  const char* who = "fused_residual_rms_norm";
  check_norm_args(who, x, weight, out_dtype);
  const bool has_res = residual.defined();
  if (has_res)
    TORCH_CHECK(residual.sizes() == x.sizes() && residual.device() == x.device() && float_or_bf16(residual) &&
                    at::promote_types(x.scalar_type(), residual.scalar_type()) == x.scalar_type(),
                who, ": the residual must be fp32 or bf16 of x's shape ", x.sizes(), " on ", x.device(),
                ", no wider than x (", x.scalar_type(), "), got ", residual.scalar_type(), " ", residual.sizes(),
                " on ", residual.device());
  const Tensor w = weight.to(x.device(), at::kFloat).contiguous();
  const Tensor r2 = has_res ? rows(residual) : at::empty({0}, x.options());
  auto out = ResidualNormOp::apply(rows(x), r2, w, has_res, eps, static_cast<int64_t>(out_dtype));
  return {out[0].view(x.sizes()), out[1].view(x.sizes())};
}

bool fused_swiglu_supports(const Tensor& t) {
  return t.defined() && t.is_cuda() && t.dim() >= 1 && float_or_bf16(t);
}

Tensor fused_swiglu(const Tensor& a, const Tensor& b) {
  TORCH_CHECK(fused_swiglu_supports(a), "fused_swiglu: a must be a CUDA tensor in fp32 or bf16, got ", a.scalar_type(),
              " ", a.sizes(), " on ", a.device());
  TORCH_CHECK(b.sizes() == a.sizes() && b.scalar_type() == a.scalar_type() && b.device() == a.device(),
              "fused_swiglu: b must match a (", a.scalar_type(), " ", a.sizes(), " on ", a.device(), "), got ",
              b.scalar_type(), " ", b.sizes(), " on ", b.device());
  return SwiGLUOp::apply(rows(a), rows(b))[0].view(a.sizes());
}

Tensor fused_swiglu_packed(const Tensor& ab) {
  TORCH_CHECK(fused_swiglu_supports(ab) && ab.size(-1) % 2 == 0,
              "fused_swiglu_packed: ab must be a CUDA tensor in fp32 or bf16 with an even last dimension [..., 2H], "
              "got ", ab.scalar_type(), " ", ab.sizes(), " on ", ab.device());
  auto shape = ab.sizes().vec();
  shape.back() /= 2;
  return SwiGLUPackedOp::apply(rows(ab))[0].view(shape);
}

Tensor fused_swiglu_linear(const Tensor& ab, const Tensor& w2, bool result_only) {
  TORCH_CHECK(fused_swiglu_supports(ab) && ab.size(-1) % 2 == 0,
              "fused_swiglu_linear: ab must be a CUDA tensor in fp32 or bf16 with an even last dimension [..., 2H], "
              "got ", ab.scalar_type(), " ", ab.sizes(), " on ", ab.device());
  TORCH_CHECK(w2.dim() == 2 && w2.size(1) == ab.size(-1) / 2 && w2.device() == ab.device() && w2.is_floating_point(),
              "fused_swiglu_linear: w2 must be a floating [d, ", ab.size(-1) / 2, "] matrix on ", ab.device(), ", got ",
              w2.scalar_type(), " ", w2.sizes(), " on ", w2.device());
  auto shape = ab.sizes().vec();
  shape.back() = w2.size(0);
  return SwiGLULinearOp::apply(rows(ab), w2, result_only)[0].view(shape);
}

}  // namespace carry
