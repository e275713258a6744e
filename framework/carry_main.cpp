// The `carry` command: subcommands dispatch to the framework (see `carry --help`).
#include "framework/check_command.h"
#include "framework/tokenize_command.h"

#include <cstdio>
#include <cstring>
#include <string>

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help")) {
    std::puts("usage: carry <command> [args]\n  mixer   run a mixer on tensors from a safetensors file");
    return argc < 2 ? 2 : 0;
  }
  if (!std::strcmp(argv[1], "tokenize")) return carry::run_tokenize_command(argc - 1, argv + 1);
  if (!std::strcmp(argv[1], "check")) return carry::run_check_command(argc - 1, argv + 1);
  std::fprintf(stderr, "carry: unknown command '%s' (see carry --help)\n", argv[1]);
  return 2;
}
