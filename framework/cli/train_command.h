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

// The fewest seconds of mpirun's odls_base_sigkill_timeout that carry train accepts without a warning.
// Open MPI's mpirun, given SIGTERM or SIGINT, sends the ranks SIGCONT, waits that many seconds, sends
// SIGTERM, waits as long again and sends SIGKILL: the ranks have that many seconds from the SIGTERM to
// finish their step and write the checkpoint.
constexpr long kMinSigkillTimeoutS = 30;

// The one-line warning rank 0 prints at start under a plain Open MPI mpirun (omp_rank set, launcher
// unset) whose odls_base_sigkill_timeout is missing or below kMinSigkillTimeoutS; empty otherwise.
// The arguments are the values of CARRY_LAUNCHER, OMPI_COMM_WORLD_RANK and
// OMPI_MCA_odls_base_sigkill_timeout (nullptr when unset).
std::string mpirun_stop_warning(const char* launcher, const char* omp_rank, const char* sigkill_timeout);

// Empty when a host's ranks each get a GPU; else the message that refuses the launch.
std::string gpu_rank_layout_error(const std::string& host, int ranks_on_host, int gpus_on_host);
}  // namespace carry
