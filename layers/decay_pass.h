// One pass of the decay class's recurrence, the building block of the families whose kernel forms are
// composed of such passes (HLA: layers/hla/decay_passes.h; log-linear Mamba-2:
// layers/log_linear/level_passes.h):
//   X_t = γ_t X_{t−1} + a_t b_tᵀ,   r_t = s · X_tᵀ c_t     (pass(c, a, b, g, X_0, s) → (r, X_T))
// with γ_t = e^{g_t} (no g: γ ≡ 1) and the read-out's scale s (in fp32, before r is rounded to c's dtype). On CUDA it is the decay class's kernels with their
// hand-written backward (layers/kernels/decay/op.h: decay_kernel_pass); chunkwise_decay_pass is the same
// pass in ATen (the scalar-decay family's chunkwise form), which the tests run the compositions with.
#pragma once

#include "layers/mixer.h"

#include <functional>
#include <utility>

namespace carry {

// pass(c, a, b, g, X_0, s) → (r [B,T,H,db] in c's dtype, X_T [B,H,da,db]); c, a [B,T,H,da], b [B,T,H,db],
// g [B,T,H] or undefined (no decay), X_0 [B,H,da,db], s > 0. Differentiable in every input.
using DecayPass = std::function<std::pair<Tensor, Tensor>(const Tensor& c, const Tensor& a, const Tensor& b,
                                                          const Tensor& g, const Tensor& x0, double scale)>;

// The pass in ATen, chunk `chunk_size`, on any device and dtype.
DecayPass chunkwise_decay_pass(int64_t chunk_size);

// A one-state family's chunkwise form with scale `scale` (default 1) from the state x0: (o, final state).
// The ATen passes of the compositions are this with "scalar_decay" or "gated_deltanet".
std::pair<Tensor, Tensor> chunkwise_scale_one(const std::string& family, const MixerInputs& in, const Tensor& x0,
                                              int64_t chunk_size, double scale = 1.0);

}  // namespace carry
