// `carry train RUN.textproto [--set a.b=v ...] [--print-world-size]`: loads the run config, builds the
// dp × sp process groups over the ranks mpirun started (MPI on CPU; NCCL, one GPU a rank, when the
// build has CUDA and GPUs are present) and runs the Trainer (framework/trainer.h).
// --print-world-size prints dp·sp of the resolved config and exits without starting MPI (launcher/train
// uses it to pick mpirun's -np).
#pragma once

namespace carry {
int run_train_command(int argc, char** argv);  // argv[0] = "train"
}  // namespace carry
