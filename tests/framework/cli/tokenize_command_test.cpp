// `carry tokenize` under faults (framework/cli/tokenize_command.cpp), each run in a child process: a
// disk that fills (the file-size limit) gives exit 1 and one line naming the file, not an abort, and
// leaves no temporary file; SIGTERM in the middle of the write removes the temporary file; an
// --eod-id past 32 bits is refused; a directory as --input is named as such. (An --eod-id past
// 2-byte ids with a BPE tokenizer: TokenizerFiles.ErrorsSayWhatIsSupported.) --jsonl: documents with
// unicode and escapes around blank lines, read back token for token; 1 thread against 3 threads with
// small pieces; a bad line (not JSON, no field, not a string) named by file and line, the first one in
// input order whatever the pieces.
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

void write_file(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

std::vector<uint32_t> tokens_of(const std::string& path) {
  TokenFile f(path);
  std::vector<int64_t> v(static_cast<size_t>(f.size()));
  f.read(0, f.size(), v.data());
  return std::vector<uint32_t>(v.begin(), v.end());
}

constexpr uint32_t kEod = 256;  // the byte tokenizer's end of document

TEST(TokenizeCommand, JsonlLinesAreDocuments) {
  auto dir = testing::make_temp_dir("carry_tokenize_jsonl");
  // Unicode as is and escaped, every escape, a member before and after, blank lines (CRLF too), an
  // empty document, and a last line without its line break.
  write_file(dir + "/a.jsonl",
             "{\"text\": \"h\xc3\xa9llo w\xc3\xb6rld \xe2\x9c\x93 \xf0\x9f\x98\x80\", \"id\": 1}\n"
             "\n"
             "   \r\n"
             "{\"meta\": {\"tags\": [\"x\", 2.5e3, true, null]}, \"text\": \"tab\\there\\nline \\\"q\\\" \\\\ \\/ "
             "\\u00e9\\ud83d\\ude00\\b\\f\\r\"}\r\n"
             "{\"text\": \"\"}\n"
             "{\"text\":\"last\"}");
  write_file(dir + "/b.jsonl", "{\"body\": \"other field\", \"text\": 3}\n");
  std::vector<std::string> docs = {"h\xc3\xa9llo w\xc3\xb6rld \xe2\x9c\x93 \xf0\x9f\x98\x80",
                                   "tab\there\nline \"q\" \\ / \xc3\xa9\xf0\x9f\x98\x80\b\f\r", "", "last"};
  std::vector<uint32_t> expected;
  for (auto& d : docs) {
    expected.push_back(kEod);
    for (unsigned char c : d) expected.push_back(c);
  }
  Outcome o = tokenize(dir, {"--jsonl", dir + "/a.jsonl", "--output", dir + "/out.tok"});
  ASSERT_EQ(o.status, 0) << o.err;
  EXPECT_EQ(tokens_of(dir + "/out.tok"), expected);
  // --field picks another member; the documents of two files in order.
  o = tokenize(dir, {"--jsonl", dir + "/b.jsonl", dir + "/b.jsonl", "--field", "body", "--output", dir + "/b.tok"});
  ASSERT_EQ(o.status, 0) << o.err;
  std::vector<uint32_t> two;
  for (int i = 0; i < 2; ++i) {
    two.push_back(kEod);
    for (unsigned char c : std::string("other field")) two.push_back(c);
  }
  EXPECT_EQ(tokens_of(dir + "/b.tok"), two);
  // Flags that do not go together.
  EXPECT_EQ(tokenize(dir, {"--jsonl", dir + "/a.jsonl", "--input", dir + "/b.jsonl", "--output", dir + "/c.tok"}).status, 2);
  EXPECT_EQ(tokenize(dir, {"--input", dir + "/a.jsonl", "--field", "body", "--output", dir + "/c.tok"}).status, 2);
  testing::remove_tree(dir);
}

TEST(TokenizeCommand, JsonlBadLinesAreNamedByFileAndLine) {
  auto dir = testing::make_temp_dir("carry_tokenize_jsonl_bad");
  auto one_line_error = [&](const std::string& content, const std::string& message) {
    write_file(dir + "/in.jsonl", content);
    Outcome o = tokenize(dir, {"--jsonl", dir + "/in.jsonl", "--output", dir + "/out.tok"});
    EXPECT_EQ(o.status, 1) << o.err;
    EXPECT_EQ(o.err, "carry tokenize: " + dir + "/in.jsonl:" + message + "\n");
    EXPECT_FALSE(testing::exists(dir + "/out.tok"));
    EXPECT_TRUE(temporaries(dir).empty());
  };
  one_line_error("{\"text\": \"a\"}\n\n{\"text\": \"b\"\n",
                 "3: not a JSON object: expected ',' or '}' in an object (found the end of the line) at column 13");
  one_line_error("{\"text\": \"a\"}\nplain text\n", "2: not a JSON object: expected a JSON object '{' (found 'p') at column 1");
  one_line_error("{\"content\": \"a\"}\n", "1: the object has no \"text\" member (--field names the text member)");
  one_line_error("{\"text\": [\"a\"]}\n", "1: \"text\" is an array, expected a string");
  // Many pieces on 3 threads: the first bad line in input order is the one named, and the good lines
  // give the tokens one thread with whole files gives.
  std::string big;
  for (int i = 1; i <= 3000; ++i) big += "{\"text\": \"document " + std::to_string(i) + " \\u00e9 " + std::string(i % 97, 'x') + "\"}\n";
  write_file(dir + "/big.jsonl", big);
  Outcome one = tokenize(dir, {"--jsonl", dir + "/big.jsonl", "--output", dir + "/one.tok", "--threads", "1"});
  Outcome three = tokenize(dir, {"--jsonl", dir + "/big.jsonl", "--output", dir + "/three.tok", "--threads", "3",
                                 "--piece-bytes", "1000"});
  ASSERT_EQ(one.status, 0) << one.err;
  ASSERT_EQ(three.status, 0) << three.err;
  const auto tokens = tokens_of(dir + "/one.tok");
  EXPECT_EQ(tokens, tokens_of(dir + "/three.tok"));
  EXPECT_EQ(std::count(tokens.begin(), tokens.end(), kEod), 3000);
  std::string bad = big;
  auto line_start = [&](int line) {
    size_t at = 0;
    for (int i = 1; i < line; ++i) at = bad.find('\n', at) + 1;
    return at;
  };
  bad.insert(line_start(2900), "{oops}\n");  // line 2900
  bad.insert(line_start(2500), "{\"text\": 1}\n");  // line 2500: the first
  write_file(dir + "/bad.jsonl", bad);
  Outcome o = tokenize(dir, {"--jsonl", dir + "/bad.jsonl", "--output", dir + "/bad.tok", "--threads", "3",
                             "--piece-bytes", "1000"});
  EXPECT_EQ(o.status, 1);
  EXPECT_EQ(o.err, "carry tokenize: " + dir + "/bad.jsonl:2500: \"text\" is a number, expected a string\n");
  testing::remove_tree(dir);
}

}  // namespace
}  // namespace carry
