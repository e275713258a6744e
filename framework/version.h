// carry's version string, the git commit it was built from, and the build's capabilities (CUDA
// compiled in or not).
#pragma once

namespace carry {
const char* version();
// The short hash of the commit the build's sources are, "-dirty" after it when tracked files differed
// from it, "unknown" for sources outside a git work tree (framework/version_commit.cmake, run at build
// time).
const char* git_commit();
bool built_with_cuda();
}  // namespace carry
