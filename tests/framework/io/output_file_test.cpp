// Output checks (framework/io/output_file.h), run as root as CI does (permissions do not stop root,
// so what cannot be written is made of paths the kernel refuses): a directory under a regular file
// (ENOTDIR), /proc (no file can be created there), more space than the disk has, /dev/full for a
// full disk (ENOSPC), a directory given as a file; links and FIFOs in place of a written file.
#include "framework/io/output_file.h"

#include "tests/helpers/temp_dir.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <fstream>

#include <sys/stat.h>
#include <unistd.h>
#include <iterator>

namespace carry {
namespace {

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "missing '" << (part) << "' in: " << (text)

// The message of what f throws ("" if it does not throw).
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

class OutputFileTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::make_temp_dir("carry_output"); }
  void TearDown() override { testing::remove_tree(dir_); }
  std::string dir_;
};

TEST_F(OutputFileTest, WritableDirectoryPassesAndIsCreated) {
  check_output_dir(dir_ + "/a/b", 1 << 20, "checkpoint.dir");
  EXPECT_TRUE(testing::exists(dir_ + "/a/b"));
  EXPECT_FALSE(testing::exists(dir_ + "/a/b/.carry_write_test." + std::to_string(::getpid())));
  EXPECT_GT(free_bytes(dir_), 0);
}

TEST_F(OutputFileTest, UnwritableDirectoriesAreNamed) {
  std::ofstream(dir_ + "/file") << "x";
  auto m = error_of([&] { check_output_dir(dir_ + "/file/ck", 0, "checkpoint.dir"); });
  EXPECT_CONTAINS(m, "checkpoint.dir: cannot create the directory " + dir_ + "/file/ck");
  EXPECT_CONTAINS(m, "Not a directory");
  m = error_of([&] { check_output_dir("/proc", 0, "checkpoint.dir"); });
  EXPECT_CONTAINS(m, "checkpoint.dir: cannot create a file in /proc");
  m = error_of([&] { check_output_dir(dir_ + "/file", 0, "checkpoint.dir"); });
  EXPECT_CONTAINS(m, dir_ + "/file exists and is not a directory");
}

TEST_F(OutputFileTest, TooLittleSpaceIsRefusedWithBothFigures) {
  auto m = error_of([&] { check_output_dir(dir_, uint64_t{1} << 62, "checkpoint.dir"); });
  EXPECT_CONTAINS(m, "checkpoint.dir: " + dir_ + " has ");
  EXPECT_CONTAINS(m, "free, but this run needs about 4398046511104.0 MiB there");
}

TEST_F(OutputFileTest, AppendsAreCheckedOnAFullDisk) {
  const std::string path = dir_ + "/m/metrics.jsonl";
  check_output_file(path, "logging.metrics_file");
  append_to_file(path, "{\"step\":1}\n", "logging.metrics_file");
  append_to_file(path, "{\"step\":2}\n", "logging.metrics_file");
  std::ifstream in(path);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "{\"step\":1}\n{\"step\":2}\n");
  EXPECT_EQ(file_size(path), 22);
  // /dev/full opens, and every write fails with ENOSPC.
  check_output_file("/dev/full", "logging.metrics_file");
  auto m = error_of([&] { append_to_file("/dev/full", "{\"step\":1}\n", "logging.metrics_file"); });
  EXPECT_CONTAINS(m, "logging.metrics_file: cannot write to /dev/full: No space left on device");
  m = error_of([&] { check_output_file(dir_, "logging.metrics_file"); });
  EXPECT_CONTAINS(m, "is a directory; expected a file name");
  m = error_of([&] { check_output_file("/proc/carry_metrics.jsonl", "logging.metrics_file"); });
  EXPECT_CONTAINS(m, "logging.metrics_file: cannot open /proc/carry_metrics.jsonl for appending");
}

// A symbolic link or a FIFO in place of the metrics file is refused before anything is written (the
// link's target keeps its bytes; the FIFO never blocks the open).
TEST_F(OutputFileTest, LinksAndFifosAreRefused) {
  const std::string victim = dir_ + "/victim", link = dir_ + "/metrics.jsonl", fifo = dir_ + "/fifo.jsonl";
  std::ofstream(victim) << "precious\n";
  ASSERT_EQ(::symlink(victim.c_str(), link.c_str()), 0);
  auto m = error_of([&] { check_output_file(link, "logging.metrics_file"); });
  EXPECT_CONTAINS(m, "logging.metrics_file: " + link + " is a symbolic link; carry writes no file through a link");
  m = error_of([&] { append_to_file(link, "{\"step\":1}\n", "logging.metrics_file"); });
  EXPECT_CONTAINS(m, " is a symbolic link");
  std::ifstream in(victim);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "precious\n");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  m = error_of([&] { check_output_file(fifo, "logging.metrics_file"); });
  EXPECT_CONTAINS(m, "logging.metrics_file: " + fifo + " is a FIFO, not a regular file");
}

// write_whole_file, which writes every file a command names (--json, --model-out, the hostfile, an
// export's files, the resolved config beside the checkpoints): a link in its place is refused and its
// target keeps its bytes; a FIFO or a directory is refused at once; a full disk names the path.
TEST_F(OutputFileTest, WholeFilesAreWrittenThroughNoLinkAndIntoNoFifo) {
  const std::string victim = dir_ + "/victim", link = dir_ + "/out.json", fifo = dir_ + "/fifo.json";
  std::ofstream(victim) << "precious\n";
  ASSERT_EQ(::symlink(victim.c_str(), link.c_str()), 0);
  auto m = error_of([&] { write_whole_file(link, "{}\n", "--json"); });
  EXPECT_EQ(m, "--json: " + link + " is a symbolic link; carry writes no file through a link (remove the link, or "
               "name the file it points to)");
  std::ifstream in(victim);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "precious\n");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  m = error_of([&] { write_whole_file(fifo, "{}\n", "--json", /*sync=*/false, /*allow_char_device=*/true); });
  EXPECT_EQ(m, "--json: " + fifo + " is a FIFO, not a regular file; remove it or choose another path");
  m = error_of([&] { write_whole_file(dir_, "{}\n", "--json"); });
  EXPECT_CONTAINS(m, "--json: " + dir_ + " is a directory, not a regular file");
  m = error_of([&] { write_whole_file("/dev/full", "{}\n", "--json", false, /*allow_char_device=*/true); });
  EXPECT_EQ(m, "--json: cannot write /dev/full: No space left on device");
  const std::string plain = dir_ + "/plain.json";
  std::ofstream(plain) << "an older and longer text\n";
  EXPECT_EQ(error_of([&] { write_whole_file(plain, "{}\n", "--json", /*sync=*/true); }), "");
  std::ifstream again(plain);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(again), {}), "{}\n");
}

}  // namespace
}  // namespace carry
