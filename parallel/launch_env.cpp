// The launcher's environment (see launch_env.h): each variable parsed strictly, every error one line
// naming the variable and its value.
#include "parallel/launch_env.h"

#include "layers/core/knobs.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>

namespace carry::parallel {

namespace {

struct Env {
  const std::map<std::string, std::string>& vars;
  const char* operator()(const char* name) const {
    auto it = vars.find(name);
    return it != vars.end() && !it->second.empty() ? it->second.c_str() : nullptr;
  }
};

long integer(const Env& env, const char* name, long lo, long hi, const std::string& launcher) {
  const char* v = env(name);
  if (!v) throw std::runtime_error(launcher + ": " + name + " is not set (it is needed with the other variables "
                                   "of this launcher)");
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  if (errno || end == v || *end || x < lo || x > hi)
    throw std::runtime_error(launcher + ": " + name + " must be an integer in [" + std::to_string(lo) + ", " +
                             std::to_string(hi) + "], got '" + v + "'");
  return x;
}

}  // namespace

const char* launch_kind_name(LaunchEnv::Kind k) {
  switch (k) {
    case LaunchEnv::Kind::mpi: return "mpi";
    case LaunchEnv::Kind::torchrun: return "torchrun";
    case LaunchEnv::Kind::slurm: return "slurm";
    default: return "single";
  }
}

std::string first_slurm_host(const std::string& nodelist) {
  // The first entry: up to the first comma outside brackets.
  size_t end = 0;
  for (int depth = 0; end < nodelist.size(); ++end) {
    if (nodelist[end] == '[') ++depth;
    else if (nodelist[end] == ']') --depth;
    else if (nodelist[end] == ',' && depth == 0) break;
  }
  const std::string first = nodelist.substr(0, end);
  const size_t open = first.find('[');
  if (open == std::string::npos) return first;
  // "prefix[range,...]suffix": the range list's first number, with its zero padding.
  size_t stop = first.find_first_of(",-]", open + 1);
  const size_t close = first.find(']', open);
  if (stop == std::string::npos || close == std::string::npos) return first;
  return first.substr(0, open) + first.substr(open + 1, stop - open - 1) + first.substr(close + 1);
}

std::map<std::string, std::string> launch_variables() {
  std::map<std::string, std::string> vars;
  auto take = [&](const char* name, const char* value) {
    if (value) vars[name] = value;
  };
  take("OMPI_COMM_WORLD_RANK", knob_value("OMPI_COMM_WORLD_RANK"));
  take("PMI_RANK", knob_value("PMI_RANK"));
  take("PMIX_RANK", knob_value("PMIX_RANK"));
  take("RANK", knob_value("RANK"));
  take("WORLD_SIZE", knob_value("WORLD_SIZE"));
  take("LOCAL_RANK", knob_value("LOCAL_RANK"));
  take("LOCAL_WORLD_SIZE", knob_value("LOCAL_WORLD_SIZE"));
  take("MASTER_ADDR", knob_value("MASTER_ADDR"));
  take("MASTER_PORT", knob_value("MASTER_PORT"));
  take("SLURM_PROCID", knob_value("SLURM_PROCID"));
  take("SLURM_NTASKS", knob_value("SLURM_NTASKS"));
  take("SLURM_LOCALID", knob_value("SLURM_LOCALID"));
  take("SLURM_NTASKS_PER_NODE", knob_value("SLURM_NTASKS_PER_NODE"));
  take("SLURM_STEP_TASKS_PER_NODE", knob_value("SLURM_STEP_TASKS_PER_NODE"));
  take("SLURM_STEP_NODELIST", knob_value("SLURM_STEP_NODELIST"));
  take("SLURM_JOB_NODELIST", knob_value("SLURM_JOB_NODELIST"));
  take("SLURM_JOB_ID", knob_value("SLURM_JOB_ID"));
  return vars;
}

LaunchEnv read_launch_env() { return read_launch_env(launch_variables()); }

LaunchEnv read_launch_env(const std::map<std::string, std::string>& vars) {
  const Env env{vars};
  LaunchEnv e;
  if (env("OMPI_COMM_WORLD_RANK") || env("PMI_RANK") || env("PMIX_RANK")) {
    e.kind = LaunchEnv::Kind::mpi;  // MPI's world says the rest
    e.source = "MPI";
    return e;
  }
  const bool torchrun = env("RANK") || env("WORLD_SIZE");
  const bool slurm = env("SLURM_PROCID") && env("SLURM_NTASKS");
  if (!torchrun && !slurm) return e;
  std::string who;
  if (torchrun) {
    e.kind = LaunchEnv::Kind::torchrun;
    who = "torchrun's environment";
    e.source = "torchrun's RANK/WORLD_SIZE";
    e.size = static_cast<int>(integer(env, "WORLD_SIZE", 1, 1 << 24, who));
    e.rank = static_cast<int>(integer(env, "RANK", 0, e.size - 1, who + " (RANK must be below WORLD_SIZE = " +
                                                                       std::to_string(e.size) + ")"));
    e.local_size = env("LOCAL_WORLD_SIZE") ? static_cast<int>(integer(env, "LOCAL_WORLD_SIZE", 1, e.size, who)) : 1;
    e.local_rank = env("LOCAL_RANK") ? static_cast<int>(integer(env, "LOCAL_RANK", 0, e.size - 1, who)) : 0;
    if (!env("MASTER_ADDR")) throw std::runtime_error(who + ": MASTER_ADDR is not set (rank 0's host, where its TCP store listens)");
    e.master_addr = env("MASTER_ADDR");
    e.master_port = static_cast<int>(integer(env, "MASTER_PORT", 1, 65535, who));
  } else {
    e.kind = LaunchEnv::Kind::slurm;
    who = "Slurm's environment (srun)";
    e.source = "Slurm's SLURM_PROCID/SLURM_NTASKS";
    e.size = static_cast<int>(integer(env, "SLURM_NTASKS", 1, 1 << 24, who));
    e.rank = static_cast<int>(integer(env, "SLURM_PROCID", 0, e.size - 1, who + " (SLURM_PROCID must be below "
                                                                            "SLURM_NTASKS = " + std::to_string(e.size) + ")"));
    e.local_rank = env("SLURM_LOCALID") ? static_cast<int>(integer(env, "SLURM_LOCALID", 0, e.size - 1, who)) : 0;
    // "4" or "4(x2)" (SLURM_STEP_TASKS_PER_NODE) or "4" (SLURM_NTASKS_PER_NODE): the leading number.
    const char* per_node = env("SLURM_NTASKS_PER_NODE") ? env("SLURM_NTASKS_PER_NODE") : env("SLURM_STEP_TASKS_PER_NODE");
    e.local_size = per_node ? std::max(1, std::atoi(per_node)) : 1;
    if (env("MASTER_ADDR")) {
      e.master_addr = env("MASTER_ADDR");
    } else {
      const char* list = env("SLURM_STEP_NODELIST") ? env("SLURM_STEP_NODELIST") : env("SLURM_JOB_NODELIST");
      if (!list) throw std::runtime_error(who + ": neither MASTER_ADDR nor SLURM_STEP_NODELIST/SLURM_JOB_NODELIST is set "
                                          "(rank 0's host, where its TCP store listens)");
      e.master_addr = first_slurm_host(list);
    }
    if (env("MASTER_PORT")) {
      e.master_port = static_cast<int>(integer(env, "MASTER_PORT", 1, 65535, who));
    } else {
      const long job = env("SLURM_JOB_ID") ? integer(env, "SLURM_JOB_ID", 0, 1L << 62, who) : 0;
      e.master_port = static_cast<int>(29500 + job % 10000);
    }
  }
  if (e.local_rank >= e.local_size) e.local_size = e.local_rank + 1;
  return e;
}

}  // namespace carry::parallel
