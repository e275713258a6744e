// Host-side helpers shared by every family's kernel launchers (delta rule, scalar/diagonal decay).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>

#include <cstdint>
#include <cstdlib>
#include <limits>

namespace carry_tiles {

// An A/B switch of the kernels (an environment variable, read once by its caller): on unless it is set
// to something starting with '0'.
inline bool switch_on(const char* name) {
  const char* e = std::getenv(name);
  return !(e && e[0] == '0');
}

// An integer A/B setting of the kernels (an environment variable, read once by its caller): 0 when
// unset or empty, else its value, which must lie in [lo, hi] (`what` says what is expected).
inline long env_int(const char* name, long lo, long hi, const char* what) {
  const char* e = std::getenv(name);
  if (!e || !*e) return 0;
  char* end = nullptr;
  const long v = std::strtol(e, &end, 10);
  TORCH_CHECK(*end == '\0' && v >= lo && v <= hi, name, ": expected ", what, ", got '", e, "'");
  return v;
}

// The current device's SM count (CUDA runtime; asked once a launch, which costs no synchronisation).
inline int sm_count() {
  int dev = 0, n = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
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

}  // namespace carry_tiles
