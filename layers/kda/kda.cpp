// KDA's chunk in closed form (kda.h states it).
#include "layers/kda/kda.h"

#include "layers/layout.h"

#include <limits>

namespace carry {

DeltaChunkPieces kda_chunk(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, const Tensor& gk,
                           double scale) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && gk.sizes() == q.sizes(),
              "kda_chunk: q, k and gk must be [B,H,C,dk] of one shape, got ", shape_str(q.sizes()), ", ",
              shape_str(k.sizes()), " and ", shape_str(gk.sizes()));
  const int64_t B = q.size(0), H = q.size(1), C = q.size(2);
  TORCH_CHECK(v.dim() == 4 && v.size(0) == B && v.size(1) == H && v.size(2) == C,
              "kda_chunk: v must be [", B, ", ", H, ", ", C, ", dv], got ", shape_str(v.sizes()));
  TORCH_CHECK(beta.sizes() == at::IntArrayRef({B, H, C}), "kda_chunk: beta must be [", B, ", ", H, ", ", C,
              "], got ", shape_str(beta.sizes()));
  const auto opt = q.options();
  Tensor G = gk.cumsum(2);                                                            // [B,H,C,dk]
  // E[t,s,d] = e^{G_td − G_sd} for s ≤ t, 0 above the diagonal (−inf before the exp: no inf, no NaN).
  auto above = causal_mask(C, /*strict=*/false, opt).logical_not().unsqueeze(-1);      // [C,C,1]
  auto E = (G.unsqueeze(3) - G.unsqueeze(2)).masked_fill(above, -std::numeric_limits<double>::infinity()).exp();
  auto pairs = [&](const Tensor& x) { return (x.unsqueeze(3) * k.unsqueeze(2) * E).sum(-1); };  // [B,H,C,C]
  Tensor QA = pairs(q) * scale;
  Tensor KA = pairs(k).tril(-1);
  auto eye_c = at::eye(C, opt);
  auto L = KA * beta.unsqueeze(-1);
  auto T = at::linalg_solve_triangular(eye_c + L, eye_c.expand_as(L), /*upper=*/false, /*left=*/true,
                                       /*unitriangular=*/true);
  auto T_beta = T * beta.unsqueeze(-2);                                               // T·diag(β)
  auto W = at::matmul(T_beta, k * G.exp());                                           // T·diag(β)·K_in
  auto G_last = G.select(2, C - 1);                                                   // [B,H,dk]
  auto k_out = k * (G_last.unsqueeze(2) - G).exp();                                   // K_out

  DeltaChunkPieces p;
  p.mixing = at::matmul(QA, T_beta);
  p.query_state = q * G.exp() * scale - at::matmul(QA, W);
  p.transport = at::diag_embed(G_last.exp()) - at::matmul(k_out.transpose(-1, -2), W);
  p.value_state = at::matmul(k_out.transpose(-1, -2), T_beta);
  p.state = at::matmul(p.value_state, v);
  return p;
}

}  // namespace carry
