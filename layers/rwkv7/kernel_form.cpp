// RWKV-7's kernel form (kernel_form.h states it).
#include "layers/rwkv7/kernel_form.h"

#include "layers/diag_decay/decayed_pairs.h"
#include "layers/kda/chunk_layout.h"
#include "layers/kda/kernel_form.h"
#include "layers/kernels/primitives/state_grad_hook.h"
#include "layers/layout.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

namespace carry {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using namespace chunk_layout;

// The walk's pieces of every chunk from chunked q, k, a, b, gk [B,H,N,C,dk], v [B,H,N,C,dv]: W', U', K_out'
// [.., 2C, ·], the decay [B,H,N,dk], Q_s [.., C, dk], QA' [.., C, 2C].
struct Pieces {
  Tensor W, U, K_out, decay, Q_s, QA;
};
Pieces pieces(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& a, const Tensor& b,
              const Tensor& gk, double scale) {
  const int64_t C = q.size(-2);
  Tensor G = gk.cumsum(-2), Gm = G - gk;
  auto from_a = decayed_pairs(a, Gm, {b, k}, G, /*strict=*/true);
  auto from_q = decayed_pairs(q, G, {b, k}, G, /*strict=*/false);
  auto eye = at::eye(C, q.options());
  Tensor T = at::linalg_solve_triangular(eye - from_a[0], eye.expand_as(from_a[0]), /*upper=*/false, /*left=*/true,
                                         /*unitriangular=*/true);
  Tensor TA = at::matmul(T, a * Gm.exp()), TK = at::matmul(T, from_a[1]);
  Tensor G_last = G.select(-2, C - 1);
  Tensor to_end = (G_last.unsqueeze(-2) - G).exp();
  Pieces p;
  p.W = at::cat({-TA, at::zeros_like(TA)}, -2);
  p.U = at::cat({at::matmul(TK, v), v}, -2);
  p.K_out = at::cat({b * to_end, k * to_end}, -2);
  p.decay = G_last.exp();
  p.Q_s = q * G.exp() * scale;
  p.QA = at::cat({from_q[0], from_q[1]}, -1) * scale;
  return p;
}

Tensor pad_rows(const Tensor& x) { return at::cat({x, at::zeros_like(x)}, -2); }  // [.., C, ·] -> [.., 2C, ·]
Tensor dense(const Tensor& t) { return t.contiguous(); }

struct Rwkv7Op : public torch::autograd::Function<Rwkv7Op> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& gk, const Tensor& a, const Tensor& b, const Tensor& s0, double scale,
                               const std::function<void(const Tensor&)>& on_final_state,
                               const std::function<void(const Tensor&)>& on_initial_state_grad) {
    const auto dt = work_dtype(q);
    const int64_t C = kRwkv7KernelChunk;
    Pieces p = pieces(chunked(q, C, dt), chunked(k, C, dt), chunked(v, C, dt), chunked(a, C, dt), chunked(b, C, dt),
                      chunked(gk, C, dt), scale);
    KdaWalk walk = kda_walk(dense(p.W), dense(p.U), dense(p.K_out), dense(p.decay), s0.to(dt).contiguous());
    if (on_final_state) on_final_state(walk.final_state);
    Tensor o = at::matmul(p.Q_s, walk.states) + at::matmul(p.QA, walk.v_new);
    ctx->save_for_backward({q, k, v, gk, a, b, walk.states, walk.v_new});
    ctx->saved_data["scale"] = scale;
    carry::kernels::primitives::keep_state_grad_hook(ctx, on_initial_state_grad);
    return {unchunked(o, q.scalar_type()), walk.final_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const Tensor &H = s[6], &V_new = s[7];
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t C = kRwkv7KernelChunk;
    const auto dt = work_dtype(s[0]);
    const int64_t B = s[0].size(0), Hh = s[0].size(2), Dk = s[0].size(3), Dv = s[2].size(3);
    // The pieces again, on a local graph from the chunked inputs.
    at::AutoGradMode grad_on(true);
    std::vector<Tensor> leaves;
    for (int i = 0; i < 6; ++i) leaves.push_back(chunked(s[i], C, dt).detach().requires_grad_(true));
    const Tensor &q = leaves[0], &k = leaves[1], &v = leaves[2], &gk = leaves[3], &a = leaves[4], &b = leaves[5];
    Pieces p = pieces(q, k, v, a, b, gk, scale);
    Tensor dO = grads[0].defined() ? chunked(grads[0], C, dt) : at::zeros({B, Hh, H.size(2), C, Dv}, H.options());
    Tensor dS_final = grads[1].defined() ? grads[1].to(dt).contiguous() : at::zeros({B, Hh, Dk, Dv}, H.options());
    Tensor dv_pre = at::matmul(t_(p.QA.detach()), dO);
    KdaReverseWalk r = kda_reverse_walk(dense(pad_rows(p.Q_s.detach())), dense(pad_rows(dO)), dense(p.W.detach()),
                                        dense(p.K_out.detach()), dense(p.decay.detach()), dense(dv_pre), dS_final);
    if (auto hook = carry::kernels::primitives::state_grad_hook(ctx)) hook(r.initial_grad);
    const Tensor& dS = r.out_grads;    // the state leaving each chunk
    const Tensor& dVn = r.v_new_grads;  // V_new' = [U_n; V]
    std::vector<Tensor> outs{p.Q_s, p.QA, p.W, p.U, p.K_out, p.decay};
    std::vector<Tensor> d_outs{at::matmul(dO, t_(H)), at::matmul(dO, t_(V_new)), -at::matmul(dVn, t_(H)), dVn,
                               at::matmul(V_new, t_(dS)), (dS * H).sum(-1)};
    auto d = torch::autograd::grad(outs, leaves, d_outs, /*retain_graph=*/false, /*create_graph=*/false,
                                   /*allow_unused=*/true);
    variable_list out;
    for (int i = 0; i < 6; ++i)
      out.push_back(d[i].defined() ? unchunked(d[i], s[i].scalar_type()) : at::zeros_like(s[i]));
    out.push_back(r.initial_grad);
    for (int i = 0; i < 3; ++i) out.push_back(Tensor());
    return out;
  }
};

}  // namespace

bool rwkv7_kernel_supports(const MixerInputs& in, const MixerOptions& opt) {
  if (!in.q.defined() || !in.v.defined() || !in.q.is_cuda() || in.q.dim() != 4 || in.v.dim() != 4) return false;
  const auto dt = in.q.scalar_type();
  const int64_t dk = in.q.size(3), dv = in.v.size(3);
  return (dt == at::kBFloat16 || dt == at::kFloat) && (dk == 64 || dk == 128) && dv % 16 == 0 && dv <= 256 &&
         opt.chunk_size == 64;
}

MixerOutput rwkv7_kernel_form(const MixerInputs& in, const Tensor& initial_state, const MixerOptions& opt) {
  TORCH_CHECK(in.q.size(1) % kRwkv7KernelChunk == 0, "rwkv7: the kernel form takes T a multiple of ",
              kRwkv7KernelChunk, ", got T = ", in.q.size(1));
  const int64_t B = in.q.size(0), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3);
  const auto dt = work_dtype(in.q);
  Tensor s0 = initial_state.defined() ? initial_state.to(dt) : at::zeros({B, H, dk, dv}, in.q.options().dtype(dt));
  std::function<void(const Tensor&)> on_state, on_s0_grad;
  if (opt.on_final_state) on_state = [&opt](const Tensor& s) { opt.on_final_state({s}); };
  if (opt.on_initial_state_grad) on_s0_grad = [f = opt.on_initial_state_grad](const Tensor& d) { f({d}); };
  auto out = Rwkv7Op::apply(in.q, in.k, in.v, in.gk, in.a, in.b, s0, opt.scale_for(dk), on_state, on_s0_grad);
  return {out[0], {out[1]}};
}

}  // namespace carry
