// The flat buffer's layout (see the header).
#include "parallel/flat_layout.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace carry::parallel {

namespace {
int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }
}  // namespace

FlatLayout FlatLayout::make(const std::vector<int64_t>& numels, int pieces) {
  TORCH_CHECK(pieces >= 1, "flat layout: expected at least one piece, got ", pieces);
  const int n = static_cast<int>(numels.size());
  // Each parameter's start with no padding between pieces (aligned), and the end of the last.
  std::vector<int64_t> start(n + 1, 0);
  for (int i = 0; i < n; ++i) {
    TORCH_CHECK(numels[i] >= 0, "flat layout: parameter ", i, " has ", numels[i], " elements");
    start[i + 1] = start[i] + round_up(numels[i], kAlign);
  }
  FlatLayout l;
  l.pieces = pieces;
  l.piece_first.assign(pieces + 1, n);
  l.piece_first[0] = 0;
  // Cut j at the boundary nearest to j/P of the total, never before cut j − 1.
  for (int j = 1; j < pieces; ++j) {
    const double target = static_cast<double>(start[n]) * j / pieces;
    int best = l.piece_first[j - 1];
    for (int i = best; i <= n; ++i)
      if (std::abs(static_cast<double>(start[i]) - target) < std::abs(static_cast<double>(start[best]) - target)) best = i;
    l.piece_first[j] = best;
  }
  for (int j = 0; j < pieces; ++j)
    l.piece_numel = std::max(l.piece_numel, start[l.piece_first[j + 1]] - start[l.piece_first[j]]);
  l.piece_numel = std::max(round_up(l.piece_numel, kAlign), kAlign);
  l.numel = l.piece_numel * pieces;
  l.offset.resize(n);
  for (int j = 0; j < pieces; ++j)
    for (int i = l.piece_first[j]; i < l.piece_first[j + 1]; ++i)
      l.offset[i] = j * l.piece_numel + start[i] - start[l.piece_first[j]];
  return l;
}

int FlatLayout::piece_of(int i) const {
  TORCH_CHECK(i >= 0 && i < static_cast<int>(offset.size()), "flat layout: no parameter ", i);
  return static_cast<int>(std::upper_bound(piece_first.begin(), piece_first.end(), i) - piece_first.begin()) - 1;
}

}  // namespace carry::parallel
