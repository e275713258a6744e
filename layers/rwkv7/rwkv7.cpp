// The diagonal-plus-rank-one chunk in closed form (rwkv7.h states it).
#include "layers/rwkv7/rwkv7.h"

#include "layers/diag_decay/decayed_pairs.h"
#include "layers/layout.h"

namespace carry {

DeltaChunkPieces dplr_chunk(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& a, const Tensor& b,
                            const Tensor& gk, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && a.sizes() == q.sizes() && b.sizes() == q.sizes() &&
                  gk.sizes() == q.sizes(),
              "dplr_chunk: q, k, a, b and gk must be [B,H,C,dk] of one shape, got ", shape_str(q.sizes()), ", ",
              shape_str(k.sizes()), ", ", shape_str(a.sizes()), ", ", shape_str(b.sizes()), " and ",
              shape_str(gk.sizes()));
  const int64_t B = q.size(0), H = q.size(1), C = q.size(2);
  TORCH_CHECK(v.dim() == 4 && v.size(0) == B && v.size(1) == H && v.size(2) == C,
              "dplr_chunk: v must be [", B, ", ", H, ", ", C, ", dv], got ", shape_str(v.sizes()));
  const auto opt = q.options();
  Tensor G = gk.cumsum(2);  // through t            [B,H,C,dk]
  Tensor Gm = G - gk;       // through t − 1
  // Σ_d x_td y_sd e^{X_td − G_sd} on the kept pairs: layers/diag_decay/decayed_pairs.h.
  auto from_a = decayed_pairs(a, Gm, {b, k}, G, /*strict=*/true);
  auto from_q = decayed_pairs(q, G, {b, k}, G, /*strict=*/false);
  Tensor AB = from_a[0], AK = from_a[1];
  Tensor QB = from_q[0] * scale, QK = from_q[1] * scale;
  auto eye_c = at::eye(C, opt);
  Tensor T = at::linalg_solve_triangular(eye_c - AB, eye_c.expand_as(AB), /*upper=*/false, /*left=*/true,
                                         /*unitriangular=*/true);
  Tensor A_in = a * Gm.exp();
  Tensor TA = at::matmul(T, A_in), TK = at::matmul(T, AK);  // U = TA·S_in + TK·V
  Tensor G_last = G.select(2, C - 1);                         // [B,H,dk]
  Tensor to_end = (G_last.unsqueeze(2) - G).exp();
  Tensor b_out = (b * to_end).transpose(-1, -2), k_out = (k * to_end).transpose(-1, -2);  // [B,H,dk,C]

  DeltaChunkPieces p;
  p.mixing = QK + at::matmul(QB, TK);
  p.query_state = q * G.exp() * scale + at::matmul(QB, TA);
  p.transport = at::diag_embed(G_last.exp()) + at::matmul(b_out, TA);
  p.value_state = k_out + at::matmul(b_out, TK);
  p.state = at::matmul(p.value_state, v);
  return p;
}

}  // namespace carry
