// The launch plan of `carry launch`: from a cluster config and a resolved run config, the hostfile and
// the mpirun command line that start dp*sp ranks of `carry train` (one rank a GPU slot). Ranks are
// numbered host by host in hostfile order and an sp group is dp_rank*sp .. dp_rank*sp + sp-1, so the
// plan gives each used host a whole number of sp groups when it can: an sp group then never spans
// hosts (its state scan stays on NVLink). Pure: nothing is read or written here (launch_command does).
#pragma once

#include "framework/config/config.h"

#include <cstdint>
#include <string>
#include <vector>

namespace carry {

struct LaunchOptions {
  std::string cluster_path;   // names the cluster in messages
  std::string hostfile_path;  // where the hostfile goes (mpirun --hostfile)
  std::string sbatch_path;    // --slurm: where the sbatch script goes (named in its comment)
  std::string carry_binary;   // the carry executable each rank runs
  bool allow_run_as_root = false;  // add mpirun's --allow-run-as-root
  bool forward_ld_library_path = true;  // -x LD_LIBRARY_PATH (only when it is set: mpirun warns otherwise)
};

struct HostSlots {
  std::string name;
  int64_t slots = 0;  // ranks placed on this host
};

struct LaunchPlan {
  int64_t world_size = 0;            // dp * sp
  std::vector<HostSlots> hosts;      // the used hosts, in cluster order
  std::string hostfile;              // "<name> slots=<n>\n" per used host
  std::vector<std::string> argv;     // mpirun ... <carry> train RUN [--set ...]
  std::vector<std::string> notes;    // what the user should know (unused hosts, sp groups spanning hosts)
};

// Throws ConfigError when the cluster is invalid (cluster_config_errors) or has fewer GPU slots than
// dp*sp, e.g. "the run needs dp*sp = 16 ranks but cluster c.textproto has 8 GPU slots (hosts: node0 8)".
LaunchPlan make_launch_plan(const ClusterConfig& cluster, const RunConfig& run, const std::string& run_path,
                            const std::vector<std::string>& overrides, const LaunchOptions& options);

// runs/launch/<run file name without .textproto>.hostfile
std::string default_hostfile_path(const std::string& run_path);
// runs/launch/<run file name without .textproto>.sbatch
std::string default_sbatch_path(const std::string& run_path);

// `carry launch --slurm`: the sbatch script that runs the same dp*sp ranks of `carry train` as the
// plan, one srun task a GPU (nodes: the hosts the plan uses; tasks and GPUs a node: the most ranks a
// host gets), MASTER_ADDR set to the job's first node and MASTER_PORT from the job id, so the ranks meet
// through carry's TCP store with no MPI (parallel/launch_env.h). Throws as make_launch_plan; `notes`
// gets what the user should know (mpirun_args are not used by srun).
std::string make_sbatch_script(const ClusterConfig& cluster, const RunConfig& run, const std::string& run_path,
                               const std::vector<std::string>& overrides, const LaunchOptions& options,
                               std::vector<std::string>* notes);

// One argument quoted for a POSIX shell (left as it is when it needs no quoting), and an argv joined
// into a line that can be pasted into a shell.
std::string shell_quote(const std::string& arg);
std::string shell_join(const std::vector<std::string>& argv);

}  // namespace carry
