// RWKV-7's channel mix (layers/rwkv7/channel_mix.h) with nonzero random parameters against a re-statement
// of FLA's RWKV7FeedForward written here (the token shift by padding, addcmul, squared ReLU), fp64: output
// and the gradient of the input and of every parameter, with and without document starts; a slice after
// another, given the token before it through `halo`, equals the whole sequence; FLA's initial values.
#include "layers/rwkv7/channel_mix.h"
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>

#include <cmath>

namespace carry::testing {
namespace {

constexpr int64_t kB = 2, kT = 12, kD = 8, kHidden = 32;

Tensor random(std::vector<int64_t> shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kDouble));
}

double rel(const Tensor& a, const Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-300);
}

// FLA's RWKV7FeedForward.forward: delta = time_shift(x) − x, value(act(key(x.addcmul(delta, x_k)))), sqrelu.
Tensor fla_feed_forward(const Rwkv7ChannelMix& m, const Tensor& x, const Tensor& starts = {}) {
  Tensor shifted = at::constant_pad_nd(x, {0, 0, 1, -1});
  if (starts.defined()) shifted = shifted * starts.logical_not().unsqueeze(-1).to(x.scalar_type());
  Tensor h = at::matmul(x.addcmul(shifted - x, m.x_k), m.key.t());
  return at::matmul(at::relu(h).pow(2), m.value.t());
}

Rwkv7ChannelMix random_mix(uint64_t seed) {
  ParameterInit init(seed, at::TensorOptions().dtype(at::kDouble));
  Rwkv7ChannelMix m(kD, kHidden, 1, 4, init);
  perturb_parameters(m.parameters(), seed + 1, 0.3);  // value starts at 0
  return m;
}

TEST(Rwkv7ChannelMix, EqualsFlaRestatementInOutputAndEveryGradient) {
  auto m = random_mix(3);
  auto x = random({kB, kT, kD}, 4).set_requires_grad(true);
  auto starts = at::zeros({kB, kT}, at::kBool);
  starts.select(1, 0).fill_(true);
  starts[1][5] = true;
  MixerLayerContext documents;
  documents.document_starts = starts;
  for (bool with_documents : {false, true}) {
    auto y = with_documents ? m.forward(x, documents) : m.forward(x);
    auto ref = with_documents ? fla_feed_forward(m, x, starts) : fla_feed_forward(m, x);
    auto w = random({kB, kT, kD}, 5);
    std::vector<Tensor> wrt{x, m.x_k, m.key, m.value};
    auto ga = torch::autograd::grad({(y * w).sum()}, wrt), gb = torch::autograd::grad({(ref * w).sum()}, wrt);
    double worst = 0;
    for (size_t i = 0; i < wrt.size(); ++i) {
      EXPECT_GT(gb[i].abs().max().item<double>(), 1e-8) << i;
      worst = std::max(worst, rel(ga[i], gb[i]));
    }
    std::printf("[ errors   ] rwkv7 channel mix%s vs FLA's RWKV7FeedForward re-stated (fp64): y %.2e, gradients %.2e\n",
                with_documents ? " with document starts" : "", rel(y, ref), worst);
    EXPECT_LE(rel(y, ref), 1e-12);
    EXPECT_LE(worst, 1e-12);
  }
  // The document start matters: token 5 of sequence 1 sees no token before it.
  auto y = m.forward(x), y_documents = m.forward(x, documents);
  EXPECT_GT(rel(y_documents.select(0, 1).select(0, 5), y.select(0, 1).select(0, 5)), 1e-3);
  EXPECT_EQ(rel(y_documents.select(0, 0), y.select(0, 0)), 0.0);
}

TEST(Rwkv7ChannelMix, SliceAfterSliceWithItsHaloEqualsTheWholeSequence) {
  auto m = random_mix(6);
  auto x = random({kB, kT, kD}, 7);
  auto whole = m.forward(x);
  const int64_t T1 = 5;
  MixerLayerContext second;
  second.offset = T1;
  int calls = 0;
  second.halo = [&](const Tensor& t, int64_t n) {
    ++calls;
    EXPECT_EQ(n, 1);
    return x.narrow(1, T1 - 1, 1);
  };
  auto cut = at::cat({m.forward(x.narrow(1, 0, T1)), m.forward(x.narrow(1, T1, kT - T1), second)}, 1);
  EXPECT_EQ(calls, 1);
  EXPECT_LE(rel(cut, whole), 1e-15);
  // Without the halo the second slice's first token differs: the halo is read.
  auto alone = m.forward(x.narrow(1, T1, kT - T1));
  EXPECT_GT(rel(alone.narrow(1, 0, 1), whole.narrow(1, T1, 1)), 1e-3);
}

TEST(Rwkv7ChannelMix, InitialValuesAreFlas) {
  ParameterInit init(2, at::TensorOptions().dtype(at::kDouble));
  const int64_t layer = 1, L = 4;
  Rwkv7ChannelMix m(kD, kHidden, layer, L, init);
  const double r = 1.0 - 1.0 * layer / L;
  for (int64_t n = 0; n < kD; ++n)
    EXPECT_NEAR(m.x_k[n].item<double>(), 1.0 - std::pow(1.0 * n / kD, std::pow(r, 4)), 1e-6) << n;
  EXPECT_EQ(m.value.abs().max().item<double>(), 0.0);
  // key [32, 8]: orthonormal columns (torch's orthogonal_ of a tall matrix), gain 1.
  auto gram = at::matmul(m.key.t(), m.key);
  EXPECT_LT((gram - at::eye(kD, gram.options())).abs().max().item<double>(), 1e-6);
  std::vector<std::string> names;
  for (auto& [n, p] : m.parameters()) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{"x_k", "key.weight", "value.weight"}));
}

}  // namespace
}  // namespace carry::testing
