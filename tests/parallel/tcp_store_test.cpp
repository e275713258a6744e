// Tests for parallel/tcp_store.h and the world without MPI (parallel/process_group.h): this test binary
// starts copies of itself as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; and
// as srun would, SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID), each running one DISABLED_ child test: the
// ranks agree on rank and world size, exchange bytes through the store, and run the dp x sp groups'
// collectives over it (all-reduce in rank order, all-gather, a ring of send_recv, broadcast, barrier).
// A rank whose rank 0 never comes fails within the timeout with one line naming the address.
#include "parallel/launch_env.h"
#include "parallel/process_group.h"
#include "parallel/tcp_store.h"

#include "tests/helpers/temp_dir.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace carry::parallel {
namespace {

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

std::string read_file(const std::string& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Starts this binary running `test` with the environment plus `vars` (MPI's rank variables removed);
// returns the pid.
pid_t spawn(const std::string& test, const std::map<std::string, std::string>& vars, const std::string& log) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e, name = kv.substr(0, kv.find('='));
    if (name == "OMPI_COMM_WORLD_RANK" || name == "PMI_RANK" || name == "PMIX_RANK" || name == "RANK" ||
        name == "WORLD_SIZE" || name.rfind("SLURM_", 0) == 0 || name.rfind("MASTER_", 0) == 0)
      continue;
    env.push_back(kv);
  }
  for (auto& [k, v] : vars) env.push_back(k + "=" + v);
  std::vector<std::string> args = {"/proc/self/exe", "--gtest_filter=" + test, "--gtest_also_run_disabled_tests"};
  pid_t pid = ::fork();
  if (pid == 0) {
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::freopen(log.c_str(), "w", stdout);
    std::freopen(log.c_str(), "a", stderr);
    ::execve("/proc/self/exe", argv.data(), envp.data());
    ::_exit(127);
  }
  return pid;
}

// Waits for every pid (killing them after `timeout_s`); their exit statuses.
std::vector<int> wait_all(const std::vector<pid_t>& pids, double timeout_s) {
  std::vector<int> rc(pids.size(), -1);
  const auto start = std::chrono::steady_clock::now();
  size_t left = pids.size();
  while (left > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      int status = 0;
      if (rc[i] == -1 && ::waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        rc[i] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        --left;
      }
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout_s) {
      for (size_t i = 0; i < pids.size(); ++i)
        if (rc[i] == -1) ::kill(pids[i], SIGKILL), ::waitpid(pids[i], nullptr, 0), rc[i] = 999;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return rc;
}

// ---- the children ----

// One rank: checks what it was told, exchanges through the store, runs the groups' collectives, and
// writes "rank R of N: ..." to $CARRY_TEST_OUT/rank<R>.txt.
TEST(StoreChild, DISABLED_Rank) {
  const LaunchEnv env = read_launch_env();
  ASSERT_TRUE(env.kind == LaunchEnv::Kind::torchrun || env.kind == LaunchEnv::Kind::slurm);
  ASSERT_TRUE(store_world());
  const WorldInfo& w = world_info();
  ASSERT_EQ(w.rank, env.rank);
  ASSERT_EQ(w.size, env.size);
  std::ostringstream out;
  out << "rank " << w.rank << " of " << w.size << " (" << launch_kind_name(env.kind) << ", local " << w.local_rank << ")";
  // Bytes through the store: every rank's greeting, with a zero byte and UTF-8 in it.
  auto store = launch_store();
  ASSERT_TRUE(store);
  store->set("greeting/" + std::to_string(w.rank), std::string("from ") + std::to_string(w.rank) + '\0' + "\xe2\x9c\x93");
  for (int r = 0; r < w.size; ++r) {
    const std::string g = store->get("greeting/" + std::to_string(r));
    EXPECT_EQ(g, std::string("from ") + std::to_string(r) + '\0' + "\xe2\x9c\x93");
  }
  EXPECT_EQ(store->add("count", 1) <= w.size, true);
  // The groups: dp 2 x sp (size/2).
  auto g = make_process_groups({2, w.size / 2}, Backend::mpi);
  EXPECT_EQ(g.world->backend(), "tcp store");
  auto t = at::full({3}, static_cast<double>(w.rank + 1), at::kDouble);
  g.world->all_reduce_sum(t);
  const double total = w.size * (w.size + 1) / 2.0;
  EXPECT_EQ(t[2].item<double>(), total);
  out << "; sum " << t[0].item<double>();
  auto parts = g.sp->all_gather(at::full({2}, g.sp_rank * 10, at::kLong));
  ASSERT_EQ(static_cast<int>(parts.size()), g.sp->size());
  for (int r = 0; r < g.sp->size(); ++r) EXPECT_EQ(parts[r][1].item<int64_t>(), r * 10);
  // A ring over sp, twice (the sequence numbers keep the messages apart).
  for (int round = 0; round < 2; ++round) {
    const int n = g.sp->size(), next = (g.sp_rank + 1) % n, prev = (g.sp_rank + n - 1) % n;
    auto send = at::full({4}, static_cast<float>(100 * round + g.sp_rank), at::kFloat);
    auto recv = at::empty({4}, at::kFloat);
    g.sp->send_recv(send, next, recv, prev, /*tag=*/round);
    EXPECT_EQ(recv[3].item<float>(), static_cast<float>(100 * round + prev));
  }
  auto b = at::full({2}, g.dp_rank == 1 ? 7.0f : 0.0f, at::kFloat);
  g.dp->broadcast(b, 1);
  EXPECT_EQ(b[0].item<float>(), 7.0f);
  g.world->barrier();
  out << "; groups dp " << g.dp_rank << " sp " << g.sp_rank << " ok\n";
  std::ofstream(std::string(std::getenv("CARRY_TEST_OUT")) + "/rank" + std::to_string(w.rank) + ".txt") << out.str();
  finalize_mpi();  // rank 0 serves the store until every rank is through
}

// A rank whose rank 0 never listens: the error after CARRY_COMM_TIMEOUT_S.
TEST(StoreChild, DISABLED_Unreachable) {
  std::string message = "(no error)";
  try {
    world_info();
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  std::ofstream(std::string(std::getenv("CARRY_TEST_OUT")) + "/unreachable.txt") << message;
}

// ---- the tests ----

TEST(TcpStore, TorchrunRanksAgreeAndExchange) {
  const std::string dir = testing::make_temp_dir("carry_store");
  const int port = free_port(), n = 4;
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r)
    pids.push_back(spawn("StoreChild.DISABLED_Rank",
                         {{"RANK", std::to_string(r)}, {"WORLD_SIZE", std::to_string(n)}, {"LOCAL_RANK", std::to_string(r)},
                          {"LOCAL_WORLD_SIZE", std::to_string(n)}, {"MASTER_ADDR", "127.0.0.1"},
                          {"MASTER_PORT", std::to_string(port)}, {"CARRY_TEST_OUT", dir}, {"CARRY_COMM_TIMEOUT_S", "60"}},
                         dir + "/log" + std::to_string(r) + ".txt"));
  auto rc = wait_all(pids, 120);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(rc[r], 0) << "rank " << r << ":\n" << read_file(dir + "/log" + std::to_string(r) + ".txt");
    EXPECT_EQ(read_file(dir + "/rank" + std::to_string(r) + ".txt"),
              "rank " + std::to_string(r) + " of 4 (torchrun, local " + std::to_string(r) + "); sum 10; groups dp " +
                  std::to_string(r / 2) + " sp " + std::to_string(r % 2) + " ok\n");
  }
  testing::remove_tree(dir);
}

TEST(TcpStore, SrunRanksAgreeAndExchange) {
  const std::string dir = testing::make_temp_dir("carry_store_slurm");
  const int port = free_port(), n = 2;
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r)
    pids.push_back(spawn("StoreChild.DISABLED_Rank",
                         {{"SLURM_PROCID", std::to_string(r)}, {"SLURM_NTASKS", std::to_string(n)},
                          {"SLURM_LOCALID", std::to_string(r)}, {"SLURM_STEP_NODELIST", "localhost"},
                          {"MASTER_PORT", std::to_string(port)}, {"CARRY_TEST_OUT", dir}, {"CARRY_COMM_TIMEOUT_S", "60"}},
                         dir + "/log" + std::to_string(r) + ".txt"));
  auto rc = wait_all(pids, 120);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(rc[r], 0) << "rank " << r << ":\n" << read_file(dir + "/log" + std::to_string(r) + ".txt");
    EXPECT_EQ(read_file(dir + "/rank" + std::to_string(r) + ".txt"),
              "rank " + std::to_string(r) + " of 2 (slurm, local " + std::to_string(r) + "); sum 3; groups dp " +
                  std::to_string(r) + " sp 0 ok\n");
  }
  testing::remove_tree(dir);
}

TEST(TcpStore, UnreachableRankZeroIsOneClearError) {
  const std::string dir = testing::make_temp_dir("carry_store_none");
  const int port = free_port();
  auto pid = spawn("StoreChild.DISABLED_Unreachable",
                   {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)},
                    {"CARRY_TEST_OUT", dir}, {"CARRY_COMM_TIMEOUT_S", "1"}},
                   dir + "/log.txt");
  auto rc = wait_all({pid}, 60);
  EXPECT_EQ(rc[0], 0) << read_file(dir + "/log.txt");
  const std::string m = read_file(dir + "/unreachable.txt");
  EXPECT_EQ(m.rfind("carry: cannot reach the TCP store at 127.0.0.1:" + std::to_string(port) +
                        " (MASTER_ADDR:MASTER_PORT from torchrun's environment) within 1 s (last error: Connection refused); "
                        "rank 0 listens there: is it running, and do all ranks have the same MASTER_ADDR and MASTER_PORT? "
                        "(CARRY_COMM_TIMEOUT_S sets the wait)",
                    0),
            0u)
      << m;
  testing::remove_tree(dir);
}

TEST(TcpStore, SetGetTakeAddInOneProcess) {
  TcpStore server("127.0.0.1", 0, true, 5, "a test");
  TcpStore client("127.0.0.1", server.port(), false, 1, "a test");
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    server.set("k", std::string(100000, 'x'));
  });
  EXPECT_EQ(client.get("k").size(), 100000u);  // waits for the set
  later.join();
  EXPECT_EQ(client.take("k").size(), 100000u);
  EXPECT_EQ(client.add("n", 2), 2);
  EXPECT_EQ(server.add("n", 3), 5);
  try {
    client.get("k");  // taken: nobody sets it again
    ADD_FAILURE() << "a get of a missing key returned";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("timeout after 1 s waiting for 'k' in the TCP store"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace carry::parallel
