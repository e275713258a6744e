// The gated_deltaproduct layer kind (layers/delta_product/layer.cpp through MixerLayer): the k, v and beta
// projections are num_householder times as wide, and their rows reach the family in FLA's layout: a row
// '(n h d)' of a token is its n_h sub-steps, interleaved along T (token t's step j at row t·n_h + j), the
// keys L2-normalized a step, beta = 2·σ(W x) (values above 1: the Householder factors may reflect); q and g
// stay a token. Computed here from the parameters by hand (no convolution: conv_size 0, silu only).
#include "layers/blocks/mixer_layer.h"
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>

namespace carry::testing {
namespace {

const Tensor& param(const NamedParameters& ps, const std::string& name) {
  for (const auto& [n, t] : ps)
    if (n == name) return t;
  ADD_FAILURE() << "no parameter " << name;
  static const Tensor none;
  return none;
}

TEST(GatedDeltaProductLayer, StepsReachTheFamilyInFlaLayout) {
  const int64_t B = 2, T = 16, d = 12, H = 2, dk = 8, dv = 6, nh = 3;
  MixerLayerSpec s;
  s.kind = "gated_deltaproduct";
  s.d_model = d, s.n_heads = H, s.head_dim_k = dk, s.head_dim_v = dv;
  s.chunk_size = 8;
  s.conv_size = 0;
  s.num_householder = nh;
  s.init_std = 0.5;  // wide betas, some above 1
  ParameterInit init(3, at::TensorOptions().dtype(at::kDouble));
  MixerLayer layer(s, init);
  const auto ps = layer.parameters();
  EXPECT_EQ(param(ps, "q_proj.weight").sizes(), at::IntArrayRef({H * dk, d}));
  EXPECT_EQ(param(ps, "k_proj.weight").sizes(), at::IntArrayRef({nh * H * dk, d}));
  EXPECT_EQ(param(ps, "v_proj.weight").sizes(), at::IntArrayRef({nh * H * dv, d}));
  EXPECT_EQ(param(ps, "b_proj.weight").sizes(), at::IntArrayRef({nh * H, d}));
  EXPECT_EQ(param(ps, "a_proj.weight").sizes(), at::IntArrayRef({H, d}));
  EXPECT_EQ(layer.mixer_options(T).num_householder, nh);

  auto x = at::randn({B, T, d}, at::make_generator<at::CPUGeneratorImpl>(4), at::TensorOptions().dtype(at::kDouble));
  MixerInputs seen;
  MixerLayerContext ctx;
  ctx.run_mixer = [&](const Mixer& m, const MixerInputs& in, const State& st, const MixerOptions& o) {
    seen = in;
    return m.chunkwise(in, st, o);
  };
  auto y = layer.forward(x, {}, ctx).y;
  ASSERT_TRUE(seen.k.defined());
  auto l2 = [](const Tensor& t) { return t * at::rsqrt(t.pow(2).sum(-1, true) + 1e-6); };
  auto k = l2(at::silu(at::linear(x, param(ps, "k_proj.weight"))).view({B, T, nh, H, dk}));
  auto v = at::silu(at::linear(x, param(ps, "v_proj.weight"))).view({B, T, nh, H, dv});
  auto beta = 2 * at::sigmoid(at::linear(x, param(ps, "b_proj.weight"))).view({B, T, nh, H});
  EXPECT_EQ(seen.q.sizes(), at::IntArrayRef({B, T, H, dk}));
  EXPECT_EQ(seen.g.sizes(), at::IntArrayRef({B, T, H}));
  ASSERT_EQ(seen.k.sizes(), at::IntArrayRef({B, T * nh, H, dk}));
  ASSERT_EQ(seen.v.sizes(), at::IntArrayRef({B, T * nh, H, dv}));
  ASSERT_EQ(seen.beta.sizes(), at::IntArrayRef({B, T * nh, H}));
  EXPECT_LE(rel_err(seen.k.reshape({B, T, nh, H, dk}), k), 1e-14);
  EXPECT_LE(rel_err(seen.v.reshape({B, T, nh, H, dv}), v), 1e-14);
  EXPECT_LE(rel_err(seen.beta.reshape({B, T, nh, H}), beta), 1e-14);
  EXPECT_GT(seen.beta.max().item<double>(), 1.0) << "beta = 2σ: some steps must reflect at this init";
  EXPECT_TRUE(at::isfinite(y).all().item<bool>());
  EXPECT_EQ(y.sizes(), x.sizes());
}

}  // namespace
}  // namespace carry::testing
