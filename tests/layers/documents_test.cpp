// Packed documents (layers/mixer.h: MixerOptions::document_starts, forward_documents) for every
// family, in fp64: Mixer::forward with document starts (whole chunks in the chunkwise form) equals
// running each document on its own in the naive form -- from the initial state for the piece that
// continues a document begun before the slice, from zeros for every other -- in outputs, final state
// and the gradients of every input and the initial state; documents start mid-chunk, on a chunk
// boundary and at position 0. A change to one document's tokens leaves every other document's outputs
// exactly as they were.
#include "tests/helpers/mixer_testing.h"
#include "tests/helpers/one_thread.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

namespace carry::testing {
namespace {

class Documents : public ::testing::TestWithParam<std::string> {
 protected:
  const Mixer& mixer() const { return get_mixer(GetParam()); }
};

// Where documents start: sequence 0 at 13 (mid-chunk), 32 (a chunk boundary) and 33; sequence 1 at 0
// and 21, sequence 2 nowhere (one document continuing from the initial state).
Tensor starts_for(int64_t B, int64_t T) {
  auto s = at::zeros({B, T}, at::kBool);
  for (int64_t p : {13, 32, 33}) s[0][p] = true;
  s[1][0] = true;
  s[1][21] = true;
  return s;
}

struct Run {
  std::vector<Tensor> outputs;  // o, final state entries
  std::vector<Tensor> grads;    // inputs (MixerInputs order), then initial state entries
};

// Σ o·w + Σ S·w' and its gradients through `f` (which maps leaf inputs and state to an output).
Run differentiate(const Mixer& m, const MixerInputs& in, const State& st,
                  const std::function<MixerOutput(const MixerInputs&, const State&)>& f) {
  at::AutoGradMode grad(true);
  MixerInputs leaves;
  std::vector<Tensor> wrt;
  for (const auto& n : MixerInputs::names())
    if (in.get(n).defined()) {
      leaves.get(n) = in.get(n).detach().clone().requires_grad_(true);
      wrt.push_back(leaves.get(n));
    }
  State s;
  for (auto& t : st) {
    s.push_back(t.detach().clone().requires_grad_(true));
    wrt.push_back(s.back());
  }
  auto out = f(leaves, s);
  at::manual_seed(5);
  auto loss = (out.o * at::randn_like(out.o)).sum();
  for (auto& t : out.final_state) loss = loss + (t * at::randn_like(t)).sum();
  auto grads = torch::autograd::grad({loss}, wrt, {}, false, false, /*allow_unused=*/true);
  Run r;
  r.outputs.push_back(out.o.detach());
  for (auto& t : out.final_state) r.outputs.push_back(t.detach());
  for (size_t i = 0; i < grads.size(); ++i) r.grads.push_back(grads[i].defined() ? grads[i] : at::zeros_like(wrt[i]));
  return r;
}

TEST_P(Documents, EachDocumentRunsAsIfAlone) {
  OneCpuThread one_thread;
  const Mixer& m = mixer();
  Shape s;
  s.B = 3;
  s.T = 48;
  MixerOptions opt;
  opt.chunk_size = 8;
  opt.offset = 0;
  auto in = random_inputs(m, s, at::kDouble, 31);
  State st = m.has_summary() ? random_state(m, in, opt, 32) : State{};
  const auto starts = starts_for(s.B, s.T);

  MixerOptions doc = opt;
  doc.form = Form::chunkwise;
  doc.document_starts = starts;
  auto packed = differentiate(m, in, st, [&](const MixerInputs& x, const State& s0) { return m.forward(x, s0, doc); });

  // The reference: per sequence, per document, the naive form on that document alone.
  auto reference = differentiate(m, in, st, [&](const MixerInputs& x, const State& s0) {
    std::vector<Tensor> os;
    std::vector<State> finals;
    for (int64_t b = 0; b < s.B; ++b) {
      std::vector<int64_t> cuts{0};
      for (int64_t p = 1; p < s.T; ++p)
        if (starts[b][p].item<bool>()) cuts.push_back(p);
      cuts.push_back(s.T);
      std::vector<Tensor> pieces;
      State cur;
      for (size_t k = 0; k + 1 < cuts.size(); ++k) {
        const MixerInputs sequence = x.sequences(b, 1);
        const MixerInputs piece = sequence.slice(cuts[k], cuts[k + 1] - cuts[k]);  // tokens (sub-step rows too)
        State init;
        if (k == 0 && !starts[b][0].item<bool>())
          for (auto& t : s0) init.push_back(t.narrow(0, b, 1));
        auto r = m.naive(piece, init, opt);
        pieces.push_back(r.o);
        cur = r.final_state;
      }
      os.push_back(at::cat(pieces, 1));
      finals.push_back(cur);
    }
    MixerOutput out;
    out.o = at::cat(os, 0);
    for (size_t i = 0; i < finals[0].size(); ++i) {
      std::vector<Tensor> parts;
      for (auto& f : finals) parts.push_back(f[i]);
      out.final_state.push_back(at::cat(parts, 0));
    }
    return out;
  });
  const double eo = max_rel_err(packed.outputs, reference.outputs), eg = max_rel_err(packed.grads, reference.grads);
  std::cout << "[ errors   ] " << m.name() << " packed documents vs each alone (naive): forward " << eo
            << " gradients " << eg << "\n";
  EXPECT_LE(eo, 1e-10);
  EXPECT_LE(eg, 1e-10);
  ASSERT_EQ(packed.grads.size(), reference.grads.size());

  // Nothing crosses a boundary: change sequence 0's first document (tokens 0..12) and sequence 1's
  // first one (0..20); every other document's outputs stay bit for bit.
  MixerInputs changed;
  for (const auto& n : MixerInputs::names())
    if (in.get(n).defined()) changed.get(n) = in.get(n).clone();
  {
    at::NoGradGuard no_grad;
    changed.v.narrow(0, 0, 1).narrow(1, 0, 13).add_(1.0);
    changed.v.narrow(0, 1, 1).narrow(1, 0, 21).mul_(-2.0);
  }
  auto a = m.forward(in, st, doc).o, b = m.forward(changed, st, doc).o;
  EXPECT_TRUE(at::equal(a.narrow(0, 0, 1).narrow(1, 13, s.T - 13), b.narrow(0, 0, 1).narrow(1, 13, s.T - 13)));
  EXPECT_TRUE(at::equal(a.narrow(0, 1, 1).narrow(1, 21, s.T - 21), b.narrow(0, 1, 1).narrow(1, 21, s.T - 21)));
  EXPECT_FALSE(at::equal(a.narrow(0, 0, 1).narrow(1, 0, 13), b.narrow(0, 0, 1).narrow(1, 0, 13)));
  if (m.has_summary()) {  // the initial state reaches only the continuing documents
    auto zero = m.forward(in, m.zero_state(in, opt), doc).o;
    EXPECT_TRUE(at::equal(zero.narrow(0, 1, 1), a.narrow(0, 1, 1)));
    EXPECT_TRUE(at::equal(zero.narrow(0, 0, 1).narrow(1, 13, s.T - 13), a.narrow(0, 0, 1).narrow(1, 13, s.T - 13)));
    EXPECT_FALSE(at::equal(zero.narrow(0, 2, 1), a.narrow(0, 2, 1)));
  }
}

INSTANTIATE_TEST_SUITE_P(AllFamilies, Documents, ::testing::ValuesIn(mixer_names()),
                         [](const auto& info) { return info.param; });

TEST(DocumentsErrors, StartsMustMatchTheInputs) {
  const Mixer& m = get_mixer("gla");
  Shape s;
  auto in = random_inputs(m, s, at::kDouble, 1);
  MixerOptions opt;
  opt.chunk_size = 16;
  opt.document_starts = at::zeros({s.B, s.T + 1}, at::kBool);
  expect_error([&] { m.forward(in, {}, opt); }, "document_starts must be a CPU bool tensor [B, T] = [2, 64]");
}

}  // namespace
}  // namespace carry::testing
