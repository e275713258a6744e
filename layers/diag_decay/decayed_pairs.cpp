// Token pairs under a decay per key dimension (decayed_pairs.h states the method).
#include "layers/diag_decay/decayed_pairs.h"

#include "layers/layout.h"

#include <limits>

namespace carry {

std::vector<Tensor> decayed_pairs(const Tensor& x, const Tensor& X, const std::vector<Tensor>& ys, const Tensor& G,
                                  bool strict, int64_t block) {
  TORCH_CHECK(x.dim() >= 2 && X.sizes() == x.sizes() && G.sizes() == x.sizes(),
              "decayed_pairs: x, X and G must be [..., C, dk] of one shape, got ", shape_str(x.sizes()), ", ",
              shape_str(X.sizes()), " and ", shape_str(G.sizes()));
  for (const Tensor& y : ys)
    TORCH_CHECK(y.sizes() == x.sizes(), "decayed_pairs: y must have x's shape ", shape_str(x.sizes()), ", got ",
                shape_str(y.sizes()));
  const int64_t C = x.size(-2), dk = x.size(-1);
  const double inf = std::numeric_limits<double>::infinity();
  const auto opt = x.options();
  std::vector<Tensor> out;
  if (block <= 0 || block >= C || C % block != 0) {
    auto drop = causal_mask(C, strict, opt).logical_not().unsqueeze(-1);  // [C,C,1]
    Tensor xE = x.unsqueeze(-2) * (X.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(drop, -inf).exp();
    for (const Tensor& y : ys) out.push_back((xE * y.unsqueeze(-3)).sum(-1));
    return out;
  }
  const int64_t c = block, nb = C / c;
  const std::vector<int64_t> lead(x.sizes().begin(), x.sizes().end() - 2);
  auto shaped = [&](const Tensor& t, std::initializer_list<int64_t> tail) {
    std::vector<int64_t> s = lead;
    s.insert(s.end(), tail);
    return t.reshape(s);
  };
  const Tensor xb = shaped(x, {nb, c, dk}), Xb = shaped(X, {nb, c, dk}), Gb = shaped(G, {nb, c, dk});
  // Inside each block: pairwise, x_td e^{X_td − G_sd} formed once.
  auto drop_in = causal_mask(c, strict, opt).logical_not().unsqueeze(-1);  // [c,c,1]
  Tensor xE = xb.unsqueeze(-2) * (Xb.unsqueeze(-2) - Gb.unsqueeze(-3)).masked_fill(drop_in, -inf).exp();
  // Across blocks: R for row block i is G at token i·c − 1 (row block 0 has no earlier token: its
  // factors are masked to zero).
  Tensor last = Gb.select(-2, c - 1);                                              // [..., nb, dk]
  Tensor R = at::cat({last.narrow(-2, 0, 1), last.narrow(-2, 0, nb - 1)}, -2);     // [..., nb, dk]
  auto lopt = opt.dtype(at::kLong);
  Tensor first = (at::arange(nb, lopt) == 0).view({nb, 1, 1});                     // [nb,1,1]
  Tensor rows = xb * (Xb - R.unsqueeze(-2)).masked_fill(first, -inf).exp();        // [..., nb, c, dk]
  Tensor later = (at::arange(C, lopt).view({1, C}) >= (at::arange(nb, lopt) * c).view({nb, 1})).unsqueeze(-1);
  Tensor to_R = (R.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(later, -inf).exp();  // [..., nb, C, dk]
  Tensor block_eye = at::eye(nb, opt).view({nb, 1, nb, 1});
  for (const Tensor& y : ys) {
    Tensor inside = (xE * shaped(y, {nb, c, dk}).unsqueeze(-3)).sum(-1);                       // [..., nb, c, c]
    Tensor across = shaped(at::matmul(rows, (y.unsqueeze(-3) * to_R).transpose(-1, -2)), {nb, c, nb, c});
    out.push_back(shaped(across + inside.unsqueeze(-2) * block_eye, {C, C}));  // across is zero on s ≥ i·c
  }
  return out;
}

Tensor decayed_pairs(const Tensor& x, const Tensor& X, const Tensor& y, const Tensor& G, bool strict,
                     int64_t block) {
  return decayed_pairs(x, X, std::vector<Tensor>{y}, G, strict, block)[0];
}

}  // namespace carry
