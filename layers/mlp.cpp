// SwiGLU MLP (mlp.h): y = W2 (silu(W1 x) ⊙ W3 x).
#include "layers/mlp.h"

#include <cmath>

namespace carry {

SwiGLU::SwiGLU(int64_t d_model, int64_t hidden, double init_std, int64_t n_layers, ParameterInit& init) {
  w1 = init.normal({hidden, d_model}, init_std);
  w3 = init.normal({hidden, d_model}, init_std);
  w2 = init.normal({d_model, hidden}, init_std / std::sqrt(2.0 * static_cast<double>(n_layers)));
}

Tensor SwiGLU::forward(const Tensor& x) const {
  return at::linear(at::silu(at::linear(x, w1)) * at::linear(x, w3), w2);
}

NamedParameters SwiGLU::parameters() const {
  return {{"w1.weight", w1}, {"w3.weight", w3}, {"w2.weight", w2}};
}

}  // namespace carry
