// Tests of layers/linear_attn/performer.*: the random features (orthogonal blocks, chi-distributed row
// norms, Gaussian entries, the same bits from the same seed, regenerated rather than stored); the
// stabilizers (they cancel exactly in the causal normalized form, a per-token key stabilizer would not,
// and they keep fp32 finite where the plain formula overflows); the estimator against exact causal
// softmax attention, with the plausible wrong variants failing the same bound; and the linear_attn layer
// with feature_map "performer" against an independent fp64 computation of its formula.
#include "layers/linear_attn/performer.h"

#include "layers/blocks/mixer_layer.h"
#include "layers/mixer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <vector>

namespace carry {
namespace {

Tensor randn(at::IntArrayRef shape, uint64_t seed, at::ScalarType dt = at::kDouble) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kDouble)).to(dt);
}

double rel(const Tensor& a, const Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-300);
}

// φ(x) = exp(ωᵀx − ‖x‖²/2)/√m with no stabilizer, the formula as the paper writes it.
Tensor plain_features(const Tensor& x, const Tensor& w) {
  auto wt = w.to(x.scalar_type());
  return at::exp(at::matmul(x, wt.t()) - x.pow(2).sum(-1, true) / 2) / std::sqrt(static_cast<double>(w.size(0)));
}

// Normalized causal linear attention by the family's chunkwise form, φ's given: [B,T,H,m] and v [B,T,H,dv].
Tensor normalized_linear_attention(const Tensor& fq, const Tensor& fk, const Tensor& v, double eps = 0) {
  MixerInputs in;
  in.q = fq, in.k = fk, in.v = v;
  MixerOptions opt;
  opt.normalize = true;
  opt.eps = eps;
  opt.scale = 1.0;
  opt.chunk_size = 16;
  return get_mixer("linear_attn").chunkwise(in, {}, opt).o;
}

// Exact causal softmax attention with logits qᵀk (no scale): q, k [B,T,H,d], v [B,T,H,dv].
Tensor causal_softmax_attention(const Tensor& q, const Tensor& k, const Tensor& v) {
  auto qh = q.transpose(1, 2), kh = k.transpose(1, 2), vh = v.transpose(1, 2);
  auto s = at::matmul(qh, kh.transpose(-1, -2));
  const int64_t T = q.size(1);
  auto future = at::ones({T, T}, at::TensorOptions().dtype(at::kBool)).triu(1);
  s = s.masked_fill(future, -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(s, -1), vh).transpose(1, 2);
}

TEST(Performer, FeaturesAreOrthogonalBlocksWithChiNorms) {
  const int64_t m = 40, d = 16;  // blocks of 16, 16 and 8 rows
  auto w = performer_random_features(m, d, 3);
  ASSERT_EQ(w.sizes(), (std::vector<int64_t>{m, d}));
  EXPECT_EQ(w.scalar_type(), at::kDouble);
  auto norms = w.norm(2, -1, true);
  auto cos = at::matmul(w / norms, (w / norms).t());
  double within = 0, across = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < m; ++j) {
      if (i == j) continue;
      double c = std::abs(cos[i][j].item<double>());
      if (i / d == j / d) within = std::max(within, c);
      else across = std::max(across, c);
    }
  std::printf("[ features ] largest |cos| within a block %.2e, across blocks %.3f\n", within, across);
  EXPECT_LE(within, 1e-13) << "rows of a block are not orthogonal";
  EXPECT_GT(across, 0.05) << "independent blocks should not be orthogonal to each other";
  // The norms follow chi(d), not a constant: unit rows would be a different (wrong) estimator.
  EXPECT_GT((norms.std() / norms.mean()).item<double>(), 0.05);

  // Statistics over many rows: every entry is marginally N(0, 1), so E‖ω‖² = d and P(|ω_ij| < 1) = 0.6827.
  auto big = performer_random_features(4096, d, 4);
  const double mean_sq = big.pow(2).sum(-1).mean().item<double>();
  const double inside = (big.abs() < 1).to(at::kDouble).mean().item<double>();
  const double var_sq = big.pow(2).sum(-1).var().item<double>();  // chi²_d: 2d
  std::printf("[ features ] 4096 rows, d=16: mean |w|^2 %.3f (16), var %.2f (32), P(|w_ij|<1) %.4f (0.6827)\n",
              mean_sq, var_sq, inside);
  EXPECT_NEAR(mean_sq, d, 0.5);
  EXPECT_NEAR(var_sq, 2 * d, 4.0);
  EXPECT_NEAR(inside, 0.6827, 0.01);
}

TEST(Performer, TheSeedFixesTheFeatures) {
  auto a = performer_random_features(96, 32, 7), b = performer_random_features(96, 32, 7);
  EXPECT_TRUE(at::equal(a, b));
  EXPECT_FALSE(at::equal(a, performer_random_features(96, 32, 8)));
  EXPECT_NE(performer_layer_seed(0, 0), performer_layer_seed(0, 1));
  EXPECT_NE(performer_layer_seed(0, 0), performer_layer_seed(1, 0));

  // Two layers from the same spec give the same bits whatever the parameter draw's order around them;
  // another feature seed or another layer index gives other features.
  auto spec = [](uint64_t feature_seed, int64_t layer) {
    MixerLayerSpec s;
    s.kind = "linear_attn";
    s.d_model = 16, s.n_heads = 2, s.head_dim_k = 8, s.head_dim_v = 8, s.chunk_size = 8;
    s.feature_map = "performer", s.num_features = 16, s.feature_seed = feature_seed, s.layer = layer;
    s.init_std = 0.3;
    return s;
  };
  auto x = randn({1, 16, 16}, 1);
  auto output = [&](const MixerLayerSpec& s) {
    ParameterInit init(5, at::TensorOptions().dtype(at::kDouble));
    return MixerLayer(s, init).forward(x).y;
  };
  auto y = output(spec(5, 2));
  EXPECT_TRUE(at::equal(y, output(spec(5, 2))));
  EXPECT_GT(rel(output(spec(6, 2)), y), 1e-3);
  EXPECT_GT(rel(output(spec(5, 3)), y), 1e-3);
  // Not parameters: the same list as with elu + 1 (nothing for the optimizer or the checkpoint).
  ParameterInit i1(5, at::TensorOptions().dtype(at::kDouble)), i2(5, at::TensorOptions().dtype(at::kDouble));
  auto elu = spec(5, 2);
  elu.feature_map = "elu";
  auto p1 = MixerLayer(spec(5, 2), i1).parameters(), p2 = MixerLayer(elu, i2).parameters();
  ASSERT_EQ(p1.size(), p2.size());
  for (size_t i = 0; i < p1.size(); ++i) EXPECT_EQ(p1[i].first, p2[i].first);
}

// In fp64: the query's per-token and the keys' shared stabilizer leave the normalized causal output as the
// plain formula gives it; a per-token key stabilizer (each key's features divided by their own largest)
// does not. The features are token-local: a slice's are the whole sequence's (to rounding).
TEST(Performer, StabilizersCancelInTheNormalizedCausalForm) {
  const int64_t B = 2, T = 64, H = 2, d = 16, m = 64, dv = 8;
  auto w = performer_random_features(m, d, 11);
  auto q = randn({B, T, H, d}, 1) * 0.7, k = randn({B, T, H, d}, 2) * 0.7, v = randn({B, T, H, dv}, 3);
  // A larger d makes the key shift positive; with d = 16 it is 0 unless forced, so force one too.
  for (double shift : {performer_key_shift(w), 3.5}) {
    auto fq = performer_feature_map(q, w, /*is_query=*/true, 0), fk = performer_feature_map(k, w, false, shift);
    auto plain = normalized_linear_attention(plain_features(q, w), plain_features(k, w), v);
    auto stabilized = normalized_linear_attention(fq, fk, v);
    auto pk = plain_features(k, w);
    auto per_token = normalized_linear_attention(fq, pk / std::get<0>(pk.max(-1, true)), v);
    const double e = rel(stabilized, plain), e_wrong = rel(per_token, plain);
    std::printf("[ errors   ] performer stabilizers, key shift %.2f: %.2e; per-token key stabilizer %.2e\n", shift,
                e, e_wrong);
    EXPECT_LE(e, 1e-12);
    EXPECT_GT(e_wrong, 1e-3);
    EXPECT_LE(fq.max().item<double>(), 1 / std::sqrt(double(m)) * (1 + 1e-15));
    // Another rank's slice: its features depend on its own tokens only (the stabilizers are per token or
    // constant). To rounding, not to the bit: a matrix product's blocking may depend on the number of rows
    // (MKL on AVX-512 machines); the ordered scan's bits rest on segments, which cut the one-rank run alike.
    auto q2 = q.narrow(1, 40, 24).contiguous(), k2 = k.narrow(1, 40, 24).contiguous();
    EXPECT_LE(rel(performer_feature_map(q2, w, true, 0), fq.narrow(1, 40, 24)), 1e-14);
    EXPECT_LE(rel(performer_feature_map(k2, w, false, shift), fk.narrow(1, 40, 24)), 1e-14);
  }
  // The key shift: max_j ‖ω_j‖²/2 less the headroom, never negative.
  auto wide = performer_random_features(128, 128, 12);
  const double top = wide.pow(2).sum(-1).max().item<double>() / 2;
  EXPECT_DOUBLE_EQ(performer_key_shift(wide), top - kPerformerKeyHeadroom);
  EXPECT_EQ(performer_key_shift(w), std::max(0.0, w.pow(2).sum(-1).max().item<double>() / 2 - kPerformerKeyHeadroom));
}

// In fp32 with d = m = 128: queries and keys along the longest feature make the plain features' products
// exceed fp32's range (the plain form gives inf/NaN); the stabilized features give the fp64 result.
TEST(Performer, StabilizedFeaturesStayFiniteWhereThePlainOnesOverflow) {
  const int64_t T = 64, d = 128, m = 128, dv = 8;
  auto w = performer_random_features(m, d, 13);
  const int64_t top = w.pow(2).sum(-1).argmax().item<int64_t>();
  auto q = randn({1, T, 1, d}, 4) * 0.5, k = randn({1, T, 1, d}, 5) * 0.5, v = randn({1, T, 1, dv}, 6);
  for (int64_t t = 3; t < T; t += 8) {
    q.select(1, t).select(1, 0).copy_(w[top] * 1.01);
    k.select(1, t - 1).select(1, 0).copy_(w[top]);
  }
  const double shift = performer_key_shift(w);
  ASSERT_GT(shift, 0) << "the longest of 128 features of width 128 has |w|^2/2 > 40";
  auto ref = normalized_linear_attention(plain_features(q, w), plain_features(k, w), v);  // fp64
  auto q32 = q.to(at::kFloat), k32 = k.to(at::kFloat), v32 = v.to(at::kFloat);
  auto plain32 = normalized_linear_attention(plain_features(q32, w), plain_features(k32, w), v32);
  auto stab32 = normalized_linear_attention(performer_feature_map(q32, w, true, 0),
                                            performer_feature_map(k32, w, false, shift), v32);
  const double e = rel(stab32.to(at::kDouble), ref);
  std::printf("[ errors   ] performer fp32, key shift %.1f: plain finite %d, stabilized vs fp64 %.2e\n", shift,
              int(at::isfinite(plain32).all().item<bool>()), e);
  EXPECT_FALSE(at::isfinite(plain32).all().item<bool>()) << "the inputs do not overflow the plain form";
  EXPECT_TRUE(at::isfinite(stab32).all().item<bool>());
  EXPECT_LE(e, 1e-4);
}

// The estimator: with many features, normalized Performer attention approximates exact causal softmax
// attention; the mean relative error per token is well below that of the plausible mistakes (unit-norm
// rows instead of chi norms, +‖x‖²/2, no ‖x‖² term, which leave a key-norm weighting that keys of
// unequal norms expose) and of uniform weights. Small logits (‖q‖² ≈ 0.4): the positive features'
// variance grows like exp(‖q + k‖²), so larger ones need far more features for the same error.
TEST(Performer, ApproximatesCausalSoftmaxAttention) {
  const int64_t B = 1, T = 64, H = 2, d = 16, m = 4096, dv = 16;
  auto q = randn({B, T, H, d}, 21) * 0.15, k = randn({B, T, H, d}, 22) * 0.15, v = randn({B, T, H, dv}, 23);
  k = k * (0.5 + at::rand({B, T, H, 1}, at::make_generator<at::CPUGeneratorImpl>(24), at::kDouble) * 2);
  auto exact = causal_softmax_attention(q, k, v);
  auto mean_rel = [&](const Tensor& o) { return ((o - exact).norm(2, -1) / exact.norm(2, -1)).mean().item<double>(); };
  auto w = performer_random_features(m, d, 25);
  // Normalized linear attention on the features exp(exponent(x))/√m of q and k.
  auto favor = [&](const std::function<Tensor(const Tensor&)>& exponent) {
    auto phi = [&](const Tensor& x) { return at::exp(exponent(x)) / std::sqrt(double(m)); };
    return normalized_linear_attention(phi(q), phi(k), v);
  };
  const double good = mean_rel(normalized_linear_attention(performer_feature_map(q, w, true, 0),
                                                           performer_feature_map(k, w, false, 0), v));
  auto unit = w / w.norm(2, -1, true);
  const double unit_rows = mean_rel(favor([&](const Tensor& x) {
    return at::matmul(x, unit.t()) - x.pow(2).sum(-1, true) / 2;
  }));
  const double plus = mean_rel(favor([&](const Tensor& x) { return at::matmul(x, w.t()) + x.pow(2).sum(-1, true) / 2; }));
  const double no_norm = mean_rel(favor([&](const Tensor& x) { return at::matmul(x, w.t()); }));
  const double uniform = mean_rel(normalized_linear_attention(at::ones_like(q), at::ones_like(k), v));
  std::printf("[ errors   ] performer m=%lld vs causal softmax: mean relative %.4f; unit rows %.4f, +|x|^2/2 %.4f, "
              "no |x|^2 %.4f, uniform weights %.4f\n", static_cast<long long>(m), good, unit_rows, plus, no_norm, uniform);
  EXPECT_LE(good, 0.05);
  for (double wrong : {unit_rows, plus, no_norm}) EXPECT_GE(wrong, 5 * good);
  EXPECT_GE(uniform, 3 * good);
}

// The layer against its formula written out in loops, fp64, with and without the normalizer:
//   q, k, v, z = x·Wᵀ;  q̂ = q·d^(−1/4), k̂ = k·d^(−1/4);  e_j(x) = ω_jᵀx − ‖x‖²/2
//   φq_j = exp(e_j(q̂) − max_i e_i(q̂))/√m,  φk_j = exp(e_j(k̂) − c)/√m,  c = max(0, max_j ‖ω_j‖²/2 − 40)
//   o_t = Σ_{s≤t} (φq_t·φk_s) v_s  [ / (Σ_{s≤t} φq_t·φk_s + 1e-6·e^(−c)) ]
//   y = o_proj(rms_norm(o)·w_norm·silu(z))
TEST(Performer, LayerEqualsAnIndependentFp64Computation) {
  const int64_t B = 2, T = 32, D = 16, H = 2, dk = 8, dv = 6, m = 20;
  for (bool normalize : {true, false}) {
    MixerLayerSpec s;
    s.kind = "linear_attn";
    s.d_model = D, s.n_heads = H, s.head_dim_k = dk, s.head_dim_v = dv, s.chunk_size = 8;
    s.feature_map = "performer", s.num_features = m, s.feature_seed = 11, s.layer = 3;
    s.normalize = normalize;
    s.init_std = 0.3;
    s.n_layers = 4;
    ParameterInit init(2, at::TensorOptions().dtype(at::kDouble));
    MixerLayer layer(s, init);
    auto x = randn({B, T, D}, 31);
    auto y = layer.forward(x).y;

    std::map<std::string, Tensor> p;
    for (auto& [n, t] : layer.parameters()) p[n] = t.detach();
    auto q = at::linear(x, p.at("q_proj.weight")).view({B, T, H, dk}) * std::pow(double(dk), -0.25);
    auto k = at::linear(x, p.at("k_proj.weight")).view({B, T, H, dk}) * std::pow(double(dk), -0.25);
    auto v = at::linear(x, p.at("v_proj.weight")).view({B, T, H, dv});
    auto z = at::linear(x, p.at("z_proj.weight")).view({B, T, H, dv});
    auto w = performer_random_features(m, dk, performer_layer_seed(11, 3));
    auto wa = w.accessor<double, 2>();
    double c = 0;
    for (int64_t j = 0; j < m; ++j) {
      double n2 = 0;
      for (int64_t i = 0; i < dk; ++i) n2 += wa[j][i] * wa[j][i];
      c = std::max(c, n2 / 2 - 40);
    }
    auto features = [&](const Tensor& xt, bool query) {  // xt [dk] -> std::vector [m]
      auto xa = xt.accessor<double, 1>();
      std::vector<double> e(m);
      double sq = 0, top = -1e300;
      for (int64_t i = 0; i < dk; ++i) sq += xa[i] * xa[i];
      for (int64_t j = 0; j < m; ++j) {
        double dot = 0;
        for (int64_t i = 0; i < dk; ++i) dot += wa[j][i] * xa[i];
        e[j] = dot - sq / 2;
        top = std::max(top, e[j]);
      }
      for (auto& ej : e) ej = std::exp(ej - (query ? top : c)) / std::sqrt(double(m));
      return e;
    };
    auto o = at::zeros({B, T, H, dv}, at::kDouble);
    auto oa = o.accessor<double, 4>();
    auto va = v.accessor<double, 4>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        std::vector<std::vector<double>> fk;
        for (int64_t t = 0; t < T; ++t) {
          fk.push_back(features(k[b][t][h].contiguous(), false));
          auto fq = features(q[b][t][h].contiguous(), true);
          double den = 0;
          for (int64_t u = 0; u <= t; ++u) {
            double a = 0;
            for (int64_t j = 0; j < m; ++j) a += fq[j] * fk[u][j];
            den += a;
            for (int64_t i = 0; i < dv; ++i) oa[b][t][h][i] += a * va[b][u][h][i];
          }
          if (normalize)
            for (int64_t i = 0; i < dv; ++i) oa[b][t][h][i] /= den + 1e-6 * std::exp(-c);
        }
      }
    auto normed = o * at::rsqrt(o.pow(2).mean(-1, true) + s.norm_eps) * p.at("o_norm.weight") * at::silu(z);
    auto ref = at::linear(normed.reshape({B, T, H * dv}), p.at("o_proj.weight"));
    const double e = rel(y, ref);
    std::printf("[ errors   ] performer layer%s vs the formula in loops: %.2e\n", normalize ? " (normalized)" : "", e);
    EXPECT_LE(e, 1e-10);
    EXPECT_GT(ref.abs().max().item<double>(), 1e-3);
  }
}

}  // namespace
}  // namespace carry
