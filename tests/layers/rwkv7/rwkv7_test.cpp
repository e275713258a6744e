// RWKV-7's diagonal-plus-rank-one update (layers/rwkv7/rwkv7.h): the family's naive and chunkwise forms
// against an independent token-by-token recurrence written here with plain loops over heads in fp64 (FLA's
// dplr recurrence: the rank-one read aᵀS of the state before the token, the decay, the writes), outputs and
// final state from a random initial state, with RWKV-7's inputs (a = −κ̂, b = κ̂ ⊙ a_lr with a_lr in (0, 1),
// decays with half-lives from 2 to 10^4 tokens per key dimension); the gradient of every input and of the
// initial state of the chunkwise form against the naive form's; finite with fast gates and long chunks; and
// with b = −β k, a = k and one shared decay it is KDA's update with the decay applied first.
#include "layers/mixer.h"
#include "layers/rwkv7/rwkv7.h"
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>

#include <cmath>

namespace carry::testing {
namespace {

struct Rwkv7Case {
  MixerInputs in;
  Tensor S0;  // [B,H,dk,dv]
};

Rwkv7Case make_case(int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto o = at::TensorOptions().dtype(at::kDouble);
  Rwkv7Case c;
  c.in.q = at::randn({B, T, H, dk}, gen, o);
  c.in.k = at::randn({B, T, H, dk}, gen, o) * 0.5;
  c.in.v = at::randn({B, T, H, dv}, gen, o);
  const double lo = std::log(2.0), hi = std::log(1e4);
  c.in.gk = -std::log(2.0) / at::exp(at::rand({B, T, H, dk}, gen, o) * (hi - lo) + lo);
  Tensor kappa = at::randn({B, T, H, dk}, gen, o);
  kappa = kappa / kappa.norm(2, -1, true);
  Tensor a_lr = at::rand({B, T, H, dk}, gen, o) * 0.9 + 0.05;
  c.in.a = -kappa;
  c.in.b = kappa * a_lr;
  c.S0 = at::randn({B, H, dk, dv}, gen, o) * 0.3;
  return c;
}

// u = aᵀS; S ← Diag(w) S + b u + k vᵀ; o = scale·Sᵀq, one head at a time.
std::pair<Tensor, Tensor> recurrence(const Rwkv7Case& c, double scale) {
  const auto& in = c.in;
  const int64_t B = in.q.size(0), T = in.q.size(1), H = in.q.size(2);
  Tensor o = at::zeros({B, T, H, in.v.size(3)}, in.v.options());
  Tensor S = c.S0.clone();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      Tensor s = S[b][h];
      for (int64_t t = 0; t < T; ++t) {
        Tensor u = at::mv(s.t(), in.a[b][t][h]);
        s = in.gk[b][t][h].exp().unsqueeze(-1) * s + at::outer(in.b[b][t][h], u) +
            at::outer(in.k[b][t][h], in.v[b][t][h]);
        o[b][t][h] = scale * at::mv(s.t(), in.q[b][t][h]);
      }
      S[b][h] = s;
    }
  return {o, S};
}

TEST(Rwkv7, NaiveAndChunkwiseEqualAnIndependentRecurrence) {
  const Mixer& m = get_mixer(kRwkv7Family);
  auto c = make_case(2, 96, 2, 8, 5, 7);
  MixerOptions opt;
  opt.chunk_size = 32;
  auto [o_ref, S_ref] = recurrence(c, 1.0 / std::sqrt(8.0));
  for (auto form : {Form::naive, Form::chunkwise}) {
    auto out = form == Form::naive ? m.naive(c.in, {c.S0}, opt) : m.chunkwise(c.in, {c.S0}, opt);
    EXPECT_LE(rel_err(out.o, o_ref), 1e-12) << (form == Form::naive ? "naive" : "chunkwise");
    EXPECT_LE(rel_err(out.final_state[0], S_ref), 1e-12) << (form == Form::naive ? "naive" : "chunkwise");
  }
  // The check can fail: the rank-one read of the decayed state (aᵀ Diag(w) S instead of aᵀ S) gives
  // another output.
  Rwkv7Case late = c;
  late.in.a = c.in.a * c.in.gk.exp();
  EXPECT_GT(rel_err(recurrence(late, 1.0 / std::sqrt(8.0)).first, o_ref), 1e-4);
}

TEST(Rwkv7, ChunkwiseGradientsEqualTheNaiveForms) {
  const Mixer& m = get_mixer(kRwkv7Family);
  auto c = make_case(1, 48, 2, 6, 4, 13);
  MixerOptions opt;
  opt.chunk_size = 16;
  auto ref = outputs_then_grads_as_run(m, Form::naive, c.in, {c.S0}, opt);
  auto got = outputs_then_grads_as_run(m, Form::chunkwise, c.in, {c.S0}, opt);
  auto names = result_names(m.state_names(), c.in);
  ASSERT_EQ(ref.size(), names.size());
  ASSERT_EQ(got.size(), names.size());
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_LE(rel_err(got[i], ref[i]), 1e-11) << names[i];
}

// Long chunks with fast gates: the pairwise exponents keep every factor a decay (no overflow, no NaN).
TEST(Rwkv7, ChunkwiseIsFiniteWithFastGatesAndLongChunks) {
  const Mixer& m = get_mixer(kRwkv7Family);
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

// KDA's update (I − β k kᵀ) Diag(α) S + β k vᵀ = Diag(α) S + (−β k)((α ⊙ k)ᵀ S) + k (β v)ᵀ is RWKV-7's with
// w = α, a = α ⊙ k, b = −β k and the value β v.
TEST(Rwkv7, KdaIsAnInstance) {
  const Mixer& rwkv = get_mixer(kRwkv7Family);
  const Mixer& kda = get_mixer("kda");
  auto c = make_case(1, 64, 2, 8, 6, 3);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  MixerInputs k_in;
  k_in.q = c.in.q, k_in.k = c.in.k / c.in.k.norm(2, -1, true), k_in.v = c.in.v, k_in.gk = c.in.gk;
  k_in.beta = at::rand({1, 64, 2}, gen, at::TensorOptions().dtype(at::kDouble)) * 0.9 + 0.05;
  MixerInputs r_in;
  r_in.q = k_in.q, r_in.k = k_in.k, r_in.gk = k_in.gk;
  r_in.v = k_in.v * k_in.beta.unsqueeze(-1);
  r_in.a = k_in.k * k_in.gk.exp();
  r_in.b = -k_in.beta.unsqueeze(-1) * k_in.k;
  MixerOptions opt;
  opt.chunk_size = 16;
  auto x = rwkv.chunkwise(r_in, {c.S0}, opt), y = kda.chunkwise(k_in, {c.S0}, opt);
  EXPECT_LE(rel_err(x.o, y.o), 1e-12);
  EXPECT_LE(rel_err(x.final_state[0], y.final_state[0]), 1e-12);
}

}  // namespace
}  // namespace carry::testing
