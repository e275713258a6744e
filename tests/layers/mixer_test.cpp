// The mixer contract, checked for every registered family in fp64 on random inputs: chunkwise equals
// naive (outputs, final state, gradients of every input and of the initial state) at two chunk sizes
// over many chunks; a sequence cut into 2, 3 and 5 pieces with the state passed along equals the
// whole; compose is associative; apply(summarize(x), S) equals forward(x, S)'s final state; bad inputs
// are refused with a message naming the problem.
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>

namespace carry::testing {
namespace {

class MixerContract : public ::testing::TestWithParam<std::string> {
 protected:
  const Mixer& mixer() const { return get_mixer(GetParam()); }
};

TEST_P(MixerContract, ChunkwiseEqualsNaiveWithGradients) {
  const Mixer& m = mixer();
  for (int64_t C : {16, 32}) {
    Shape s;
    s.T = 128;
    s.offset = 7 * 64;
    MixerOptions opt;
    opt.chunk_size = C;
    opt.offset = s.offset;
    for (bool normalize : {false, true}) {
      opt.normalize = normalize;
      auto in = random_inputs(m, s, at::kDouble, 1000 + C);
      auto st = random_state(m, in, opt, 2000 + C);
      auto a = run_with_grads(m, Form::chunkwise, in, st, opt);
      auto b = run_with_grads(m, Form::naive, in, st, opt);
      double eo = max_rel_err(a.outputs, b.outputs), eg = max_rel_err(a.grads, b.grads);
      std::cout << "[ errors   ] " << m.name() << " C=" << C << (normalize ? " normalized" : "")
                << " forward " << eo << " gradients " << eg << "\n";
      EXPECT_LE(eo, 1e-10);
      EXPECT_LE(eg, 1e-10);
      ASSERT_EQ(a.grads.size(), b.grads.size());
      for (auto& g : a.grads) EXPECT_GT(g.abs().max().item<double>(), 0) << "a gradient is all zeros";
    }
  }
}

TEST_P(MixerContract, PiecesWithStatePassedEqualWhole) {
  const Mixer& m = mixer();
  if (!m.has_summary()) GTEST_SKIP() << m.name() << " has no recurrent state";
  const int64_t C = 16;
  Shape s;
  s.T = 30 * C;
  s.offset = 3 * 64;
  MixerOptions opt;
  opt.chunk_size = C;
  opt.offset = s.offset;
  auto in = random_inputs(m, s, at::kDouble, 7);
  auto st = random_state(m, in, opt, 8);
  auto whole = m.chunkwise(in, st, opt);
  for (int pieces : {2, 3, 5}) {
    // Uneven cuts on chunk boundaries: piece i gets (i+1) shares.
    std::vector<int64_t> len;
    int64_t shares = pieces * (pieces + 1) / 2, used = 0;
    for (int i = 0; i < pieces; ++i) {
      int64_t n = i + 1 == pieces ? s.T / C - used : (s.T / C) * (i + 1) / shares;
      len.push_back(n * C);
      used += n;
    }
    State cur = st;
    std::vector<Tensor> outs;
    int64_t start = 0;
    for (int64_t n : len) {
      MixerOptions po = opt;
      po.offset = s.offset + start;
      auto r = m.chunkwise(in.slice(start, n), cur, po);
      outs.push_back(r.o);
      cur = r.final_state;
      start += n;
    }
    double eo = rel_err(at::cat(outs, 1), whole.o), es = max_rel_err(cur, whole.final_state);
    std::cout << "[ errors   ] " << m.name() << " " << pieces << " pieces: output " << eo
              << " state " << es << "\n";
    EXPECT_LE(eo, 1e-12);
    EXPECT_LE(es, 1e-12);
  }
}

TEST_P(MixerContract, SummaryAlgebra) {
  const Mixer& m = mixer();
  if (!m.has_summary()) GTEST_SKIP() << m.name() << " has no recurrent state";
  const int64_t C = 16;
  Shape s;
  s.T = 12 * C;
  s.offset = 5 * 64;
  MixerOptions opt;
  opt.chunk_size = C;
  opt.offset = s.offset;
  auto in = random_inputs(m, s, at::kDouble, 21);
  auto st = random_state(m, in, opt, 22);
  int64_t cuts[] = {0, 3 * C, 7 * C, 12 * C};
  std::vector<Summary> sum;
  for (int i = 0; i < 3; ++i) {
    MixerOptions po = opt;
    po.offset = s.offset + cuts[i];
    sum.push_back(m.summarize(in.slice(cuts[i], cuts[i + 1] - cuts[i]), po));
  }
  // Associativity, on the state part and on the transport's action on a random state.
  auto left = m.compose(m.compose(sum[0], sum[1]), sum[2]);
  auto right = m.compose(sum[0], m.compose(sum[1], sum[2]));
  double ea = max_rel_err(left.state, right.state);
  double et = max_rel_err(m.apply(left, st), m.apply(right, st));
  // apply(summarize(x), S) == forward(x, S).final_state, for one slice and for the composition.
  auto whole = m.chunkwise(in, st, opt);
  double e1 = max_rel_err(m.apply(left, st), whole.final_state);
  auto first = m.chunkwise(in.slice(0, cuts[1]), st, opt);
  double e2 = max_rel_err(m.apply(sum[0], st), first.final_state);
  std::cout << "[ errors   ] " << m.name() << " associativity " << ea << " / " << et
            << " apply(summary) " << e1 << " / " << e2 << "\n";
  EXPECT_LE(ea, 1e-12);
  EXPECT_LE(et, 1e-12);
  EXPECT_LE(e1, 1e-12);
  EXPECT_LE(e2, 1e-12);
}

// The families with a closed form of the incoming state's share and a fixed summary for the end ranks
// (the tree and allgather scans' one-pass form and shortcut).
bool has_one_pass_form(const std::string& n) {
  return n == "scalar_decay" || n == "gla" || n == "mamba1" || n == "linear_attn" || n == "deltanet" ||
         n == "gated_deltanet" || n == "kda" || n == "rwkv7" || n == "gated_deltaproduct";
}

// Families with Mixer::fixed_summary: the one-pass ones and HLA's two (a zero transport).
bool has_fixed_summary(const std::string& n) { return has_one_pass_form(n) || n == "hla2" || n == "ahla"; }

// Families with a closed form of the incoming state's share (the one-pass tree and allgather scans):
// forward(x, S).o = forward(x, 0).o + state_output(x, S) and forward(x, S).final_state =
// apply({transport(x), forward(x, 0).final_state}, S), plain and normalized where the family says so.
TEST_P(MixerContract, StateOutputIsTheIncomingStatesShare) {
  const Mixer& m = mixer();
  if (!m.has_summary()) GTEST_SKIP() << m.name() << " has no recurrent state";
  const int64_t C = 16;
  Shape s;
  s.T = 10 * C;
  s.offset = 2 * 64;
  MixerOptions opt;
  opt.chunk_size = C;
  opt.offset = s.offset;
  int checked = 0;
  for (bool normalize : {false, true}) {
    opt.normalize = normalize;
    auto in = random_inputs(m, s, at::kDouble, 31);
    if (!m.has_state_output(in, opt)) continue;
    auto st = random_state(m, in, opt, 32);
    auto with = m.chunkwise(in, st, opt);
    auto from_zero = m.chunkwise(in, {}, opt);
    auto o = from_zero.o + m.state_output(in, st, opt);
    auto fin = m.apply(Summary{m.transport(in, opt), from_zero.final_state}, st);
    double eo = max_rel_err({o}, {with.o}), es = max_rel_err(fin, with.final_state);
    double share = (with.o - from_zero.o).abs().max().item<double>() / with.o.abs().max().item<double>();
    std::cout << "[ errors   ] " << m.name() << (normalize ? " normalized" : "") << " state_output " << eo
              << " final state " << es << " (the incoming state's share of o: " << share << ")\n";
    EXPECT_LE(eo, 1e-12);
    EXPECT_LE(es, 1e-12);
    EXPECT_GT(share, 1e-3) << "the incoming state must matter for the check to mean anything";
    ++checked;
  }
  const std::string n = m.name();
  if (has_one_pass_form(n))
    EXPECT_GE(checked, 1) << n << " has the one-pass form";
  if (n == "linear_attn") EXPECT_EQ(checked, 1) << "normalized linear attention is not linear in the state";
}

// Mixer::fixed_summary (the end ranks of the tree and allgather scans): its state is the given one
// and its transport has the shapes of the family's own summaries (it is composed and sent like theirs);
// where the family's transport can be zero, composing it after any summary gives the given state.
TEST_P(MixerContract, FixedSummaryHasTheSummaryShapes) {
  const Mixer& m = mixer();
  if (!m.has_summary()) GTEST_SKIP() << m.name() << " has no recurrent state";
  const int64_t C = 16;
  Shape s;
  s.T = 4 * C;
  MixerOptions opt;
  opt.chunk_size = C;
  auto in = random_inputs(m, s, at::kDouble, 41);
  auto st = random_state(m, in, opt, 42);
  auto fixed = m.fixed_summary(in, st);
  const std::string n = m.name();
  ASSERT_EQ(fixed.has_value(), has_fixed_summary(n)) << n;
  if (!fixed) return;
  Summary own = m.summarize(in, opt);
  ASSERT_EQ(fixed->transport.size(), own.transport.size()) << n;
  for (size_t i = 0; i < own.transport.size(); ++i)
    EXPECT_EQ(fixed->transport[i].sizes(), own.transport[i].sizes()) << n << " transport " << i;
  ASSERT_EQ(fixed->state.size(), st.size());
  for (size_t i = 0; i < st.size(); ++i) EXPECT_TRUE(fixed->state[i].equal(st[i])) << n << " state " << i;
  if (n == "linear_attn") return;  // its only transport is the identity
  auto other = random_state(m, in, opt, 43);
  auto out = m.apply(m.compose(own, *fixed), other);
  EXPECT_LE(max_rel_err(out, st), 0.0) << n << ": the zero transport maps every state to the fixed one";
}

// MixerOptions::on_final_state: Mixer::forward calls it exactly once, with the tensors of the returned
// final state (every form; with document starts too, at the end: the documents' own runs must not call
// it). The ordered scan sends the state to the next rank from it.
TEST_P(MixerContract, FinalStateHookRunsOnceWithTheReturnedState) {
  const Mixer& m = mixer();
  Shape s;  // B = 2, T = 64
  MixerOptions opt;
  opt.chunk_size = 16;
  auto in = random_inputs(m, s, at::kDouble, 41);
  State st = m.has_summary() ? random_state(m, in, opt, 42) : State{};
  for (int variant = 0; variant < 3; ++variant) {
    MixerOptions o = opt;
    o.form = variant == 0 ? Form::naive : Form::chunkwise;
    if (variant == 2) {
      auto starts = at::zeros({s.B, s.T}, at::kBool);
      starts[0][0] = true;
      starts[0][24] = true;
      starts[1][40] = true;
      o.document_starts = starts;
    }
    int calls = 0;
    State seen;
    o.on_final_state = [&](const State& fin) {
      ++calls;
      seen = fin;
    };
    MixerOutput out = m.forward(in, st, o);
    const char* what[] = {"naive", "chunkwise", "chunkwise with documents"};
    ASSERT_EQ(calls, 1) << m.name() << " " << what[variant] << ": the hook must run exactly once";
    ASSERT_EQ(seen.size(), out.final_state.size()) << m.name() << " " << what[variant];
    for (size_t i = 0; i < seen.size(); ++i) {
      ASSERT_EQ(seen[i].defined(), out.final_state[i].defined()) << m.name() << " entry " << i;
      if (seen[i].defined())
        EXPECT_TRUE(at::equal(seen[i], out.final_state[i])) << m.name() << " " << what[variant] << ": entry " << i;
    }
  }
}

TEST_P(MixerContract, BadInputsAreRefusedClearly) {
  const Mixer& m = mixer();
  Shape s;
  s.T = 64;
  MixerOptions opt;
  opt.chunk_size = 16;
  auto in = random_inputs(m, s, at::kDouble, 5);
  // Length not a multiple of the chunk size.
  expect_error([&] { m.chunkwise(in.slice(0, 40), {}, opt); }, "multiple of chunk_size");
  // Mismatched heads.
  auto bad = in;
  bad.v = at::randn({s.B, s.T, s.H + 1, s.dv}, at::kDouble);
  expect_error([&] { m.chunkwise(bad, {}, opt); }, "'v'");
  // NaN in a gate (or in k for families without gates).
  auto names = m.input_names();
  std::string gate = "k";
  for (auto n : {"g", "gk", "beta"})
    if (std::find(names.begin(), names.end(), n) != names.end()) gate = n;
  auto nan = in;
  nan.get(gate) = in.get(gate).clone();
  nan.get(gate).view(-1)[3] = std::nan("");
  // Values are looked at only when asked (a device-to-host read): then the NaN is named.
  EXPECT_NO_THROW(m.chunkwise(nan, {}, opt));
  opt.check_values = true;
  expect_error([&] { m.chunkwise(nan, {}, opt); }, "NaN");
  expect_error([&] { m.naive(nan, {}, opt); }, "NaN");
}

INSTANTIATE_TEST_SUITE_P(AllFamilies, MixerContract, ::testing::ValuesIn(mixer_names()),
                         [](const auto& info) { return info.param; });

TEST(MixerRegistry, UnknownFamilyNamesTheKnownOnes) {
  expect_error([] { get_mixer("nope"); }, "linear_attn");
}

}  // namespace
}  // namespace carry::testing
