// The `carry` command: a thin dispatcher. `carry --help` lists the commands, `carry --version` prints
// the version and whether CUDA is compiled in; each command lives in framework/<name>_command.
#include "framework/cli/check_command.h"
#include "framework/cli/launch_command.h"
#include "framework/cli/mixer_command.h"
#include "framework/cli/scan_bench_command.h"
#include "framework/cli/tokenize_command.h"
#include "framework/cli/train_command.h"
#include "framework/version.h"

#include <cstdio>
#include <string>

namespace {
const char* const kUsage =
    "usage: carry <command> [args]\n"
    "\n"
    "commands:\n"
    "  check       check every mixer family's forms and state summaries against each other\n"
    "  launch      start a training run on a cluster with mpirun (carry launch --help)\n"
    "  mixer       run a mixer family on tensors from a safetensors file (carry mixer --help)\n"
    "  scan-bench  sequence-parallel forward vs the serial run, under mpirun (carry scan-bench --help)\n"
    "  tokenize    turn text files into a token file (byte, SentencePiece, BPE; carry tokenize --help)\n"
    "  train       train a model from a run config (under mpirun; launcher/train starts it)\n"
    "\n"
    "  --help      this text\n"
    "  --version   the version and whether CUDA is compiled in\n";
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  std::string command = argv[1];
  if (command == "--help" || command == "-h" || command == "help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (command == "--version") {
    std::printf("carry %s (CUDA %s)\n", carry::version(),
                carry::built_with_cuda() ? "compiled in" : "not compiled in");
    return 0;
  }
  if (command == "check") return carry::run_check_command(argc - 1, argv + 1);
  if (command == "launch") return carry::run_launch_command(argc - 1, argv + 1);
  if (command == "mixer") return carry::run_mixer_command(argc - 1, argv + 1);
  if (command == "scan-bench") return carry::run_scan_bench_command(argc - 1, argv + 1);
  if (command == "train") return carry::run_train_command(argc - 1, argv + 1);
  if (command == "tokenize") return carry::run_tokenize_command(argc - 1, argv + 1);
  std::fprintf(stderr, "carry: unknown command '%s' (see carry --help)\n", argv[1]);
  return 2;
}
