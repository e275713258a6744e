// Tests for parallel/launch_env.h: torchrun's and srun's variables give the rank, world size, local
// rank and the TCP store's address; MPI's variables win; missing or bad values are one line naming the
// variable; Slurm node lists give their first host.
#include "parallel/launch_env.h"

#include <gtest/gtest.h>

#include <map>
#include <stdexcept>
#include <string>

namespace carry::parallel {
namespace {

using Vars = std::map<std::string, std::string>;

std::string error_of(const Vars& v) {
  try {
    read_launch_env(v);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(LaunchEnv, Torchrun) {
  auto e = read_launch_env(Vars{{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                                {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(e.kind, LaunchEnv::Kind::torchrun);
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_size, 4);
  EXPECT_EQ(e.master_addr, "node0");
  EXPECT_EQ(e.master_port, 29500);
  // torchrun inside an sbatch job: torchrun's variables win over Slurm's.
  auto both = read_launch_env(Vars{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1234"},
                                   {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}});
  EXPECT_EQ(both.kind, LaunchEnv::Kind::torchrun);
  EXPECT_EQ(both.size, 2);
}

TEST(LaunchEnv, Slurm) {
  auto e = read_launch_env(Vars{{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "1"},
                                {"SLURM_STEP_TASKS_PER_NODE", "8(x2)"}, {"SLURM_STEP_NODELIST", "gpu[003-004]"},
                                {"SLURM_JOB_ID", "123456"}});
  EXPECT_EQ(e.kind, LaunchEnv::Kind::slurm);
  EXPECT_EQ(e.rank, 9);
  EXPECT_EQ(e.size, 16);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_size, 8);
  EXPECT_EQ(e.master_addr, "gpu003");
  EXPECT_EQ(e.master_port, 29500 + 123456 % 10000);
  // MASTER_ADDR and MASTER_PORT, when set (the sbatch script of carry launch --slurm sets them), win.
  auto set = read_launch_env(Vars{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"MASTER_ADDR", "login1"},
                                  {"MASTER_PORT", "40000"}, {"SLURM_JOB_NODELIST", "a,b"}});
  EXPECT_EQ(set.master_addr, "login1");
  EXPECT_EQ(set.master_port, 40000);
  EXPECT_EQ(set.local_rank, 0);
}

TEST(LaunchEnv, MpiWinsAndNothingIsSingle) {
  EXPECT_EQ(read_launch_env(Vars{{"OMPI_COMM_WORLD_RANK", "1"}, {"RANK", "1"}, {"WORLD_SIZE", "2"}}).kind,
            LaunchEnv::Kind::mpi);
  EXPECT_EQ(read_launch_env(Vars{{"PMIX_RANK", "0"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}).kind,
            LaunchEnv::Kind::mpi);
  auto single = read_launch_env(Vars{});
  EXPECT_EQ(single.kind, LaunchEnv::Kind::single);
  EXPECT_EQ(single.size, 1);
  EXPECT_EQ(std::string(launch_kind_name(single.kind)), "single");
}

TEST(LaunchEnv, ErrorsNameTheVariable) {
  EXPECT_EQ(error_of({{"RANK", "0"}}), "torchrun's environment: WORLD_SIZE is not set (it is needed with the other "
                                       "variables of this launcher)");
  EXPECT_EQ(error_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}),
            "torchrun's environment (RANK must be below WORLD_SIZE = 4): RANK must be an integer in [0, 3], got '4'");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "two"}}),
            "torchrun's environment: WORLD_SIZE must be an integer in [1, 16777216], got 'two'");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}}),
            "torchrun's environment: MASTER_ADDR is not set (rank 0's host, where its TCP store listens)");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}}),
            "torchrun's environment: MASTER_PORT must be an integer in [1, 65535], got '70000'");
  EXPECT_EQ(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}),
            "Slurm's environment (srun): neither MASTER_ADDR nor SLURM_STEP_NODELIST/SLURM_JOB_NODELIST is set (rank "
            "0's host, where its TCP store listens)");
}

TEST(LaunchEnv, FirstSlurmHost) {
  EXPECT_EQ(first_slurm_host("node7"), "node7");
  EXPECT_EQ(first_slurm_host("gpu[003-005,009],login1"), "gpu003");
  EXPECT_EQ(first_slurm_host("a[1,4]b,c"), "a1b");
  EXPECT_EQ(first_slurm_host("x,y"), "x");
  EXPECT_EQ(first_slurm_host(""), "");
}

}  // namespace
}  // namespace carry::parallel
