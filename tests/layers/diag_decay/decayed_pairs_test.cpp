// decayed_pairs (layers/diag_decay/decayed_pairs.h): the blocked form (pairwise inside 8-token blocks,
// matrix products across them) against the definition written here entry by entry in fp64, for chunks of
// 8 to 128 tokens (36: a chunk the block does not divide), the strict and the inclusive pairs, X = G and X = G − gk, gates with half-lives from
// 0.05 to 10^5 tokens a key dimension; the gradients of all four inputs against the pairwise form's
// (block 0); finite values and gradients in fp32 when the cumulative decay falls to −6400 over a chunk
// (where e^{−G} alone would overflow).
#include "layers/diag_decay/decayed_pairs.h"

#include <gtest/gtest.h>

#include <cmath>

namespace carry {
namespace {

struct PairsCase {
  Tensor x, y, gk, G;
};

PairsCase make(int64_t H, int64_t C, int64_t dk, double min_half_life, uint64_t seed, at::ScalarType dt = at::kDouble) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto o = at::TensorOptions().dtype(at::kDouble);
  PairsCase c;
  c.x = at::randn({2, H, C, dk}, gen, o);
  c.y = at::randn({2, H, C, dk}, gen, o);
  const double lo = std::log(min_half_life), hi = std::log(1e5);
  c.gk = -std::log(2.0) / at::exp(at::rand({2, H, C, dk}, gen, o) * (hi - lo) + lo);
  c.G = c.gk.cumsum(2);
  c.x = c.x.to(dt), c.y = c.y.to(dt), c.gk = c.gk.to(dt), c.G = c.G.to(dt);
  return c;
}

double rel(const Tensor& a, const Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-300);
}

TEST(DecayedPairs, BlockedEqualsTheDefinition) {
  for (int64_t C : {8, 16, 32, 48, 64, 128, 36}) {
    for (bool strict : {false, true}) {
      PairsCase c = make(2, C, 8, 0.05, 7 + C);
      Tensor X = strict ? c.G - c.gk : c.G;
      Tensor got = decayed_pairs(c.x, X, c.y, c.G, strict);
      Tensor want = at::zeros({2, 2, C, C}, c.x.options());
      auto xa = c.x.accessor<double, 4>(), ya = c.y.accessor<double, 4>(), Xa = X.accessor<double, 4>(),
           Ga = c.G.accessor<double, 4>();
      auto wa = want.accessor<double, 4>();
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t t = 0; t < C; ++t)
            for (int64_t s = 0; s < (strict ? t : t + 1); ++s) {
              double sum = 0;
              for (int64_t d = 0; d < 8; ++d) sum += xa[b][h][t][d] * ya[b][h][s][d] * std::exp(Xa[b][h][t][d] - Ga[b][h][s][d]);
              wa[b][h][t][s] = sum;
            }
      double e = rel(got, want);
      std::printf("[ errors   ] decayed_pairs C=%ld %s: %.3e\n", static_cast<long>(C), strict ? "strict" : "inclusive", e);
      EXPECT_LT(e, 1e-13) << "C=" << C << " strict=" << strict;
      // Above the kept pairs: exactly zero.
      auto drop = at::ones({C, C}, at::kBool).triu(strict ? 0 : 1);
      EXPECT_EQ(got.masked_select(drop).abs().max().item<double>(), 0.0);
    }
  }
}

TEST(DecayedPairs, GradientsEqualThePairwiseForm) {
  for (bool strict : {false, true}) {
    PairsCase c = make(3, 64, 16, 0.5, 21 + strict);
    auto run = [&](int64_t block) {
      Tensor x = c.x.clone().requires_grad_(), y = c.y.clone().requires_grad_(), gk = c.gk.clone().requires_grad_();
      Tensor G = gk.cumsum(2);
      Tensor X = strict ? G - gk : G;
      Tensor P = decayed_pairs(x, X, y, G, strict, block);
      auto w = at::sin(at::arange(P.numel(), P.options()).view(P.sizes()));  // a fixed cotangent
      (P * w).sum().backward();
      return std::vector<Tensor>{P.detach(), x.grad(), y.grad(), gk.grad()};
    };
    auto blocked = run(kDecayedPairsBlock), pairwise = run(0);
    const char* names[] = {"P", "dx", "dy", "dgk"};
    for (size_t i = 0; i < 4; ++i) {
      double e = rel(blocked[i], pairwise[i]);
      std::printf("[ errors   ] decayed_pairs %s %s blocked vs pairwise: %.3e\n", strict ? "strict" : "inclusive", names[i], e);
      EXPECT_LT(e, 1e-12) << names[i];
    }
  }
}

TEST(DecayedPairs, FiniteWhenTheChunkDecaysFarInFp32) {
  // gk down to −100 a token: G reaches −6400 over 64 tokens (e^{6400} overflows any float).
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto o = at::TensorOptions().dtype(at::kFloat);
  Tensor x = at::randn({1, 2, 64, 8}, gen, o).requires_grad_(), y = at::randn({1, 2, 64, 8}, gen, o).requires_grad_();
  Tensor gk = (-100.0 * at::rand({1, 2, 64, 8}, gen, o)).requires_grad_();
  Tensor G = gk.cumsum(2);
  Tensor P = decayed_pairs(x, G, y, G, /*strict=*/false);
  P.sum().backward();
  EXPECT_TRUE(at::isfinite(P).all().item<bool>());
  for (const Tensor& g : {x.grad(), y.grad(), gk.grad()}) EXPECT_TRUE(at::isfinite(g).all().item<bool>());
  // The diagonal is Σ_d x_td y_td exactly (e^0).
  EXPECT_LT(rel(P.detach().diagonal(0, -2, -1), (x * y).sum(-1).detach()), 1e-6);
}

}  // namespace
}  // namespace carry
