// One verdict a test for a GoogleTest run over MPI ranks (the *_test_mpi.cpp suites under mpirun, whose
// main in tests/parallel/state_scan_test_mpi.cpp installs this listener). Every rank runs every test,
// and a failure on one rank can leave the others waiting in a collective it never joins, or leave
// messages unmatched for the tests after it. So after each test the ranks agree on its verdict (a
// polled allreduce of a failure flag over their own duplicate of MPI_COMM_WORLD):
//   - every rank passed: the run goes on;
//   - some rank failed: rank 0 prints the test's name, the failing ranks and the first failure of
//     each, and the job stops (MPI_Abort), so no later test runs on communicators left out of step;
//   - the ranks do not all arrive: a rank that failed waits kFailedWaitS for the others, one that passed
//     the communicators' timeout and then kPassedMarginS more (by then a rank stuck in a collective has
//     timed out and arrived); then it prints its own verdict and what it waited for, and stops the job.
// A failing test thus ends the job within seconds with the failing rank's message, instead of every
// rank waiting out its communicators' timeouts, test after test.
#pragma once

#include "parallel/process_group.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace carry::testing {

class RanksAgreeOnEveryTest : public ::testing::EmptyTestEventListener {
 public:
  static constexpr double kFailedWaitS = 10;
  static constexpr double kPassedMarginS = 30;
  static constexpr size_t kMaxMessage = 400;

  RanksAgreeOnEveryTest() {
    MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }

  void OnTestStart(const ::testing::TestInfo&) override {
    failed_ = false;
    first_failure_.clear();
  }

  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    if (!failed_) {
      // The failure on one line (GoogleTest's summary runs over several), at most kMaxMessage characters.
      std::string summary, line;
      std::istringstream lines(r.summary());
      while (std::getline(lines, line)) {
        line.erase(0, line.find_first_not_of(' '));
        if (!line.empty()) summary += (summary.empty() ? "" : " / ") + line;
      }
      if (summary.size() > kMaxMessage) summary = summary.substr(0, kMaxMessage) + "...";
      first_failure_ =
          std::string(r.file_name() ? r.file_name() : "?") + ":" + std::to_string(r.line_number()) + ": " + summary;
    }
    failed_ = true;
  }

  void OnTestEnd(const ::testing::TestInfo& info) override {
    const std::string test = std::string(info.test_suite_name()) + "." + info.name();
    const double wait = failed_ ? kFailedWaitS : parallel::default_comm_timeout_s() + kPassedMarginS;
    int mine = failed_ ? 1 : 0, any = 0;
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_Iallreduce(&mine, &any, 1, MPI_INT, MPI_MAX, comm_, &req);
    if (!completes(req, wait)) {
      std::fprintf(stderr,
                   "[ STOPPING ] %s: rank %d of %d %s; the other ranks did not finish the test within %.0f s: "
                   "stopping the job\n",
                   test.c_str(), rank_, size_, failed_ ? ("failed: " + first_failure_).c_str() : "passed", wait);
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (!any) return;
    // Every rank's first failure (empty where it passed) to rank 0, which reports them and stops the job.
    int len = static_cast<int>(first_failure_.size());
    std::vector<int> lens(size_), offsets(size_, 0);
    MPI_Request r1 = MPI_REQUEST_NULL;
    MPI_Igather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, comm_, &r1);
    const bool gathered = completes(r1, kFailedWaitS);
    int total = 0;
    if (rank_ == 0)
      for (int i = 0; i < size_; ++i) offsets[i] = total, total += lens[i];
    std::vector<char> all(std::max(total, 1));
    MPI_Request r2 = MPI_REQUEST_NULL;
    if (gathered)
      MPI_Igatherv(first_failure_.data(), len, MPI_CHAR, all.data(), lens.data(), offsets.data(), MPI_CHAR, 0, comm_,
                   &r2);
    if (rank_ == 0) {
      const bool texts = gathered && completes(r2, kFailedWaitS);
      std::string ranks, lines;
      for (int i = 0; texts && i < size_; ++i) {
        if (lens[i] == 0) continue;
        ranks += (ranks.empty() ? "" : ", ") + std::to_string(i);
        lines += "  rank " + std::to_string(i) + ": " + std::string(all.data() + offsets[i], lens[i]) + "\n";
      }
      std::fprintf(stdout,
                   "[  FAILED  ] %s failed on rank(s) %s of %d:\n%sstopping the job: the ranks' communicators may be "
                   "out of step after a failed test, so no later test runs\n",
                   test.c_str(), texts ? ranks.c_str() : "(their messages did not arrive)", size_, lines.c_str());
      std::fflush(stdout);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (gathered) completes(r2, kFailedWaitS);
    // Rank 0 stops the job; should it not, this rank does.
    std::this_thread::sleep_for(std::chrono::duration<double>(kFailedWaitS));
    MPI_Abort(MPI_COMM_WORLD, 1);
  }

 private:
  // Polls `req` until it completes (true) or `seconds` pass (false).
  static bool completes(MPI_Request& req, double seconds) {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      int done = 0;
      MPI_Test(&req, &done, MPI_STATUS_IGNORE);
      if (done) return true;
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > seconds) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  bool failed_ = false;
  std::string first_failure_;
};

}  // namespace carry::testing
