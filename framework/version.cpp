// Version, commit and build capabilities, printed by `carry --version` and at the start of every job.
// The commit comes from framework/version_commit.h, which the build writes (CMakeLists.txt, target
// carry_commit) and only this file includes, so a new commit recompiles this file alone.
#include "framework/version.h"

#include "framework/version_commit.h"

namespace carry {
const char* version() { return "0.1.0"; }
const char* git_commit() { return CARRY_GIT_COMMIT; }
bool built_with_cuda() {
#ifdef CARRY_WITH_CUDA
  return true;
#else
  return false;
#endif
}
}  // namespace carry
