// The fused convolution and L2 normalization as torch autograd Functions (see conv_op.h).
// Compiled with the CUDA sources (CARRY_CUDA builds and the compile-and-link check).
#include "layers/kernels/blocks/conv_op.h"

#include "layers/kernels/blocks/conv.h"

#include <torch/csrc/autograd/custom_function.h>

namespace carry {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

Tensor or_empty(const Tensor& t, const at::TensorOptions& options) {
  return t.defined() ? t : at::empty({0}, options);
}
Tensor or_undefined(const Tensor& t) { return t.numel() == 0 ? Tensor() : t; }

// x contiguous, weight fp32 contiguous, halo contiguous in x's dtype (or empty), start int64 (or empty).
struct ConvOp : public torch::autograd::Function<ConvOp> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, const Tensor& halo,
                               const Tensor& start, int64_t offset, bool silu, std::vector<int64_t> widths,
                               int64_t out_dtype) {
    auto y = carry::kernels::blocks::conv_fwd(x, w, or_undefined(halo), or_undefined(start), offset, silu, widths,
                                  static_cast<at::ScalarType>(out_dtype));
    ctx->save_for_backward({x, w, halo, start});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["silu"] = silu;
    ctx->saved_data["widths"] = widths;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const Tensor halo = or_undefined(s[2]);
    std::vector<Tensor> dy;
    for (auto& g : grads) dy.push_back(g.defined() ? g.contiguous() : Tensor());
    // The output gradients share one dtype (the outputs' own).
    auto d = carry::kernels::blocks::conv_bwd(s[0], s[1], halo, or_undefined(s[3]), ctx->saved_data["offset"].toInt(),
                                  ctx->saved_data["silu"].toBool(), dy, ctx->saved_data["widths"].toIntVector());
    return {d[0], d[1], halo.defined() ? d[2] : Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// x [M,H,D] with stride(2) = 1, stride(1) = D.
struct L2Op : public torch::autograd::Function<L2Op> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x) {
    ctx->save_for_backward({x});
    return carry::kernels::blocks::l2norm_fwd(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto x = ctx->get_saved_variables()[0];
    if (!grads[0].defined()) return {Tensor()};
    return {carry::kernels::blocks::l2norm_bwd(x, grads[0].to(x.scalar_type()).contiguous())};
  }
};

at::ScalarType conv_out_dtype(const Tensor& x, const Tensor& weight) {
  return at::promote_types(x.scalar_type(), weight.scalar_type());
}

}  // namespace

bool fused_conv_supports(const Tensor& x, const Tensor& weight) {
  if (!x.defined() || !weight.defined() || !x.is_cuda() || x.dim() != 3 || weight.dim() != 2) return false;
  const auto xt = x.scalar_type();
  if (xt != at::kBFloat16 && xt != at::kFloat) return false;
  if (!at::isFloatingType(weight.scalar_type())) return false;
  const auto out = conv_out_dtype(x, weight);
  return (out == at::kFloat || (out == at::kBFloat16 && xt == at::kBFloat16)) && weight.size(0) == x.size(2) &&
         weight.size(1) >= 1 && weight.size(1) <= carry::kernels::blocks::kMaxTaps;
}

std::vector<Tensor> fused_causal_conv1d(const Tensor& x, const Tensor& weight, const Tensor& halo,
                                        const Tensor& document_start, int64_t offset, bool silu,
                                        const std::vector<int64_t>& widths, bool bf16_out) {
  TORCH_CHECK(fused_conv_supports(x, weight), "fused_causal_conv1d: takes x [B,T,C] bf16 or fp32 on CUDA and weight "
              "[C,K] with 1 <= K <= ", carry::kernels::blocks::kMaxTaps, " (promoted dtype fp32, or bf16 for bf16 x); got x ",
              x.sizes(), " ", x.scalar_type(), " on ", x.device(), ", weight ", weight.sizes(), " ",
              weight.scalar_type());
  const auto out = bf16_out && x.scalar_type() == at::kBFloat16 ? at::kBFloat16 : conv_out_dtype(x, weight);
  // Casts outside the Function: autograd casts their gradients back (weight's to its own dtype).
  Tensor w32 = weight.to(at::kFloat).contiguous();
  Tensor h = halo.defined() ? halo.to(x.scalar_type()).contiguous() : Tensor();
  Tensor start = document_start.defined() ? document_start.narrow(1, offset, x.size(1)) : Tensor();
  TORCH_CHECK(!document_start.defined() || (document_start.device() == x.device() &&
                                            document_start.scalar_type() == at::kLong),
              "fused_causal_conv1d: document_start must be int64 on ", x.device(), ", got ",
              document_start.scalar_type(), " on ", document_start.device());
  if (start.defined() && start.stride(1) != 1) start = start.contiguous();
  return ConvOp::apply(x.contiguous(), w32, or_empty(h, x.options()),
                       or_empty(start, x.options().dtype(at::kLong)), offset, silu, widths,
                       static_cast<int64_t>(out));
}

bool fused_l2_supports(const Tensor& x) {
  return x.defined() && x.is_cuda() && x.dim() >= 1 && x.size(-1) >= 1 && x.size(-1) <= 256 &&
         (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat);
}

Tensor fused_l2_normalize(const Tensor& x) {
  TORCH_CHECK(fused_l2_supports(x), "fused_l2_normalize: takes a CUDA tensor in bf16 or fp32 with a last dimension "
              "of 1..256, got ", x.sizes(), " ", x.scalar_type(), " on ", x.device());
  const int64_t D = x.size(-1), H = x.dim() >= 2 ? x.size(-2) : 1;
  Tensor v = x.reshape({-1, H, D});  // a view when the rows are evenly spaced
  if (v.stride(2) != 1 || v.stride(1) != D) v = v.contiguous();
  return L2Op::apply(v).view(x.sizes());
}

}  // namespace carry
