// The token pairs of a chunk under a decay per key dimension, the intra-chunk matrix that GLA, KDA and
// RWKV-7's chunkwise forms share:
//   P[t, s] = Σ_d x_td y_sd e^{X_td − G_sd}   on the kept pairs s ≤ t (strict: s < t), 0 above,
// with G the cumulative log decay of the chunk (non-increasing along it) and X = G (or G⁻ = G − gk, the
// decay through t − 1, with strict). Every factor is a decay over tokens of the chunk, so nothing
// overflows whatever the gates:
// - inside blocks of `block` tokens, pairwise: e^{X_td − G_sd} over a [block, block, dk] tensor, the
//   difference masked before the exp;
// - across blocks, two factors through the cumulative decay R at the token before row block i starts,
//   P[t, s] = Σ_d (x_td e^{X_td − R_d}) (y_sd e^{R_d − G_sd}) for s before the block: both exponents are
//   ≤ 0, and the sum is one matrix product a row block.
// So the chunk costs C·block·dk pairwise terms instead of C²·dk, and the rest is matrix products.
// x, X [..., C, dk] (rows t), y, G [..., C, dk] (columns s), one dtype; returns [..., C, C]. A chunk of
// at most `block` tokens, or one that `block` does not divide, is one block.
#pragma once

#include "layers/mixer.h"

namespace carry {

inline constexpr int64_t kDecayedPairsBlock = 8;

Tensor decayed_pairs(const Tensor& x, const Tensor& X, const Tensor& y, const Tensor& G, bool strict,
                     int64_t block = kDecayedPairsBlock);
// The pairs of one x with several y (the decays and the row factors formed once): {P(x, ys[0]), ...}.
std::vector<Tensor> decayed_pairs(const Tensor& x, const Tensor& X, const std::vector<Tensor>& ys, const Tensor& G,
                                  bool strict, int64_t block = kDecayedPairsBlock);

}  // namespace carry
