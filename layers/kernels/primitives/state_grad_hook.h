// MixerOptions::on_initial_state_grad kept in a kernel form's autograd context for its backward (the
// kernel ops of the delta rule, the decay class and the fused kernels without per-chunk states).
#pragma once

#include <torch/csrc/autograd/custom_function.h>

#include <functional>

namespace carry::kernels::primitives {

struct StateGradHook : torch::CustomClassHolder {
  explicit StateGradHook(std::function<void(const at::Tensor&)> f) : fn(std::move(f)) {}
  std::function<void(const at::Tensor&)> fn;
};

// Keeps f (when set) in ctx for state_grad_hook.
inline void keep_state_grad_hook(torch::autograd::AutogradContext* ctx, const std::function<void(const at::Tensor&)>& f) {
  if (f) ctx->saved_data["on_s0_grad"] = at::IValue::make_capsule(c10::make_intrusive<StateGradHook>(f));
}
// The hook keep_state_grad_hook kept (empty when none was).
inline std::function<void(const at::Tensor&)> state_grad_hook(torch::autograd::AutogradContext* ctx) {
  auto it = ctx->saved_data.find("on_s0_grad");
  if (it == ctx->saved_data.end()) return {};
  return c10::static_intrusive_pointer_cast<StateGradHook>(it->second.toCapsule())->fn;
}

}  // namespace carry::kernels::primitives
