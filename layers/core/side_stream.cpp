// SideStream (see side_stream.h): the CUDA half lives in cuda_device.cu, compiled with the kernels.
#include "layers/core/side_stream.h"

#ifdef CARRY_WITH_CUDA
#include "layers/core/cuda_device.h"
#endif

#include <c10/util/Exception.h>

namespace carry {

SideStream::SideStream(const at::Tensor& like, int slot) {
#ifdef CARRY_WITH_CUDA
  if (slot < 0 || !like.defined() || !like.is_cuda()) return;
  TORCH_CHECK(slot <= 1, "SideStream: expected slot 0 or 1, got ", slot);
  device_ = like.get_device();
  slot_ = slot;
#else
  (void)like;
  (void)slot;
#endif
}

void SideStream::run(const std::function<void()>& f) const {
#ifdef CARRY_WITH_CUDA
  if (active()) {
    auto call = [](void* ctx) { (*static_cast<const std::function<void()>*>(ctx))(); };
    cuda::side_stream_run(device_, slot_, call, const_cast<std::function<void()>*>(&f));
    return;
  }
#endif
  f();
}

void SideStream::join() const {
#ifdef CARRY_WITH_CUDA
  if (active()) cuda::side_stream_join(device_, slot_);
#endif
}

void SideStream::used_on_current(const at::Tensor& t) const {
#ifdef CARRY_WITH_CUDA
  if (active() && t.defined() && t.is_cuda()) cuda::record_on_current_stream(t);
#else
  (void)t;
#endif
}

}  // namespace carry
