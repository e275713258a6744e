// KDA's kernel form (kernel_form.h states the algorithm).
#include "layers/kda/kernel_form.h"

#include "layers/diag_decay/decayed_pairs.h"
#include "layers/kda/chunk_layout.h"
#include "layers/kernels/primitives/state_grad_hook.h"
#include "layers/layout.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#ifdef CARRY_WITH_CUDA
#include "layers/kernels/kda/api.h"
#endif

namespace carry {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using namespace chunk_layout;

// The chunk pieces of kernel_form.h from chunked q, k, gk [B,H,N,C,dk], v [B,H,N,C,dv], beta [B,H,N,C].
struct Pieces {
  Tensor G, G_last, QA, KA, T, M, K_in, W, U, K_out, Q_s, decay;
};
Pieces pieces(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& gk, const Tensor& beta, double scale) {
  Pieces p;
  const int64_t C = q.size(-2);
  p.G = gk.cumsum(-2);
  p.G_last = p.G.select(-2, C - 1);  // [B,H,N,dk]
  p.QA = decayed_pairs(q, p.G, k, p.G, /*strict=*/false) * scale;
  p.KA = decayed_pairs(k, p.G, k, p.G, /*strict=*/true);
  auto eye = at::eye(C, q.options());
  p.T = at::linalg_solve_triangular(eye + p.KA * beta.unsqueeze(-1), eye.expand_as(p.KA), /*upper=*/false,
                                    /*left=*/true, /*unitriangular=*/true);
  p.M = p.T * beta.unsqueeze(-2);
  p.K_in = k * p.G.exp();
  p.W = at::matmul(p.M, p.K_in);
  p.U = at::matmul(p.M, v);
  p.K_out = k * (p.G_last.unsqueeze(-2) - p.G).exp();
  p.Q_s = q * p.G.exp() * scale;
  p.decay = p.G_last.exp();
  return p;
}

Tensor dense(const Tensor& t) { return t.contiguous(); }

struct KdaOp : public torch::autograd::Function<KdaOp> {
  // Returns {o, final_state}.
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& gk, const Tensor& beta, const Tensor& s0, double scale, int64_t C,
                               const std::function<void(const Tensor&)>& on_final_state,
                               const std::function<void(const Tensor&)>& on_initial_state_grad) {
    const auto dt = work_dtype(q);
    Tensor qc = chunked(q, C, dt), kc = chunked(k, C, dt), vc = chunked(v, C, dt), gc = chunked(gk, C, dt),
           bc = chunked(beta, C, dt);
    Pieces p = pieces(qc, kc, vc, gc, bc, scale);
    KdaWalk walk = kda_walk(dense(p.W), dense(p.U), dense(p.K_out), dense(p.decay), s0.to(dt).contiguous());
    if (on_final_state) on_final_state(walk.final_state);
    Tensor o = at::matmul(p.Q_s, walk.states) + at::matmul(p.QA, walk.v_new);
    ctx->save_for_backward({q, k, v, gk, beta, walk.states, walk.v_new});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["chunk"] = C;
    carry::kernels::primitives::keep_state_grad_hook(ctx, on_initial_state_grad);
    return {unchunked(o, q.scalar_type()), walk.final_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const Tensor &q = s[0], &k = s[1], &v = s[2], &gk = s[3], &beta = s[4], &H = s[5], &V_new = s[6];
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t C = ctx->saved_data["chunk"].toInt();
    const auto dt = work_dtype(q);
    const int64_t B = q.size(0), Hh = q.size(2), Dk = q.size(3), Dv = v.size(3);
    Tensor qc = chunked(q, C, dt), kc = chunked(k, C, dt), vc = chunked(v, C, dt), gc = chunked(gk, C, dt),
           bc = chunked(beta, C, dt);
    Tensor dO = grads[0].defined() ? chunked(grads[0], C, dt) : at::zeros_like(V_new);
    Tensor dS_final = grads[1].defined() ? grads[1].to(dt).contiguous()
                                         : at::zeros({B, Hh, Dk, Dv}, q.options().dtype(dt));
    Pieces p = pieces(qc, kc, vc, gc, bc, scale);
    Tensor dv_pre = at::matmul(t_(p.QA), dO);
    KdaReverseWalk r = kda_reverse_walk(dense(p.Q_s), dense(dO), dense(p.W), dense(p.K_out), dense(p.decay),
                                        dense(dv_pre), dS_final);
    if (auto hook = carry::kernels::primitives::state_grad_hook(ctx)) hook(r.initial_grad);
    const Tensor& dS = r.out_grads;    // [B,H,N,dk,dv]: the state leaving each chunk
    const Tensor& dVn = r.v_new_grads;  // [B,H,N,C,dv]

    const auto opt = qc.options();
    Tensor incl = causal_mask(C, /*strict=*/false, opt), strict = causal_mask(C, /*strict=*/true, opt);
    Tensor dQA = at::matmul(dO, t_(V_new)) * incl;
    Tensor dQ_s = at::matmul(dO, t_(H));
    Tensor dq = dQ_s * p.G.exp() * scale;
    Tensor dG = dQ_s * p.Q_s;
    Tensor dG_last = (dS * H).sum(-1) * p.decay;
    Tensor dK_out = at::matmul(V_new, t_(dS));
    Tensor dk = dK_out * (p.G_last.unsqueeze(-2) - p.G).exp();
    Tensor out_terms = dK_out * p.K_out;
    dG = dG - out_terms;
    dG_last = dG_last + out_terms.sum(-2);
    Tensor dW = -at::matmul(dVn, t_(H));
    Tensor dM = (at::matmul(dVn, t_(vc)) + at::matmul(dW, t_(p.K_in))) * incl;
    Tensor dvc = at::matmul(t_(p.M), dVn);
    Tensor dK_in = at::matmul(t_(p.M), dW);
    dk = dk + dK_in * p.G.exp();
    dG = dG + dK_in * p.K_in;
    Tensor dT = dM * bc.unsqueeze(-2);
    Tensor dbeta = (dM * p.T).sum(-2);
    Tensor dL = -at::matmul(at::matmul(t_(p.T), dT), t_(p.T)) * strict;
    Tensor dKA = dL * bc.unsqueeze(-1);
    dbeta = dbeta + (dL * p.KA).sum(-1);
    {  // the pairs' gradients: decayed_pairs differentiated on a local graph
      at::AutoGradMode grad_on(true);
      Tensor qg = qc.detach().requires_grad_(true), kg = kc.detach().requires_grad_(true),
             Gg = p.G.detach().requires_grad_(true);
      Tensor QA = decayed_pairs(qg, Gg, kg, Gg, /*strict=*/false) * scale;
      Tensor KA = decayed_pairs(kg, Gg, kg, Gg, /*strict=*/true);
      auto d = torch::autograd::grad({QA, KA}, {qg, kg, Gg}, {dQA, dKA});
      dq = dq + d[0];
      dk = dk + d[1];
      dG = dG + d[2];
    }
    dG.select(-2, C - 1).add_(dG_last);
    Tensor dgk = dG.flip(-2).cumsum(-2).flip(-2);
    return {unchunked(dq, q.scalar_type()),
            unchunked(dk, k.scalar_type()),
            unchunked(dvc, v.scalar_type()),
            unchunked(dgk, gk.scalar_type()),
            from_bhtd(merge_chunks(dbeta)).to(beta.scalar_type()),
            r.initial_grad,
            Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

bool kda_kernel_supports(const MixerInputs& in, const MixerOptions& opt) {
  if (!in.q.defined() || !in.v.defined() || !in.q.is_cuda() || in.q.dim() != 4 || in.v.dim() != 4) return false;
  const auto dt = in.q.scalar_type();
  const int64_t dk = in.q.size(3), dv = in.v.size(3);
  return (dt == at::kBFloat16 || dt == at::kFloat) && (dk == 64 || dk == 128) && dv % 16 == 0 && dv <= 256 &&
         opt.chunk_size == 64;
}

MixerOutput kda_kernel_form(const MixerInputs& in, const Tensor& initial_state, const MixerOptions& opt) {
  const int64_t B = in.q.size(0), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3);
  const auto dt = work_dtype(in.q);
  Tensor s0 = initial_state.defined() ? initial_state.to(dt) : at::zeros({B, H, dk, dv}, in.q.options().dtype(dt));
  std::function<void(const Tensor&)> on_state, on_s0_grad;
  if (opt.on_final_state) on_state = [&opt](const Tensor& s) { opt.on_final_state({s}); };
  // Called in the backward, after this function returned: it holds its own copy of the caller's hook.
  if (opt.on_initial_state_grad) on_s0_grad = [f = opt.on_initial_state_grad](const Tensor& d) { f({d}); };
  auto out = KdaOp::apply(in.q, in.k, in.v, in.gk, in.beta, s0, opt.scale_for(dk), opt.chunk_size, on_state,
                          on_s0_grad);
  return {out[0], {out[1]}};
}

KdaWalk kda_walk(const Tensor& w, const Tensor& u, const Tensor& k_out, const Tensor& decay, const Tensor& s0) {
#ifdef CARRY_WITH_CUDA
  if (w.is_cuda()) {
    auto r = carry::kernels::kda::walk_fwd(w, u, k_out, decay, s0);
    return {r[0], r[1], r[2]};
  }
#endif
  const int64_t N = w.size(2);
  std::vector<Tensor> states, v_new;
  Tensor S = s0;
  for (int64_t n = 0; n < N; ++n) {
    states.push_back(S);
    Tensor vn = u.select(2, n) - at::matmul(w.select(2, n), S);
    S = decay.select(2, n).unsqueeze(-1) * S + at::matmul(t_(k_out.select(2, n)), vn);
    v_new.push_back(vn);
  }
  return {at::stack(states, 2), at::stack(v_new, 2), S};
}

KdaReverseWalk kda_reverse_walk(const Tensor& q_s, const Tensor& d_o, const Tensor& w, const Tensor& k_out,
                                const Tensor& decay, const Tensor& dv_pre, const Tensor& d_final) {
#ifdef CARRY_WITH_CUDA
  if (w.is_cuda()) {
    auto r = carry::kernels::kda::walk_bwd(q_s, d_o, w, k_out, decay, dv_pre, d_final);
    return {r[0], r[1], r[2]};
  }
#endif
  const int64_t N = w.size(2);
  std::vector<Tensor> out_grads(N), v_new_grads(N);
  Tensor dS = d_final;
  for (int64_t n = N - 1; n >= 0; --n) {
    out_grads[n] = dS;
    Tensor dvn = dv_pre.select(2, n) + at::matmul(k_out.select(2, n), dS);
    dS = decay.select(2, n).unsqueeze(-1) * dS + at::matmul(t_(q_s.select(2, n)), d_o.select(2, n)) -
         at::matmul(t_(w.select(2, n)), dvn);
    v_new_grads[n] = dvn;
  }
  return {at::stack(out_grads, 2), at::stack(v_new_grads, 2), dS};
}

}  // namespace carry
