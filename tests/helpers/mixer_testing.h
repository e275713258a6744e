// Test helpers for mixers: the shared checking utilities of framework/cli/mixer_check.h under the test
// namespace, plus GoogleTest-side helpers.
#pragma once

#include "framework/cli/mixer_check.h"
#include "layers/blocks/parameters.h"

#include <ATen/core/grad_mode.h>

#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <functional>
#include <string>
#include <vector>

namespace carry::testing {

using carry::Form;
using carry::max_rel_err;
using carry::num_levels;
using carry::random_inputs;
using carry::random_state;
using carry::rel_err;
using carry::run_with_grads;
using carry::Shape;
using Result = carry::FormResult;

// Adds N(0, std²) noise from `seed` to every parameter in place: nonzero values everywhere for layers whose
// initialization zeroes some (rwkv7: o_proj and the LoRAs' first factors), so that every term is tested.
inline void perturb_parameters(const NamedParameters& params, uint64_t seed, double std) {
  at::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (const auto& [name, p] : params)
    p.add_(at::randn(p.sizes(), gen, at::TensorOptions().dtype(at::kDouble)).to(p.options()) * std);
}

// Every defined input of `in` converted to dtype dt (q, k, v and the gates alike).
inline MixerInputs inputs_as(const MixerInputs& in, at::ScalarType dt) {
  MixerInputs out;
  for (const auto& n : MixerInputs::names())
    if (in.get(n).defined()) out.get(n) = in.get(n).to(dt);
  return out;
}

// The outputs (o, then the final state's tensors) followed by the gradients of every input and initial
// state for run_with_grads' random functional (seed 5), all in fp32: the kernel tests' comparison list.
inline std::vector<Tensor> outputs_then_grads(const Mixer& m, Form form, const MixerInputs& in, const State& s0,
                                              const MixerOptions& opt) {
  auto r = run_with_grads(m, form, in, s0, opt, /*seed=*/5);
  r.outputs.insert(r.outputs.end(), r.grads.begin(), r.grads.end());
  for (auto& t : r.outputs) t = t.to(at::kFloat);
  return r.outputs;
}

// The outputs then the gradients of run_with_grads' random functional in the run's own dtype (fp64 for
// fp64 inputs: outputs_then_grads rounds to fp32, which hides differences below fp32's rounding).
inline std::vector<Tensor> outputs_then_grads_as_run(const Mixer& m, Form form, const MixerInputs& in,
                                                     const State& s0, const MixerOptions& opt) {
  auto r = run_with_grads(m, form, in, s0, opt, /*seed=*/5);
  r.outputs.insert(r.outputs.end(), r.grads.begin(), r.grads.end());
  return r.outputs;
}

// The names of outputs_then_grads' list: o, final_<entry> for each state entry, d<input> for each defined
// input, d_initial_<entry>.
inline std::vector<std::string> result_names(const std::vector<std::string>& state_entries, const MixerInputs& in) {
  std::vector<std::string> names{"o"};
  for (const auto& s : state_entries) names.push_back("final_" + s);
  for (const auto& n : MixerInputs::names())
    if (in.get(n).defined()) names.push_back("d" + n);
  for (const auto& s : state_entries) names.push_back("d_initial_" + s);
  return names;
}

// A family whose kernel form is `kernel_form` (a composition under test, e.g. over an ATen pass), everything
// else `base`'s: run it with Form::kernel on any device.
class WithKernelForm final : public Mixer {
 public:
  using KernelForm = std::function<MixerOutput(const MixerInputs&, const State&, const MixerOptions&)>;
  WithKernelForm(const Mixer& base, KernelForm kernel_form) : base_(base), kernel_form_(std::move(kernel_form)) {}
  std::string name() const override { return base_.name(); }
  std::vector<std::string> input_names() const override { return base_.input_names(); }
  std::vector<std::string> optional_input_names() const override { return base_.optional_input_names(); }
  int64_t rows_per_token(const std::string& n, const MixerOptions& o) const override {
    return base_.rows_per_token(n, o);
  }
  bool broadcasts_heads(const std::string& n) const override { return base_.broadcasts_heads(n); }
  std::vector<std::string> state_names() const override { return base_.state_names(); }
  State zero_state(const MixerInputs& in, const MixerOptions& o) const override { return base_.zero_state(in, o); }
  void check(const MixerInputs& in, const MixerOptions& o, bool chunked) const override { base_.check(in, o, chunked); }
  MixerOutput naive(const MixerInputs& in, const State& s, const MixerOptions& o) const override {
    return base_.naive(in, s, o);
  }
  MixerOutput chunkwise(const MixerInputs& in, const State& s, const MixerOptions& o) const override {
    return base_.chunkwise(in, s, o);
  }
  bool has_kernel() const override { return true; }
  MixerOutput kernel(const MixerInputs& in, const State& s, const MixerOptions& o) const override {
    base_.check(in, o, true);
    return kernel_form_(in, s, o);
  }

 private:
  const Mixer& base_;
  KernelForm kernel_form_;
};

// Expects `f` to throw a c10::Error whose message contains `needle`.
template <class F>
void expect_error(F f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(needle), std::string::npos)
        << "message was: " << e.what_without_backtrace();
  }
}

// MixerOptions' two hooks in a form that calls them (the kernel forms): runs m.forward(in, init, opt)
// with on_final_state and on_initial_state_grad set, then differentiates the output and the final state
// with random cotangents. on_final_state must run once, inside the forward, with the bits of the
// returned final state; on_initial_state_grad `grad_hook_calls` times (0 or 1), inside the backward,
// with the bits autograd returns for init[0]. `tag` names the case in failures.
inline void check_state_hooks(const Mixer& m, const MixerInputs& in, const State& init, MixerOptions opt,
                              int grad_hook_calls, const std::string& tag) {
  int calls = 0, grad_calls = 0;
  State seen;
  Tensor seen_grad;
  opt.on_final_state = [&](const State& s) {
    ++calls;
    for (auto& t : s) seen.push_back(t.clone());
  };
  opt.on_initial_state_grad = [&](const State& d) {
    ++grad_calls;
    seen_grad = d[0].clone();
  };
  State leaves;
  for (auto& t : init) leaves.push_back(t.clone().requires_grad_(true));
  MixerOutput out = m.forward(in, leaves, opt);
  ASSERT_EQ(calls, 1) << tag;
  ASSERT_EQ(seen.size(), out.final_state.size()) << tag;
  for (size_t i = 0; i < seen.size(); ++i)
    EXPECT_TRUE(at::equal(seen[i], out.final_state[i])) << tag << ": final state entry " << i << " was not final in the hook";
  EXPECT_EQ(grad_calls, 0) << tag << ": the backward hook ran before the backward";
  std::vector<Tensor> outs{out.o}, cot{at::randn_like(out.o)};
  for (auto& t : out.final_state) outs.push_back(t), cot.push_back(at::randn_like(t));
  auto grads = torch::autograd::grad(outs, {leaves[0]}, cot, /*retain_graph=*/false, false, /*allow_unused=*/true);
  ASSERT_EQ(grad_calls, grad_hook_calls) << tag;
  if (grad_hook_calls == 1)
    EXPECT_TRUE(at::equal(seen_grad, grads[0])) << tag << ": the backward hook's d S0 is not the returned one";
}

}  // namespace carry::testing
