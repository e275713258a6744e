// Gated DeltaProduct (layers/delta_product/delta_product.h) in fp64: the naive and chunkwise forms
// against an independent recurrence written here with plain loops over heads (FLA's naive reference's
// order: the token's decay, then its n_h delta-rule steps, then the read-out), outputs and final state
// from a random initial state; the chunkwise form against the naive one in every gradient (q, k, v, g,
// beta and the initial state); one step a token is Gated DeltaNet exactly; bad shapes are refused with a
// message that says what was expected. Realistic inputs: half-lives from 2 to 10^5 tokens (never a
// zero gate), unit keys, β in (0, 2) (negative eigenvalues of the Householder factors included).
#include "layers/delta_product/delta_product.h"
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>

#include <cmath>

namespace carry::testing {
namespace {

struct Case {
  MixerInputs in;
  Tensor S0;  // [B,H,dk,dv]
};

Case make_case(int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv, int64_t nh, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto o = at::TensorOptions().dtype(at::kDouble);
  Case c;
  c.in.q = at::randn({B, T, H, dk}, gen, o);
  c.in.k = at::randn({B, T * nh, H, dk}, gen, o);
  c.in.k = c.in.k / c.in.k.norm(2, -1, true);
  c.in.v = at::randn({B, T * nh, H, dv}, gen, o);
  // Half-lives log-uniform in [2, 1e5] tokens: g = −ln 2 / half-life.
  const double lo = std::log(2.0), hi = std::log(1e5);
  c.in.g = -std::log(2.0) / at::exp(at::rand({B, T, H}, gen, o) * (hi - lo) + lo);
  c.in.beta = at::rand({B, T * nh, H}, gen, o) * 1.9 + 0.05;
  c.S0 = at::randn({B, H, dk, dv}, gen, o) * 0.3;
  return c;
}

// Per head: S ← e^{g_t} S; for j < n_h: S ← S + β k (v − Sᵀk)ᵀ; o_t = scale·Sᵀq_t. `gate_last` applies the
// decay after the steps instead (another recurrence, to show the comparison can fail).
std::pair<Tensor, Tensor> recurrence(const Case& c, int64_t nh, double scale, bool gate_last = false) {
  const auto& in = c.in;
  const int64_t B = in.q.size(0), T = in.q.size(1), H = in.q.size(2);
  Tensor o = at::zeros({B, T, H, in.v.size(3)}, in.v.options());
  Tensor S = c.S0.clone();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      Tensor s = S[b][h];
      for (int64_t t = 0; t < T; ++t) {
        if (!gate_last) s = in.g[b][t][h].exp() * s;
        for (int64_t j = 0; j < nh; ++j) {
          Tensor k = in.k[b][t * nh + j][h], v = in.v[b][t * nh + j][h];
          s = s + in.beta[b][t * nh + j][h] * at::outer(k, v - at::mv(s.t(), k));
        }
        if (gate_last) s = in.g[b][t][h].exp() * s;
        o[b][t][h] = scale * at::mv(s.t(), in.q[b][t][h]);
      }
      S[b][h] = s;
    }
  return {o, S};
}

TEST(GatedDeltaProduct, NaiveAndChunkwiseEqualAnIndependentRecurrence) {
  const Mixer& m = get_mixer("gated_deltaproduct");
  for (int64_t nh : {2, 3}) {
    auto c = make_case(2, 96, 2, 8, 5, nh, 7 + nh);
    MixerOptions opt;
    opt.chunk_size = 32;
    opt.num_householder = nh;
    auto [o_ref, S_ref] = recurrence(c, nh, 1.0 / std::sqrt(8.0));
    for (auto form : {Form::naive, Form::chunkwise}) {
      auto out = form == Form::naive ? m.naive(c.in, {c.S0}, opt) : m.chunkwise(c.in, {c.S0}, opt);
      const double eo = rel_err(out.o, o_ref), es = rel_err(out.final_state[0], S_ref);
      std::cout << "[ errors   ] n_h=" << nh << " " << form_name(form) << " vs the recurrence: output " << eo
                << " state " << es << "\n";
      EXPECT_LE(eo, 1e-12) << form_name(form) << " n_h=" << nh;
      EXPECT_LE(es, 1e-12) << form_name(form) << " n_h=" << nh;
    }
    // The comparison can fail: the decay after the token's steps is another recurrence.
    auto [o_late, S_late] = recurrence(c, nh, 1.0 / std::sqrt(8.0), /*gate_last=*/true);
    EXPECT_GT(rel_err(o_late, o_ref), 1e-6);
  }
}

TEST(GatedDeltaProduct, ChunkwiseEqualsNaiveInEveryGradient) {
  const Mixer& m = get_mixer("gated_deltaproduct");
  for (int64_t nh : {2, 3}) {
    for (int64_t C : {16, 32}) {
      auto c = make_case(2, 64, 2, 8, 6, nh, 100 + 10 * nh + C);
      MixerOptions opt;
      opt.chunk_size = C;
      opt.num_householder = nh;
      auto a = run_with_grads(m, Form::chunkwise, c.in, {c.S0}, opt);
      auto b = run_with_grads(m, Form::naive, c.in, {c.S0}, opt);
      const double eo = max_rel_err(a.outputs, b.outputs), eg = max_rel_err(a.grads, b.grads);
      std::cout << "[ errors   ] n_h=" << nh << " C=" << C << " chunkwise vs naive: forward " << eo << " gradients "
                << eg << "\n";
      EXPECT_LE(eo, 1e-11);
      ASSERT_EQ(a.grads.size(), 6u);  // q, k, v, g, beta, S0
      const char* names[] = {"dq", "dk", "dv", "dg", "dbeta", "dS0"};
      for (size_t i = 0; i < a.grads.size(); ++i) {
        EXPECT_LE(rel_err(a.grads[i], b.grads[i]), 1e-11) << names[i] << " n_h=" << nh << " C=" << C;
        EXPECT_GT(a.grads[i].abs().max().item<double>(), 0) << names[i] << " is all zeros";
      }
    }
  }
}

// n_h = 1: the very Gated DeltaNet computation (the chunkwise form bit for bit, the naive one to rounding).
TEST(GatedDeltaProduct, OneStepATokenIsGatedDeltaNet) {
  const Mixer& dp = get_mixer("gated_deltaproduct");
  const Mixer& gdn = get_mixer("gated_deltanet");
  auto c = make_case(2, 64, 2, 8, 6, 1, 3);
  MixerOptions opt;
  opt.chunk_size = 16;
  opt.num_householder = 1;
  auto a = dp.chunkwise(c.in, {c.S0}, opt), b = gdn.chunkwise(c.in, {c.S0}, opt);
  EXPECT_TRUE(at::equal(a.o, b.o));
  EXPECT_TRUE(at::equal(a.final_state[0], b.final_state[0]));
  auto an = dp.naive(c.in, {c.S0}, opt), bn = gdn.naive(c.in, {c.S0}, opt);
  EXPECT_LE(rel_err(an.o, bn.o), 1e-13);
  EXPECT_LE(rel_err(an.final_state[0], bn.final_state[0]), 1e-13);
  // The summaries too.
  auto sa = dp.summarize(c.in, opt), sb = gdn.summarize(c.in, opt);
  EXPECT_TRUE(at::equal(sa.transport[0], sb.transport[0]));
  EXPECT_TRUE(at::equal(sa.state[0], sb.state[0]));
}

// The sub-token expansion is FLA's: q on the last sub-token of each token, g on the first.
TEST(GatedDeltaProduct, ExpansionPlacesQueryLastAndGateFirst) {
  auto c = make_case(1, 4, 1, 3, 2, 3, 5);
  MixerInputs e = deltaproduct_as_gated_deltanet(c.in, 3);
  ASSERT_EQ(e.q.sizes(), at::IntArrayRef({1, 12, 1, 3}));
  ASSERT_EQ(e.g.sizes(), at::IntArrayRef({1, 12, 1}));
  for (int64_t t = 0; t < 4; ++t)
    for (int64_t j = 0; j < 3; ++j) {
      EXPECT_TRUE(at::equal(e.q[0][3 * t + j][0], j == 2 ? c.in.q[0][t][0] : at::zeros({3}, at::kDouble)));
      EXPECT_EQ(e.g[0][3 * t + j][0].item<double>(), j == 0 ? c.in.g[0][t][0].item<double>() : 0.0);
    }
  Tensor o = at::arange(24, at::kDouble).view({1, 12, 1, 2});
  EXPECT_TRUE(at::equal(deltaproduct_token_rows(o, 3), o.view({1, 4, 3, 1, 2}).select(2, 2)));
}

// A slice of tokens takes n_h rows a token of the sub-step inputs (MixerInputs::slice), so pieces with the
// state passed along give the whole.
TEST(GatedDeltaProduct, SlicesTakeEveryStepOfTheirTokens) {
  const Mixer& m = get_mixer("gated_deltaproduct");
  auto c = make_case(1, 64, 2, 8, 4, 2, 9);
  MixerOptions opt;
  opt.chunk_size = 16;
  auto part = c.in.slice(16, 32);
  EXPECT_EQ(part.q.size(1), 32);
  EXPECT_EQ(part.k.size(1), 64);
  EXPECT_TRUE(at::equal(part.beta, c.in.beta.narrow(1, 32, 64)));
  auto whole = m.chunkwise(c.in, {c.S0}, opt);
  auto first = m.chunkwise(c.in.slice(0, 16), {c.S0}, opt);
  auto second = m.chunkwise(c.in.slice(16, 48), first.final_state, opt);
  EXPECT_LE(rel_err(at::cat({first.o, second.o}, 1), whole.o), 1e-13);
  EXPECT_LE(rel_err(second.final_state[0], whole.final_state[0]), 1e-13);
}

TEST(GatedDeltaProduct, BadShapesAreRefusedClearly) {
  const Mixer& m = get_mixer("gated_deltaproduct");
  auto c = make_case(1, 32, 2, 8, 4, 2, 1);
  MixerOptions opt;
  opt.chunk_size = 16;
  auto bad = c.in;
  bad.k = c.in.k.narrow(1, 0, 32);  // one key a token, where num_householder = 2 asks for two
  expect_error([&] { m.chunkwise(bad, {}, opt); },
               "gated_deltaproduct: 'k' must have T·num_householder rows along dim 1, got 32 (num_householder = 2 "
               "sub-steps a token, interleaved along T: T·num_householder = 64 rows for q's T = 32)");
  bad = c.in;
  bad.beta = c.in.beta.narrow(1, 0, 48);
  expect_error([&] { m.naive(bad, {}, opt); }, "'beta' must have T·num_householder rows");
  bad = c.in;
  bad.g = at::zeros({1, 64, 2}, at::kDouble);  // a gate a sub-step: the family's gate is a token's
  expect_error([&] { m.chunkwise(bad, {}, opt); }, "gated_deltaproduct: 'g' must have shape [1, 32, 2], got [1, 64, 2]");
  MixerOptions three = opt;
  three.num_householder = 3;
  expect_error([&] { m.chunkwise(c.in, {}, three); }, "T·num_householder = 96 rows for q's T = 32");
  MixerOptions none = opt;
  none.num_householder = 0;
  expect_error([&] { m.chunkwise(c.in, {}, none); }, "num_householder (delta-rule steps a token) must be >= 1, got 0");
  bad = c.in;
  bad.beta = c.in.beta * 1.2;  // up to 2.34: beyond the delta rule's [0, 2]
  MixerOptions values = opt;
  values.check_values = true;
  expect_error([&] { m.chunkwise(bad, {}, values); }, "'beta' (the delta-rule write strength) must lie in [0, 2]");
}

}  // namespace
}  // namespace carry::testing
