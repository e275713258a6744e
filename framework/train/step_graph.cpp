// StepGraph (see step_graph.h): the CUDA graph itself is layers/core/cuda_graph.h's.
#include "framework/train/step_graph.h"

#include "layers/core/device.h"

#ifdef CARRY_WITH_CUDA
#include "layers/core/cuda_graph.h"
#endif

#include <c10/util/Exception.h>

namespace carry {

struct StepGraph::Impl {
  at::Device device = at::kCPU;
  at::Tensor tokens, targets, mask;  // the static inputs
  Outputs out;
  int64_t peak = 0;
#ifdef CARRY_WITH_CUDA
  std::unique_ptr<cuda::Graph> graph;
#endif
};

StepGraph::StepGraph(const at::Device& device) : impl_(std::make_unique<Impl>()) {
#ifdef CARRY_WITH_CUDA
  TORCH_CHECK(device.is_cuda(), "parallel.cuda_graph: true needs a GPU, but this rank trains on ", device.str());
  impl_->device = device;
#else
  TORCH_CHECK(false, "parallel.cuda_graph: true needs carry built with CUDA (CARRY_CUDA=ON); this build has no "
              "CUDA (training on ", device.str(), ")");
#endif
}

StepGraph::~StepGraph() = default;

int64_t StepGraph::captured_peak_bytes() const { return impl_->peak; }

bool StepGraph::captured() const {
#ifdef CARRY_WITH_CUDA
  return impl_->graph != nullptr;
#else
  return false;
#endif
}

StepGraph::Outputs StepGraph::run(const at::Tensor& tokens, const at::Tensor& targets, const at::Tensor& mask,
                                  const Body& body) {
#ifdef CARRY_WITH_CUDA
  auto& s = *impl_;
  if (!s.graph) {
    s.tokens = tokens.clone(), s.targets = targets.clone(), s.mask = mask.clone();
    try {
      s.graph = std::make_unique<cuda::Graph>(s.device.index(), [&] { s.out = body(s.tokens, s.targets, s.mask); });
    } catch (const std::exception& e) {
      const auto* c = dynamic_cast<const c10::Error*>(&e);
      TORCH_CHECK(false, "parallel.cuda_graph: the training step could not be captured as a CUDA graph: ",
                  c ? c->what_without_backtrace() : e.what(), "; run without parallel.cuda_graph");
    }
    s.peak = cuda_peak_allocated_bytes(s.device.index());
  } else {
    auto put = [](at::Tensor& to, const at::Tensor& from, const char* what) {
      TORCH_CHECK(from.sizes() == to.sizes() && from.scalar_type() == to.scalar_type(), "parallel.cuda_graph: the "
                  "step's ", what, " are ", from.sizes(), " ", from.scalar_type(), " but the graph was captured on ",
                  to.sizes(), " ", to.scalar_type());
      to.copy_(from, /*non_blocking=*/true);
    };
    put(s.tokens, tokens, "tokens");
    put(s.targets, targets, "targets");
    put(s.mask, mask, "loss mask");
  }
  s.graph->replay();
  return s.out;
#else
  (void)tokens, (void)targets, (void)mask, (void)body;
  TORCH_CHECK(false, "parallel.cuda_graph: this build has no CUDA");
#endif
}

}  // namespace carry
