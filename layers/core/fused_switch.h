// One process-wide switch between the fused CUDA ops and their ATen forms (for comparisons), and the
// GPU check that keeps the fused ops off a GPU they were not built for.
#pragma once

#include <string>

namespace carry {

// Default true; a training run sets it from its config (`fused_ops`). False: every op runs its ATen form
// on CUDA too (the mixers their chunkwise forms under automatic dispatch; the norms, the MLP's activation
// and the convolutions their ATen chains), for comparisons. Only CUDA tensors are affected: on the CPU the
// ATen forms always run. Also false, whatever was set, when the first CUDA device is not one the kernels
// were compiled for (fused_ops_gpu_message): the ATen forms run everywhere.
bool fused_ops_enabled();
void set_fused_ops(bool enabled);

// The fused CUDA ops are compiled for sm_90a (Hopper, compute capability 9.0), whose code runs on no
// other GPU. For a device of compute capability major.minor named `device`: empty when the kernels run
// there, else the one line a run prints once (what was found, what runs instead).
std::string fused_ops_gpu_message(int major, int minor, const std::string& device);

}  // namespace carry
