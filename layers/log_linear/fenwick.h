// Fenwick (binary) bookkeeping of log-linear attention over absolute positions: the level of a pair of
// tokens, and the block states that cross a boundary. Pure integer functions; no tensors.
//
// Levels. level(t, s) = bit_width(t xor s) for s <= t: 0 for s = t, 1 + msb(t xor s) for s < t.
//
// The state at a boundary p (tokens [0, p) behind, tokens t >= p ahead) has one entry per bit j, with
// the dyadic interval I_j(p) = [b_j(p), b_j(p) + 2^j), b_j(p) = (p >> (j+1)) << (j+1):
//   - bit j set in p: I_j(p) is a block of the binary decomposition of [0, p) (the blocks partition
//     [0, p)); every s in it has the same level for every t >= p, namely bit_width(t xor b_j(p)), and
//     s lies in block j exactly when msb(p xor s) = j.
//   - bit j not set in p: I_j(p) contains p; no token of [0, p) is in it, so a state reached from the
//     zero state keeps this entry zero. The entry is still given a meaning, so that every state tuple
//     (a random one in tests, say) evolves linearly and consistently: it is read by t >= p at level
//     bit_width(t xor b_j(p)), like a block, and it merges like one.
// Moving the boundary p -> q (q >= p), entry j of p goes to the smallest entry of q whose interval
// contains I_j(p): j' = max(j, msb(q xor b_j(p))) (a block of [0, p) lands in the one block of [0, q)
// that contains it; a non-set entry whose interval still contains q stays where it is). This map is
// transitive (p -> q -> r equals p -> r) and keeps every read level unchanged; a token s in [p, q)
// lands in entry msb(q xor s).
#pragma once

#include <cstdint>

namespace carry {

// Number of significant bits of x (0 for x = 0).
int64_t bit_width(uint64_t x);

// level(t, s) for 0 <= s <= t.
int64_t fenwick_level(int64_t t, int64_t s);

// b_j(p) = (p >> (j+1)) << (j+1): the start of entry j's interval at boundary p.
int64_t fenwick_block_start(int64_t p, int64_t j);

// The level at which a token t >= p reads entry j of the state at boundary p.
int64_t fenwick_entry_level(int64_t p, int64_t j, int64_t t);

// The entry of the state at q >= p that receives entry j of the state at p.
int64_t fenwick_merge_target(int64_t p, int64_t q, int64_t j);

// The entry of the state at q that holds token s < q: msb(q xor s).
int64_t fenwick_token_entry(int64_t q, int64_t s);

// Level weights L needed by tokens at positions [0, end) together with the state at `end`:
// bit_width(end) + 1 (levels 0..bit_width(end-1) for the tokens, entries 0..msb(end) of the state;
// the state has L - 1 entries).
int64_t fenwick_levels_needed(int64_t end);

}  // namespace carry
