// CUDA device discovery and memory figures: counts usable devices without failing on machines that
// have the toolkit but no GPU or driver (the CPU machines compile and link this file; nothing runs
// there), and reads the peak memory of PyTorch's caching allocator.
#include "layers/core/cuda_device.h"
#include "layers/kernels/primitives/host.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <array>
#include <cstdio>
#include <mutex>
#include <optional>
#include <vector>

namespace carry::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver / no device" error
    return 0;
  }
  return n;
}

const char* device_name(int index) {
  static thread_local char buf[256];
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, index) != cudaSuccess) {
    cudaGetLastError();
    std::snprintf(buf, sizeof buf, "CUDA device %d (unavailable)", index);
  } else {
    std::snprintf(buf, sizeof buf, "%s, sm_%d%d, %.1f GiB", p.name, p.major, p.minor,
                  p.totalGlobalMem / double(1 << 30));
  }
  return buf;
}

int compute_capability(int index) {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, index) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return p.major * 10 + p.minor;
}

long long peak_allocated_bytes(int index) {
  auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
}

void allocator_counts(int index, long long* mallocs, long long* retries) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  *mallocs = stats.num_device_alloc;
  *retries = stats.num_alloc_retries;
}

void synchronize() { cudaDeviceSynchronize(); }

void make_current(int index) { c10::cuda::set_device(static_cast<c10::DeviceIndex>(index)); }

void event_times_ms(void (*call)(void*), void* ctx, int reps, double* ms) {
  constexpr size_t kFlush = 256u << 20;  // larger than any Hopper L2 (50 MB on H100 and H200), as do_bench
  static void* flush = nullptr;  // outside the caching allocator: it does not enter its peak figures
  if (!flush) C10_CUDA_CHECK(cudaMalloc(&flush, kFlush));
  const cudaStream_t st = c10::cuda::getCurrentCUDAStream().stream();
  std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(reps));
  for (auto& e : ev) C10_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    C10_CUDA_CHECK(cudaMemsetAsync(flush, 0, kFlush, st));
    C10_CUDA_CHECK(cudaEventRecord(ev[2 * i], st));
    call(ctx);
    C10_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], st));
  }
  C10_CUDA_CHECK(cudaEventSynchronize(ev.back()));
  for (int i = 0; i < reps; ++i) {
    float t = 0.f;
    C10_CUDA_CHECK(cudaEventElapsedTime(&t, ev[2 * i], ev[2 * i + 1]));
    ms[i] = t;
  }
  for (auto& e : ev) cudaEventDestroy(e);
}

namespace {
// Side stream `slot` of `device`, taken from the pool on first use and kept.
c10::cuda::CUDAStream side_stream(int device, int slot) {
  static std::mutex mu;
  static std::vector<std::array<std::optional<c10::cuda::CUDAStream>, 2>> streams;
  std::lock_guard<std::mutex> lock(mu);
  if (streams.size() <= static_cast<size_t>(device)) streams.resize(device + 1);
  auto& s = streams[device][slot];
  if (!s) s = c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device));
  return *s;
}
}  // namespace

void side_stream_run(int device, int slot, void (*call)(void*), void* ctx) {
  const auto dev = static_cast<c10::DeviceIndex>(device);
  const c10::cuda::CUDAStream side = side_stream(device, slot);
  carry::kernels::primitives::join(c10::cuda::getCurrentCUDAStream(dev), side);
  c10::cuda::CUDAStreamGuard guard(side);
  call(ctx);
}

void side_stream_join(int device, int slot) {
  const auto dev = static_cast<c10::DeviceIndex>(device);
  carry::kernels::primitives::join(side_stream(device, slot), c10::cuda::getCurrentCUDAStream(dev));
}

void record_on_current_stream(const at::Tensor& t) {
  c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(),
                                                c10::cuda::getCurrentCUDAStream(t.get_device()));
}

std::shared_ptr<void> record_event(int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));  // the event belongs to that device
  cudaEvent_t e = nullptr;
  C10_CUDA_CHECK(cudaEventCreate(&e));
  std::shared_ptr<void> owned(e, [](void* p) { cudaEventDestroy(static_cast<cudaEvent_t>(p)); });
  C10_CUDA_CHECK(cudaEventRecord(e, c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream()));
  return owned;
}

double event_elapsed_ms(void* a, void* b) {
  C10_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(b)));
  float ms = 0.f;
  C10_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(a), static_cast<cudaEvent_t>(b)));
  return ms;
}

void reset_peak_allocated(int index) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(index));
}

}  // namespace carry::cuda
