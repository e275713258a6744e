// Linear attention's and the scalar decay's fused kernels (fused.cu) as torch autograd Functions (see
// fused_op.h).
// Compiled with the CUDA sources (CARRY_CUDA builds and the compile-and-link check).
#include "layers/kernels/decay/fused_op.h"
#include "layers/kernels/decay/fused_launch.h"

#include "layers/kernels/primitives/host.h"
#include "layers/kernels/primitives/state_grad_hook.h"

#include <torch/csrc/autograd/custom_function.h>

namespace carry {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct LaFusedOp : public torch::autograd::Function<LaFusedOp> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& s0,
                               double scale) {
    const int forced = carry::kernels::decay::fused::fused_forced_segments();
    const int ns = forced > 0 ? forced : linear_attn_fused_segments(q.size(0), q.size(2), q.size(1) / 64);
    auto out = carry::kernels::decay::fused::launch_fwd(q, k, v, s0, (float)scale, ns);
    ctx->save_for_backward({q, k, v, out[2]});
    ctx->saved_data["scale"] = scale;
    return {out[0], out[1]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const Tensor &q = s[0], &k = s[1], &v = s[2], &Sin = s[3];
    const Tensor d_o = grads[0].defined() ? carry::kernels::primitives::dense16(grads[0].to(q.scalar_type())) : at::zeros_like(v);
    const Tensor dSf = grads[1].defined() ? grads[1].to(at::kFloat).contiguous()
                                          : at::zeros({q.size(0), q.size(2), 128, 128}, q.options().dtype(at::kFloat));
    auto d = carry::kernels::decay::fused::launch_bwd(q, k, v, Sin, d_o, dSf, (float)ctx->saved_data["scale"].toDouble());
    return {d[0], d[1], d[2], d[3], Tensor()};
  }
};

// The scalar decay: the same kernels with gb, the log decay summed within each chunk (fp32, from g).
struct SdFusedOp : public torch::autograd::Function<SdFusedOp> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                               const Tensor& s0, double scale,
                               const std::function<void(const Tensor&)>& on_final_state,
                               const std::function<void(const Tensor&)>& on_initial_state_grad) {
    const int64_t B = q.size(0), T = q.size(1), H = q.size(2), N = T / 64;
    const Tensor gb = g.to(at::kFloat).reshape({B, N, 64, H}).cumsum(2).reshape({B, T, H}).contiguous();
    const int forced = carry::kernels::decay::fused::fused_forced_segments();
    const int ns = forced > 0 ? forced : linear_attn_fused_segments(B, H, N);
    auto out = carry::kernels::decay::fused::launch_fwd(q, k, v, s0, (float)scale, ns, gb);
    if (on_final_state) on_final_state(out[1]);
    ctx->save_for_backward({q, k, v, gb, out[2], out[3], out[1]});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["g_dtype"] = static_cast<int64_t>(g.scalar_type());
    carry::kernels::primitives::keep_state_grad_hook(ctx, on_initial_state_grad);
    return {out[0], out[1]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const Tensor &q = s[0], &k = s[1], &v = s[2], &gb = s[3], &Sin = s[4], &gam = s[5], &Sfin = s[6];
    const Tensor d_o = grads[0].defined() ? carry::kernels::primitives::dense16(grads[0].to(q.scalar_type())) : at::zeros_like(v);
    const Tensor dSf = grads[1].defined() ? grads[1].to(at::kFloat).contiguous()
                                          : at::zeros({q.size(0), q.size(2), 128, 128}, q.options().dtype(at::kFloat));
    auto d = carry::kernels::decay::fused::launch_bwd(q, k, v, Sin, d_o, dSf, (float)ctx->saved_data["scale"].toDouble(), gb, gam);
    if (auto hook = carry::kernels::primitives::state_grad_hook(ctx)) hook(d[3]);
    // ∂L/∂G_t (G the log decay summed from the start) = ⟨q_t, dq_t⟩ − ⟨k_t, dk_t⟩, plus ⟨dS_T, S_T⟩ at the
    // last token; g_t enters every G_{t' ≥ t}, so dg is its sum from t to the end.
    Tensor dG = d[4] - d[5];
    dG.select(1, dG.size(1) - 1).add_((dSf * Sfin).sum({2, 3}));
    // The sum from t to the end along the innermost dimension: ATen's scan along T as an outer dimension
    // of [B, T, H] walks it with H threads (16 ms a call at 131072 tokens, H = 16, on an H200).
    const Tensor dg = dG.movedim(1, -1).contiguous().flip({-1}).cumsum(-1).flip({-1}).movedim(-1, 1);
    const auto g_dtype = static_cast<at::ScalarType>(ctx->saved_data["g_dtype"].toInt());
    return {d[0], d[1], d[2], dg.to(g_dtype), d[3], Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

bool scalar_decay_fused_supports(const MixerInputs& in, const MixerOptions& opt) {
  if (!carry::kernels::decay::fused::decay_fused_enabled() || opt.serial_states || opt.chunk_size != 64) return false;
  if (!in.g.defined() || !in.q.defined() || !in.k.defined() || !in.v.defined() || !in.q.is_cuda() || in.q.dim() != 4)
    return false;
  if (in.q.scalar_type() != at::kBFloat16 || in.k.scalar_type() != at::kBFloat16 ||
      in.v.scalar_type() != at::kBFloat16 || !at::isFloatingType(in.g.scalar_type()))
    return false;
  const auto& q = in.q;
  return q.size(3) == 128 && in.k.sizes() == q.sizes() && in.v.dim() == 4 && in.v.size(3) == 128 &&
         in.v.size(0) == q.size(0) && in.v.size(1) == q.size(1) && in.v.size(2) == q.size(2) &&
         in.g.sizes() == at::IntArrayRef({q.size(0), q.size(1), q.size(2)}) && q.size(1) >= 64 && q.size(1) % 64 == 0;
}

MixerOutput scalar_decay_fused_form(const Mixer& family, const MixerInputs& in, const State& init,
                                    const MixerOptions& opt) {
  family.check(in, opt, /*chunked=*/true);
  TORCH_CHECK(scalar_decay_fused_supports(in, opt), family.name(), ": the fused kernels do not take these inputs");
  const Tensor& s0_in = init.empty() ? Tensor() : init[0];
  Tensor s0 = s0_in.defined() ? s0_in.to(at::kFloat).contiguous()
                              : at::zeros({in.q.size(0), in.q.size(2), 128, 128}, in.q.options().dtype(at::kFloat));
  std::function<void(const Tensor&)> on_state, on_s0_grad;
  if (opt.on_final_state) on_state = [&opt](const Tensor& x) { opt.on_final_state({x}); };
  // Called in the backward, after this function returned: it holds its own copy of the caller's hook.
  if (opt.on_initial_state_grad) on_s0_grad = [f = opt.on_initial_state_grad](const Tensor& d) { f({d}); };
  auto out = SdFusedOp::apply(carry::kernels::primitives::dense16(in.q), carry::kernels::primitives::dense16(in.k), carry::kernels::primitives::dense16(in.v), in.g,
                              s0, opt.scale_for(in.q.size(3)), on_state, on_s0_grad);
  return {out[0], {out[1]}};
}

bool linear_attn_fused_supports(const MixerInputs& in, const MixerOptions& opt) {
  if (!carry::kernels::decay::fused::fused_enabled() || opt.normalize || opt.serial_states || opt.chunk_size != 64) return false;
  if (!in.q.defined() || !in.k.defined() || !in.v.defined() || !in.q.is_cuda() || in.q.dim() != 4) return false;
  if (in.q.scalar_type() != at::kBFloat16 || in.k.scalar_type() != at::kBFloat16 ||
      in.v.scalar_type() != at::kBFloat16)
    return false;
  return in.q.size(3) == 128 && in.v.dim() == 4 && in.v.size(3) == 128 && in.k.sizes() == in.q.sizes() &&
         in.v.size(0) == in.q.size(0) && in.v.size(1) == in.q.size(1) && in.v.size(2) == in.q.size(2) &&
         in.q.size(1) >= 64 && in.q.size(1) % 64 == 0;
}

std::pair<Tensor, Tensor> linear_attn_fused_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                    const Tensor& initial_state, double scale) {
  Tensor s0 = initial_state.defined() ? initial_state.to(at::kFloat).contiguous()
                                      : at::zeros({q.size(0), q.size(2), 128, 128}, q.options().dtype(at::kFloat));
  auto out = LaFusedOp::apply(carry::kernels::primitives::dense16(q), carry::kernels::primitives::dense16(k), carry::kernels::primitives::dense16(v), s0, scale);
  return {out[0], out[1]};
}

}  // namespace carry
