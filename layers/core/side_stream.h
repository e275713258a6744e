// A second CUDA stream for work that may run beside the caller's (parallel.recompute_overlap runs a
// layer's recomputation there while the layer above it runs its backward). Two slots a device, each one
// stream taken once from PyTorch's pool. Without CUDA, or for a tensor not on a GPU, a SideStream is
// inactive: run() calls f in place and the rest does nothing.
#pragma once

#include <ATen/ATen.h>

#include <functional>

namespace carry {

class SideStream {
 public:
  // Slot 0 or 1 of `like`'s device; inactive for a CPU tensor, a negative slot or a build without CUDA.
  SideStream(const at::Tensor& like, int slot);
  bool active() const { return slot_ >= 0; }
  int slot() const { return slot_; }
  // The side stream first waits for the work the current stream has queued so far; then f runs with
  // the side stream as the current one (what f launches goes there).
  void run(const std::function<void()>& f) const;
  // The current stream waits for the work queued on the side stream so far.
  void join() const;
  // t, made on the side stream, is used (and freed) on the current stream too: the caching allocator
  // must not hand its memory out again before the current stream's work on it is done.
  void used_on_current(const at::Tensor& t) const;

 private:
  int device_ = -1, slot_ = -1;
};

}  // namespace carry
