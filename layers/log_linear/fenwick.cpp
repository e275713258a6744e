// Fenwick bookkeeping of log-linear attention (see fenwick.h): levels, block starts, merges.
#include "layers/log_linear/fenwick.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace carry {

int64_t bit_width(uint64_t x) {
  int64_t n = 0;
  while (x) {
    ++n;
    x >>= 1;
  }
  return n;
}

int64_t fenwick_level(int64_t t, int64_t s) {
  TORCH_INTERNAL_ASSERT(0 <= s && s <= t, "fenwick_level needs 0 <= s <= t, got t=", t, " s=", s);
  return bit_width(static_cast<uint64_t>(t ^ s));
}

int64_t fenwick_block_start(int64_t p, int64_t j) {
  TORCH_INTERNAL_ASSERT(p >= 0 && j >= 0 && j < 62);
  return (p >> (j + 1)) << (j + 1);
}

int64_t fenwick_entry_level(int64_t p, int64_t j, int64_t t) {
  TORCH_INTERNAL_ASSERT(t >= p, "a token t=", t, " before the boundary p=", p, " reads no state");
  return bit_width(static_cast<uint64_t>(t ^ fenwick_block_start(p, j)));
}

int64_t fenwick_merge_target(int64_t p, int64_t q, int64_t j) {
  TORCH_INTERNAL_ASSERT(q >= p, "boundaries move forward only, got p=", p, " q=", q);
  int64_t msb = bit_width(static_cast<uint64_t>(q ^ fenwick_block_start(p, j))) - 1;
  return std::max(j, msb);
}

int64_t fenwick_token_entry(int64_t q, int64_t s) {
  TORCH_INTERNAL_ASSERT(0 <= s && s < q, "token s=", s, " is not before the boundary q=", q);
  return bit_width(static_cast<uint64_t>(q ^ s)) - 1;
}

int64_t fenwick_levels_needed(int64_t end) {
  TORCH_INTERNAL_ASSERT(end >= 0);
  return bit_width(static_cast<uint64_t>(end)) + 1;
}

}  // namespace carry
