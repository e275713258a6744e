// The scalar/diagonal-decay kernel form as a torch autograd Function (see op.h).
// Compiled with the CUDA sources (CARRY_CUDA builds and the compile-and-link check).
#include "layers/kernels/decay/op.h"

#include "layers/kernels/decay/api.h"
#include "layers/layout.h"
#include "layers/kernels/primitives/state_grad_hook.h"

#include <torch/csrc/autograd/custom_function.h>

namespace carry {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct DecayKernelOp : public torch::autograd::Function<DecayKernelOp> {
  // g travels as an empty tensor for linear attention (autograd Functions take no undefined tensors).
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& g_or_empty, const Tensor& s0, double scale, int64_t kind,
                               int64_t segments, const std::function<void(const Tensor&)>& on_final_state,
                               const std::function<void(const Tensor&)>& on_initial_state_grad) {
    const auto decay = static_cast<carry::kernels::decay::Decay>(kind);
    const Tensor g = g_or_empty.numel() == 0 ? Tensor() : g_or_empty;
    auto out = carry::kernels::decay::decay_fwd(decay, q, k, v, g, scale, s0, static_cast<int>(segments), on_final_state);
    variable_list keep{q, k, v, g_or_empty};
    keep.insert(keep.end(), out.begin() + 2, out.end());
    ctx->save_for_backward(keep);
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["kind"] = kind;
    ctx->saved_data["segments"] = segments;
    carry::kernels::primitives::keep_state_grad_hook(ctx, on_initial_state_grad);
    return {out[0], out[1]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const Tensor &q = s[0], &k = s[1], &v = s[2];
    const Tensor g = s[3].numel() == 0 ? Tensor() : s[3];
    std::vector<Tensor> saved(s.begin() + 4, s.end());
    const auto decay = static_cast<carry::kernels::decay::Decay>(ctx->saved_data["kind"].toInt());
    const int64_t B = q.size(0), T = q.size(1), H = q.size(2), dk = q.size(3), dv = v.size(3);
    Tensor d_o = grads[0].defined() ? grads[0].contiguous() : at::zeros({B, T, H, dv}, v.options());
    Tensor d_s = grads[1].defined() ? grads[1].contiguous()
                                    : at::zeros({B, H, dk, dv}, q.options().dtype(at::kFloat));
    const std::function<void(const Tensor&)> hook = carry::kernels::primitives::state_grad_hook(ctx);
    auto d = carry::kernels::decay::decay_bwd(decay, q, k, v, g, ctx->saved_data["scale"].toDouble(), Tensor(), saved, d_o,
                                    d_s, static_cast<int>(ctx->saved_data["segments"].toInt()), hook);
    return {d[0], d[1], d[2], g.defined() ? d[3] : Tensor(), d[4], Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor dense(const Tensor& t) { return t.contiguous(); }

}  // namespace

bool decay_kernel_supports(const MixerInputs& in, const MixerOptions& opt) {
  if (!in.q.defined() || !in.v.defined() || !in.q.is_cuda() || in.q.dim() != 4 || in.v.dim() != 4) return false;
  const auto dt = in.q.scalar_type();
  const int64_t dk = in.q.size(3), dv = in.v.size(3);
  return (dt == at::kBFloat16 || dt == at::kFloat) && (dk == 64 || dk == 96 || dk == 128) &&
         (dv % 64 == 0 && dv >= 64 && dv <= 256) && opt.chunk_size == 64;
}

void check_decay_kernel_supports(const std::string& family, const MixerInputs& in, const MixerOptions& opt) {
  TORCH_CHECK(decay_kernel_supports(in, opt), family, ": the kernel form takes CUDA tensors in bf16 or fp32, dk in "
              "{64, 96, 128}, dv in {64, 128, 192, 256} and chunk_size 64; got q ", shape_str(in.q.sizes()), " ",
              in.q.scalar_type(), " on ", in.q.device(), ", v ", shape_str(in.v.sizes()), ", chunk_size ",
              opt.chunk_size);
}

MixerOutput decay_kernel_form(const Mixer& family, DecayKernel kind, const Tensor& gate, const MixerInputs& in,
                              const State& initial_state, const MixerOptions& opt) {
  family.check(in, opt, /*chunked=*/true);
  check_decay_kernel_supports(family.name(), in, opt);
  std::function<void(const Tensor&)> on_state, on_s0_grad;
  if (opt.on_final_state) on_state = [&opt](const Tensor& s) { opt.on_final_state({s}); };
  // Called in the backward, after this function returned: it holds its own copy of the caller's hook.
  if (opt.on_initial_state_grad) on_s0_grad = [f = opt.on_initial_state_grad](const Tensor& d) { f({d}); };
  auto r = decay_kernel_forward(kind, in.q, in.k, in.v, gate, initial_state.empty() ? Tensor() : initial_state[0],
                                opt.scale_for(in.q.size(3)), opt.serial_states, on_state, on_s0_grad);
  return {r.first, {r.second}};
}

std::pair<Tensor, Tensor> decay_kernel_forward(DecayKernel kind, const Tensor& q, const Tensor& k, const Tensor& v,
                                               const Tensor& g, const Tensor& initial_state, double scale,
                                               bool serial_states,
                                               const std::function<void(const Tensor&)>& on_final_state,
                                               const std::function<void(const Tensor&)>& on_initial_state_grad) {
  const int64_t B = q.size(0), H = q.size(2), dk = q.size(3), dv = v.size(3);
  Tensor s0 = initial_state.defined() ? initial_state.to(at::kFloat).contiguous()
                                      : at::zeros({B, H, dk, dv}, q.options().dtype(at::kFloat));
  // A bf16 gate goes in as it is (the kernels cumulate it in fp32: the same values as an fp32 copy of it,
  // without the copy's pass over memory); its gradient comes back in fp32 and autograd rounds it to bf16.
  Tensor gate_in = kind == DecayKernel::none ? at::empty({0}, q.options().dtype(at::kFloat))
               : g.scalar_type() == at::kBFloat16 ? g.contiguous()
                                                   : g.to(at::kFloat).contiguous();
  auto out = DecayKernelOp::apply(dense(q), dense(k), dense(v), gate_in, s0, scale, static_cast<int64_t>(kind),
                                  int64_t{serial_states ? 1 : 0}, on_final_state, on_initial_state_grad);
  return {out[0], out[1]};
}

DecayPass decay_kernel_pass(bool serial_states) {
  return [serial_states](const Tensor& c, const Tensor& a, const Tensor& b, const Tensor& g, const Tensor& x0,
                         double scale) {
    return decay_kernel_forward(g.defined() ? DecayKernel::scalar : DecayKernel::none, c, a, b, g, x0, scale,
                                serial_states);
  };
}

}  // namespace carry
