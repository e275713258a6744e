// Sequence parallelism for any mixer with a state summary (README.md, Design §3). The sequence is cut into
// P equal slices, one per rank of the sp communicator, each a whole number of chunks; rank r holds
// tokens [r·T/P, (r+1)·T/P). The affine map of a slice, S_out = A_r·S_in + B_r (`summarize`), lets
// the ranks find their incoming states S_in by a scan over ranks, and the chunkwise form then runs
// on each slice with its S_in (MixerOptions::offset = the slice's absolute position).
//
// Forward modes:
//   ordered   rank r receives S_in from r−1, runs its chunkwise form, sends S_out to r+1. The same
//             chunk operations in the same order as one serial run: bit-identical to it (on CPU;
//             see README.md, Design §3 for what that needs). Pipelined by head groups (ZeCO's All-Scan):
//             the heads are cut into G groups and, per group g = 0..G−1, rank r receives group g's
//             S_in, runs the chunkwise form on those heads and sends their S_out on at once, so
//             rank r+1 starts group g while rank r computes group g+1: about (G+P−1)/G local
//             forwards instead of P. Heads are independent in every family (inputs narrow on dim
//             2, every state entry has the heads at dim 1).
//   tree      every rank summarizes its slice (rank 0 folds the initial state in with apply); an
//             exclusive Hillis-Steele scan over ranks with compose(first, second) gives S_in in
//             ⌈log2 P⌉ rounds; then the local chunkwise form. Equal to serial up to rounding.
//   allgather every rank gathers all summaries and folds those of the ranks before it.
//   In both, a family with Mixer::state_output (scalar decay, GLA, Mamba-1, linear attention without its
//   normalizer; no document starts) runs its slice once, from the zero state: that run's final state
//   is the summary's state, Mixer::transport its transport, and after the scan S_in's share is added
//   to the output (state_output; summed in the wider dtype, rounded once to the output's) and to
//   the final state (apply). Other families summarize the slice, then run it again from S_in.
// Backward mirrors it right to left. With g_r the gradient at S_in of rank r's forward for its own
// output cotangents (dS_out = its direct final-state gradient), and Λ_r the full gradient at S_in,
//   Λ_r = g_r + A_rᵀ·Λ_{r+1},  Λ_P = 0,
// and rank r's local backward with dS_out = (direct) + Λ_{r+1} gives every input gradient (and, on
// rank 0, Λ_0 = the initial state's). ordered passes Λ along the chain; tree runs the mirrored
// log-depth scan of the maps x ↦ g + Aᵀx; allgather gathers the g's. ordered runs per head group
// too: group g's Λ arrives from r+1, its local backward runs, its Λ_r leaves for r−1 at once. Aᵀ·x
// is the vector-Jacobian product of apply(summary, S) in S (apply is affine in S), so no family
// needs transpose code.
#pragma once

#include "layers/mixer.h"
#include "parallel/process_group.h"

#include <string>

namespace carry::parallel {

enum class ScanMode { ordered, tree, allgather };
ScanMode parse_scan_mode(const std::string& name);  // "ordered" | "tree" | "allgather"
std::string scan_mode_name(ScanMode mode);

// This rank's slice of a whole sequence: tokens [r·T/P, (r+1)·T/P) of every defined input. Checks
// that T is a multiple of P·chunk_size (the same message on every rank).
MixerInputs sp_slice(const MixerInputs& whole, int sp_rank, int sp_size, int64_t chunk_size);

// The mixer over a sequence split across the ranks of `sp` (one call on every rank of it,
// collective). `in`: this rank's slice (every rank the same length, a multiple of opt.chunk_size);
// `opt` as for a serial run over the whole sequence (opt.offset = position of the sequence's first
// token; rank r runs at opt.offset + r·T/P). `initial_state`: the state before the first token,
// read on sp rank 0 only (other ranks' is ignored and gets no gradient); {} = zeros. Returns this
// rank's outputs and the state at the end of its slice (on the last rank the sequence's final
// state), on every rank and in every mode in the dtypes the family's form gives for the slice (a
// kernel form's bf16 o, fp32 states: the serial run's). Differentiable in every input and in rank 0's initial state when autograd is on: the
// backward is collective too (every rank of `sp` must run it, and in the same order as the
// forwards; `sp` and `mixer` must outlive it; it runs once: no retain_graph, no double backward).
// The backward needs the local graph of the forward, kept until then. Layout errors (lengths,
// shapes, dtypes differ or are not whole chunks) are detected together, so every rank throws the
// same message; an input refused by one rank's check() (or a wrongly shaped initial_state on
// rank 0) is reported on all.
// `head_groups` (ordered mode; the other modes check it and run all heads at once): the number G
// of head groups the chain is pipelined over; it must divide the number of heads H and be the same
// on every rank. 1 (the default) = no pipelining; 0 = default_head_groups(H).
// Measured on H200s with the ATen forms (README): G > 1 launches G times as many smaller kernels and
// was slower, and GPU batched solves/products may round differently for a smaller head batch (Gated
// DeltaNet at G=4 differed from serial by 4.8e-7), so G = 1 is the default and the bit-identical
// choice on GPUs; on CPU every family is bitwise at any G (tested).
// `layout_agreed`: the caller has agreed the slice layout with the other ranks once for all calls
// (make_slice_context does, for training): no agreement message per call, and a layout error is then
// reported by the rank that sees it only.
MixerOutput sp_mixer_forward(const Mixer& mixer, Communicator& sp, const MixerInputs& in,
                             const State& initial_state, const MixerOptions& opt, ScanMode mode,
                             int head_groups = 1, bool layout_agreed = false);

// A pipelining choice for H heads: the largest divisor of H that is at most 4.
int default_head_groups(int64_t heads);

}  // namespace carry::parallel
