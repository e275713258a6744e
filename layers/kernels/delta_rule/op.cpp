// The delta rule's kernel form as a torch autograd Function (see op.h). Compiled with the CUDA
// sources (CARRY_CUDA builds and the compile-and-link check), never on the ATen-only path.
#include "layers/kernels/delta_rule/op.h"

#include "layers/kernels/primitives/state_grad_hook.h"
#include "layers/kernels/delta_rule/api.h"

#include <torch/csrc/autograd/custom_function.h>

namespace carry {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

Tensor dense(const Tensor& t) { return t.defined() ? t.contiguous() : t; }

// torch autograd Functions take no undefined tensors: an absent g (DeltaNet) travels as an empty
// tensor, an absent initial state as zeros.
Tensor absent_as_empty(const Tensor& t, const Tensor& like) {
  return t.defined() ? t.contiguous() : at::empty({0}, like.options());
}
Tensor empty_as_absent(const Tensor& t) { return t.numel() == 0 ? Tensor() : t; }

struct DeltaRuleKernelOp : public torch::autograd::Function<DeltaRuleKernelOp> {
  // Returns {o, final_state}.
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& g_or_empty, const Tensor& beta, const Tensor& s0, double scale,
                               int64_t chunk, const std::function<void(const Tensor&)>& on_final_state,
                               const std::function<void(const Tensor&)>& on_initial_state_grad, bool serial) {
    const Tensor g = empty_as_absent(g_or_empty);
    auto out = carry::kernels::delta_rule::gdn_fwd(q, k, v, g, beta, scale, s0, chunk, on_final_state, serial ? 1 : 0);
    variable_list keep{q, k, v, g_or_empty, beta, s0};
    keep.insert(keep.end(), out.begin() + 2, out.end());
    ctx->save_for_backward(keep);
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["chunk"] = chunk;
    carry::kernels::primitives::keep_state_grad_hook(ctx, on_initial_state_grad);
    return {out[0], out[1]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const Tensor &q = s[0], &k = s[1], &v = s[2], &beta = s[4], &s0 = s[5];
    const Tensor g = empty_as_absent(s[3]);
    std::vector<Tensor> saved(s.begin() + 6, s.end());
    const int64_t B = q.size(0), T = q.size(1), H = q.size(2), dk = q.size(3), dv = v.size(3);
    Tensor d_o = grads[0].defined() ? grads[0].contiguous() : at::zeros({B, T, H, dv}, v.options());
    Tensor d_s = grads[1].defined() ? grads[1].contiguous()
                                    : at::zeros({B, H, dk, dv}, q.options().dtype(at::kFloat));
    const std::function<void(const Tensor&)> hook = carry::kernels::primitives::state_grad_hook(ctx);
    auto d = carry::kernels::delta_rule::gdn_bwd(q, k, v, g, beta, ctx->saved_data["scale"].toDouble(), s0, saved, d_o, d_s,
                                ctx->saved_data["chunk"].toInt(), hook);
    return {d[0], d[1], d[2], g.defined() ? d[3] : Tensor(), d[4], d[5], Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

bool delta_rule_kernel_supports(const MixerInputs& in, const MixerOptions& opt) {
  if (!in.q.defined() || !in.v.defined() || !in.q.is_cuda() || in.q.dim() != 4 || in.v.dim() != 4) return false;
  const auto dt = in.q.scalar_type();
  const int64_t dk = in.q.size(3), dv = in.v.size(3);
  return (dt == at::kBFloat16 || dt == at::kFloat) && (dk == 64 || dk == 128) &&
         (dv == 64 || dv == 128 || dv == 256) && opt.chunk_size == 64;
}

MixerOutput delta_rule_kernel_forward(const MixerInputs& in, const Tensor& initial_state, const MixerOptions& opt) {
  const int64_t B = in.q.size(0), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3);
  Tensor s0 = initial_state.defined() ? initial_state.to(at::kFloat).contiguous()
                                      : at::zeros({B, H, dk, dv}, in.q.options().dtype(at::kFloat));
  std::function<void(const Tensor&)> on_state, on_s0_grad;
  if (opt.on_final_state) on_state = [&opt](const Tensor& s) { opt.on_final_state({s}); };
  // Called in the backward, after this function returned: it holds its own copy of the caller's hook.
  if (opt.on_initial_state_grad) on_s0_grad = [f = opt.on_initial_state_grad](const Tensor& d) { f({d}); };
  auto out = DeltaRuleKernelOp::apply(dense(in.q), dense(in.k), dense(in.v), absent_as_empty(in.g, in.q),
                                      dense(in.beta), s0, opt.scale_for(in.q.size(3)), opt.chunk_size, on_state,
                                      on_s0_grad, opt.serial_states);
  return {out[0], {out[1]}};
}

}  // namespace carry
