// Which launcher started this process, and the rank, world size and local rank it gave it, read from
// the environment at startup:
//   mpi       mpirun (OMPI_COMM_WORLD_RANK) or another MPI launcher (PMI_RANK, PMIX_RANK): MPI's world;
//   torchrun  RANK, WORLD_SIZE, LOCAL_RANK (LOCAL_WORLD_SIZE), MASTER_ADDR, MASTER_PORT, as torchrun and
//             torch.distributed's env:// set them;
//   slurm     srun's SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (SLURM_NTASKS_PER_NODE or
//             SLURM_STEP_TASKS_PER_NODE); MASTER_ADDR (default: the first host of SLURM_STEP_NODELIST
//             or SLURM_JOB_NODELIST) and MASTER_PORT (default: 29500 + SLURM_JOB_ID % 10000);
//   single    none of these: one process.
// MPI's variables win when present; torchrun's come before Slurm's (torchrun inside an sbatch job sees
// both). Without MPI the ranks meet through a TCP store on MASTER_ADDR:MASTER_PORT (parallel/tcp_store.h).
#pragma once

#include <map>
#include <string>

namespace carry::parallel {

struct LaunchEnv {
  enum class Kind { single, mpi, torchrun, slurm } kind = Kind::single;
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
  std::string master_addr;  // torchrun, slurm: where rank 0's TCP store listens
  int master_port = 0;
  std::string source;       // for messages: "torchrun's RANK/WORLD_SIZE", "Slurm's SLURM_PROCID/SLURM_NTASKS"
};

const char* launch_kind_name(LaunchEnv::Kind k);  // "single", "mpi", "torchrun", "slurm"

// The launchers' variables that are set in this process's environment (name -> value).
std::map<std::string, std::string> launch_variables();
// From `vars` (launch_variables() by default; tests pass their own). Throws std::runtime_error with
// one line naming the variable when a launcher's variables are incomplete or not numbers (RANK without
// WORLD_SIZE, RANK past WORLD_SIZE, a MASTER_PORT that is not a port).
LaunchEnv read_launch_env(const std::map<std::string, std::string>& vars);
LaunchEnv read_launch_env();

// The first host of a Slurm node list ("gpu[003-005,009],login1" -> "gpu003"); "" for an empty list.
std::string first_slurm_host(const std::string& nodelist);

}  // namespace carry::parallel
