// Version and build capabilities, printed by `carry --version` and at the start of every job.
#include "framework/version.h"

namespace carry {
const char* version() { return "0.1.0"; }
bool built_with_cuda() {
#ifdef CARRY_WITH_CUDA
  return true;
#else
  return false;
#endif
}
}  // namespace carry
