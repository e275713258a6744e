// The launch plan (see launch_plan.h): place dp*sp ranks on the cluster's hosts, write the hostfile
// text and build mpirun's argv.
#include "framework/launch/launch_plan.h"

#include "layers/layout.h"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

namespace carry {

namespace {


// Whether mpirun's own arguments already hold one of `options` (as "-opt", "--opt" or "--opt=value").
bool has_option(const google::protobuf::RepeatedPtrField<std::string>& args, const std::vector<std::string>& options) {
  for (auto& a : args) {
    std::string name = a.substr(0, a.find('='));
    if (name.rfind("--", 0) == 0) name = name.substr(2);
    else if (name.rfind("-", 0) == 0) name = name.substr(1);
    else continue;
    if (std::find(options.begin(), options.end(), name) != options.end()) return true;
  }
  return false;
}

// Ranks per host, in cluster order. First try whole sp groups on every host (no sp group spans two
// hosts); when those do not reach `world_size`, fill each host up in order.
std::vector<HostSlots> place_ranks(const ClusterConfig& cluster, int64_t world_size, int64_t sp) {
  std::vector<HostSlots> used;
  int64_t left = world_size;
  for (auto& h : cluster.hosts()) {
    int64_t take = std::min(left, h.gpus() / sp * sp);
    if (take > 0) used.push_back({h.name(), take});
    left -= take;
  }
  if (left == 0) return used;
  used.clear();
  left = world_size;
  for (auto& h : cluster.hosts()) {
    int64_t take = std::min(left, h.gpus());
    if (take > 0) used.push_back({h.name(), take});
    left -= take;
  }
  return used;
}

}  // namespace

namespace {
std::string run_name(const std::string& run_path) {
  std::string base = run_path.substr(run_path.find_last_of('/') + 1);  // npos + 1 == 0
  const std::string ext = ".textproto";
  if (base.size() > ext.size() && base.compare(base.size() - ext.size(), ext.size(), ext) == 0)
    base.resize(base.size() - ext.size());
  if (base.empty()) base = "run";
  return base;
}
}  // namespace

std::string default_hostfile_path(const std::string& run_path) { return "runs/launch/" + run_name(run_path) + ".hostfile"; }
std::string default_sbatch_path(const std::string& run_path) { return "runs/launch/" + run_name(run_path) + ".sbatch"; }

std::string shell_quote(const std::string& arg) {
  static const std::string safe =
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_@%+=:,./-";
  if (!arg.empty() && arg.find_first_not_of(safe) == std::string::npos) return arg;
  std::string out = "'";
  for (char c : arg) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string shell_join(const std::vector<std::string>& argv) {
  std::vector<std::string> quoted;
  for (auto& a : argv) quoted.push_back(shell_quote(a));
  return join(quoted, " ");
}

LaunchPlan make_launch_plan(const ClusterConfig& cluster, const RunConfig& run, const std::string& run_path,
                            const std::vector<std::string>& overrides, const LaunchOptions& options) {
  const std::string cluster_name = options.cluster_path.empty() ? "(cluster config)" : options.cluster_path;
  auto errors = cluster_config_errors(cluster);
  if (!errors.empty()) throw ConfigError(cluster_name + ": " + join(errors, "\n" + cluster_name + ": "));

  LaunchPlan plan;
  const int64_t sp = run.parallel().sp();
  plan.world_size = run.parallel().dp() * sp;
  int64_t slots = 0;
  std::vector<std::string> all_hosts;
  for (auto& h : cluster.hosts()) {
    slots += h.gpus();
    all_hosts.push_back(h.name() + " " + std::to_string(h.gpus()));
  }
  if (plan.world_size > slots)
    throw ConfigError("the run needs dp*sp = " + std::to_string(plan.world_size) + " ranks (" + run_path +
                      ": parallel { dp: " + std::to_string(run.parallel().dp()) + " sp: " + std::to_string(sp) +
                      " }) but cluster " + cluster_name + " has " + std::to_string(slots) +
                      " GPU slots (hosts: " + join(all_hosts, ", ") + ")");

  plan.hosts = place_ranks(cluster, plan.world_size, sp);
  std::vector<std::string> used, spanning;
  for (auto& h : plan.hosts) {
    plan.hostfile += h.name + " slots=" + std::to_string(h.slots) + "\n";
    used.push_back(h.name + " " + std::to_string(h.slots));
    if (h.slots % sp != 0) spanning.push_back(h.name + " (" + std::to_string(h.slots) + ")");
  }
  if (plan.world_size < slots) {
    std::vector<std::string> unused;
    for (auto& h : cluster.hosts()) {
      bool is_used = std::any_of(plan.hosts.begin(), plan.hosts.end(), [&](const HostSlots& u) { return u.name == h.name(); });
      if (!is_used) unused.push_back(h.name());
    }
    plan.notes.push_back("the run uses " + std::to_string(plan.world_size) + " of the " + std::to_string(slots) +
                         " GPU slots: " + join(used, ", ") + (unused.empty() ? "" : "; unused: " + join(unused, ", ")));
  }
  if (!spanning.empty())
    plan.notes.push_back("warning: sp = " + std::to_string(sp) + " does not divide the ranks on " + join(spanning, ", ") +
                         ": sp groups span hosts, which is slower (their state scan crosses the network)");

  auto& a = plan.argv;
  a = {"mpirun"};
  if (options.allow_run_as_root) a.push_back("--allow-run-as-root");
  a.insert(a.end(), {"-np", std::to_string(plan.world_size), "--hostfile", options.hostfile_path});
  if (!has_option(cluster.mpirun_args(), {"map-by", "npernode", "pernode", "npersocket", "ppr", "bynode", "byslot"})) {
    bool same = std::all_of(plan.hosts.begin(), plan.hosts.end(),
                            [&](const HostSlots& h) { return h.slots == plan.hosts.front().slots; });
    a.push_back("--map-by");
    a.push_back(same ? "ppr:" + std::to_string(plan.hosts.front().slots) + ":node" : "slot");
  }
  if (!has_option(cluster.mpirun_args(), {"bind-to", "bind-to-core", "bind-to-socket", "bind-to-none"}))
    a.insert(a.end(), {"--bind-to", "none"});
  const auto& env = cluster.env();
  if (!cluster.network_interface().empty()) {
    const std::string& iface = cluster.network_interface();
    a.insert(a.end(), {"--mca", "btl_tcp_if_include", iface, "--mca", "oob_tcp_if_include", iface});
    if (!env.count("NCCL_SOCKET_IFNAME")) a.insert(a.end(), {"-x", "NCCL_SOCKET_IFNAME=" + iface});
  }
  // NVLink multicast (NVLS) stays off unless the cluster says otherwise.
  if (!env.count("NCCL_NVLS_ENABLE")) a.insert(a.end(), {"-x", "NCCL_NVLS_ENABLE=0"});
  if (options.forward_ld_library_path) a.insert(a.end(), {"-x", "LD_LIBRARY_PATH"});
  // The ranks learn that a stop signal reaches them as SIGUSR1 (carry launch forwards it), so they do
  // not warn about mpirun's odls_base_sigkill_timeout.
  a.insert(a.end(), {"-x", "CARRY_LAUNCHER=carry_launch"});
  std::map<std::string, std::string> sorted_env(env.begin(), env.end());
  for (auto& kv : sorted_env) a.insert(a.end(), {"-x", kv.first + "=" + kv.second});
  a.insert(a.end(), cluster.mpirun_args().begin(), cluster.mpirun_args().end());
  a.insert(a.end(), {options.carry_binary, "train", run_path});
  for (auto& o : overrides) a.insert(a.end(), {"--set", o});
  return plan;
}

std::string make_sbatch_script(const ClusterConfig& cluster, const RunConfig& run, const std::string& run_path,
                               const std::vector<std::string>& overrides, const LaunchOptions& options,
                               std::vector<std::string>* notes) {
  const LaunchPlan plan = make_launch_plan(cluster, run, run_path, overrides, options);
  if (notes) *notes = plan.notes;
  int64_t per_node = 0;
  for (auto& h : plan.hosts) per_node = std::max(per_node, h.slots);
  const int64_t nodes = static_cast<int64_t>(plan.hosts.size());
  if (nodes * per_node != plan.world_size && notes)
    notes->push_back("the hosts get different numbers of ranks; Slurm places " + std::to_string(per_node) +
                     " a node, so srun runs " + std::to_string(plan.world_size) + " tasks on " + std::to_string(nodes) +
                     " nodes (--ntasks)");
  if (!cluster.mpirun_args().empty() && notes)
    notes->push_back("the cluster's mpirun_args are not used under Slurm (slurm { srun_args } are)");
  const auto& job = cluster.slurm();
  const std::string name = run_name(run_path);
  std::string s;
  auto line = [&](const std::string& l) { s += l + "\n"; };
  line("#!/bin/bash");
  line("# Written by `carry launch --slurm` for " + run_path + " on cluster " + options.cluster_path + ": " +
       std::to_string(plan.world_size) + " ranks of carry train (dp " + std::to_string(run.parallel().dp()) + " x sp " +
       std::to_string(run.parallel().sp()) + "), one srun task a GPU.");
  line("# Submit with: sbatch " + shell_quote(options.sbatch_path.empty() ? default_sbatch_path(run_path) : options.sbatch_path));
  line("# The ranks read SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID and meet through carry's TCP store on");
  line("# MASTER_ADDR:MASTER_PORT (the job's first node); no MPI is started.");
  line("#SBATCH --job-name=" + shell_quote(name));
  line("#SBATCH --nodes=" + std::to_string(nodes));
  line("#SBATCH --ntasks=" + std::to_string(plan.world_size));
  line("#SBATCH --ntasks-per-node=" + std::to_string(per_node));
  line("#SBATCH --gpus-per-node=" + std::to_string(per_node));
  if (!job.partition().empty()) line("#SBATCH --partition=" + shell_quote(job.partition()));
  if (!job.account().empty()) line("#SBATCH --account=" + shell_quote(job.account()));
  if (!job.time_limit().empty()) line("#SBATCH --time=" + shell_quote(job.time_limit()));
  if (job.stop_signal_s() > 0) line("#SBATCH --signal=USR1@" + std::to_string(job.stop_signal_s()));
  line("#SBATCH --output=runs/launch/" + name + "-%j.out");
  for (auto& a : job.sbatch_args()) line("#SBATCH " + a);
  line("set -euo pipefail");
  line("export MASTER_ADDR=\"$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\"");
  line("export MASTER_PORT=$((29500 + SLURM_JOB_ID % 10000))");
  const auto& env = cluster.env();
  if (!cluster.network_interface().empty() && !env.count("NCCL_SOCKET_IFNAME"))
    line("export NCCL_SOCKET_IFNAME=" + shell_quote(cluster.network_interface()));
  if (!env.count("NCCL_NVLS_ENABLE")) line("export NCCL_NVLS_ENABLE=0");
  line("export CARRY_LAUNCHER=slurm");
  std::map<std::string, std::string> sorted_env(env.begin(), env.end());
  for (auto& kv : sorted_env) line("export " + kv.first + "=" + shell_quote(kv.second));
  std::vector<std::string> srun = {"srun", "--mpi=none", "--kill-on-bad-exit=1", "--ntasks=" + std::to_string(plan.world_size)};
  srun.insert(srun.end(), job.srun_args().begin(), job.srun_args().end());
  srun.insert(srun.end(), {options.carry_binary, "train", run_path});
  for (auto& o : overrides) srun.insert(srun.end(), {"--set", o});
  // exec: srun's exit status (75 after a stop with a checkpoint) is the job's.
  line("exec " + shell_join(srun));
  return s;
}

}  // namespace carry
