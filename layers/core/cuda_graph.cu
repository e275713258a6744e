// The CUDA graph of layers/core/cuda_graph.h, on PyTorch's CUDAGraph (its capture routes the capture's
// allocations to a private pool of the caching allocator).
#include "layers/core/cuda_graph.h"

#include "layers/kernels/primitives/host.h"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

namespace carry::cuda {

struct Graph::Impl {
  c10::DeviceIndex device = 0;
  at::cuda::CUDAGraph graph;
};

Graph::Graph(int device, const std::function<void()>& f) : impl_(std::make_unique<Impl>()) {
  const auto dev = static_cast<c10::DeviceIndex>(device);
  impl_->device = dev;
  c10::cuda::CUDAGuard device_guard(dev);
  const auto current = c10::cuda::getCurrentCUDAStream(dev);
  const auto stream = c10::cuda::getStreamFromPool(false, dev);  // a capture needs a stream of its own
  carry::kernels::primitives::join(current, stream);
  // The capture allocates its tensors anew in the graph's pool: the blocks the caching allocator holds
  // free from earlier work go back to the device first, so that the two do not both stay reserved.
  C10_CUDA_CHECK(cudaStreamSynchronize(current.stream()));
  c10::cuda::CUDACachingAllocator::emptyCache();
  c10::cuda::CUDAStreamGuard stream_guard(stream);
  impl_->graph.capture_begin();
  try {
    f();
  } catch (...) {
    // End the invalidated capture so that the device takes work again; its error is the one thrown.
    try {
      impl_->graph.capture_end();
    } catch (...) {
    }
    (void)cudaGetLastError();
    throw;
  }
  impl_->graph.capture_end();
}

Graph::~Graph() = default;

void Graph::replay() const {
  c10::cuda::CUDAGuard device_guard(impl_->device);
  impl_->graph.replay();
}

}  // namespace carry::cuda
