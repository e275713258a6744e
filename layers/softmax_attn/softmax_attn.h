// Causal softmax attention, family "softmax_attn": o_t = Σ_s softmax_s(scale·q_t·k_s) v_s over keys
// t−window < s ≤ t (MixerOptions::window; 0 = every s ≤ t). No recurrent state: has_summary() is
// false and the state tuple is empty. Forms: naive = the materialized masked T×T softmax; chunkwise =
// query blocks of chunk_size against only the key blocks the mask reaches, with an online (running max
// and sum) softmax, never a T×T tensor; kernel (CUDA builds) = the same online softmax fused on blocks of
// 64 tokens (layers/kernels/softmax_attn/api.h). A slice attends within itself: across sequence-parallel ranks
// a window needs the previous rank's last keys and values (a halo), which is not this file's business.
#pragma once

#include "layers/mixer.h"

#include <vector>

namespace carry {

// The key blocks the chunkwise form visits for query block `query_block` (blocks of chunk_size tokens),
// in visiting order: the diagonal block first, then earlier blocks while any of their keys is inside the
// window of some query of the block. For window w > 0 that is at most 1 + ceil((w−1)/chunk_size) blocks,
// so the work grows linearly with T; for w = 0 it is every block up to the diagonal.
std::vector<int64_t> softmax_attn_key_blocks(int64_t query_block, int64_t chunk_size, int64_t window);

}  // namespace carry
