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

struct GpuKernels {
  bool fused = true;   // the first CUDA device runs the fused ops
  bool hopper = true;  // ... and the Hopper-only ones
};

// What the first CUDA device runs, asked once; the message printed once where it does not run them all.
const GpuKernels& gpu_kernels() {
  static std::once_flag once;
  static GpuKernels k;
  std::call_once(once, [] {
    if (cuda_device_count() == 0) return;
    const int cc = cuda_compute_capability(0);
    k.fused = fused_ops_run_on(cc / 10, cc % 10);
    k.hopper = hopper_kernels_run_on(cc / 10, cc % 10);
    const std::string message = fused_ops_gpu_message(cc / 10, cc % 10, cuda_device_name(0));
    if (!message.empty()) std::fprintf(stderr, "%s\n", message.c_str());
  });
  return k;
}
}  // namespace

bool fused_ops_enabled() { return state().load() && gpu_kernels().fused; }

bool gpu_runs_hopper_kernels() { return gpu_kernels().hopper; }

bool fused_ops_run_on(int major, int minor) { return (major == 9 || major == 10) && minor == 0; }

bool hopper_kernels_run_on(int major, int minor) { return major == 9 && minor == 0; }

void set_fused_ops(bool enabled) { state().store(enabled); }

std::string fused_ops_gpu_message(int major, int minor, const std::string& device) {
  if (hopper_kernels_run_on(major, minor)) return "";
  const std::string found = "carry: the GPU " + device + " has compute capability " + std::to_string(major) + "." +
                            std::to_string(minor) + "; ";
  if (fused_ops_run_on(major, minor))
    return found + "the delta rule's kernels are built for sm_90a (Hopper, 9.0) only, so deltanet, gated_deltanet, "
                   "gated_deltaproduct and loglinear_gdn layers run their ATen chunkwise forms on this GPU (correct, "
                   "slower); every other kernel runs (built for sm_100a)";
  return found + "carry's CUDA kernels are built for sm_90a (Hopper, 9.0) and sm_100a (Blackwell, 10.0) only, so "
                 "every op runs its ATen form on this GPU (correct, slower; the kernels' speed needs an H100, H200, "
                 "GH200, B200 or GB200)";
}

}  // namespace carry
