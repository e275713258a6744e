// Tests of layers/softmax_attn/softmax_attn.*: the naive form against a per-query loop over exactly the keys in the
// window; chunkwise vs naive with gradients for windows 1, 5, 17, 64 and one larger than T; the key
// blocks the chunkwise form visits are exactly those the mask reaches, so for a window their number
// grows linearly with T (counted, not timed); bad options refused. The generic contract tests run the
// family with window 0 in mixer_test.cpp.
#include "layers/softmax_attn/softmax_attn.h"
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>

namespace carry::testing {
namespace {

const Mixer& attn() { return get_mixer("softmax_attn"); }

TEST(SoftmaxAttn, NaiveEqualsPerQueryLoop) {
  Shape s;
  s.T = 40;
  auto in = random_inputs(attn(), s, at::kDouble, 1);
  for (int64_t w : {0, 1, 7}) {
    MixerOptions opt;
    opt.window = w;
    auto out = attn().naive(in, {}, opt).o;
    double scale = opt.scale_for(s.dk), err = 0;
    for (int64_t t = 0; t < s.T; ++t) {
      int64_t first = w > 0 ? std::max<int64_t>(0, t - w + 1) : 0;
      auto K = in.k.narrow(1, first, t - first + 1), V = in.v.narrow(1, first, t - first + 1);
      auto qt = in.q.select(1, t).unsqueeze(1);                              // [B,1,H,dk]
      auto p = at::softmax((qt * K).sum(-1) * scale, 1);                   // [B,s,H]
      auto o = (p.unsqueeze(-1) * V).sum(1);                               // [B,H,dv]
      err = std::max(err, rel_err(out.select(1, t), o));
    }
    std::cout << "[ errors   ] softmax_attn naive window=" << w << " vs per-query loop: " << err << "\n";
    EXPECT_LE(err, 1e-12);
  }
}

TEST(SoftmaxAttn, WindowsChunkwiseEqualNaiveWithGradients) {
  Shape s;
  s.T = 96;
  for (int64_t C : {16, 32}) {
    for (int64_t w : {1, 5, 17, 64, 200}) {
      MixerOptions opt;
      opt.chunk_size = C;
      opt.window = w;
      auto in = random_inputs(attn(), s, at::kDouble, 100 + w + C);
      auto a = run_with_grads(attn(), Form::chunkwise, in, {}, opt);
      auto b = run_with_grads(attn(), Form::naive, in, {}, opt);
      double eo = max_rel_err(a.outputs, b.outputs), eg = max_rel_err(a.grads, b.grads);
      std::cout << "[ errors   ] softmax_attn C=" << C << " window=" << w << " forward " << eo
                << " gradients " << eg << "\n";
      EXPECT_LE(eo, 1e-10);
      EXPECT_LE(eg, 1e-10);
      for (auto& g : a.grads) EXPECT_TRUE(at::isfinite(g).all().item<bool>());
      for (auto& g : a.grads) EXPECT_GT(g.abs().max().item<double>(), 0);
    }
  }
}

// Does any (query t, key s) pair of blocks (i, j) lie inside the causal window?
bool block_reachable(int64_t i, int64_t j, int64_t C, int64_t w) {
  for (int64_t t = i * C; t < (i + 1) * C; ++t)
    for (int64_t s = j * C; s < (j + 1) * C; ++s)
      if (s <= t && (w == 0 || s > t - w)) return true;
  return false;
}

TEST(SoftmaxAttn, VisitedKeyBlocksAreExactlyTheReachableOnes) {
  for (int64_t C : {4, 16}) {
    for (int64_t w : {0, 1, 5, 16, 17, 64}) {
      for (int64_t i = 0; i < 24; ++i) {
        auto blocks = softmax_attn_key_blocks(i, C, w);
        ASSERT_FALSE(blocks.empty());
        EXPECT_EQ(blocks.front(), i) << "the diagonal block must come first";
        for (int64_t j = 0; j <= i; ++j) {
          bool visited = std::find(blocks.begin(), blocks.end(), j) != blocks.end();
          EXPECT_EQ(visited, block_reachable(i, j, C, w)) << "C=" << C << " w=" << w << " i=" << i
                                                          << " j=" << j;
        }
      }
    }
  }
}

TEST(SoftmaxAttn, WindowedWorkGrowsLinearlyWithT) {
  const int64_t C = 16;
  auto visits = [&](int64_t num_blocks, int64_t w) {
    int64_t n = 0;
    for (int64_t i = 0; i < num_blocks; ++i) n += softmax_attn_key_blocks(i, C, w).size();
    return n;
  };
  for (int64_t w : {1, 17, 64}) {
    int64_t per_block = 1 + (w - 1 + C - 1) / C;  // most key blocks one query block can reach
    std::vector<int64_t> counts;
    for (int64_t N : {16, 32, 64, 128}) {
      counts.push_back(visits(N, w));
      EXPECT_LE(counts.back(), per_block * N);
    }
    std::cout << "[ errors   ] softmax_attn window=" << w << " key blocks visited for T=256..2048: "
              << counts[0] << " " << counts[1] << " " << counts[2] << " " << counts[3] << "\n";
    // Doubling T adds a fixed number of blocks per added query block: the increments double.
    EXPECT_EQ(counts[2] - counts[1], 2 * (counts[1] - counts[0]));
    EXPECT_EQ(counts[3] - counts[2], 2 * (counts[2] - counts[1]));
  }
  // Full causal attention visits every block up to the diagonal: quadratic.
  EXPECT_EQ(visits(64, 0), 64 * 65 / 2);
}

TEST(SoftmaxAttn, BadOptionsAndStateAreRefused) {
  Shape s;
  s.T = 32;
  auto in = random_inputs(attn(), s, at::kDouble, 3);
  MixerOptions opt;
  opt.chunk_size = 16;
  opt.window = -1;
  EXPECT_THROW(attn().chunkwise(in, {}, opt), c10::Error);
  EXPECT_THROW(attn().naive(in, {}, opt), c10::Error);
  opt.window = 0;
  EXPECT_THROW(attn().chunkwise(in, {at::zeros({2}, at::kDouble)}, opt), c10::Error);
  auto bad = in;
  bad.k = at::randn({s.B, s.T, s.H, s.dk + 1}, at::kDouble);
  EXPECT_THROW(attn().chunkwise(bad, {}, opt), c10::Error);
  EXPECT_FALSE(attn().has_summary());
  EXPECT_TRUE(attn().state_names().empty());
  EXPECT_TRUE(attn().zero_state(in, opt).empty());
  EXPECT_THROW(attn().summarize(in, opt), c10::Error);
}

}  // namespace
}  // namespace carry::testing
