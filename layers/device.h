// Which devices this build and machine offer: CUDA devices when carry was built with CUDA and a GPU is
// present, otherwise the CPU only. GPU tests ask here and skip themselves with a message.
#pragma once

#include <string>

namespace carry {
int cuda_device_count();        // 0 on CPU-only builds or machines
std::string cuda_device_name(int index);
}  // namespace carry
