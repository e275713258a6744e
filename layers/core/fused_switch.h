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

// The fused CUDA ops are compiled for sm_90a (Hopper, compute capability 9.0) and, all but the delta
// rule's (its walks are wgmma products, a Hopper instruction), for sm_100a (Blackwell B200/GB200, 10.0);
// arch-specific code runs on no other GPU. For a device of compute capability major.minor named
// `device`: empty when every kernel runs there, else the one line a run prints once (what was found,
// what runs instead).
std::string fused_ops_gpu_message(int major, int minor, const std::string& device);

// Whether the fused ops run on a device of compute capability major.minor (9.0 and 10.0), and whether
// the Hopper-only ones do (9.0): the delta rule's kernels (DeltaNet, Gated DeltaNet, Gated
// DeltaProduct, log-linear Gated DeltaNet), whose layers run their chunkwise forms elsewhere.
bool fused_ops_run_on(int major, int minor);
bool hopper_kernels_run_on(int major, int minor);

// The first CUDA device runs the Hopper-only kernels (true without a CUDA device): the delta rule's
// layers have a kernel form (has_kernel) only where it does, so elsewhere their automatic dispatch takes
// the chunkwise form and an explicit kernel form says why it cannot run.
bool gpu_runs_hopper_kernels();

}  // namespace carry
