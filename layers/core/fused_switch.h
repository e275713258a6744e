// One process-wide switch between the fused CUDA ops and their ATen forms (for comparisons).
#pragma once

namespace carry {

// Default true; a training run sets it from its config (`fused_ops`). False: every op runs its ATen form on CUDA too (the mixers their chunkwise forms under automatic dispatch;
// the norms, the MLP's activation and the convolutions their ATen chains), for comparisons. Only CUDA
// tensors are affected: on the CPU the ATen forms always run.
bool fused_ops_enabled();
void set_fused_ops(bool enabled);

}  // namespace carry
