// Host-side helpers shared by every family's kernel launchers (delta rule, scalar/diagonal decay).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>

namespace carry_tiles {

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

}  // namespace carry_tiles
