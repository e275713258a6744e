// Parameters of the model's modules (norms, MLP, mixer layers, the model): plain ATen tensors that are
// autograd leaves, listed flat by dotted names ("layers.3.mixer.q_proj.weight") for the trainer, the
// optimizer and checkpoints. Initial values are drawn in fp32 on the CPU from one counter-based
// generator, in the order the modules are built, then cast to the model's dtype and device: a seed
// gives the same values on every machine, and an fp64 model holds exactly its fp32 twin's values.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace carry {

using at::Tensor;

using NamedParameters = std::vector<std::pair<std::string, Tensor>>;

// Draws initial values; every tensor it returns is a leaf with requires_grad.
class ParameterInit {
 public:
  ParameterInit(uint64_t seed, at::TensorOptions options)
      : gen_(at::make_generator<at::CPUGeneratorImpl>(seed)), options_(options) {}

  // N(0, std²) entries.
  Tensor normal(at::IntArrayRef shape, double std) {
    if (meta()) return shape_only(shape);
    return leaf(at::empty(shape, at::kFloat).normal_(0.0, std, gen_));
  }
  // U(low, high) entries.
  Tensor uniform(at::IntArrayRef shape, double low, double high) {
    if (meta()) return shape_only(shape);
    return leaf(at::empty(shape, at::kFloat).uniform_(low, high, gen_));
  }
  Tensor full(at::IntArrayRef shape, double value) {
    if (meta()) return shape_only(shape);
    return leaf(at::full(shape, value, at::kFloat));
  }
  // A value computed in fp32 on the CPU (e.g. from uniform_cpu) made a parameter.
  Tensor leaf(const Tensor& cpu_fp32) {
    return cpu_fp32.to(options_).detach().set_requires_grad(true);
  }
  // U(low, high) in fp32 on the CPU, not yet a parameter (to transform first).
  Tensor uniform_cpu(at::IntArrayRef shape, double low, double high) {
    return at::empty(shape, at::kFloat).uniform_(low, high, gen_);
  }
  const at::TensorOptions& options() const { return options_; }
  // On the meta device (shapes only, no storage: parameter counts of full-size models) nothing is drawn.
  bool meta() const { return options_.device().is_meta(); }

 private:
  Tensor shape_only(at::IntArrayRef shape) { return at::empty(shape, options_).set_requires_grad(true); }

  at::Generator gen_;
  at::TensorOptions options_;
};

// Appends `prefix + name` for every entry of `from`.
inline void append_parameters(NamedParameters& out, const std::string& prefix, const NamedParameters& from) {
  for (auto& [name, t] : from) out.emplace_back(prefix + name, t);
}

}  // namespace carry
