// Softmax attention's kernel form as a torch autograd Function (see op.h). Compiled with the
// CUDA sources (CARRY_CUDA builds and the compile-and-link check), never on the ATen-only path. The
// forward saves q, k, v, o and the per-row log-sum-exp; the backward recomputes the scores from them.
#include "layers/kernels/softmax_attn/op.h"

#include "layers/kernels/softmax_attn/api.h"

#include <torch/csrc/autograd/custom_function.h>

namespace carry {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct SoftmaxAttnKernelOp : public torch::autograd::Function<SoftmaxAttnKernelOp> {
  static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                        int64_t window) {
    auto out = carry::kernels::softmax_attn::attn_fwd(q, k, v, scale, window);
    ctx->save_for_backward({q, k, v, out[0], out[1]});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["window"] = window;
    return out[0];
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const Tensor &q = s[0], &k = s[1], &v = s[2], &o = s[3], &lse = s[4];
    // The gradient arrives in o's dtype unless a caller cast it; the kernels read it in the inputs'.
    Tensor d_o = grads[0].defined() ? grads[0].to(o.scalar_type()).contiguous() : at::zeros_like(o);
    auto d = carry::kernels::softmax_attn::attn_bwd(q, k, v, o, lse, d_o, ctx->saved_data["scale"].toDouble(),
                                  ctx->saved_data["window"].toInt());
    return {d[0], d[1], d[2], Tensor(), Tensor()};
  }
};

}  // namespace

bool softmax_attn_kernel_supports(const MixerInputs& in, const MixerOptions& opt) {
  const Tensor &q = in.q, &k = in.k, &v = in.v;
  if (!q.defined() || !k.defined() || !v.defined() || !q.is_cuda() || q.dim() != 4 || k.dim() != 4 || v.dim() != 4)
    return false;
  const auto dt = q.scalar_type();
  const int64_t T = q.size(1), dk = q.size(3), dv = v.size(3);
  return (dt == at::kBFloat16 || dt == at::kFloat) && k.scalar_type() == dt && v.scalar_type() == dt &&
         k.device() == q.device() && v.device() == q.device() && dk == dv && (dk == 64 || dk == 128) && T > 0 &&
         T % 64 == 0 && q.size(0) > 0 && q.size(2) > 0 && opt.window >= 0;
}

Tensor softmax_attn_kernel_forward(const MixerInputs& in, const MixerOptions& opt) {
  return SoftmaxAttnKernelOp::apply(in.q, in.k, in.v, opt.scale_for(in.q.size(3)), opt.window);
}

}  // namespace carry
