// The scalar/diagonal-decay class's kernel form (layers/kernels/decay/api.h) as one
// differentiable op (CUDA builds only): forward and hand-written backward behind a torch autograd
// Function, used by the kernel forms of linear_attn, scalar_decay and gla.
#pragma once

#include "layers/decay_pass.h"
#include "layers/mixer.h"

namespace carry {

enum class DecayKernel { none, scalar, diag };

// Whether the kernels take these inputs: CUDA, bf16 or fp32 (one dtype), dk ∈ {64, 96, 128},
// dv ∈ {64, 128, 192, 256}, chunk_size 64 (T a multiple of it is checked by the family's check()).
bool decay_kernel_supports(const MixerInputs& in, const MixerOptions& opt);

// The recurrence S_t = diag(e^{g_t}) S_{t−1} + k_t v_tᵀ, o_t = scale · S_tᵀ q_t from `initial_state`
// [B,H,dk,dv] (undefined: zeros); g undefined (none), [B,T,H] (scalar) or [B,T,H,dk] (diag), any
// float dtype (the kernels read it in fp32). Returns o [B,T,H,dv] in q's dtype and the final state in
// fp32; differentiable in q, k, v, g and the initial state. serial_states: the state recurrence walks
// the chunks in order (MixerOptions::serial_states), else an in-GPU segment scan may run.
// on_final_state, when set, is called with the final state once its walk is enqueued, before the output
// kernel (MixerOptions::on_final_state).
std::pair<Tensor, Tensor> decay_kernel_forward(DecayKernel kind, const Tensor& q, const Tensor& k, const Tensor& v,
                                               const Tensor& g, const Tensor& initial_state, double scale,
                                               bool serial_states = false,
                                               const std::function<void(const Tensor&)>& on_final_state = {},
                                               const std::function<void(const Tensor&)>& on_initial_state_grad = {});

// The recurrence as a decay pass (layers/decay_pass.h): the pass's scale, the scalar gate where g is given (none
// otherwise); serial_states walks the chunks in order.
DecayPass decay_kernel_pass(bool serial_states);

// The kernel form of a family of this class with one state S and gate `gate` (undefined for none):
// the family's checks, the supported-shape check, then decay_kernel_forward.
MixerOutput decay_kernel_form(const Mixer& family, DecayKernel kind, const Tensor& gate, const MixerInputs& in,
                              const State& initial_state, const MixerOptions& opt);

// The error when the kernel form is forced on inputs it does not take.
void check_decay_kernel_supports(const std::string& family, const MixerInputs& in, const MixerOptions& opt);

}  // namespace carry
