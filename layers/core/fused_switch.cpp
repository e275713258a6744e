// The fused-ops switch (fused_switch.h).
#include "layers/core/fused_switch.h"

#include "layers/core/device.h"

#include <atomic>
#include <cstdio>
#include <mutex>

namespace carry {
namespace {
std::atomic<bool>& state() {
  static std::atomic<bool> s{true};
  return s;
}

// Whether the first CUDA device runs the kernels, asked once; the message printed once where it does not.
bool gpu_runs_kernels() {
  static std::once_flag once;
  static bool ok = true;
  std::call_once(once, [] {
    if (cuda_device_count() == 0) return;
    const int cc = cuda_compute_capability(0);
    const std::string message = fused_ops_gpu_message(cc / 10, cc % 10, cuda_device_name(0));
    if (message.empty()) return;
    ok = false;
    std::fprintf(stderr, "%s\n", message.c_str());
  });
  return ok;
}
}  // namespace

bool fused_ops_enabled() { return state().load() && gpu_runs_kernels(); }

void set_fused_ops(bool enabled) { state().store(enabled); }

std::string fused_ops_gpu_message(int major, int minor, const std::string& device) {
  if (major == 9 && minor == 0) return "";
  return "carry: the GPU " + device + " has compute capability " + std::to_string(major) + "." +
         std::to_string(minor) + "; carry's CUDA kernels are built for sm_90a (Hopper, 9.0) only, so every op "
         "runs its ATen form on this GPU (correct, slower; the kernels' speed needs an H100, H200 or GH200)";
}

}  // namespace carry
