// Tests of layers/diag_decay/gla.*: the token recurrence (naive form) against the closed-form masked mixing it
// defines, GLA without decay against linear attention, the chunkwise form under decays strong enough
// to overflow a q·exp(G), k·exp(−G) factorization, and the transport of a summary. The contract tests
// (chunkwise vs naive with gradients, pieces, algebra) run for "gla" in mixer_test.cpp.
#include "layers/diag_decay/gla.h"
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>

namespace carry::testing {
namespace {

const Mixer& gla() { return get_mixer("gla"); }

// o_t = scale Σ_{s≤t} Σ_d q_td k_sd exp(G_td − G_sd) v_s + scale (q_t ⊙ exp(G_t))ᵀ S0 and
// S_T = exp(G_T) ⊙ S0 + Σ_s (k_s ⊙ exp(G_T − G_s)) v_sᵀ, G the cumulative gate over the whole slice.
std::pair<Tensor, Tensor> closed_form(const MixerInputs& in, const Tensor& S0, double scale) {
  auto q = in.q.transpose(1, 2) * scale, k = in.k.transpose(1, 2), v = in.v.transpose(1, 2);
  auto G = in.gk.transpose(1, 2).cumsum(2);  // [B,H,T,dk]
  int64_t T = q.size(2);
  auto decay = (G.unsqueeze(3) - G.unsqueeze(2)).exp();  // [B,H,t,s,dk]
  auto M = (q.unsqueeze(3) * k.unsqueeze(2) * decay).sum(-1) * at::ones({T, T}, q.options()).tril();
  auto o = at::matmul(M, v) + at::matmul(q * G.exp(), S0);
  auto G_T = G.select(2, T - 1);
  auto S = G_T.exp().unsqueeze(-1) * S0 +
           at::matmul((k * (G_T.unsqueeze(2) - G).exp()).transpose(-1, -2), v);
  return {o.transpose(1, 2), S};
}

TEST(Gla, NaiveEqualsClosedFormMixing) {
  Shape s;
  s.T = 24;
  MixerOptions opt;
  opt.scale = 0.7;
  auto in = random_inputs(gla(), s, at::kDouble, 11);
  auto S0 = random_state(gla(), in, opt, 12)[0];
  auto out = gla().naive(in, {S0}, opt);
  auto [o, S] = closed_form(in, S0, 0.7);
  double eo = rel_err(out.o, o), es = rel_err(out.final_state[0], S);
  std::cout << "[ errors   ] gla naive vs closed form: output " << eo << " state " << es << "\n";
  EXPECT_LE(eo, 1e-12);
  EXPECT_LE(es, 1e-12);
}

TEST(Gla, WithoutDecayEqualsLinearAttention) {
  Shape s;
  s.T = 64;
  MixerOptions opt;
  opt.chunk_size = 16;
  auto in = random_inputs(gla(), s, at::kDouble, 31);
  in.gk = at::zeros_like(in.gk);
  const Mixer& lin = get_mixer("linear_attn");
  auto lin_state = random_state(lin, in, opt, 32);
  auto a = gla().chunkwise(in, {lin_state[0]}, opt);
  auto b = lin.chunkwise(in, lin_state, opt);
  double eo = rel_err(a.o, b.o), es = rel_err(a.final_state[0], b.final_state[0]);
  std::cout << "[ errors   ] gla(gk=0) vs linear_attn: output " << eo << " state " << es << "\n";
  EXPECT_LE(eo, 1e-12);
  EXPECT_LE(es, 1e-12);
}

// Per-chunk cumulative gates reach about −1000: exp(−G) would overflow even fp64, and keys with
// gk = 0 next to keys with gk down to −60 check that no dimension is lost. Outputs and gradients must be
// finite and agree with the recurrence.
TEST(Gla, StrongDecaysStayFiniteAndExact) {
  Shape s;
  s.T = 128;
  MixerOptions opt;
  opt.chunk_size = 64;
  auto in = random_inputs(gla(), s, at::kDouble, 41);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
  auto u = at::rand(in.gk.sizes(), gen, in.gk.options());
  in.gk = at::where(u < 0.5, -120 * u, at::zeros_like(u));
  ASSERT_LT(in.gk.narrow(1, 0, 64).sum(1).min().item<double>(), -709);
  auto st = random_state(gla(), in, opt, 43);
  auto a = run_with_grads(gla(), Form::chunkwise, in, st, opt);
  auto b = run_with_grads(gla(), Form::naive, in, st, opt);
  for (auto& t : a.outputs) EXPECT_TRUE(at::isfinite(t).all().item<bool>());
  for (auto& t : a.grads) EXPECT_TRUE(at::isfinite(t).all().item<bool>());
  double eo = max_rel_err(a.outputs, b.outputs), eg = max_rel_err(a.grads, b.grads);
  std::cout << "[ errors   ] gla strong decays: forward " << eo << " gradients " << eg << "\n";
  EXPECT_LE(eo, 1e-10);
  EXPECT_LE(eg, 1e-10);
}

TEST(Gla, TransportIsTheProductOfDecays) {
  Shape s;
  s.T = 96;
  MixerOptions opt;
  opt.chunk_size = 32;
  auto in = random_inputs(gla(), s, at::kDouble, 51);
  auto sum = gla().summarize(in, opt);
  ASSERT_EQ(sum.transport.size(), 1u);
  auto expect = in.gk.sum(1).exp();  // [B,H,dk]
  double e = rel_err(sum.transport[0], expect);
  std::cout << "[ errors   ] gla transport vs exp(Σ gk): " << e << "\n";
  EXPECT_LE(e, 1e-12);
  EXPECT_EQ(sum.transport[0].sizes(), (std::vector<int64_t>{s.B, s.H, s.dk}));
}

TEST(Gla, BadStateIsRefused) {
  Shape s;
  s.T = 32;
  MixerOptions opt;
  opt.chunk_size = 16;
  auto in = random_inputs(gla(), s, at::kDouble, 61);
  auto bad = at::zeros({s.B, s.H, s.dk, s.dv + 1}, at::kDouble);
  try {
    gla().chunkwise(in, {bad}, opt);
    ADD_FAILURE() << "a state of the wrong shape was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("initial_state"), std::string::npos)
        << e.what_without_backtrace();
  }
  auto pos = in;
  pos.gk = in.gk.clone();
  pos.gk.view(-1)[5] = 0.1;
  opt.check_values = true;  // a positive log gate is a value check
  EXPECT_THROW(gla().chunkwise(pos, {}, opt), c10::Error);
}

}  // namespace
}  // namespace carry::testing
