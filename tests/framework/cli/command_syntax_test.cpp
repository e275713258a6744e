// Every `carry` subcommand reads its arguments with CommandArgs, run in-process here: "--flag=value"
// and "--flag value" give the same result (the same files, output or error), a missing value, an
// unknown flag, a bad integer and a switch given a value each give one line naming the flag (then
// the usage, for the commands that print it) and the command's usage exit code, and --help prints
// the usage on stdout with exit code 0. Nothing here starts MPI or needs a GPU.
#include "framework/cli/bench_command.h"
#include "framework/cli/check_command.h"
#include "framework/cli/env_command.h"
#include "framework/cli/eval_command.h"
#include "framework/cli/export_command.h"
#include "framework/cli/generate_command.h"
#include "framework/cli/launch_command.h"
#include "framework/cli/mixer_command.h"
#include "framework/cli/scan_bench_command.h"
#include "framework/cli/tokenize_command.h"
#include "framework/cli/train_command.h"
#include "framework/io/safetensors.h"
#include "tests/helpers/temp_dir.h"
#include "tests/paths.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace carry {
namespace {

using Command = int (*)(int, char**);

struct Result {
  int rc = -1;
  std::string out, err;
};

// `carry <name> <args...>` in-process, stdout and stderr captured.
Result run(Command command, const std::string& name, std::vector<std::string> args) {
  args.insert(args.begin(), name);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  Result r;
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  r.rc = command(static_cast<int>(args.size()), argv.data());
  r.err = ::testing::internal::GetCapturedStderr();
  r.out = ::testing::internal::GetCapturedStdout();
  return r;
}

int eval(int argc, char** argv) { return run_eval_command(argc, argv, /*finalize_mpi=*/false); }
int mixer(int argc, char** argv) { return run_mixer_command(argc, argv); }

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// A usage error: exit code rc, the first stderr line starts with `line`, and what follows it is
// nothing or the usage.
void expect_usage_error(Command command, const std::string& name, const std::vector<std::string>& args, int rc,
                        const std::string& line) {
  std::string shown = "carry " + name;
  for (auto& a : args) shown += " " + a;
  SCOPED_TRACE(shown);
  Result r = run(command, name, args);
  EXPECT_EQ(r.rc, rc);
  EXPECT_EQ(first_line(r.err).substr(0, line.size()), line) << "stderr: " << r.err;
  const auto nl = r.err.find('\n');
  ASSERT_NE(nl, std::string::npos) << r.err;
  const std::string rest = r.err.substr(nl + 1);
  EXPECT_TRUE(rest.empty() || rest.rfind("usage: carry " + name, 0) == 0) << "after the message: " << rest;
}

// --help and -h: the usage on stdout, nothing on stderr, exit code 0.
void expect_help(Command command, const std::string& name, std::vector<std::string> before = {},
                 const std::string& usage_start = "") {
  for (const char* h : {"--help", "-h"}) {
    auto args = before;
    args.push_back(h);
    SCOPED_TRACE("carry " + name + " " + h);
    Result r = run(command, name, args);
    EXPECT_EQ(r.rc, 0);
    EXPECT_EQ(r.out.rfind(usage_start.empty() ? "usage: carry " + name : usage_start, 0), 0u) << r.out;
    EXPECT_EQ(r.err, "");
  }
}

// The two spellings give the same exit code, stdout and stderr.
Result expect_same(Command command, const std::string& name, const std::vector<std::string>& equals_form,
                   const std::vector<std::string>& space_form) {
  Result a = run(command, name, equals_form), b = run(command, name, space_form);
  EXPECT_EQ(a.rc, b.rc);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.err, b.err);
  return a;
}

const std::string kSource = CARRY_SOURCE_DIR;
const std::string kRun = kSource + "/configs/demo_mqar.textproto";  // dp 1, sp 2
const std::string kCluster = kSource + "/configs/clusters/one_host_4gpu.textproto";

std::string read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

struct TempDir {
  std::string path = testing::make_temp_dir("carry_command_syntax");
  ~TempDir() { testing::remove_tree(path); }
};

TEST(CommandSyntax, Train) {
  expect_help(run_train_command, "train");
  for (auto steps : {std::vector<std::string>{"--max-steps=3"}, std::vector<std::string>{"--max-steps", "3"}}) {
    auto args = steps;
    args.insert(args.begin(), kRun);
    args.push_back("--print-world-size");
    Result r = run(run_train_command, "train", args);
    EXPECT_EQ(r.rc, 0) << r.err;
    EXPECT_EQ(r.out, "2\n");
  }
  Result config = expect_same(run_train_command, "train",
                              {kRun, "--set=seed=7", "--set", "optimizer.lr=0.5", "--max-minutes=2", "--print-config"},
                              {kRun, "--set", "seed=7", "--set=optimizer.lr=0.5", "--max-minutes", "2", "--print-config"});
  EXPECT_EQ(config.rc, 0) << config.err;
  EXPECT_NE(config.out.find("seed: 7\n"), std::string::npos) << config.out;
  EXPECT_NE(config.out.find("lr: 0.5\n"), std::string::npos) << config.out;
  expect_usage_error(run_train_command, "train", {kRun, "--max-steps"}, 2, "carry train: --max-steps needs a value");
  expect_usage_error(run_train_command, "train", {kRun, "--max-steps=abc"}, 2,
                     "carry train: --max-steps needs an integer >= 1, got 'abc'");
  expect_usage_error(run_train_command, "train", {kRun, "--max-steps", "0"}, 2,
                     "carry train: --max-steps needs an integer >= 1, got '0'");
  expect_usage_error(run_train_command, "train", {kRun, "--max-minutes=-1"}, 2,
                     "carry train: --max-minutes needs a positive number, got '-1'");
  expect_usage_error(run_train_command, "train", {kRun, "--bogus=1"}, 2, "carry train: unknown flag '--bogus'");
  expect_usage_error(run_train_command, "train", {kRun, "--dry-run=yes"}, 2,
                     "carry train: --dry-run takes no value, got '--dry-run=yes'");
  expect_usage_error(run_train_command, "train", {kRun, "other.textproto"}, 2,
                     "carry train: one run config expected, got '" + kRun + "' and 'other.textproto'");
}

TEST(CommandSyntax, Launch) {
  expect_help(run_launch_command, "launch");
  Result r = expect_same(run_launch_command, "launch",
                         {"--cluster=" + kCluster, kRun, "--set=seed=3", "--set", "optimizer.lr=0.5",
                          "--hostfile=/tmp/x.hostfile", "--carry=/opt/carry", "--dry-run"},
                         {"--cluster", kCluster, kRun, "--set", "seed=3", "--set=optimizer.lr=0.5", "--hostfile",
                          "/tmp/x.hostfile", "--carry", "/opt/carry", "--dry-run"});
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out.rfind("hostfile /tmp/x.hostfile:\n", 0), 0u) << r.out;
  EXPECT_NE(r.out.find("/opt/carry train"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--set seed=3 --set optimizer.lr=0.5"), std::string::npos) << r.out;
  expect_usage_error(run_launch_command, "launch", {kRun, "--cluster"}, 2, "carry launch: --cluster needs a value");
  expect_usage_error(run_launch_command, "launch", {"--cluster=" + kCluster, kRun, "--bogus"}, 2,
                     "carry launch: unknown flag '--bogus'");
  expect_usage_error(run_launch_command, "launch", {"--cluster=" + kCluster, kRun, "--dry-run=no"}, 2,
                     "carry launch: --dry-run takes no value, got '--dry-run=no'");
}

TEST(CommandSyntax, Env) {
  expect_help(run_env_command, "env");
  Result r = run(run_env_command, "env", {"--names"});
  EXPECT_EQ(r.rc, 0);
  EXPECT_NE(r.out.find("CARRY_COMM_TIMEOUT_S\n"), std::string::npos);
  // `carry env` exits 1 on a usage error, without the usage.
  expect_usage_error(run_env_command, "env", {"--names=1"}, 1, "carry env: --names takes no value, got '--names=1'");
  expect_usage_error(run_env_command, "env", {"--bogus"}, 1,
                     "carry env: unknown flag '--bogus' (expected --names or --help)");
}

TEST(CommandSyntax, Check) {
  expect_help(run_check_command, "check");
  Result a = run(run_check_command, "check", {"--family=gla", "--no-timing", "--device=cpu"});
  Result b = run(run_check_command, "check", {"--family", "gla", "--no-timing", "--device", "cpu"});
  EXPECT_EQ(a.rc, 0) << a.err;
  EXPECT_EQ(b.rc, 0) << b.err;
  // All but the last line (its time) are equal.
  EXPECT_EQ(a.out.substr(0, a.out.rfind("families checked")), b.out.substr(0, b.out.rfind("families checked")));
  EXPECT_EQ(a.out.rfind("carry check: 1 mixer families on cpu\n", 0), 0u) << a.out;
  expect_usage_error(run_check_command, "check", {"--family=nope"}, 2, "carry check: unknown mixer family 'nope'");
  expect_usage_error(run_check_command, "check", {"--timing-len=x"}, 2,
                     "carry check: --timing-len needs an integer >= 1, got 'x'");
  expect_usage_error(run_check_command, "check", {"--timing-len", "100"}, 2,
                     "carry check: --timing-len must be a positive multiple of 64, got 100");
  expect_usage_error(run_check_command, "check", {"--device"}, 2, "carry check: --device needs a value");
  expect_usage_error(run_check_command, "check", {"--bogus"}, 2, "carry check: unknown flag '--bogus'");
}

TEST(CommandSyntax, Bench) {
  expect_help(run_bench_command, "bench", {}, "usage: carry bench kernels");
  expect_help(run_bench_command, "bench", {"kernels"}, "usage: carry bench kernels");
  // The flags are read before the families are looked up (and before any GPU is needed).
  expect_same(run_bench_command, "bench", {"kernels", "--reps=3", "--T=16,32", "--timer=wall", "--families=nope"},
              {"kernels", "--reps", "3", "--T", "16,32", "--timer", "wall", "--families", "nope"});
  expect_usage_error(run_bench_command, "bench", {"kernels", "--reps=3", "--families=nope"}, 2,
                     "carry bench: unknown mixer family 'nope'");
  expect_usage_error(run_bench_command, "bench", {"kernels", "--T=16,x"}, 2,
                     "carry bench: --T needs a comma-separated list of integers >= 1, got '16,x'");
  expect_usage_error(run_bench_command, "bench", {"kernels", "--timer=gpu"}, 2,
                     "carry bench: --timer: expected events or wall, got 'gpu'");
  expect_usage_error(run_bench_command, "bench", {"kernels", "--reps"}, 2, "carry bench: --reps needs a value");
  expect_usage_error(run_bench_command, "bench", {"kernels", "--serial=1"}, 2,
                     "carry bench: --serial takes no value, got '--serial=1'");
  expect_usage_error(run_bench_command, "bench", {"kernels", "--bogus"}, 2, "carry bench: unknown flag '--bogus'");
  expect_usage_error(run_bench_command, "bench", {"--reps=3"}, 2, "carry bench: expected 'kernels'");
}

TEST(CommandSyntax, ScanBench) {
  expect_help(run_scan_bench_command, "scan-bench");
  Result r = expect_same(run_scan_bench_command, "scan-bench", {"--seq-len=64", "--head-groups=1,2", "--dtype=int8"},
                         {"--seq-len", "64", "--head-groups", "1,2", "--dtype", "int8"});
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(first_line(r.err), "carry scan-bench: --dtype expects bf16, float32 or float64, got 'int8'");
  expect_usage_error(run_scan_bench_command, "scan-bench", {"--head-groups=1,x"}, 2,
                     "carry scan-bench: --head-groups needs a comma-separated list of integers >= 1, got '1,x'");
  expect_usage_error(run_scan_bench_command, "scan-bench", {"--seq-len", "abc"}, 2,
                     "carry scan-bench: --seq-len needs an integer >= 1, got 'abc'");
  expect_usage_error(run_scan_bench_command, "scan-bench", {"--reps"}, 2, "carry scan-bench: --reps needs a value");
  expect_usage_error(run_scan_bench_command, "scan-bench", {"--bogus=2"}, 2,
                     "carry scan-bench: unknown flag '--bogus'");
}

TEST(CommandSyntax, Mixer) {
  expect_help(mixer, "mixer");
  TempDir dir;
  const std::string in = dir.path + "/in.safetensors";
  at::manual_seed(5);
  auto opt = at::TensorOptions().dtype(at::kDouble);
  save_safetensors(in, {{"q", at::randn({1, 16, 1, 4}, opt)}, {"k", at::randn({1, 16, 1, 4}, opt)},
                        {"v", at::randn({1, 16, 1, 3}, opt)}});
  Result a = run(mixer, "mixer",
                 {"--family=linear_attn", "--input=" + in, "--output=" + dir.path + "/a.safetensors",
                  "--chunk-size=8", "--offset=2", "--normalize"});
  Result b = run(mixer, "mixer",
                 {"--family", "linear_attn", "--input", in, "--output", dir.path + "/b.safetensors",
                  "--chunk-size", "8", "--offset", "2", "--normalize"});
  EXPECT_EQ(a.rc, 0) << a.err;
  EXPECT_EQ(b.rc, 0) << b.err;
  auto ta = load_safetensors(dir.path + "/a.safetensors"), tb = load_safetensors(dir.path + "/b.safetensors");
  ASSERT_EQ(ta.size(), tb.size());
  for (auto& [name, t] : ta) EXPECT_TRUE(at::equal(t, tb.at(name))) << name;
  expect_usage_error(mixer, "mixer", {"--chunk-size"}, 2, "carry mixer: --chunk-size needs a value");
  expect_usage_error(mixer, "mixer", {"--offset=x"}, 2, "carry mixer: --offset needs an integer >= 0, got 'x'");
  expect_usage_error(mixer, "mixer", {"--bogus"}, 2, "carry mixer: unknown flag '--bogus'");
}

TEST(CommandSyntax, Tokenize) {
  expect_help(run_tokenize_command, "tokenize");
  TempDir dir;
  const std::string a = dir.path + "/a.txt", b = dir.path + "/b.txt";
  std::ofstream(a) << "first document\n";
  std::ofstream(b) << "second\n";
  Result x = run(run_tokenize_command, "tokenize",
                 {"--input=" + a, b, "--output=" + dir.path + "/x.tok", "--threads=1", "--piece-bytes=8"});
  Result y = run(run_tokenize_command, "tokenize",
                 {"--input", a, b, "--output", dir.path + "/y.tok", "--threads", "1", "--piece-bytes", "8"});
  EXPECT_EQ(x.rc, 0) << x.err;
  EXPECT_EQ(y.rc, 0) << y.err;
  const std::string tx = read(dir.path + "/x.tok");
  EXPECT_GT(tx.size(), std::string("first document\nsecond\n").size());
  EXPECT_EQ(tx, read(dir.path + "/y.tok"));
  expect_usage_error(run_tokenize_command, "tokenize", {"--input", a, "--output=o", "--eod-id=x"}, 2,
                     "carry tokenize: --eod-id needs an integer >= 0, got 'x'");
  expect_usage_error(run_tokenize_command, "tokenize", {"--input", "--output", "o"}, 2,
                     "carry tokenize: --input needs at least one file");
  expect_usage_error(run_tokenize_command, "tokenize", {"--input", a, "--output"}, 2,
                     "carry tokenize: --output needs a value");
  expect_usage_error(run_tokenize_command, "tokenize", {"--input", a, "--bogus"}, 2,
                     "carry tokenize: unknown flag '--bogus'");
}

// The commands that read a trained model: their flags are read before MODEL is opened.
TEST(CommandSyntax, ModelCommands) {
  expect_help(eval, "eval");
  expect_help(run_generate_command, "generate");
  expect_help(run_export_command, "export");
  expect_help(run_import_command, "import");
  Result e = expect_same(eval, "eval", {"MODEL", "--batch-size=2", "--seq-len=0"},
                         {"MODEL", "--batch-size", "2", "--seq-len", "0"});
  EXPECT_EQ(e.rc, 2);
  EXPECT_EQ(first_line(e.err), "carry eval: --seq-len needs an integer >= 1, got '0'");
  expect_usage_error(eval, "eval", {"MODEL", "--cpu=yes"}, 2, "carry eval: --cpu takes no value, got '--cpu=yes'");
  expect_usage_error(eval, "eval", {"MODEL", "--bogus"}, 2, "carry eval: unknown flag '--bogus'");
  Result g = expect_same(run_generate_command, "generate", {"MODEL", "--prompt=hi", "--max-new-tokens=abc"},
                         {"MODEL", "--prompt", "hi", "--max-new-tokens", "abc"});
  EXPECT_EQ(g.rc, 2);
  EXPECT_EQ(first_line(g.err), "carry generate: --max-new-tokens needs an integer >= 0, got 'abc'");
  Result x = expect_same(run_export_command, "export", {"MODEL", "--out=o", "--format=xx"},
                         {"MODEL", "--out", "o", "--format", "xx"});
  EXPECT_EQ(x.rc, 2);
  EXPECT_EQ(first_line(x.err), "carry export: --format must be fla or hf, got 'xx'");
  expect_usage_error(run_import_command, "import", {"FOLDER", "--model-out"}, 2,
                     "carry import: --model-out needs a value");
}

}  // namespace
}  // namespace carry
