// Mixed precision (README.md, Design §4): bf16 autocast for the projections, the MLP and the head, with fp32
// master weights, and the mixer cores (their chunkwise forms and recurrent states) always in fp32.
//   AutocastScope    turns ATen's autocast on for one device type with a lower-precision dtype for its
//                    lifetime and restores the previous setting after (a no-op when `enabled` is false);
//   AutocastState    the autocast setting of the current thread, captured and re-applied later (the
//                    recomputation in backward runs the layer again under the forward's setting);
//   full_precision   the mixer inputs and state cast up to fp32 when autocast is on for their device;
//   FullPrecisionScope  turns autocast off for a mixer core's ops (restores it on exit).
#pragma once

#include "layers/mixer.h"

#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>

namespace carry {

class AutocastScope {
 public:
  AutocastScope(at::DeviceType device, at::ScalarType dtype, bool enabled = true);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  at::DeviceType device_;
  bool active_, was_enabled_;
  at::ScalarType was_dtype_;
};

struct AutocastState {
  bool cpu = false, cuda = false;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;
  static AutocastState current();
};

// Applies an AutocastState for its lifetime.
class AutocastStateScope {
 public:
  explicit AutocastStateScope(const AutocastState& s);

 private:
  AutocastScope cpu_, cuda_;
};

// Whether autocast is on for the device of `x` in this thread.
bool autocast_active_for(const Tensor& x);

// Inside this scope ATen's autocast does nothing (a mixer core sees its inputs' dtype).
class FullPrecisionScope {
 private:
  c10::impl::ExcludeDispatchKeyGuard guard_{c10::autocast_dispatch_keyset};
};

// The floating tensors of `in` and `state` below fp32 cast up to fp32 (others unchanged).
MixerInputs full_precision(const MixerInputs& in);
State full_precision(const State& state);
// The kernel forms' precision under autocast: every input in the autocast dtype of its device (bf16),
// except the gates (g, gk, beta), which stay fp32 (a log decay rounded to bf16 loses its cumulative sum).
MixerInputs kernel_precision(const MixerInputs& in);

}  // namespace carry
