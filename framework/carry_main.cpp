// The `carry` command: a thin dispatcher. `carry --help` lists the commands, `carry --version` prints
// the version and whether CUDA is compiled in; each command lives in framework/<name>_command.
#include "framework/cli/bench_command.h"
#include "framework/cli/check_command.h"
#include "framework/cli/env_command.h"
#include "framework/cli/error_text.h"
#include "framework/cli/eval_command.h"
#include "framework/cli/export_command.h"
#include "framework/cli/generate_command.h"
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
    "  bench       time the kernel forms on the GPU (carry bench kernels --help)\n"
    "  check       check every mixer family's forms and state summaries against each other\n"
    "  env         every environment variable carry reads: audience, default, value here, what it does\n"
    "  eval        loss, perplexity, bits per byte and the loss by position of a trained model (carry eval --help)\n"
    "  export      write a checkpoint as a flash-linear-attention / Hugging Face folder (carry export --help)\n"
    "  generate    sample text from a trained model, one recurrent step a token (carry generate --help)\n"
    "  import      read an FLA / Hugging Face folder and print its carry model config (carry import --help)\n"
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
    std::printf("carry %s (commit %s; CUDA %s)\n", carry::version(), carry::git_commit(),
                carry::built_with_cuda() ? "compiled in" : "not compiled in");
    return 0;
  }
  // What a command does not catch itself ends here with one line, not std::terminate's abort.
  try {
    if (command == "bench") return carry::run_bench_command(argc - 1, argv + 1);
    if (command == "check") return carry::run_check_command(argc - 1, argv + 1);
    if (command == "env") return carry::run_env_command(argc - 1, argv + 1);
    if (command == "eval") return carry::run_eval_command(argc - 1, argv + 1);
    if (command == "export") return carry::run_export_command(argc - 1, argv + 1);
    if (command == "generate") return carry::run_generate_command(argc - 1, argv + 1);
    if (command == "import") return carry::run_import_command(argc - 1, argv + 1);
    if (command == "launch") return carry::run_launch_command(argc - 1, argv + 1);
    if (command == "mixer") return carry::run_mixer_command(argc - 1, argv + 1);
    if (command == "scan-bench") return carry::run_scan_bench_command(argc - 1, argv + 1);
    if (command == "train") return carry::run_train_command(argc - 1, argv + 1);
    if (command == "tokenize") return carry::run_tokenize_command(argc - 1, argv + 1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "carry %s: %s\n", command.c_str(), carry::error_text(e).c_str());
    return 1;
  }
  std::fprintf(stderr, "carry: unknown command '%s' (see carry --help)\n", argv[1]);
  return 2;
}
