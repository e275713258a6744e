// SwiGLU MLP (mlp.h): y = W2 (silu(W1 x) ⊙ W3 x). On CUDA (builds with CARRY_WITH_CUDA, unless
// fused_ops_enabled() is false) W1 and W3 run as one matmul with [W1; W3] (concatenated per call; the
// parameters stay two) and silu(a) ⊙ b is one fused kernel over the two halves of its output
// (layers/kernels/blocks/norm_swiglu_op.h), forward and backward, with W2 in the same op so that the activation
// is recomputed in the backward instead of kept (one [T, hidden] tensor less a layer). The CPU runs the
// ATen form below.
#include "layers/blocks/mlp.h"

#ifdef CARRY_WITH_CUDA
#include "layers/core/fused_switch.h"
#include "layers/kernels/blocks/norm_swiglu_op.h"
#endif

#include <cmath>

namespace carry {

SwiGLU::SwiGLU(int64_t d_model, int64_t hidden, double init_std, int64_t n_layers, ParameterInit& init) {
  w1 = init.normal({hidden, d_model}, init_std);
  w3 = init.normal({hidden, d_model}, init_std);
  w2 = init.normal({d_model, hidden}, init_std / std::sqrt(2.0 * static_cast<double>(n_layers)));
}

Tensor SwiGLU::forward(const Tensor& x, bool result_only) const {
#ifdef CARRY_WITH_CUDA
  if (x.is_cuda() && fused_ops_enabled()) {
    auto ab = at::linear(x, at::cat({w1, w3}, 0));  // [..., 2·hidden] = [W1 x | W3 x]
    if (fused_swiglu_supports(ab)) return fused_swiglu_linear(ab, w2, result_only);
    auto h = ab.chunk(2, -1);
    return at::linear(at::silu(h[0]) * h[1], w2);
  }
#endif
  (void)result_only;  // the ATen form computes its result either way
  return at::linear(at::silu(at::linear(x, w1)) * at::linear(x, w3), w2);
}

NamedParameters SwiGLU::parameters() const {
  return {{"w1.weight", w1}, {"w3.weight", w3}, {"w2.weight", w2}};
}

}  // namespace carry
