// Tests of layers/hla/hla.* beyond the generic contract (mixer_test.cpp runs for "hla2" and "ahla" too):
// the decayed combine of two slice summaries equals the token recurrence over both slices, with a
// per-token decay; combines with the cross term missing or decayed otherwise (README.md, Design §2: the HLA
// paper's printed §4.3 combine is not to be trusted) differ from the recurrence, so the check can fail; no gate equals
// g ≡ 0; the chunkwise form equals the recurrence over many chunks, gradients included.
#include "layers/hla/hla.h"
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>

namespace carry::testing {
namespace {

Tensor matvec(const Tensor& M, const Tensor& x) { return at::matmul(M, x.unsqueeze(-1)).squeeze(-1); }
Tensor r4(const Tensor& rho) { return rho.unsqueeze(-1).unsqueeze(-1); }
Tensor r3(const Tensor& rho) { return rho.unsqueeze(-1); }

// Inputs with a per-token decay that varies from token to token (γ_t roughly 0.9 .. 0.998), mild enough
// that ρ over a slice stays far from 0, so terms that carry ρ are visible.
MixerInputs decayed_inputs(const Mixer& m, const Shape& s, uint64_t seed) {
  auto in = random_inputs(m, s, at::kDouble, seed);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + 1);
  in.g = at::log_sigmoid(at::randn({s.B, s.T, s.H}, gen, at::kDouble) + 4);
  return in;
}

// Σ_t exp(Σ_{r>t} g_r) x_t y_tᵀ over a slice, for x, y [B,T,H,d]: the "decayed from t" weighting.
Tensor decayed_from_token(const Tensor& x, const Tensor& y, const Tensor& g) {
  auto b = g.cumsum(1);                                                  // [B,T,H]
  auto w = at::exp(b.narrow(1, b.size(1) - 1, 1) - b);                   // ρ / Γ_t
  return at::einsum("bth,bthi,bthj->bhij", {w, x, y});
}
// Σ_t x_t y_tᵀ (undecayed).
Tensor undecayed(const Tensor& x, const Tensor& y) { return at::einsum("bthi,bthj->bhij", {x, y}); }

struct Slices {
  MixerInputs a, b, ab;
  State x;  // a random state before A
};

Slices make_slices(const Mixer& m, int64_t TA, int64_t TB, uint64_t seed) {
  Shape s;
  s.T = TA + TB;
  Slices r;
  r.ab = decayed_inputs(m, s, seed);
  r.a = r.ab.slice(0, TA);
  r.b = r.ab.slice(TA, TB);
  r.x = random_state(m, r.ab, MixerOptions{}, seed + 2);
  return r;
}

// hla2's A-then-B state with a chosen G/h cross matrix (the right one is S̃_B).
State hla2_combine_with(const Summary& A, const Summary& B, const Tensor& cross) {
  auto rb4 = r4(B.transport[0]), rb3 = r3(B.transport[0]);
  const State &a = A.state, &b = B.state;
  State out = {rb4 * a[0] + b[0], rb4 * a[1] + b[1], rb3 * a[2] + b[2], rb4 * a[3] + b[3],
               rb3 * a[4] + b[4]};
  if (cross.defined()) {
    out[3] = out[3] + at::matmul(cross, a[1]);
    out[4] = out[4] + matvec(cross, a[2]);
  }
  return out;
}

TEST(Hla2, DecayedCombineEqualsTokenRecurrence) {
  const Mixer& m = get_mixer(kHla2Family);
  MixerOptions opt;
  opt.chunk_size = 16;
  auto sl = make_slices(m, 32, 48, 31);
  auto A = m.summarize(sl.a, opt), B = m.summarize(sl.b, opt);
  auto AB = m.compose(A, B);
  // The recurrence over A then B, from zero and from a random state X.
  auto from_zero = m.naive(sl.ab, {}, opt).final_state;
  auto from_x = m.naive(sl.ab, sl.x, opt).final_state;
  double e_zero = max_rel_err(AB.state, from_zero);
  double e_x = max_rel_err(m.apply(AB, sl.x), from_x);
  // Each slice's summary against the recurrence over that slice alone.
  double e_a = max_rel_err(m.apply(A, sl.x), m.naive(sl.a, sl.x, opt).final_state);
  std::cout << "[ errors   ] hla2 decayed combine vs recurrence: from zero " << e_zero << ", from X "
            << e_x << ", one slice from X " << e_a << "\n";
  EXPECT_LE(e_zero, 1e-12);
  EXPECT_LE(e_x, 1e-12);
  EXPECT_LE(e_a, 1e-12);

  // The same combine written out by hand with S̃_B passes; wrong cross terms fail.
  const Tensor& S_tilde_b = B.transport[1];
  double e_right = max_rel_err(hla2_combine_with(A, B, S_tilde_b), from_zero);
  // No cross term at all.
  double e_none = max_rel_err(hla2_combine_with(A, B, Tensor()), from_zero);
  // Cross term decayed from token t to the end, Σ (ρ/Γ_t) k kᵀ = S_B, instead of Σ (ρ/γ_t) k kᵀ.
  double e_s = max_rel_err(hla2_combine_with(A, B, B.state[0]), from_zero);
  // Cross term decayed from token t−1 to the end, Σ exp(b_T − b_{t−1}) k kᵀ.
  auto bb = sl.b.g.cumsum(1);
  auto w_prev = at::exp(bb.narrow(1, bb.size(1) - 1, 1) - bb + sl.b.g);
  double e_prev = max_rel_err(
      hla2_combine_with(A, B, at::einsum("bth,bthi,bthj->bhij", {w_prev, sl.b.k, sl.b.k})), from_zero);
  // Cross term with ρ_B in front of an undecayed sum.
  auto undec = r4(B.transport[0]) * undecayed(sl.b.k, sl.b.k);
  double e_rho = max_rel_err(hla2_combine_with(A, B, undec), from_zero);
  // The check of S̃ itself: S̃_B = Σ (ρ/γ_t) k kᵀ computed directly from B's gates.
  auto b = sl.b.g.cumsum(1);
  auto w = at::exp(b.narrow(1, b.size(1) - 1, 1) - sl.b.g);              // ρ/γ_t = exp(b_T − g_t)
  double e_st = rel_err(S_tilde_b, at::einsum("bth,bthi,bthj->bhij", {w, sl.b.k, sl.b.k}));
  // Transport composed without ρ_A on S̃_B: acting on X it must fail.
  Summary wrong = AB;
  wrong.transport[1] = r4(B.transport[0]) * A.transport[1] + B.transport[1];
  double e_tr_right = max_rel_err(m.apply(AB, sl.x), from_x);
  double e_tr_wrong = max_rel_err(m.apply(wrong, sl.x), from_x);
  std::cout << "[ errors   ] hla2 combine by hand " << e_right << ", S_tilde direct " << e_st
            << "; wrong combines: no cross " << e_none << ", S_B as cross " << e_s
            << ", decayed from t-1 " << e_prev << ", rho*undecayed " << e_rho << ", S_tilde without rho_A " << e_tr_wrong << "\n";
  EXPECT_LE(e_right, 1e-12);
  EXPECT_LE(e_st, 1e-12);
  EXPECT_LE(e_tr_right, 1e-12);
  EXPECT_GT(e_none, 1e-3);
  EXPECT_GT(e_s, 1e-3);
  EXPECT_GT(e_prev, 1e-3);
  EXPECT_GT(e_rho, 1e-3);
  EXPECT_GT(e_tr_wrong, 1e-3);
}

// ahla's A-then-B state with a chosen E/n cross matrix (the right one is ρ_B R̄_B).
State ahla_combine_with(const Summary& A, const Summary& B, const Tensor& cross) {
  auto rb4 = r4(B.transport[0]), rb3 = r3(B.transport[0]);
  const State &a = A.state, &b = B.state;
  State out = {rb4 * a[0] + b[0], rb3 * a[1] + b[1], rb4 * a[2] + b[2], rb3 * a[3] + b[3]};
  if (cross.defined()) {
    out[2] = out[2] + at::matmul(cross, a[0]);
    out[3] = out[3] + matvec(cross, a[1]);
  }
  return out;
}

TEST(Ahla, DecayedCombineEqualsTokenRecurrence) {
  const Mixer& m = get_mixer(kAhlaFamily);
  MixerOptions opt;
  opt.chunk_size = 16;
  auto sl = make_slices(m, 32, 48, 41);
  auto A = m.summarize(sl.a, opt), B = m.summarize(sl.b, opt);
  auto AB = m.compose(A, B);
  auto from_zero = m.naive(sl.ab, {}, opt).final_state;
  auto from_x = m.naive(sl.ab, sl.x, opt).final_state;
  double e_zero = max_rel_err(AB.state, from_zero);
  double e_x = max_rel_err(m.apply(AB, sl.x), from_x);
  double e_a = max_rel_err(m.apply(A, sl.x), m.naive(sl.a, sl.x, opt).final_state);
  // R̄ is the undecayed Σ k qᵀ, and R̄_AB = R̄_A + R̄_B.
  double e_r = rel_err(AB.transport[1], undecayed(sl.ab.k, sl.ab.q));
  std::cout << "[ errors   ] ahla decayed combine vs recurrence: from zero " << e_zero << ", from X "
            << e_x << ", one slice from X " << e_a << ", R_bar " << e_r << "\n";
  EXPECT_LE(e_zero, 1e-12);
  EXPECT_LE(e_x, 1e-12);
  EXPECT_LE(e_a, 1e-12);
  EXPECT_LE(e_r, 1e-12);

  auto rb = r4(B.transport[0]);
  double e_right = max_rel_err(ahla_combine_with(A, B, rb * B.transport[1]), from_zero);
  double e_none = max_rel_err(ahla_combine_with(A, B, Tensor()), from_zero);
  // R decayed like the state, Σ (ρ/Γ_t) k qᵀ, in place of ρ_B R̄_B.
  double e_dec = max_rel_err(
      ahla_combine_with(A, B, decayed_from_token(sl.b.k, sl.b.q, sl.b.g)), from_zero);
  // R̄_B without the factor ρ_B.
  double e_norho = max_rel_err(ahla_combine_with(A, B, B.transport[1]), from_zero);
  // Transport composed as a decayed state, ρ_B R̄_A + R̄_B: acting on X it must fail.
  Summary wrong = AB;
  wrong.transport[1] = r4(B.transport[0]) * A.transport[1] + B.transport[1];
  double e_tr_wrong = max_rel_err(m.apply(wrong, sl.x), from_x);
  std::cout << "[ errors   ] ahla combine by hand " << e_right << "; wrong combines: no cross "
            << e_none << ", decayed R " << e_dec << ", R_bar without rho_B " << e_norho
            << ", R_bar composed with rho_B " << e_tr_wrong << "\n";
  EXPECT_LE(e_right, 1e-12);
  EXPECT_GT(e_none, 1e-3);
  EXPECT_GT(e_dec, 1e-3);
  EXPECT_GT(e_norho, 1e-3);
  EXPECT_GT(e_tr_wrong, 1e-3);
}

class HlaFamilies : public ::testing::TestWithParam<std::string> {
 protected:
  const Mixer& mixer() const { return get_mixer(GetParam()); }
};

TEST_P(HlaFamilies, NoGateEqualsZeroGate) {
  const Mixer& m = mixer();
  Shape s;
  s.T = 64;
  auto in = random_inputs(m, s, at::kDouble, 51);
  auto zero_g = in;
  zero_g.g = at::zeros({s.B, s.T, s.H}, at::kDouble);
  in.g = Tensor();
  MixerOptions opt;
  opt.chunk_size = 16;
  auto st = random_state(m, in, opt, 52);
  double worst = 0;
  for (bool normalize : {false, true}) {
    opt.normalize = normalize;
    for (bool chunked : {false, true}) {
      auto a = chunked ? m.chunkwise(in, st, opt) : m.naive(in, st, opt);
      auto b = chunked ? m.chunkwise(zero_g, st, opt) : m.naive(zero_g, st, opt);
      worst = std::max({worst, rel_err(a.o, b.o), max_rel_err(a.final_state, b.final_state)});
    }
  }
  auto sa = m.summarize(in, opt), sb = m.summarize(zero_g, opt);
  worst = std::max({worst, max_rel_err(sa.state, sb.state), max_rel_err(sa.transport, sb.transport)});
  // Without g the forms must really differ from a decayed run (the gate is read when given).
  auto decayed = random_inputs(m, s, at::kDouble, 51);
  double differ = rel_err(m.chunkwise(decayed, st, opt).o, m.chunkwise(in, st, opt).o);
  std::cout << "[ errors   ] " << m.name() << " no g vs g=0: " << worst << " (vs decayed: " << differ
            << ")\n";
  EXPECT_LE(worst, 1e-14);
  EXPECT_GT(differ, 1e-3);
}

TEST_P(HlaFamilies, ChunkwiseEqualsRecurrenceOverManyChunks) {
  const Mixer& m = mixer();
  Shape s;
  s.T = 1024;
  s.B = 1;
  MixerOptions opt;
  opt.chunk_size = 16;  // 64 chunks
  for (bool normalize : {false, true}) {
    opt.normalize = normalize;
    auto in = random_inputs(m, s, at::kDouble, 61);
    auto st = random_state(m, in, opt, 62);
    auto a = run_with_grads(m, Form::chunkwise, in, st, opt);
    auto b = run_with_grads(m, Form::naive, in, st, opt);
    double eo = max_rel_err(a.outputs, b.outputs), eg = max_rel_err(a.grads, b.grads);
    std::cout << "[ errors   ] " << m.name() << " T=1024 C=16" << (normalize ? " normalized" : "")
              << " forward " << eo << " gradients " << eg << "\n";
    EXPECT_LE(eo, 1e-10);
    EXPECT_LE(eg, 1e-10);
  }
}

TEST_P(HlaFamilies, MalformedSummariesAndStatesAreRefused) {
  const Mixer& m = mixer();
  Shape s;
  s.T = 32;
  MixerOptions opt;
  opt.chunk_size = 16;
  auto in = random_inputs(m, s, at::kDouble, 71);
  auto sum = m.summarize(in, opt);
  Summary short_sum = sum;
  short_sum.transport.pop_back();
  try {
    m.compose(sum, short_sum);
    ADD_FAILURE() << "compose accepted a summary without its S_tilde/R_bar";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("transport"), std::string::npos)
        << e.what_without_backtrace();
  }
  State bad = m.zero_state(in, opt);
  bad.pop_back();
  EXPECT_THROW(m.apply(sum, bad), c10::Error);
  // A wrong-shaped initial state names the entry.
  State wrong = m.zero_state(in, opt);
  wrong[0] = at::zeros({1, 1, 1}, at::kDouble);
  try {
    m.chunkwise(in, wrong, opt);
    ADD_FAILURE() << "chunkwise accepted a wrong-shaped initial state";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("initial_state"), std::string::npos)
        << e.what_without_backtrace();
  }
  // A positive log gate is refused (values checked).
  opt.check_values = true;
  auto up = in;
  up.g = in.g.abs() + 0.1;
  EXPECT_THROW(m.naive(up, {}, opt), c10::Error);
}

INSTANTIATE_TEST_SUITE_P(Hla, HlaFamilies, ::testing::Values(kHla2Family, kAhlaFamily),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace carry::testing
