// Tests for framework/launch/launch_plan.h (`carry launch`): the hostfile and mpirun argv for the clusters
// under configs/clusters with runs from configs/, too few GPU slots, placement of sp groups on hosts,
// mapping and binding (the cluster's own mpirun_args win), the network interface, env order, quoting;
// the sbatch script of `carry launch --slurm`, line for line.
#include "tests/paths.h"
#include "framework/launch/launch_plan.h"

#include <gtest/gtest.h>
#include <google/protobuf/text_format.h>

#include <algorithm>
#include <string>
#include <vector>

namespace carry {
namespace {

using Args = std::vector<std::string>;

const std::string kConfigs = std::string(CARRY_SOURCE_DIR) + "/configs/";

LaunchOptions options_for(const std::string& cluster_path) {
  LaunchOptions o;
  o.cluster_path = cluster_path;
  o.hostfile_path = "runs/launch/x.hostfile";
  o.carry_binary = "/opt/carry/bin/carry";
  return o;
}

ClusterConfig cluster_from_text(const std::string& text) {
  ClusterConfig c;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &c)) << text;
  return c;
}

RunConfig layout(int64_t dp, int64_t sp) {
  RunConfig r;
  r.mutable_parallel()->set_dp(dp);
  r.mutable_parallel()->set_sp(sp);
  return r;
}

// The value after `flag` in argv ("" when absent).
std::string value_of(const Args& argv, const std::string& flag) {
  for (size_t i = 0; i + 1 < argv.size(); ++i)
    if (argv[i] == flag) return argv[i + 1];
  return "";
}

int count_of(const Args& argv, const std::string& item) {
  return static_cast<int>(std::count(argv.begin(), argv.end(), item));
}

TEST(LaunchPlan, OneHostDemoRun) {
  const std::string cluster_path = kConfigs + "clusters/one_host_4gpu.textproto";
  const std::string run_path = kConfigs + "demo_mqar.textproto";  // dp 1, sp 2
  auto plan = make_launch_plan(load_cluster_config(cluster_path), load_run_config(run_path), run_path, {},
                               options_for(cluster_path));
  EXPECT_EQ(plan.world_size, 2);
  EXPECT_EQ(plan.hostfile, "localhost slots=2\n");
  // The cluster's own "--bind-to none" replaces carry's.
  EXPECT_EQ(plan.argv, (Args{"mpirun", "-np", "2", "--hostfile", "runs/launch/x.hostfile", "--map-by", "ppr:2:node",
                             "-x", "NCCL_NVLS_ENABLE=0", "-x", "LD_LIBRARY_PATH", "-x", "CARRY_LAUNCHER=carry_launch", "-x", "NCCL_DEBUG=WARN",
                             "--bind-to", "none", "/opt/carry/bin/carry", "train", run_path}));
  ASSERT_EQ(plan.notes.size(), 1u);
  EXPECT_EQ(plan.notes[0], "the run uses 2 of the 4 GPU slots: localhost 2");
}

TEST(LaunchPlan, OneHostFullWithOverridesAndRoot) {
  const std::string cluster_path = kConfigs + "clusters/one_host_4gpu.textproto";
  const std::string run_path = kConfigs + "runs/mamba2_125m_512k_needle.textproto";  // dp 2, sp 2
  Args overrides = {"optimizer.lr=1e-3", "logging.metrics_file=runs/a b/m.jsonl"};
  auto o = options_for(cluster_path);
  o.allow_run_as_root = true;
  auto plan = make_launch_plan(load_cluster_config(cluster_path), load_run_config(run_path, overrides), run_path,
                               overrides, o);
  EXPECT_EQ(plan.hostfile, "localhost slots=4\n");
  EXPECT_TRUE(plan.notes.empty());
  EXPECT_EQ(plan.argv, (Args{"mpirun", "--allow-run-as-root", "-np", "4", "--hostfile", "runs/launch/x.hostfile",
                             "--map-by", "ppr:4:node", "-x", "NCCL_NVLS_ENABLE=0", "-x", "LD_LIBRARY_PATH", "-x", "CARRY_LAUNCHER=carry_launch", "-x",
                             "NCCL_DEBUG=WARN", "--bind-to", "none", "/opt/carry/bin/carry", "train", run_path,
                             "--set", "optimizer.lr=1e-3", "--set", "logging.metrics_file=runs/a b/m.jsonl"}));
  const std::string line = shell_join(plan.argv);
  const std::string tail = " train " + run_path + " --set optimizer.lr=1e-3 --set 'logging.metrics_file=runs/a b/m.jsonl'";
  EXPECT_EQ(line.substr(line.size() - std::min(line.size(), tail.size())), tail) << line;
}

TEST(LaunchPlan, TwoHostsOneHostUsed) {
  const std::string cluster_path = kConfigs + "clusters/two_hosts.textproto";
  const std::string run_path = kConfigs + "runs/gla_125m_128k.textproto";  // dp 1, sp 8
  auto plan = make_launch_plan(load_cluster_config(cluster_path), load_run_config(run_path), run_path, {},
                               options_for(cluster_path));
  EXPECT_EQ(plan.hostfile, "node0 slots=8\n");
  // The cluster's --map-by and --bind-to replace carry's; eth0 for MPI's TCP and NCCL's bootstrap.
  EXPECT_EQ(plan.argv, (Args{"mpirun", "-np", "8", "--hostfile", "runs/launch/x.hostfile", "--mca",
                             "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0", "-x",
                             "NCCL_SOCKET_IFNAME=eth0", "-x", "NCCL_NVLS_ENABLE=0", "-x", "LD_LIBRARY_PATH", "-x", "CARRY_LAUNCHER=carry_launch", "-x",
                             "NCCL_DEBUG=WARN", "-x", "NCCL_IB_DISABLE=0", "--bind-to", "none", "--map-by",
                             "ppr:8:node", "/opt/carry/bin/carry", "train", run_path}));
  ASSERT_EQ(plan.notes.size(), 1u);
  EXPECT_EQ(plan.notes[0], "the run uses 8 of the 16 GPU slots: node0 8; unused: node1");
}

TEST(LaunchPlan, TwoHostsSpGroupSpansHosts) {
  const std::string cluster_path = kConfigs + "clusters/two_hosts.textproto";
  const std::string run_path = kConfigs + "runs/gated_deltanet_340m_512k.textproto";  // dp 1, sp 16
  auto plan = make_launch_plan(load_cluster_config(cluster_path), load_run_config(run_path), run_path, {},
                               options_for(cluster_path));
  EXPECT_EQ(plan.hostfile, "node0 slots=8\nnode1 slots=8\n");
  EXPECT_EQ(value_of(plan.argv, "-np"), "16");
  ASSERT_EQ(plan.notes.size(), 1u);
  EXPECT_EQ(plan.notes[0].rfind("warning: sp = 16 does not divide the ranks on node0 (8), node1 (8)", 0), 0u)
      << plan.notes[0];
  // dp 2 x sp 8: one sp group a host, no warning.
  Args overrides = {"parallel.dp=2", "parallel.sp=8"};
  plan = make_launch_plan(load_cluster_config(cluster_path), load_run_config(run_path, overrides), run_path,
                          overrides, options_for(cluster_path));
  EXPECT_EQ(plan.hostfile, "node0 slots=8\nnode1 slots=8\n");
  EXPECT_TRUE(plan.notes.empty());
}

TEST(LaunchPlan, MoreRanksThanSlotsIsAnError) {
  const std::string cluster_path = kConfigs + "clusters/one_host_4gpu.textproto";
  const std::string run_path = kConfigs + "runs/gla_125m_128k.textproto";  // dp 1, sp 8
  try {
    make_launch_plan(load_cluster_config(cluster_path), load_run_config(run_path), run_path, {},
                     options_for(cluster_path));
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), "the run needs dp*sp = 8 ranks (" + run_path +
                                         ": parallel { dp: 1 sp: 8 }) but cluster " + cluster_path +
                                         " has 4 GPU slots (hosts: localhost 4)");
  }
}

TEST(LaunchPlan, InvalidClusterIsAnError) {
  auto c = cluster_from_text("hosts { name: \"a\" gpus: 0 }");
  try {
    make_launch_plan(c, layout(1, 1), "run.textproto", {}, options_for("c.textproto"));
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), "c.textproto: hosts[0].gpus: must be >= 1, got 0");
  }
}

TEST(LaunchPlan, UnequalHostsMapBySlot) {
  auto c = cluster_from_text("hosts { name: \"a\" gpus: 4 } hosts { name: \"b\" gpus: 2 }");
  auto plan = make_launch_plan(c, layout(3, 2), "run.textproto", {}, options_for("c.textproto"));
  EXPECT_EQ(plan.hostfile, "a slots=4\nb slots=2\n");
  EXPECT_EQ(value_of(plan.argv, "--map-by"), "slot");
  EXPECT_EQ(value_of(plan.argv, "--bind-to"), "none");
  EXPECT_TRUE(plan.notes.empty());
}

TEST(LaunchPlan, SpGroupsStayOnOneHostWhenTheyCan) {
  // 8 ranks of sp 4 on two 6-GPU hosts: 4 + 4, not 6 + 2 (which would split the second sp group).
  auto c = cluster_from_text("hosts { name: \"a\" gpus: 6 } hosts { name: \"b\" gpus: 6 }");
  auto plan = make_launch_plan(c, layout(2, 4), "run.textproto", {}, options_for("c.textproto"));
  EXPECT_EQ(plan.hostfile, "a slots=4\nb slots=4\n");
  EXPECT_EQ(value_of(plan.argv, "--map-by"), "ppr:4:node");
  ASSERT_EQ(plan.notes.size(), 1u);
  EXPECT_EQ(plan.notes[0], "the run uses 8 of the 12 GPU slots: a 4, b 4");
  // 6 ranks of sp 2 on 3 + 3 GPUs: whole sp groups give only 4, so the hosts are filled (with a warning).
  c = cluster_from_text("hosts { name: \"a\" gpus: 3 } hosts { name: \"b\" gpus: 3 }");
  plan = make_launch_plan(c, layout(3, 2), "run.textproto", {}, options_for("c.textproto"));
  EXPECT_EQ(plan.hostfile, "a slots=3\nb slots=3\n");
  ASSERT_EQ(plan.notes.size(), 1u);
  EXPECT_EQ(plan.notes[0].rfind("warning: sp = 2 does not divide the ranks on a (3), b (3)", 0), 0u) << plan.notes[0];
}

TEST(LaunchPlan, UserBindToOrMapByWins) {
  auto c = cluster_from_text("hosts { name: \"a\" gpus: 4 } mpirun_args: [\"--bind-to=core\"]");
  auto plan = make_launch_plan(c, layout(1, 4), "run.textproto", {}, options_for("c.textproto"));
  EXPECT_EQ(count_of(plan.argv, "--bind-to"), 0);
  EXPECT_EQ(count_of(plan.argv, "--bind-to=core"), 1);
  EXPECT_EQ(value_of(plan.argv, "--map-by"), "ppr:4:node");
  c = cluster_from_text("hosts { name: \"a\" gpus: 4 } mpirun_args: [\"-map-by\", \"socket\"]");
  plan = make_launch_plan(c, layout(1, 4), "run.textproto", {}, options_for("c.textproto"));
  EXPECT_EQ(count_of(plan.argv, "--map-by"), 0);
  EXPECT_EQ(value_of(plan.argv, "-map-by"), "socket");
  EXPECT_EQ(value_of(plan.argv, "--bind-to"), "none");
}

TEST(LaunchPlan, NetworkInterface) {
  auto c = cluster_from_text("hosts { name: \"a\" gpus: 2 } network_interface: \"ib0\"");
  auto plan = make_launch_plan(c, layout(1, 2), "run.textproto", {}, options_for("c.textproto"));
  Args mca = {"--mca", "btl_tcp_if_include", "ib0", "--mca", "oob_tcp_if_include", "ib0", "-x", "NCCL_SOCKET_IFNAME=ib0"};
  EXPECT_NE(std::search(plan.argv.begin(), plan.argv.end(), mca.begin(), mca.end()), plan.argv.end());
  c = cluster_from_text("hosts { name: \"a\" gpus: 2 }");
  plan = make_launch_plan(c, layout(1, 2), "run.textproto", {}, options_for("c.textproto"));
  EXPECT_EQ(count_of(plan.argv, "--mca"), 0);
  EXPECT_EQ(value_of(plan.argv, "-x"), "NCCL_NVLS_ENABLE=0");
}

TEST(LaunchPlan, EnvSortedAndNvlsOverridable) {
  auto c = cluster_from_text(
      "hosts { name: \"a\" gpus: 1 } env { key: \"ZED\" value: \"1\" } env { key: \"ALPHA\" value: \"x y\" } "
      "env { key: \"NCCL_NVLS_ENABLE\" value: \"1\" } env { key: \"MID\" value: \"3\" }");
  auto plan = make_launch_plan(c, layout(1, 1), "run.textproto", {}, options_for("c.textproto"));
  Args xs;
  for (size_t i = 0; i + 1 < plan.argv.size(); ++i)
    if (plan.argv[i] == "-x") xs.push_back(plan.argv[i + 1]);
  EXPECT_EQ(xs, (Args{"LD_LIBRARY_PATH", "CARRY_LAUNCHER=carry_launch", "ALPHA=x y", "MID=3", "NCCL_NVLS_ENABLE=1", "ZED=1"}));
  EXPECT_NE(shell_join(plan.argv).find(" -x 'ALPHA=x y' "), std::string::npos) << shell_join(plan.argv);
  // Without LD_LIBRARY_PATH in the environment it is not forwarded (mpirun would warn).
  auto opts = options_for("c.textproto");
  opts.forward_ld_library_path = false;
  auto quiet = make_launch_plan(c, layout(1, 1), "run.textproto", {}, opts);
  xs.clear();
  for (size_t i = 0; i + 1 < quiet.argv.size(); ++i)
    if (quiet.argv[i] == "-x") xs.push_back(quiet.argv[i + 1]);
  EXPECT_EQ(xs, (Args{"CARRY_LAUNCHER=carry_launch", "ALPHA=x y", "MID=3", "NCCL_NVLS_ENABLE=1", "ZED=1"}));
}

TEST(LaunchPlan, ShellQuoteAndHostfilePath) {
  EXPECT_EQ(shell_quote("ppr:8:node"), "ppr:8:node");
  EXPECT_EQ(shell_quote(""), "''");
  EXPECT_EQ(shell_quote("it's"), "'it'\\''s'");
  EXPECT_EQ(shell_quote("$HOME"), "'$HOME'");
  EXPECT_EQ(default_hostfile_path("configs/demo_mqar.textproto"), "runs/launch/demo_mqar.hostfile");
  EXPECT_EQ(default_hostfile_path("run.txt"), "runs/launch/run.txt.hostfile");
}

TEST(LaunchPlan, SlurmSbatchScript) {
  const std::string cluster_path = kConfigs + "clusters/slurm_two_nodes.textproto";
  const std::string run_path = kConfigs + "runs/gla_125m_128k.textproto";  // dp 1, sp 8
  auto o = options_for(cluster_path);
  o.sbatch_path = "runs/launch/gla_125m_128k.sbatch";
  std::vector<std::string> notes;
  RunConfig run = load_run_config(run_path, {"parallel.dp=2"});
  const std::string script =
      make_sbatch_script(load_cluster_config(cluster_path), run, run_path, {"parallel.dp=2"}, o, &notes);
  EXPECT_EQ(script,
            "#!/bin/bash\n"
            "# Written by `carry launch --slurm` for " + run_path + " on cluster " + cluster_path +
            ": 16 ranks of carry train (dp 2 x sp 8), one srun task a GPU.\n"
            "# Submit with: sbatch runs/launch/gla_125m_128k.sbatch\n"
            "# The ranks read SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID and meet through carry's TCP store on\n"
            "# MASTER_ADDR:MASTER_PORT (the job's first node); no MPI is started.\n"
            "#SBATCH --job-name=gla_125m_128k\n"
            "#SBATCH --nodes=2\n"
            "#SBATCH --ntasks=16\n"
            "#SBATCH --ntasks-per-node=8\n"
            "#SBATCH --gpus-per-node=8\n"
            "#SBATCH --partition=gpu\n"
            "#SBATCH --account=my-project\n"
            "#SBATCH --time=24:00:00\n"
            "#SBATCH --signal=USR1@300\n"
            "#SBATCH --output=runs/launch/gla_125m_128k-%j.out\n"
            "#SBATCH --exclusive\n"
            "set -euo pipefail\n"
            "export MASTER_ADDR=\"$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\"\n"
            "export MASTER_PORT=$((29500 + SLURM_JOB_ID % 10000))\n"
            "export NCCL_SOCKET_IFNAME=ib0\n"
            "export NCCL_NVLS_ENABLE=0\n"
            "export CARRY_LAUNCHER=slurm\n"
            "export NCCL_DEBUG=WARN\n"
            "exec srun --mpi=none --kill-on-bad-exit=1 --ntasks=16 --cpu-bind=none /opt/carry/bin/carry train " +
                run_path + " --set parallel.dp=2\n");
  EXPECT_TRUE(notes.empty()) << notes[0];
  // One node's worth, no slurm block: only what the cluster says; too many ranks is the plan's error.
  auto small = cluster_from_text("hosts { name: \"a\" gpus: 4 }");
  const std::string one = make_sbatch_script(small, layout(1, 2), "r.textproto", {}, o, &notes);
  EXPECT_NE(one.find("#SBATCH --nodes=1\n#SBATCH --ntasks=2\n#SBATCH --ntasks-per-node=2\n#SBATCH --gpus-per-node=2\n"
                     "#SBATCH --signal=USR1@300\n"),
            std::string::npos)
      << one;
  EXPECT_EQ(one.find("--partition"), std::string::npos);
  EXPECT_NE(one.find("exec srun --mpi=none --kill-on-bad-exit=1 --ntasks=2 /opt/carry/bin/carry train r.textproto\n"),
            std::string::npos);
  EXPECT_THROW(make_sbatch_script(small, layout(1, 8), "r.textproto", {}, o, &notes), ConfigError);
}

}  // namespace
}  // namespace carry
