// DeltaNet and Gated DeltaNet beyond the generic contract tests (which run for both families in
// mixer_test.cpp): the chunk pieces (M, P, A_chunk, B_chunk, R) against products of token transitions
// built one token at a time; the summary's dense transport against the token product over several
// chunks; Gated DeltaNet with g ≡ 0 against DeltaNet across forms; the accepted β range [0, 2]
// (boundaries accepted and exact, everything else refused naming 'beta'); fp32/bf16 inputs keep their
// state and transport in fp32.
#include "layers/delta_rule/delta_rule.h"
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace carry::testing {
namespace {

const char* kFamilies[] = {"deltanet", "gated_deltanet"};

// Token transitions γ_t (I − β_t k_t k_tᵀ) in [B,H,T,dk,dk], from [B,T,H,·] inputs (γ ≡ 1 without g).
Tensor token_transitions(const MixerInputs& in) {
  auto k = in.k.transpose(1, 2), beta = in.beta.transpose(1, 2);
  auto eye = at::eye(k.size(-1), k.options());
  auto a = eye - beta.unsqueeze(-1).unsqueeze(-1) * k.unsqueeze(-1) * k.unsqueeze(-2);
  if (in.g.defined()) a = a * in.g.transpose(1, 2).exp().unsqueeze(-1).unsqueeze(-1);
  return a;
}

// Expects `f` to throw a c10::Error whose message contains every needle.
template <class F>
void expect_error(F f, std::vector<std::string> needles) {
  try {
    f();
    ADD_FAILURE() << "expected an error mentioning '" << needles[0] << "'";
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    for (auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "message was: " << msg;
  }
}

TEST(DeltaRule, ChunkPiecesMatchTokenRecurrence) {
  for (const char* family : kFamilies) {
    const Mixer& m = get_mixer(family);
    Shape s;  // T = 64: chunks 0..3 of C = 16; take chunk 2
    MixerOptions opt;
    opt.chunk_size = 16;
    const int64_t C = opt.chunk_size, chunk = 2;
    auto in = random_inputs(m, s, at::kDouble, 31);
    if (in.g.defined()) in.g = in.g * 4;  // stronger decay, so a wrong decay factor shows
    auto p = delta_rule_chunk(in, chunk, opt);

    // Φ(t, s) one token at a time: phi[s] = Φ(t, s) after step t; phi0 = Φ(t, 0).
    auto c = in.slice(chunk * C, C);
    auto a = token_transitions(c);
    auto q = c.q.transpose(1, 2), k = c.k.transpose(1, 2), v = c.v.transpose(1, 2);
    auto beta = c.beta.transpose(1, 2);
    double scale = opt.scale_for(s.dk);
    auto eye = at::eye(s.dk, q.options()).expand({s.B, s.H, s.dk, s.dk});
    Tensor phi0 = eye;
    std::vector<Tensor> phi;
    auto M = at::zeros({s.B, s.H, C, C}, q.options()), P = at::zeros({s.B, s.H, C, s.dk}, q.options());
    for (int64_t t = 0; t < C; ++t) {
      auto at_ = a.select(2, t);
      phi0 = at::matmul(at_, phi0);
      for (auto& f : phi) f = at::matmul(at_, f);
      phi.push_back(eye);
      auto qt = q.select(2, t).unsqueeze(-2);  // [B,H,1,dk]
      P.select(2, t).copy_(scale * at::matmul(qt, phi0).squeeze(-2));
      for (int64_t j = 0; j <= t; ++j) {
        auto kj = k.select(2, j).unsqueeze(-1);
        M.select(2, t).select(-1, j).copy_(
            scale * beta.select(2, j) * at::matmul(qt, at::matmul(phi[j], kj)).squeeze(-1).squeeze(-1));
      }
    }
    std::vector<Tensor> cols;
    for (int64_t j = 0; j < C; ++j)
      cols.push_back(beta.select(2, j).unsqueeze(-1) * at::matmul(phi[j], k.select(2, j).unsqueeze(-1)).squeeze(-1));
    auto R = at::stack(cols, -1);  // [B,H,dk,C]
    auto Bst = at::matmul(R, v);

    double eM = rel_err(p.mixing, M), eP = rel_err(p.query_state, P), eA = rel_err(p.transport, phi0);
    double eR = rel_err(p.value_state, R), eB = rel_err(p.state, Bst);
    std::cout << "[ errors   ] " << family << " chunk pieces: M " << eM << " P " << eP << " A " << eA
              << " R " << eR << " B " << eB << "\n";
    EXPECT_LE(eM, 1e-12);
    EXPECT_LE(eP, 1e-12);
    EXPECT_LE(eA, 1e-12);
    EXPECT_LE(eR, 1e-12);
    EXPECT_LE(eB, 1e-12);
    // M is causal: exactly zero above the diagonal, nonzero on it.
    EXPECT_EQ(p.mixing.triu(1).abs().max().item<double>(), 0);
    EXPECT_GT(p.mixing.diagonal(0, -2, -1).abs().min().item<double>(), 0);
  }
}

TEST(DeltaRule, SummaryTransportIsTheTokenProduct) {
  for (const char* family : kFamilies) {
    const Mixer& m = get_mixer(family);
    Shape s;
    s.T = 80;  // 5 chunks of 16
    MixerOptions opt;
    opt.chunk_size = 16;
    auto in = random_inputs(m, s, at::kDouble, 41);
    auto sum = m.summarize(in, opt);
    auto a = token_transitions(in);
    Tensor A = a.select(2, 0);
    for (int64_t t = 1; t < s.T; ++t) A = at::matmul(a.select(2, t), A);  // later token on the left
    auto from_zero = m.naive(in, {}, opt).final_state[0];
    double eA = rel_err(sum.transport[0], A), eB = rel_err(sum.state[0], from_zero);
    std::cout << "[ errors   ] " << family << " summary transport " << eA << " state " << eB << "\n";
    ASSERT_EQ(sum.transport.size(), 1u);
    EXPECT_EQ(sum.transport[0].sizes(), at::IntArrayRef({s.B, s.H, s.dk, s.dk}));
    EXPECT_LE(eA, 1e-12);
    EXPECT_LE(eB, 1e-12);
  }
}

// Gradients of the gated family's run with the entry of g dropped, to line up with DeltaNet's leaves.
std::vector<Tensor> without_g(std::vector<Tensor> grads) {
  grads.erase(grads.begin() + 3);  // leaves are q, k, v, g, beta, S
  return grads;
}

TEST(DeltaRule, GatedWithZeroGateEqualsDeltaNet) {
  const Mixer& plain = get_mixer("deltanet");
  const Mixer& gated = get_mixer("gated_deltanet");
  Shape s;
  s.T = 96;
  MixerOptions opt;
  opt.chunk_size = 32;
  auto in = random_inputs(plain, s, at::kDouble, 51);
  auto st = random_state(plain, in, opt, 52);
  auto gin = in;
  gin.g = at::zeros({s.B, s.T, s.H}, at::kDouble);
  // Across forms, so the two families never run the same code path against each other.
  auto a = run_with_grads(gated, Form::chunkwise, gin, st, opt);
  auto b = run_with_grads(plain, Form::naive, in, st, opt);
  auto c = run_with_grads(gated, Form::naive, gin, st, opt);
  auto d = run_with_grads(plain, Form::chunkwise, in, st, opt);
  double e1 = max_rel_err(a.outputs, b.outputs), g1 = max_rel_err(without_g(a.grads), b.grads);
  double e2 = max_rel_err(c.outputs, d.outputs), g2 = max_rel_err(without_g(c.grads), d.grads);
  auto sg = gated.summarize(gin, opt), sp = plain.summarize(in, opt);
  double es = std::max(rel_err(sg.transport[0], sp.transport[0]), rel_err(sg.state[0], sp.state[0]));
  std::cout << "[ errors   ] gated_deltanet(g=0) vs deltanet: forward " << e1 << " / " << e2
            << " gradients " << g1 << " / " << g2 << " summary " << es << "\n";
  EXPECT_LE(e1, 1e-10);
  EXPECT_LE(g1, 1e-10);
  EXPECT_LE(e2, 1e-10);
  EXPECT_LE(g2, 1e-10);
  EXPECT_LE(es, 1e-12);
  // And g does matter: a nonzero gate changes the output.
  auto gin2 = gin;
  gin2.g = random_inputs(gated, s, at::kDouble, 53).g;
  EXPECT_GT(rel_err(gated.chunkwise(gin2, st, opt).o, a.outputs[0]), 1e-3);
}

TEST(DeltaRule, BetaRangeIsZeroToTwo) {
  for (const char* family : kFamilies) {
    const Mixer& m = get_mixer(family);
    Shape s;
    MixerOptions opt;
    opt.chunk_size = 16;
    opt.check_values = true;
    auto in = random_inputs(m, s, at::kDouble, 61);
    const double inf = std::numeric_limits<double>::infinity();
    for (double bad : {-0.01, 2.01, -inf, inf, std::nan("")}) {
      auto b = in;
      b.beta = in.beta.clone();
      b.beta.view(-1)[17] = bad;
      // NaN and inf are caught by the finiteness check, the rest by the range check.
      std::vector<std::string> needles{"'beta'"};
      needles.push_back(std::isfinite(bad) ? "[0, 2]" : "NaN or infinite");
      expect_error([&] { m.naive(b, {}, opt); }, needles);
      expect_error([&] { m.chunkwise(b, {}, opt); }, needles);
      expect_error([&] { m.summarize(b, opt); }, needles);
      expect_error([&] { delta_rule_chunk(b, 0, opt); }, needles);
    }
    // The boundaries are accepted, and the forms still agree there (β = 2: reflections, β = 0: no write).
    auto edge = in;
    edge.beta = in.beta.clone();
    edge.beta.view(-1).slice(0, 0, -1, 3).fill_(2.0);
    edge.beta.view(-1).slice(0, 1, -1, 7).fill_(0.0);
    auto st = random_state(m, edge, opt, 62);
    auto a = run_with_grads(m, Form::chunkwise, edge, st, opt);
    auto b = run_with_grads(m, Form::naive, edge, st, opt);
    double eo = max_rel_err(a.outputs, b.outputs), eg = max_rel_err(a.grads, b.grads);
    std::cout << "[ errors   ] " << family << " beta in {0, 2} at places: forward " << eo
              << " gradients " << eg << "\n";
    EXPECT_LE(eo, 1e-10);
    EXPECT_LE(eg, 1e-10);
  }
}

TEST(DeltaRule, LowPrecisionInputsKeepFp32StateAndTransport) {
  for (const char* family : kFamilies) {
    const Mixer& m = get_mixer(family);
    Shape s;
    MixerOptions opt;
    opt.chunk_size = 16;
    auto in64 = random_inputs(m, s, at::kDouble, 71);
    // Reference: fp64 on the same (rounded) inputs, so only the computation's precision is measured;
    // the chunk algebra runs in fp32 for both dtypes, only bf16's output rounding (2^-8) is added.
    for (auto [dt, tol] : {std::pair{at::kFloat, 1e-5}, std::pair{at::kBFloat16, 1e-2}}) {
      MixerInputs in, in_ref;
      for (const char* n : {"q", "k", "v", "g", "beta"})
        if (in64.get(n).defined()) {
          in.get(n) = in64.get(n).to(dt);
          in_ref.get(n) = in.get(n).to(at::kDouble);
        }
      auto ref = m.naive(in_ref, {}, opt);
      auto ref_sum = m.summarize(in_ref, opt);
      auto out = m.chunkwise(in, {}, opt);
      auto sum = m.summarize(in, opt);
      EXPECT_EQ(out.o.scalar_type(), dt);
      EXPECT_EQ(out.final_state[0].scalar_type(), at::kFloat);
      EXPECT_EQ(m.zero_state(in, opt)[0].scalar_type(), at::kFloat);
      EXPECT_EQ(sum.transport[0].scalar_type(), at::kFloat);
      EXPECT_EQ(sum.state[0].scalar_type(), at::kFloat);
      double eo = rel_err(out.o.to(at::kDouble), ref.o);
      double ea = rel_err(sum.transport[0].to(at::kDouble), ref_sum.transport[0]);
      std::cout << "[ errors   ] " << family << " " << dt << " inputs vs fp64: output " << eo
                << " transport " << ea << "\n";
      EXPECT_LE(eo, tol);
      EXPECT_LE(ea, 1e-5);
    }
  }
}

}  // namespace
}  // namespace carry::testing
