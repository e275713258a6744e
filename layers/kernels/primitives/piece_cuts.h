// Where a state walk in pieces cuts the chunks (host only, no CUDA): the pieces schedules of the
// delta rule (layers/kernels/delta_rule/launch.h) walk piece after piece while the chunk-local kernels
// of the next piece (forward: the WY preparation) or of the finished one (the output; backward: the
// chunk gradients) run beside the walk. Only the sequence's two end pieces have nothing beside them:
// the first piece's preparation (or, backward, intra-chunk dV) runs before any walk, and the last
// piece's chunk-local kernels after the last walk. The ramp shortens them: lengths in the proportions
// 1/4, 1/2, 1, ..., 1, 1/2, 1/4, so the work that waits shrinks to a quarter of a piece's while each
// piece's chunk-local work still fits beside its neighbour's walk. The cut never changes a chunk's
// operations (every chunk runs the same whatever the pieces): the bits are those of one walk.
#pragma once

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

namespace carry::kernels::primitives {

// n + 1 boundaries 0 = c[0] < c[1] < ... < c[n] = N of N chunks in n pieces (fewer when N is short: every
// piece holds at least one chunk). Uniform: pieces of ceil(N/n) chunks, the last shorter. Ramped (ramp,
// n ≥ 5 and end pieces of at least min_end chunks): the two pieces at each end in the proportions 1/4
// and 1/2 of the others, the N − ends chunks spread evenly over the middle n − 4 (the first ones a
// chunk longer when it does not divide). Symmetric, so a reverse walk's first pieces are as short as a
// forward's. A chunk-local kernel of a few chunks takes about as long as one of a few dozen (its blocks
// fill no wave: at H=4, dv=256 the WY preparation of 13 chunks took 20 µs, of 54 chunks 27), so end
// pieces shorter than min_end save nothing.
inline std::vector<int> piece_cuts(int N, int n, bool ramp, int min_end = 1) {
  if (N < 1 || n < 1)
    throw std::invalid_argument("piece_cuts: expected N >= 1 chunks and n >= 1 pieces, got N = " + std::to_string(N) +
                                ", n = " + std::to_string(n));
  n = std::min(n, N);
  std::vector<int> c{0};
  if (!ramp || n < 5 || N < 8 * n || N < 4 * (n - 2.5) * min_end) {
    const int len = (N + n - 1) / n;
    for (int x = len; x < N; x += len) c.push_back(x);
    c.push_back(N);
    return c;
  }
  const double unit = N / (n - 2.5);  // a middle piece's length: 2·(1/4 + 1/2) + (n − 4) = n − 2.5 units
  const int e0 = std::max(1, (int)std::lround(unit / 4)), e1 = std::max(1, (int)std::lround(unit / 2));
  const int mid = N - 2 * (e0 + e1), m = n - 4;
  std::vector<int> len{e0, e1};
  for (int i = 0; i < m; ++i) len.push_back(mid / m + (i < mid % m ? 1 : 0));
  len.push_back(e1);
  len.push_back(e0);
  for (int l : len) c.push_back(c.back() + l);
  return c;
}

}  // namespace carry::kernels::primitives
