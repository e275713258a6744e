// The head's fused cross entropy (cross_entropy.h): the binding of layers/kernels/blocks/loss.h in CUDA
// builds, an error in the others.
#include "layers/blocks/cross_entropy.h"

#include <c10/util/Exception.h>

#ifdef CARRY_WITH_CUDA
#include "layers/kernels/blocks/loss.h"
#endif

namespace carry {

bool fused_cross_entropy_built() {
#ifdef CARRY_WITH_CUDA
  return true;
#else
  return false;
#endif
}

void fused_cross_entropy_rows(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& weights,
                              const at::Tensor& ce, const at::Tensor& predictions, bool grads) {
#ifdef CARRY_WITH_CUDA
  kernels::blocks::cross_entropy_rows(logits, targets, weights, ce, predictions, grads);
#else
  (void)logits, (void)targets, (void)weights, (void)ce, (void)predictions, (void)grads;
  TORCH_CHECK(false, "fused_cross_entropy_rows: this build of carry has no CUDA kernels (CARRY_CUDA=OFF)");
#endif
}

}  // namespace carry
