// Device discovery behind the CUDA build option (see device.h).
#include "layers/core/device.h"

#include <c10/util/Exception.h>

#include <chrono>

#ifdef CARRY_WITH_CUDA
#include "layers/core/cuda_device.h"
#endif

namespace carry {
int cuda_device_count() {
#ifdef CARRY_WITH_CUDA
  return cuda::device_count();
#else
  return 0;
#endif
}
std::string cuda_device_name(int index) {
#ifdef CARRY_WITH_CUDA
  return cuda::device_name(index);
#else
  return "no CUDA in this build (index " + std::to_string(index) + ")";
#endif
}
int cuda_compute_capability(int index) {
#ifdef CARRY_WITH_CUDA
  return cuda::compute_capability(index);
#else
  (void)index;
  return 0;
#endif
}
int64_t cuda_peak_allocated_bytes(int index) {
#ifdef CARRY_WITH_CUDA
  return cuda::peak_allocated_bytes(index);
#else
  (void)index;
  return 0;
#endif
}
void cuda_reset_peak_allocated(int index) {
#ifdef CARRY_WITH_CUDA
  cuda::reset_peak_allocated(index);
#else
  (void)index;
#endif
}
CudaAllocatorCounts cuda_allocator_counts(int index) {
  CudaAllocatorCounts c;
#ifdef CARRY_WITH_CUDA
  long long mallocs = 0, retries = 0;
  cuda::allocator_counts(index, &mallocs, &retries);
  c.mallocs = mallocs, c.retries = retries;
#else
  (void)index;
#endif
  return c;
}
void cuda_make_current(int index) {
#ifdef CARRY_WITH_CUDA
  cuda::make_current(index);
#else
  (void)index;
#endif
}
void cuda_synchronize() {
#ifdef CARRY_WITH_CUDA
  cuda::synchronize();
#endif
}
std::vector<double> cuda_event_times_ms(const std::function<void()>& f, int reps) {
#ifdef CARRY_WITH_CUDA
  std::vector<double> ms(static_cast<size_t>(reps));
  auto call = [](void* ctx) { (*static_cast<const std::function<void()>*>(ctx))(); };
  cuda::event_times_ms(call, const_cast<std::function<void()>*>(&f), reps, ms.data());
  return ms;
#else
  (void)f;
  (void)reps;
  return {};
#endif
}
TimingMark timing_mark(int cuda_device) {
  TimingMark m;
#ifdef CARRY_WITH_CUDA
  if (cuda_device >= 0) {
    m.event = cuda::record_event(cuda_device);
    return m;
  }
#else
  TORCH_CHECK(cuda_device < 0, "timing_mark: a mark on CUDA device ", cuda_device, " in a build without CUDA");
#endif
  m.host_s = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  return m;
}
double timing_mark_ms(const TimingMark& a, const TimingMark& b) {
  TORCH_CHECK(bool(a.event) == bool(b.event), "timing_mark_ms: a CUDA mark and a host mark");
#ifdef CARRY_WITH_CUDA
  if (a.event) return cuda::event_elapsed_ms(a.event.get(), b.event.get());
#endif
  return 1e3 * (b.host_s - a.host_s);
}
}  // namespace carry
