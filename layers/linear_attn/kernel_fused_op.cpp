// Linear attention's fused kernels (kernel_fused.cu) as a torch autograd Function (see kernel_fused.h).
// Compiled with the CUDA sources (CARRY_CUDA builds and the compile-and-link check).
#include "layers/linear_attn/kernel_fused.h"
#include "layers/linear_attn/kernel_fused_launch.h"

#include "layers/common/kernel_host.h"

#include <torch/csrc/autograd/custom_function.h>

namespace carry {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct LaFusedOp : public torch::autograd::Function<LaFusedOp> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& s0,
                               double scale) {
    const int forced = carry_la::fused_forced_segments();
    const int ns = forced > 0 ? forced : linear_attn_fused_segments(q.size(0), q.size(2), q.size(1) / 64);
    auto out = carry_la::launch_fwd(q, k, v, s0, (float)scale, ns);
    ctx->save_for_backward({q, k, v, out[2]});
    ctx->saved_data["scale"] = scale;
    return {out[0], out[1]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const Tensor &q = s[0], &k = s[1], &v = s[2], &Sin = s[3];
    const Tensor d_o = grads[0].defined() ? carry_tiles::dense16(grads[0].to(q.scalar_type())) : at::zeros_like(v);
    const Tensor dSf = grads[1].defined() ? grads[1].to(at::kFloat).contiguous()
                                          : at::zeros({q.size(0), q.size(2), 128, 128}, q.options().dtype(at::kFloat));
    auto d = carry_la::launch_bwd(q, k, v, Sin, d_o, dSf, (float)ctx->saved_data["scale"].toDouble());
    return {d[0], d[1], d[2], d[3], Tensor()};
  }
};

}  // namespace

bool linear_attn_fused_supports(const MixerInputs& in, const MixerOptions& opt) {
  if (!carry_la::fused_enabled() || opt.normalize || opt.serial_states || opt.chunk_size != 64) return false;
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
  auto out = LaFusedOp::apply(carry_tiles::dense16(q), carry_tiles::dense16(k), carry_tiles::dense16(v), s0, scale);
  return {out[0], out[1]};
}

}  // namespace carry
