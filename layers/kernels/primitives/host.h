// Host-side helpers shared by every family's kernel launchers (delta rule, scalar/diagonal decay).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <mutex>
#include <unordered_map>

namespace carry::kernels::primitives {

// The current device's SM count (CUDA runtime; asked once a launch, which costs no synchronisation).
inline int sm_count() {
  int dev = 0, n = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

// Lets `kernel` launch with up to `bytes` of dynamic shared memory on the current device and, with
// `max_carveout`, prefer the SM's whole shared-memory carve-out. The runtime is asked only when a
// (kernel, device) needs a larger limit than it was given (the limit is the kernel's, on the device's
// context, and only ever grows here), so a steady training step makes no such call. Measured on an
// H200: the call does not wait for the GPU, but costs 1 to 54 us of host time, and each
// launcher made several a layer.
// Safe from several host threads: the call and the record are made under one lock.
inline void allow_smem_raw(const void* kernel, size_t bytes, bool max_carveout) {
  struct Key {
    const void* kernel;
    int device;
    bool operator==(const Key& o) const { return kernel == o.kernel && device == o.device; }
  };
  struct Hash {
    size_t operator()(const Key& k) const { return std::hash<const void*>()(k.kernel) ^ (size_t(k.device) << 1); }
  };
  struct Given {
    size_t bytes = 0;
    bool carveout = false;
  };
  static std::mutex mu;
  static std::unordered_map<Key, Given, Hash> given;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  Given& g = given[Key{kernel, dev}];
  if (bytes > g.bytes) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    g.bytes = bytes;
  }
  if (max_carveout && !g.carveout) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        (int)cudaSharedmemCarveoutMaxShared));
    g.carveout = true;
  }
}
template <typename K>
void allow_smem(K* kernel, size_t bytes, bool max_carveout = false) {
  allow_smem_raw(reinterpret_cast<const void*>(kernel), bytes, max_carveout);
}

// at::empty, filled with NaN when `poison` is on (a debug switch: unwritten elements then show).
inline at::Tensor alloc_poisoned(at::IntArrayRef sizes, const at::TensorOptions& opt, bool poison) {
  auto t = at::empty(sizes, opt);
  if (poison) t.fill_(std::numeric_limits<float>::quiet_NaN());
  return t;
}

// Contiguous, and 16-byte aligned (the kernels copy rows with 16-byte cp.async): a view with an
// odd storage offset is copied.
inline at::Tensor dense16(const at::Tensor& t) {
  auto c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 ? c.clone() : c;
}

// `after` waits for what has been enqueued on `before` so far (nothing when they are one stream).
inline void join(const at::cuda::CUDAStream& before, const at::cuda::CUDAStream& after) {
  if (before == after) return;
  at::cuda::CUDAEvent e;
  e.record(before);
  e.block(after);
}

}  // namespace carry::kernels::primitives
