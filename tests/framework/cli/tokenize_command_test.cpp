// `carry tokenize` under faults (framework/cli/tokenize_command.cpp), each run in a child process: a
// disk that fills (the file-size limit) gives exit 1 and one line naming the file, not an abort, and
// leaves no temporary file; SIGTERM in the middle of the write removes the temporary file; an
// --eod-id past 32 bits is refused; a directory as --input is named as such. (An --eod-id past
// 2-byte ids with a BPE tokenizer: TokenizerFiles.ErrorsSayWhatIsSupported.)
#include "framework/cli/tokenize_command.h"

#include "framework/data/token_file.h"
#include "tests/helpers/temp_dir.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

namespace carry {
namespace {

struct Outcome {
  bool exited = false;
  int status = -1;  // exit status, or the signal that ended it
  std::string err;  // its stderr
};

// Runs `carry tokenize ARGS` in a child process (with `before` run first in the child) and collects
// its stderr; `while_running` is called in the parent with the child's pid.
Outcome tokenize(const std::string& dir, std::vector<std::string> args, const std::function<void()>& before = {},
                 const std::function<void(pid_t)>& while_running = {}) {
  const std::string err_path = dir + "/stderr.txt";
  args.insert(args.begin(), "tokenize");
  pid_t pid = ::fork();
  if (pid == 0) {
    int fd = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 2);
    int out = ::open("/dev/null", O_WRONLY);
    ::dup2(out, 1);
    if (before) before();
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    ::_exit(run_tokenize_command(static_cast<int>(argv.size()), argv.data()));
  }
  if (while_running) while_running(pid);
  int status = 0;
  ::waitpid(pid, &status, 0);
  Outcome o;
  o.exited = WIFEXITED(status);
  o.status = o.exited ? WEXITSTATUS(status) : WTERMSIG(status);
  std::ifstream in(err_path);
  o.err.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return o;
}

// The names in dir that start with out.tok.tmp (the writer's temporary files).
std::vector<std::string> temporaries(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (auto* e = ::readdir(d))
      if (std::string(e->d_name).rfind("out.tok.tmp", 0) == 0) out.push_back(e->d_name);
    ::closedir(d);
  }
  return out;
}

void write_text(const std::string& path, size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  std::string line = "the quick brown fox jumps over the lazy dog\n";
  for (size_t n = 0; n < bytes; n += line.size()) out << line;
}

TEST(TokenizeCommand, AFullDiskIsOneLineAndLeavesNoTemporaryFile) {
  auto dir = testing::make_temp_dir("carry_tokenize_full");
  write_text(dir + "/in.txt", 1 << 20);  // 1 MiB: 2 MiB of tokens, past the 256 KiB limit
  Outcome o = tokenize(dir, {"--input", dir + "/in.txt", "--output", dir + "/out.tok", "--threads", "2"}, [] {
    std::signal(SIGXFSZ, SIG_IGN);  // the write fails with EFBIG, as on a full disk with ENOSPC
    struct rlimit limit {256 << 10, 256 << 10};
    ::setrlimit(RLIMIT_FSIZE, &limit);
  });
  EXPECT_TRUE(o.exited) << "ended on signal " << o.status << ": " << o.err;
  EXPECT_EQ(o.status, 1) << o.err;
  EXPECT_NE(o.err.find("carry tokenize: " + dir + "/out.tok.tmp."), std::string::npos) << o.err;
  EXPECT_NE(o.err.find("cannot write"), std::string::npos) << o.err;
  EXPECT_EQ(std::count(o.err.begin(), o.err.end(), '\n'), 1) << o.err;
  EXPECT_TRUE(temporaries(dir).empty()) << temporaries(dir)[0];
  EXPECT_FALSE(testing::exists(dir + "/out.tok"));
  testing::remove_tree(dir);
}

TEST(TokenizeCommand, StopSignalRemovesTheTemporaryFile) {
  auto dir = testing::make_temp_dir("carry_tokenize_term");
  write_text(dir + "/in.txt", 32 << 20);
  bool seen = false;
  Outcome o = tokenize(dir, {"--input", dir + "/in.txt", "--output", dir + "/out.tok", "--threads", "1"}, {},
                       [&](pid_t pid) {
                         const auto start = std::chrono::steady_clock::now();
                         while (!(seen = !temporaries(dir).empty()) &&
                                std::chrono::steady_clock::now() - start < std::chrono::seconds(20))
                           std::this_thread::sleep_for(std::chrono::microseconds(200));
                         ::kill(pid, SIGTERM);
                       });
  ASSERT_TRUE(seen) << "no temporary file appeared: " << o.err;
  ASSERT_FALSE(o.exited) << "tokenize finished before the signal (exit " << o.status << "): use a larger input";
  EXPECT_EQ(o.status, SIGTERM);
  EXPECT_TRUE(temporaries(dir).empty()) << temporaries(dir)[0];
  EXPECT_FALSE(testing::exists(dir + "/out.tok"));
  testing::remove_tree(dir);
}

TEST(TokenizeCommand, EndOfDocumentIdsAreCheckedAndFit) {
  auto dir = testing::make_temp_dir("carry_tokenize_eod");
  write_text(dir + "/in.txt", 100);
  Outcome big = tokenize(dir, {"--input", dir + "/in.txt", "--output", dir + "/out.tok", "--eod-id", "4294967297"});
  EXPECT_EQ(big.status, 2) << big.err;
  EXPECT_NE(big.err.find("--eod-id must be below 4294967295 (token ids are 32-bit), got 4294967297"), std::string::npos)
      << big.err;
  EXPECT_FALSE(testing::exists(dir + "/out.tok"));
  Outcome folder = tokenize(dir, {"--input", dir, "--output", dir + "/out2.tok"});
  EXPECT_EQ(folder.status, 1) << folder.err;
  EXPECT_NE(folder.err.find("--input " + dir + ": is a directory; expected a text file"), std::string::npos) << folder.err;
  testing::remove_tree(dir);
}

}  // namespace
}  // namespace carry
