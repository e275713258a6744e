// Log-linear Mamba-2 as passes of the decay class's recurrence, one a level (the family's kernel form).
//
// o_t = s·Σ_ℓ λ_t[ℓ] q_tᵀ X^ℓ_t, with X^ℓ_t the decayed sum of what t reads at level ℓ (log_linear.h,
// fenwick.h). A level ℓ pairs each block of 2^ℓ positions (aligned in absolute position) with itself:
// tokens of its first half (bit ℓ−1 clear) are read at level ℓ by tokens of its second half (bit ℓ−1
// set), and by no one else. So, with a chunk of C = 2^c tokens:
//   - levels 0..c (pairs inside a chunk): the chunk's decayed causal QKᵀ weighted by λ_t[level(t,s)],
//     in ATen, every chunk at once;
//   - each level ℓ > c: one decay pass (layers/decay_pass.h) over the slice cut at multiples of 2^ℓ
//     (whole blocks batched together), the keys of second halves zeroed, its read-out kept for second
//     halves and weighted by λ_t[ℓ]; a block's pass starts from zero, so nothing crosses a block.
// The incoming state's entries S_j read like a source at position b_j(p) (fenwick.h: every t ≥ p reads
// S_j at level bit_width(t xor b_j(p))): an entry joins the initial state of level ℓ's pass over the
// block holding p when b_j(p) lies in that block's first half, and the entries with b_j(p) = p are read
// by the slice's first chunk at its levels 0..c. The final state at q = p + T: entry j for a bit j ≥ c set
// in q is the final state of level j+1's pass (its last block's first half is q's block j); every other
// entry holds the incoming entries that merge into it (fenwick_merge_target), carried by the slice's
// decay.
//
// The passes are chunk-local within a block and start afresh at every block boundary, so the bits do
// not depend on where a sequence is cut at a block boundary of every level it spans; the ordered scan's
// bits rest on parallel.segments as for HLA (decay_passes.h). Levels 0..c and the weighted sums are fp32.
#pragma once

#include "layers/decay_pass.h"

namespace carry {

// in: q, k [B,T,H,dk], v [B,T,H,dv], g [B,T,H], l [B,T,H,L]; the state: L−1 entries [B,H,dk,dv] (empty:
// zeros); opt.offset (a multiple of opt.chunk_size, a power of two) and opt.scale as the family's.
MixerOutput loglinear_mamba2_by_level_passes(const MixerInputs& in, const State& initial_state,
                                             const MixerOptions& opt, const DecayPass& pass);

}  // namespace carry
