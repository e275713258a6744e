// Which devices this build and machine offer: CUDA devices when carry was built with CUDA and a GPU is
// present, otherwise the CPU only. GPU tests ask here and skip themselves with a message.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace carry {
int cuda_device_count();        // 0 on CPU-only builds or machines
std::string cuda_device_name(int index);
// Device `index`'s compute capability as major·10 + minor (90 for Hopper); 0 without CUDA.
int cuda_compute_capability(int index);
// The caching allocator's peak of allocated bytes on a device since the last reset (0 without CUDA).
int64_t cuda_peak_allocated_bytes(int index);
void cuda_reset_peak_allocated(int index);
// The caching allocator's cudaMalloc calls on a device so far, and its retries after a failed one
// (zeros without CUDA): a steady training step adds to neither.
struct CudaAllocatorCounts {
  int64_t mallocs = 0, retries = 0;
};
CudaAllocatorCounts cuda_allocator_counts(int index);
// Makes CUDA device `index` the calling thread's current device (what libtorch and the runtime use
// where no device is named); a no-op without CUDA.
void cuda_make_current(int index);
// Waits for all work on the current CUDA device (benchmarks); a no-op without CUDA.
void cuda_synchronize();
// GPU milliseconds of each of `reps` calls of f, taken as triton.testing.do_bench (the anchors' timer)
// takes them: the L2 cache flushed before each call, CUDA events around it on the current stream, no
// host wait between calls. Empty without CUDA.
std::vector<double> cuda_event_times_ms(const std::function<void()>& f, int reps);
// A point on a timeline: with cuda_device >= 0, an event recorded on that device's current stream (the
// GPU reaches it once the work queued before it is done), whichever device the calling thread has
// current; with -1, the host clock. timing_mark_ms
// gives the milliseconds from `a` to `b`, waiting until the GPU has reached `b`.
struct TimingMark {
  std::shared_ptr<void> event;  // a cudaEvent_t, destroyed with the last copy
  double host_s = 0;
};
TimingMark timing_mark(int cuda_device);
double timing_mark_ms(const TimingMark& a, const TimingMark& b);
}  // namespace carry
