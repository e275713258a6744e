// A CUDA graph of the work a host function enqueues (compiled only with the CUDA sources; the trainer's
// parallel.cuda_graph, framework/train/step_graph.h, is its user). The interface names no CUDA type.
#pragma once

#include <functional>
#include <memory>

namespace carry::cuda {

class Graph {
 public:
  // Captures what f enqueues on device `device`: f runs with a stream of the device's pool as the
  // current one, that stream first waiting for the work the current stream has queued so far (and the
  // caching allocator first returning its free blocks to the device, waiting for that work). Nothing
  // f enqueues runs then; every tensor f allocates on the device comes from the graph's own memory pool
  // and keeps its address in every replay (the tensors f leaves alive are the graph's outputs). Throws
  // when f does what a capture cannot hold (a host read of device memory, a synchronization, a copy
  // from pageable host memory), with CUDA's or PyTorch's message.
  Graph(int device, const std::function<void()>& f);
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  // Runs the captured work once on the current stream of the device, after what it has queued.
  void replay() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace carry::cuda
