// carry's version string and the build's capabilities (CUDA compiled in or not).
#pragma once

namespace carry {
const char* version();
bool built_with_cuda();
}  // namespace carry
