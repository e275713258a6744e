// Log-linear Mamba-2 and Gated DeltaNet level by level on their base model's kernels (the families'
// kernel forms).
//
// o_t = s·Σ_ℓ λ_t[ℓ] q_tᵀ X^ℓ_t, with X^ℓ_t the decayed sum of what t reads at level ℓ (log_linear.h,
// fenwick.h). A level ℓ pairs each block of 2^ℓ positions (aligned in absolute position) with itself:
// tokens of its first half (bit ℓ−1 clear) are read at level ℓ by tokens of its second half (bit ℓ−1
// set), and by no one else. So, with a chunk of C = 2^c tokens:
//   - levels 0..c (pairs inside a chunk): the chunk's decayed causal QKᵀ weighted by λ_t[level(t,s)],
//     in ATen, every chunk at once;
//   - each level ℓ > c: a pass of the base model over the slice cut at multiples of 2^ℓ, the writes of
//     second halves zeroed, its read-out kept for second halves and weighted by λ_t[ℓ]; a block's pass
//     starts from zero, so nothing crosses a block (Gated DeltaNet runs every level's pass in one walk,
//     level_walk.h; Mamba-2 takes
//     two products instead of the pass, below).
// The incoming state's entries S_j read like a source at position b_j(p) (fenwick.h: every t ≥ p reads
// S_j at level bit_width(t xor b_j(p))): an entry joins the initial state of level ℓ's pass over the
// block holding p when b_j(p) lies in that block's first half, and the entries with b_j(p) = p are read
// by the slice's first chunk at its levels 0..c. The final state at q = p + T: entry j for a bit j ≥ c set
// in q is the final state of level j+1's pass (its last block's first half is q's block j); every other
// entry holds the incoming entries that merge into it (fenwick_merge_target), carried by the slice's
// decay.
//
// The ordered scan's bits rest on parallel.segments as for HLA (decay_passes.h): the one-GPU run is cut
// at the same places, and each slice's operations are deterministic. Levels 0..c and the weighted sums
// are fp32.
#pragma once

#include "layers/decay_pass.h"

namespace carry {

// log-linear Mamba-2, in: q, k [B,T,H,dk], v [B,T,H,dv], g [B,T,H], l [B,T,H,L]; the state: L−1 entries
// [B,H,dk,dv] (empty: zeros); opt.offset (a multiple of opt.chunk_size, a power of two) and opt.scale as
// the family's. Each level above the chunk is two matrix products instead of a pass: a block's first
// half written into one state (its keys scaled by their decay to the block's middle), read by its second
// half (queries scaled by their decay from the middle and by λ). Scalar decay makes a state's transport
// over the second half a factor, so nothing walks the chunks. Levels 0..c as above; every product takes
// the inputs' dtype and sums in fp32. Deterministic: a slice cut at the same place gives the same bits,
// which is what the ordered scan's segments need.
MixerOutput loglinear_mamba2_by_level_products(const MixerInputs& in, const State& initial_state,
                                               const MixerOptions& opt);

// One pass of the delta rule (Gated DeltaNet, scale 1): S_t = γ_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,
// r_t = S_tᵀ q_t; pass(q, k, v, g, beta, S_0) → (r, S_T). A token whose v is zero only carries the state.
using DeltaPass = std::function<std::pair<Tensor, Tensor>(const Tensor& q, const Tensor& k, const Tensor& v,
                                                          const Tensor& g, const Tensor& beta, const Tensor& s0)>;

// log-linear Gated DeltaNet the same way (in also has beta [B,T,H]): the levels inside a chunk from the
// delta rule's chunk pieces (every chunk at once), every level above it in one walk over the chunks from
// the same pieces (level_walk.h: a chunk writes at a level in its block's first half and only carries the
// state in its second), and the slice's transport of the incoming entries from `pass`, from the identity
// with no values, when an initial state is given.
MixerOutput loglinear_gdn_by_level_passes(const MixerInputs& in, const State& initial_state,
                                          const MixerOptions& opt, const DeltaPass& pass);

// The delta-rule pass in ATen: the Gated DeltaNet family's chunkwise form (chunk `chunk_size`), for tests.
DeltaPass chunkwise_delta_pass(int64_t chunk_size);

}  // namespace carry
