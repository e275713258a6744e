// hla2's kernel form without the normalizer as one autograd op (hla2_op.h).
#include "layers/kernels/hla/hla2_op.h"

#include "layers/hla/decay_passes.h"
#include "layers/kernels/decay/api.h"
#include "layers/kernels/decay/op.h"
#include "layers/kernels/hla/glue.h"
#include "layers/layout.h"

#include <torch/csrc/autograd/custom_function.h>

namespace carry {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
namespace dk_ = carry::kernels::decay;
namespace glue = carry::kernels::hla;

// x one token later along T: ←x_t = x_{t−1}, ←x_0 = 0.
Tensor later(const Tensor& x) {
  const int64_t T = x.size(1);
  return at::cat({at::zeros_like(x.narrow(1, 0, 1)), x.narrow(1, 0, T - 1)}, 1);
}

// The pass's saved tensors: decay_fwd's outputs after o and the final state.
std::vector<Tensor> saved_of(const std::vector<Tensor>& fwd) { return {fwd.begin() + 2, fwd.end()}; }

struct Hla2JointOp : public torch::autograd::Function<Hla2JointOp> {
  // g travels as an empty tensor without a decay (autograd Functions take no undefined tensors); g is fp32,
  // the states fp32 [B,H,dk,dk], [B,H,dk,dv], [B,H,dk,dv]. Returns {o, S_T, C_T, G_T}.
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& g_or_empty, const Tensor& S0, const Tensor& C0, const Tensor& G0,
                               double scale, bool serial) {
    const bool decayed = g_or_empty.numel() > 0;
    const auto kind = decayed ? dk_::Decay::scalar : dk_::Decay::none;
    const Tensor g = decayed ? g_or_empty : Tensor();
    const int64_t dk = q.size(3), dv = v.size(3);
    const int seg = serial ? 1 : 0;
    Tensor qb = later(q), vb = later(v), gb = decayed ? later(g) : Tensor();
    auto fW = dk_::decay_fwd(kind, k, qb, vb, gb, 1.0, C0, seg);
    Tensor kW = at::cat({k, fW[0]}, -1);
    auto fJ = dk_::decay_fwd(kind, q, k, kW, g, scale, at::cat({S0, G0}, -1), seg);
    Tensor R = glue::columns(fJ[0], 0, dk);
    auto fS = dk_::decay_fwd(kind, R, q, v, g, 1.0, C0, seg);
    Tensor o = glue::minus_columns(fS[0], fJ[0], dk);
    variable_list keep{q, k, v, g_or_empty, qb, vb, decayed ? gb : g_or_empty, kW, R};
    for (const auto* f : {&fW, &fJ, &fS}) {
      auto s = saved_of(*f);
      keep.insert(keep.end(), s.begin(), s.end());
    }
    ctx->save_for_backward(keep);
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["serial"] = serial;
    ctx->saved_data["n_saved"] = static_cast<int64_t>(fW.size() - 2);
    const Tensor& SG = fJ[1];
    return {o, SG.narrow(-1, 0, dk).contiguous(), fS[1], SG.narrow(-1, dk, dv).contiguous()};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const Tensor &q = s[0], &k = s[1], &v = s[2], &qb = s[4], &vb = s[5], &kW = s[7], &R = s[8];
    const bool decayed = s[3].numel() > 0;
    const auto kind = decayed ? dk_::Decay::scalar : dk_::Decay::none;
    const Tensor g = decayed ? s[3] : Tensor(), gb = decayed ? s[6] : Tensor();
    const int64_t n = ctx->saved_data["n_saved"].toInt();
    auto saved = [&](int pass) { return std::vector<Tensor>(s.begin() + 9 + pass * n, s.begin() + 9 + (pass + 1) * n); };
    const double scale = ctx->saved_data["scale"].toDouble();
    const int seg = ctx->saved_data["serial"].toBool() ? 1 : 0;
    const int64_t B = q.size(0), H = q.size(2), dk = q.size(3), dv = v.size(3);
    const auto f32 = q.options().dtype(at::kFloat);
    auto state_grad = [&](int i, int64_t cols) {
      return grads[i].defined() ? grads[i].contiguous() : at::zeros({B, H, dk, cols}, f32);
    };
    Tensor d_o = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(v);
    // SC = pass(R, q, v, g, C_0): {dR, dq, dv, dg, dC_0}.
    auto bS = dk_::decay_bwd(kind, R, q, v, g, 1.0, Tensor(), saved(2), d_o, state_grad(2, dv), seg);
    // RG = pass(q, k, [k, W], g, [S_0, G_0]): its output's gradient is [dR, −dO].
    auto bJ = dk_::decay_bwd(kind, q, k, kW, g, scale, Tensor(), saved(1), glue::cat_neg(bS[0], d_o),
                             at::cat({state_grad(1, dk), state_grad(3, dv)}, -1), seg);
    // W = pass(k, ←q, ←v, ←g, C_0), its final state unread.
    auto bW = dk_::decay_bwd(kind, k, qb, vb, gb, 1.0, Tensor(), saved(0), glue::columns(bJ[2], dk, dv),
                             at::zeros({B, H, dk, dv}, f32), seg);
    Tensor dq = glue::sum_grads(bJ[0], bS[1], bW[1], 0, /*next_token=*/true);
    Tensor dk_in = glue::sum_grads(bJ[1], bW[0], bJ[2], 0, /*next_token=*/false);
    Tensor dv_in = glue::sum_grads(bS[2], Tensor(), bW[2], 0, /*next_token=*/true);
    Tensor dg;
    if (decayed) {
      const int64_t T = q.size(1);
      dg = bJ[3] + bS[3];
      if (T > 1) dg.narrow(1, 0, T - 1).add_(bW[3].narrow(1, 1, T - 1));
    }
    const Tensor& dSG = bJ[4];
    return {dq, dk_in, dv_in, dg, dSG.narrow(-1, 0, dk), bS[4] + bW[4], dSG.narrow(-1, dk, dv), Tensor(), Tensor()};
  }
};

}  // namespace

bool hla2_joint_kernel_supports(const MixerInputs& in, const MixerOptions& opt) {
  return !opt.normalize && in.q.size(3) + in.v.size(3) <= 256;
}

MixerOutput hla2_joint_kernel_form(const MixerInputs& in, const State& init, const MixerOptions& opt) {
  const int64_t B = in.q.size(0), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3);
  const auto so = in.q.options().dtype(at::kFloat);
  // The gate in fp32: its gradient from every pass is summed there and rounded once.
  const Tensor g = in.g.defined() ? in.g.to(at::kFloat).contiguous() : in.g;
  Tensor S0 = state_or_zeros(init, 0, {B, H, dk, dk}, so).to(at::kFloat).contiguous();
  Tensor C0 = state_or_zeros(init, 1, {B, H, dk, dv}, so).to(at::kFloat).contiguous();
  Tensor m0 = state_or_zeros(init, 2, {B, H, dk}, so).to(at::kFloat);
  Tensor G0 = state_or_zeros(init, 3, {B, H, dk, dv}, so).to(at::kFloat).contiguous();
  Tensor h0 = state_or_zeros(init, 4, {B, H, dk}, so).to(at::kFloat);
  Tensor g_in = g.defined() ? g : at::empty({0}, so);
  auto out = Hla2JointOp::apply(in.q.contiguous(), in.k.contiguous(), in.v.contiguous(), g_in, S0, C0, G0,
                                opt.scale_for(dk), opt.serial_states);
  auto [m, h] = normalizer_states(decay_kernel_pass(opt.serial_states), in.q, in.k, in.k, g, m0, h0, /*strict=*/true);
  return {out[0], {out[1], out[2], m, out[3], h}};
}

}  // namespace carry
