// Causal softmax attention, family "softmax_attn": o_t = Σ_{s ∈ A(t)} softmax_s(scale·q_t·k_s) v_s, one
// softmax over the key set A(t) of query t. No recurrent state: has_summary() is false.
//
// The mask. Positions count within a document: p(t) = MixerOptions::offset + t for row t of a slice that
// is one document (Mixer::forward cuts packed documents into such pieces, forward_documents). With
// w = window, G = global_tokens, S = stride:
//   s ∈ A(t)  ⇔  s ≤ t  and  ( w = 0  or  t − s < w  or  p(s) < G  or  (S > 0 and p(s) mod S = S − 1) ).
//   - w alone: full causal (w = 0) or sliding-window attention, keys t−w < s ≤ t;
//   - global tokens (Longformer, Beltagy et al. 2020, causal form): every token also attends to the first
//     G tokens of its document, and those G tokens attend to every key before them in the document (the
//     rule above gives them exactly that: every key before a global token is a global token);
//   - the strided pattern (Child et al. 2019, "Generating Long Sequences with Sparse Transformers", §4.2):
//     the paper's "fixed" pattern is A(1) = {j : ⌊j/ℓ⌋ = ⌊i/ℓ⌋} and A(2) = {j : j mod ℓ ∈ {ℓ−c, …, ℓ−1}},
//     its "strided" one A(1) = {j : max(0, i−ℓ) ≤ j ≤ i}, A(2) = {j : (i − j) mod ℓ = 0}. Here the local
//     part is the sliding window (in the place of the strided pattern's A(1)) and the second part the
//     fixed pattern's summary columns with c = 1, ℓ = S: every key at a document position ≡ S−1 mod S, so
//     every later token reads the same columns. Both parts in one softmax over their union (the paper's
//     merged head, §5.2).
//   Both G and S need w > 0 (with w = 0 every earlier key is attended already); they combine freely.
//
// The initial state: empty, or, for G > 0 or S > 0, the keys before the slice that the pattern reads, as
// {k [B,M,H,dk], v [B,M,H,dv], valid [B,M] (1 = a key, 0 = padding), in k's dtype}: global tokens and
// summary columns of the document in progress at the slice's start that lie before it, every one outside
// every query's window. Every query of the slice sees every valid one (a slice at a document start has
// none: forward_documents hands them to the piece that continues a document only). This is how sequence
// parallelism brings them from earlier ranks (mixer_layer.cpp; what crosses ranks: softmax_attn_relay_plan
// below). The final state is always empty.
//
// Forms: naive = the materialized masked T×T scores (plus the M keys before the slice) and one softmax;
// chunkwise = without G and S, per query block of C tokens, the reachable key blocks of the window
// (softmax_attn_key_blocks) with the full mask where the window's edge or the diagonal cuts them, in one
// online softmax: a running row max m (a stabilizer, detached: the result does not depend on it), a running
// sum l and an accumulator, rescaled by exp(m_old − m_new) as key blocks arrive, never a T×T tensor; with G
// or S, per query block of R = w rounded up to whole chunks, the keys [a − w + 1, a + R) masked, the global
// and summary keys before them and the keys before the slice scored at once and in one softmax a row (R
// rows × R + w + G + T/S columns a block: few large products). Work: T·(w + G + T/S) score columns
// (2w with the patterns). Backward: autograd through these ATen ops. kernel (CUDA
// builds) = the same online softmax fused on blocks of 64 tokens (layers/kernels/softmax_attn/api.h), for
// the window alone: with G or S automatic dispatch takes the chunkwise form. A slice attends within itself
// and its initial state: across sequence-parallel ranks a window needs the previous rank's last keys and
// values (a halo), which the layer prepends.
#pragma once

#include "layers/mixer.h"

#include <vector>

namespace carry {

// The key blocks the chunkwise form visits for query block `query_block` (blocks of chunk_size tokens),
// in visiting order: the diagonal block first, then earlier blocks while any of their keys is inside the
// window of some query of the block. For window w > 0 that is at most 1 + ceil((w−1)/chunk_size) blocks,
// so the work grows linearly with T; for w = 0 it is every block up to the diagonal.
std::vector<int64_t> softmax_attn_key_blocks(int64_t query_block, int64_t chunk_size, int64_t window);

// Whether a key at document position `position` is read by every later token of its document beyond the
// window: a global token (position < global_tokens) or a summary column (position ≡ stride−1 mod stride).
bool softmax_attn_pattern_key(int64_t position, int64_t global_tokens, int64_t stride);

// What crosses sequence-parallel ranks for the sparse patterns, in rank order: rank r sends rank r+1 one
// message [B, rows, C] of key/value rows, which rank r+1 reads as [memory rows; halo rows]:
//   memory rows  the pattern keys (softmax_attn_pattern_key) of the document in progress at rank r+1's
//                extended start E = offset − halo that lie before E, by position, padded with zero rows
//                to the most any sequence has (`valid` says which are keys): a document that started on
//                an earlier rank brings its global tokens and summary columns along; one that starts at or
//                after E brings none;
//   halo rows    the window's halo, positions [E, offset).
// Rank r builds its message from its own message in and its own rows (index), so the prefix grows along
// the ranks (at most G + T_doc/S memory rows a sequence, T_doc the tokens of the document before E): one
// send a rank in each direction, in the order of the ordered scan, which also runs over ordered segments.
struct SoftmaxAttnRelayPlan {
  int64_t memory_rows = 0;   // memory rows of this rank's incoming message (padded)
  int64_t halo_rows = 0;     // halo rows after them (0 on rank 0)
  Tensor valid;              // [B, memory_rows] bool, CPU: which memory rows are keys
  // The outgoing message (to rank + 1): [B, rows] int64, CPU: each row's index into cat(incoming message,
  // this rank's rows) along T, −1 for a zero row. Undefined on the last rank.
  Tensor index;
};
// `starts`: [batch, sequence_length] bool document starts (undefined: one document a sequence); ranks of
// `length` tokens;
// `halo`: the window's halo rows (0 for none); global_tokens and stride as in MixerOptions.
SoftmaxAttnRelayPlan softmax_attn_relay_plan(const Tensor& starts, int64_t batch, int64_t sequence_length, int64_t rank,
                                             int64_t length, int64_t halo, int64_t global_tokens, int64_t stride);

}  // namespace carry
