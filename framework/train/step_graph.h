// parallel.cuda_graph: a training step's device work replayed as one CUDA graph.
//
// At one rank with one micro-batch a step, the forward, the backward of the loss share and the gradient
// clipping are the same kernels on the same shapes every step: StepGraph captures them once, on the
// batch copied into static input buffers, and replays them after copying each later step's batch there.
// The host then enqueues a few copies and one graph launch instead of about a thousand kernels, so a
// small step no longer leaves the GPU waiting between kernels on the host. The capture's tensors keep
// their addresses in every replay: the loss sums, the gradient norm and the parameters' gradients
// (their .grad) are read where the capture left them. The optimizer runs outside, after the step's host
// read, as without the graph; a replay computes what the eager step would, bit for bit.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>

namespace carry {

class StepGraph {
 public:
  // What the captured work leaves: [Σ ce·mask, Σ mask] (fp64) and the gradient norm.
  struct Outputs {
    at::Tensor sums, norm;
  };
  // The step's device work on the static batch (tokens, targets, loss mask).
  using Body = std::function<Outputs(const at::Tensor& tokens, const at::Tensor& targets, const at::Tensor& mask)>;

  // For training on `device`; throws, saying why, on a CPU device or in a build without CUDA.
  explicit StepGraph(const at::Device& device);
  ~StepGraph();
  // Whether the graph was captured (the parameters' .grad are then its outputs: kept, not reset).
  bool captured() const;
  // The caching allocator's peak of allocated bytes when the capture ended (0 before): it covers the
  // step's activations, which later replays hold in the graph's pool without allocating them again.
  int64_t captured_peak_bytes() const;
  // The first call copies the batch into the static buffers and captures `body` on them (running
  // nothing; the parameters' .grad must be undefined then, so that the backward writes fresh ones);
  // every call then replays the graph, later calls after copying their batch into the buffers, which
  // must have the first batch's shapes. Returns the outputs, valid until the next call's replay.
  Outputs run(const at::Tensor& tokens, const at::Tensor& targets, const at::Tensor& mask, const Body& body);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace carry
