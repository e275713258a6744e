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
//
// owned_gradient: x's gradient from its other uses arrives as one tensor that nothing else holds (the
// fused convolution's input gradient, layers/kernels/blocks/conv_op.h). The gradient of x's last `halo`
// tokens from the next rank is then added into it in place, on those tokens only, before x's grad_fn
// runs, instead of coming back as a second gradient of x's full size that autograd adds (a fill and
// an add over all of x each layer: 2 ms a step at 125M on two H100s). Without it (x may share its
// gradient with another tensor, or have no other use), the gradient of x's size, as before.
Tensor halo_exchange(Communicator& sp, const Tensor& x, int64_t halo, bool owned_gradient = false);

}  // namespace carry::parallel
