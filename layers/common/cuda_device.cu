// CUDA device discovery and memory figures: counts usable devices without failing on machines that
// have the toolkit but no GPU or driver (the CPU machines compile and link this file; nothing runs
// there), and reads the peak memory of PyTorch's caching allocator.
#include "layers/common/cuda_device.cuh"

#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime.h>

#include <cstdio>

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

void reset_peak_allocated(int index) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(index));
}

}  // namespace carry::cuda
