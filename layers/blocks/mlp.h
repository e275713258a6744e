// SwiGLU MLP: y = W2 (silu(W1 x) ⊙ W3 x), W1, W3: d_model -> hidden, W2: hidden -> d_model, no biases.
// On CUDA, W1 and W3 run as one matmul and silu(·) ⊙ (·) as one fused kernel (mlp.cpp).
// Initialization: W1, W3 ~ N(0, init_std²); W2 ~ N(0, (init_std / sqrt(2·n_layers))²), the GPT-2 scaling
// of projections that write into the residual stream.
#pragma once

#include "layers/blocks/parameters.h"

namespace carry {

struct SwiGLU {
  SwiGLU() = default;
  SwiGLU(int64_t d_model, int64_t hidden, double init_std, int64_t n_layers, ParameterInit& init);
  // result_only: the caller reads only the result's graph, not its values (a recomputation in the
  // backward, layers/blocks/recompute.h): the fused CUDA path then skips the activation and W2's product; the
  // other paths compute as usual. The gradients are the same either way.
  Tensor forward(const Tensor& x, bool result_only = false) const;
  // "w1.weight" [hidden, d], "w3.weight" [hidden, d], "w2.weight" [d, hidden].
  NamedParameters parameters() const;

  Tensor w1, w3, w2;
};

}  // namespace carry
