// carry::kernels::primitives::piece_cuts (layers/kernels/primitives/piece_cuts.h): the chunk boundaries of a state walk in pieces.
// Host only, so it runs without a GPU.
#include "layers/kernels/primitives/piece_cuts.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace carry::testing {
namespace {

// Boundaries start at 0, end at N, and rise strictly (every piece holds a chunk).
void expect_partition(const std::vector<int>& c, int N, const std::string& what) {
  ASSERT_GE(c.size(), 2u) << what;
  EXPECT_EQ(c.front(), 0) << what;
  EXPECT_EQ(c.back(), N) << what;
  for (size_t i = 1; i < c.size(); ++i) EXPECT_LT(c[i - 1], c[i]) << what << ": piece " << i - 1 << " is empty";
}

TEST(PieceCuts, UniformPiecesAsBefore) {
  EXPECT_EQ(carry::kernels::primitives::piece_cuts(7, 3, false), (std::vector<int>{0, 3, 6, 7}));
  EXPECT_EQ(carry::kernels::primitives::piece_cuts(7, 7, false), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(carry::kernels::primitives::piece_cuts(4, 9, false), (std::vector<int>{0, 1, 2, 3, 4}));  // at most N pieces
  EXPECT_EQ(carry::kernels::primitives::piece_cuts(512, 1, true), (std::vector<int>{0, 512}));
  // too short a piece for a ramp, or too few pieces: uniform
  EXPECT_EQ(carry::kernels::primitives::piece_cuts(7, 7, true), carry::kernels::primitives::piece_cuts(7, 7, false));
  EXPECT_EQ(carry::kernels::primitives::piece_cuts(64, 4, true), carry::kernels::primitives::piece_cuts(64, 4, false));
}

TEST(PieceCuts, RampShortensBothEnds) {
  // 512 chunks in 12 pieces: 13, 27, eight of 54, 27, 13 (the kernels' automatic pieces ask for end
  // pieces of 32 chunks, so they ramp from 1216 chunks: below)
  const auto c = carry::kernels::primitives::piece_cuts(512, 12, true);
  std::vector<int> len;
  for (size_t i = 1; i < c.size(); ++i) len.push_back(c[i] - c[i - 1]);
  EXPECT_EQ(len, (std::vector<int>{13, 27, 54, 54, 54, 54, 54, 54, 54, 54, 27, 13}));
  for (int N : {40, 41, 100, 256, 257, 511, 512, 2048, 2049, 4096})
    for (int n : {5, 6, 8, 12}) {
      if (N < 8 * n) continue;
      const auto r = carry::kernels::primitives::piece_cuts(N, n, true);
      const std::string what = "N=" + std::to_string(N) + " n=" + std::to_string(n);
      expect_partition(r, N, what);
      ASSERT_EQ(r.size(), size_t(n + 1)) << what;
      const int first = r[1] - r[0], second = r[2] - r[1], last = r[n] - r[n - 1], mid = r[3] - r[2];
      EXPECT_EQ(first, last) << what << ": symmetric";
      EXPECT_EQ(second, r[n - 1] - r[n - 2]) << what << ": symmetric";
      EXPECT_LE(first, second) << what;
      EXPECT_LT(second, mid) << what;
      EXPECT_LE(4 * first, mid + 4) << what << ": the end pieces about a quarter of a middle piece";
      for (int i = 3; i < n - 2; ++i) EXPECT_LE(std::abs((r[i + 1] - r[i]) - mid), 1) << what << ": piece " << i;
    }
  // end pieces shorter than min_end chunks: uniform (the kernels' automatic pieces ask for 32)
  EXPECT_EQ(carry::kernels::primitives::piece_cuts(1024, 12, true, 32), carry::kernels::primitives::piece_cuts(1024, 12, false));
  EXPECT_EQ(carry::kernels::primitives::piece_cuts(2048, 12, true, 32), carry::kernels::primitives::piece_cuts(2048, 12, true));
  EXPECT_NE(carry::kernels::primitives::piece_cuts(2048, 12, true, 32), carry::kernels::primitives::piece_cuts(2048, 12, false));
  EXPECT_GE(carry::kernels::primitives::piece_cuts(2048, 12, true, 32)[1], 32);
  for (int N : {1, 5, 64, 100, 2049})
    for (int n : {1, 2, 3, 7, 12, 200}) {
      const std::string what = "N=" + std::to_string(N) + " n=" + std::to_string(n);
      expect_partition(carry::kernels::primitives::piece_cuts(N, n, true), N, what);
      expect_partition(carry::kernels::primitives::piece_cuts(N, n, false), N, what);
    }
}

TEST(PieceCuts, RefusesEmptyInput) {
  EXPECT_THROW(carry::kernels::primitives::piece_cuts(0, 3, true), std::invalid_argument);
  EXPECT_THROW(carry::kernels::primitives::piece_cuts(5, 0, false), std::invalid_argument);
}

}  // namespace
}  // namespace carry::testing
