// `carry env`: every environment variable carry and its launcher scripts read (layers/core/knobs.h),
// grouped by audience, with its default, its value in this environment when set, and one line of doc.
// `carry env --names` prints the names alone, one a line.
#pragma once

namespace carry {
int run_env_command(int argc, char** argv);  // argv[0] is "env"
}  // namespace carry
