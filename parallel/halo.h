// Halo exchange for operators that look a few tokens back across a rank boundary: short causal
// convolutions (Mamba-2, Gated DeltaNet) and sliding-window attention. Forward: every rank sends the
// last `halo` tokens of its slice to the next rank and receives the previous rank's (zeros on sp rank
// 0). Backward: the gradient of the received halo goes back to the previous rank and is added to the
// gradient of its last `halo` tokens. Differentiable; collective over the sp communicator (every rank
// calls it, and runs the backward, in the same order).
#pragma once

#include "parallel/process_group.h"

namespace carry::parallel {

// x: this rank's slice [B, T, ...] (T >= halo, the same on every rank). Returns [B, halo, ...]: the
// tokens just before this slice. The communicator must outlive the backward.
Tensor halo_exchange(Communicator& sp, const Tensor& x, int64_t halo);

}  // namespace carry::parallel
