// KDA's chunk in closed form (kda.h states it).
#include "layers/kda/kda.h"

#include "layers/diag_decay/decayed_pairs.h"
#include "layers/layout.h"

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
  // Σ_d x_td k_sd e^{G_td − G_sd} on s ≤ t (s < t for KA): layers/diag_decay/decayed_pairs.h.
  Tensor QA = decayed_pairs(q, G, k, G, /*strict=*/false) * scale;
  Tensor KA = decayed_pairs(k, G, k, G, /*strict=*/true);
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
