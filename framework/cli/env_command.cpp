// `carry env` (see env_command.h).
#include "framework/cli/env_command.h"

#include "framework/cli/command_args.h"
#include "layers/core/knobs.h"

#include <cstdio>
#include <cstdlib>
#include <string>

namespace carry {

int run_env_command(int argc, char** argv) {
  bool names = false;
  CommandArgs args(argc, argv);
  if (args.help()) {
    std::printf(
        "usage: carry env [--names]\n"
        "  Every environment variable carry and its launcher scripts read: audience, default, the value\n"
        "  set here (if any) and what it does. --names: the names alone, one a line.\n"
        "  A config field is the normal way to change what a run computes; docs/environment.md has more.\n");
    return 0;
  }
  try {
    for (std::string a; args.next(a);) {
      if (a == "--names") names = true;
      else if (a.rfind("-", 0) == 0) throw UsageError("unknown flag '" + a + "' (expected --names or --help)");
      else throw UsageError("unexpected argument '" + a + "' (expected --names or --help)");
    }
  } catch (const UsageError& e) {
    std::fprintf(stderr, "carry env: %s\n", e.what());
    return 1;
  }
  if (names) {
    for (const auto& k : knobs()) std::printf("%s\n", k.name);
    return 0;
  }
  const char* audience = nullptr;
  for (const auto& k : knobs()) {
    const char* a = knob_audience_name(k.audience);
    if (!audience || std::string(audience) != a) {
      std::printf("%s%s:\n", audience ? "\n" : "", a);
      audience = a;
    }
    const char* v = knob_value(k.name);
    std::printf("  %-32s default %-18s %s\n", k.name, k.default_value, v ? ("set: " + std::string(v)).c_str() : "");
    std::printf("      %s\n", k.doc);
  }
  return 0;
}

}  // namespace carry
