// Kimi Delta Attention (layers/kda/kda.h): the family's naive and chunkwise forms against an independent
// token-by-token recurrence written here with plain loops over heads in fp64 (the order FLA's naive
// reference applies: the decay per key dimension, then the delta-rule write), outputs and final state from a
// random initial state; realistic gates (half-lives from 2 to 10^4 tokens per key dimension, β in (0, 1),
// unit keys); and with every key dimension sharing one gate KDA equals Gated DeltaNet.
#include "layers/mixer.h"
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>

#include <cmath>

namespace carry::testing {
namespace {

struct KdaCase {
  MixerInputs in;
  Tensor S0;  // [B,H,dk,dv]
};

KdaCase make_case(int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto o = at::TensorOptions().dtype(at::kDouble);
  KdaCase c;
  c.in.q = at::randn({B, T, H, dk}, gen, o);
  c.in.k = at::randn({B, T, H, dk}, gen, o);
  c.in.k = c.in.k / c.in.k.norm(2, -1, true);
  c.in.v = at::randn({B, T, H, dv}, gen, o);
  const double lo = std::log(2.0), hi = std::log(1e4);
  c.in.gk = -std::log(2.0) / at::exp(at::rand({B, T, H, dk}, gen, o) * (hi - lo) + lo);
  c.in.beta = at::rand({B, T, H}, gen, o) * 0.9 + 0.05;
  c.S0 = at::randn({B, H, dk, dv}, gen, o) * 0.3;
  return c;
}

// S ← Diag(α) S; S ← S + β k (v − Sᵀk)ᵀ; o = scale·Sᵀq, one head at a time.
std::pair<Tensor, Tensor> recurrence(const KdaCase& c, double scale) {
  const auto& in = c.in;
  const int64_t B = in.q.size(0), T = in.q.size(1), H = in.q.size(2);
  Tensor o = at::zeros({B, T, H, in.v.size(3)}, in.v.options());
  Tensor S = c.S0.clone();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      Tensor s = S[b][h];
      for (int64_t t = 0; t < T; ++t) {
        Tensor k = in.k[b][t][h], v = in.v[b][t][h], q = in.q[b][t][h];
        s = in.gk[b][t][h].exp().unsqueeze(-1) * s;
        Tensor err = v - at::mv(s.t(), k);
        s = s + in.beta[b][t][h] * at::outer(k, err);
        o[b][t][h] = scale * at::mv(s.t(), q);
      }
      S[b][h] = s;
    }
  return {o, S};
}

TEST(Kda, NaiveAndChunkwiseEqualAnIndependentRecurrence) {
  const Mixer& m = get_mixer("kda");
  auto c = make_case(2, 96, 2, 8, 5, 7);
  MixerOptions opt;
  opt.chunk_size = 32;
  auto [o_ref, S_ref] = recurrence(c, 1.0 / std::sqrt(8.0));
  for (auto form : {Form::naive, Form::chunkwise}) {
    auto out = form == Form::naive ? m.naive(c.in, {c.S0}, opt) : m.chunkwise(c.in, {c.S0}, opt);
    EXPECT_LE(rel_err(out.o, o_ref), 1e-12) << (form == Form::naive ? "naive" : "chunkwise");
    EXPECT_LE(rel_err(out.final_state[0], S_ref), 1e-12) << (form == Form::naive ? "naive" : "chunkwise");
  }
  // The check can fail: the decay after the write (Gated DeltaNet's order, which differs for a decay per
  // dimension) gives another output.
  auto [o_gdn_order, S_gdn_order] = [&] {
    const auto& in = c.in;
    Tensor o = at::zeros_like(o_ref), S = c.S0.clone();
    for (int64_t b = 0; b < in.q.size(0); ++b)
      for (int64_t h = 0; h < in.q.size(2); ++h) {
        Tensor s = S[b][h];
        for (int64_t t = 0; t < in.q.size(1); ++t) {
          Tensor k = in.k[b][t][h], v = in.v[b][t][h], q = in.q[b][t][h];
          s = s - in.beta[b][t][h] * at::outer(k, at::mv(s.t(), k));
          s = in.gk[b][t][h].exp().unsqueeze(-1) * s + in.beta[b][t][h] * at::outer(k, v);
          o[b][t][h] = at::mv(s.t(), q) / std::sqrt(8.0);
        }
        S[b][h] = s;
      }
    return std::make_pair(o, S);
  }();
  EXPECT_GT(rel_err(o_gdn_order, o_ref), 1e-4);
}

// Long chunks with fast gates: the pairwise exponents keep every factor a decay (no overflow, no NaN).
TEST(Kda, ChunkwiseIsFiniteWithFastGatesAndLongChunks) {
  const Mixer& m = get_mixer("kda");
  auto c = make_case(1, 256, 1, 8, 4, 11);
  c.in.gk = c.in.gk * 40;  // half-lives down to 0.05 tokens: e^{−G} over a chunk would overflow
  MixerOptions opt;
  opt.chunk_size = 128;
  auto out = m.chunkwise(c.in, {c.S0}, opt);
  auto ref = m.naive(c.in, {c.S0}, opt);
  EXPECT_TRUE(at::isfinite(out.o).all().item<bool>());
  EXPECT_LE(rel_err(out.o, ref.o), 1e-10);
  EXPECT_LE(rel_err(out.final_state[0], ref.final_state[0]), 1e-10);
}

TEST(Kda, SharedGateEqualsGatedDeltaNet) {
  const Mixer& kda = get_mixer("kda");
  const Mixer& gdn = get_mixer("gated_deltanet");
  auto c = make_case(1, 64, 2, 8, 6, 3);
  MixerInputs g = c.in;
  g.g = c.in.gk.select(-1, 0).contiguous();
  g.gk = Tensor();
  MixerInputs d = c.in;
  d.gk = g.g.unsqueeze(-1).expand_as(c.in.gk).contiguous();
  MixerOptions opt;
  opt.chunk_size = 16;
  auto a = kda.chunkwise(d, {c.S0}, opt), b = gdn.chunkwise(g, {c.S0}, opt);
  EXPECT_LE(rel_err(a.o, b.o), 1e-12);
  EXPECT_LE(rel_err(a.final_state[0], b.final_state[0]), 1e-12);
}

}  // namespace
}  // namespace carry::testing
