// The flat buffer's layout (parallel/flat_layout.h): every parameter starts at a multiple of kAlign,
// no two overlap, pieces are runs of whole parameters in order, of equal padded length, cut near j/P of
// the total; degenerate inputs (more pieces than parameters, one huge parameter) still give a layout.
#include "parallel/flat_layout.h"

#include <gtest/gtest.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace carry::parallel {
namespace {

void check(const std::vector<int64_t>& numels, int P) {
  const auto l = FlatLayout::make(numels, P);
  const std::string what = std::to_string(numels.size()) + " parameters, " + std::to_string(P) + " pieces";
  ASSERT_EQ(l.offset.size(), numels.size()) << what;
  ASSERT_EQ(l.piece_first.size(), static_cast<size_t>(P + 1)) << what;
  EXPECT_EQ(l.piece_first.front(), 0);
  EXPECT_EQ(l.piece_first.back(), static_cast<int>(numels.size()));
  EXPECT_EQ(l.numel, l.piece_numel * P);
  EXPECT_EQ(l.piece_numel % FlatLayout::kAlign, 0);
  int64_t total = 0;
  for (int j = 0; j < P; ++j) {
    EXPECT_LE(l.piece_first[j], l.piece_first[j + 1]) << what;
    int64_t end = j * l.piece_numel;
    for (int i = l.piece_first[j]; i < l.piece_first[j + 1]; ++i) {
      EXPECT_EQ(l.piece_of(i), j) << what << ", parameter " << i;
      EXPECT_EQ(l.offset[i] % FlatLayout::kAlign, 0) << what << ", parameter " << i;
      EXPECT_GE(l.offset[i], end) << what << ": parameter " << i << " overlaps the one before";
      end = l.offset[i] + numels[i];
      total += numels[i];
    }
    EXPECT_LE(end, (j + 1) * l.piece_numel) << what << ": piece " << j << " runs over its end";
  }
  // Cuts near j/P: no piece longer than an even share plus the largest parameter and the padding.
  int64_t largest = 0;
  for (auto n : numels) largest = std::max(largest, n);
  EXPECT_LE(l.piece_numel, total / P + largest + FlatLayout::kAlign * (static_cast<int64_t>(numels.size()) + 1)) << what;
}

TEST(FlatLayout, PiecesAreEqualRunsOfAlignedParameters) {
  const std::vector<int64_t> model{24576000, 6, 6, 768, 589824, 589824, 589824, 3072, 4608, 589824, 768,
                                   1769472, 1769472, 1769472, 768, 24576000};
  for (int P : {1, 2, 4, 8}) check(model, P);
  check({5}, 4);                 // more pieces than parameters: empty pieces
  check({1, 1000000, 1}, 2);     // one parameter is most of the model
  check({0, 3, 0, 17}, 2);       // empty parameters
  // The 125M-like list splits its two 24.6M-element tables apart at two pieces.
  const auto two = FlatLayout::make(model, 2);
  EXPECT_LT(two.piece_first[1], static_cast<int>(model.size()) - 1);
  EXPECT_GT(two.piece_first[1], 0);
}

TEST(FlatLayout, BadInputIsRefused) {
  EXPECT_THROW(FlatLayout::make({4, 4}, 0), c10::Error);
  EXPECT_THROW(FlatLayout::make({4, -1}, 1), c10::Error);
  EXPECT_THROW(FlatLayout::make({4}, 1).piece_of(1), c10::Error);
}

}  // namespace
}  // namespace carry::parallel
