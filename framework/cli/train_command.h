// `carry train RUN.textproto [--set a.b=v ...] [--max-steps N] [--max-minutes M] [--print-world-size]
// [--print-config]`: loads the run config, builds the
// dp × sp process groups over the ranks mpirun started (MPI on CPU; NCCL, one GPU a rank, when the
// build has CUDA and GPUs are present) and runs the Trainer (framework/train/trainer.h).
// --print-world-size prints dp·sp of the resolved config and exits without starting MPI (launcher/train
// uses it to pick mpirun's -np).
#pragma once

#include <string>

namespace carry {
int run_train_command(int argc, char** argv);  // argv[0] = "train"

// Empty when a host's ranks each get a GPU; else the message that refuses the launch.
std::string gpu_rank_layout_error(const std::string& host, int ranks_on_host, int gpus_on_host);
}  // namespace carry
