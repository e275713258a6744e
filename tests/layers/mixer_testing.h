// Test helpers for mixers: random valid inputs for any family (never zeros), relative errors, and
// gradients of a random linear functional of (o, final_state) with respect to every input and the
// initial state, through autograd.
#pragma once

#include "layers/mixer.h"

#include <torch/csrc/autograd/autograd.h>

#include <map>
#include <string>
#include <vector>

namespace carry::testing {

struct Shape {
  int64_t B = 2, T = 64, H = 2, dk = 8, dv = 6;
  int64_t offset = 0;  // absolute position of the first token (log-linear levels)
};

// Levels needed for positions [0, offset+T): 2 + floor(log2(offset+T-1)).
inline int64_t num_levels(const Shape& s) {
  int64_t last = s.offset + s.T - 1, L = 1;
  while ((int64_t{1} << (L - 1)) <= last) ++L;
  return L + 1;
}

// Random inputs for the family's input_names() and optional_input_names(): q, k, v ~ N(0,1); log gates log σ(x+3) (decays around
// 0.95); beta = σ(x); level weights σ(x)+0.1. Families that read beta get L2-normalized keys.
inline MixerInputs random_inputs(const Mixer& m, const Shape& s, at::ScalarType dtype, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto opt = at::TensorOptions().dtype(dtype);
  MixerInputs in;
  auto names = m.input_names();
  for (auto& n : m.optional_input_names()) names.push_back(n);
  bool delta = std::find(names.begin(), names.end(), "beta") != names.end();
  for (auto& n : names) {
    Tensor t;
    if (n == "q" || n == "k") t = at::randn({s.B, s.T, s.H, s.dk}, gen, opt);
    else if (n == "v") t = at::randn({s.B, s.T, s.H, s.dv}, gen, opt);
    else if (n == "g") t = at::log_sigmoid(at::randn({s.B, s.T, s.H}, gen, opt) + 3);
    else if (n == "gk") t = at::log_sigmoid(at::randn({s.B, s.T, s.H, s.dk}, gen, opt) + 3);
    else if (n == "beta") t = at::sigmoid(at::randn({s.B, s.T, s.H}, gen, opt));
    else if (n == "l") t = at::sigmoid(at::randn({s.B, s.T, s.H, num_levels(s)}, gen, opt)) + 0.1;
    if (delta && n == "k") t = t / t.norm(2, -1, true);
    in.get(n) = t;
  }
  return in;
}

inline State random_state(const Mixer& m, const MixerInputs& in, const MixerOptions& opt,
                          uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  State s = m.zero_state(in, opt);
  for (auto& t : s) t = at::randn(t.sizes(), gen, t.options());
  return s;
}

// max|a-b| / max|b| (max-norm relative error); 0 when both are empty.
inline double rel_err(const Tensor& a, const Tensor& b) {
  if (!a.defined() && !b.defined()) return 0;
  if (b.numel() == 0) return 0;
  double den = b.abs().max().item<double>();
  double num = (a - b).abs().max().item<double>();
  return den > 0 ? num / den : num;
}

inline double max_rel_err(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double e = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) e = std::max(e, rel_err(a[i], b[i]));
  return e;
}

// Leaves that require grad, so a form can be differentiated with respect to each.
struct Leaves {
  MixerInputs in;
  State state;
  std::vector<Tensor> all() const {
    std::vector<Tensor> v;
    for (const char* n : {"q", "k", "v", "g", "gk", "beta", "l"})
      if (in.get(n).defined()) v.push_back(in.get(n));
    for (auto& t : state) v.push_back(t);
    return v;
  }
};

inline Leaves make_leaves(const MixerInputs& in, const State& state) {
  Leaves l;
  for (const char* n : {"q", "k", "v", "g", "gk", "beta", "l"})
    if (in.get(n).defined()) l.in.get(n) = in.get(n).detach().clone().requires_grad_(true);
  for (auto& t : state) l.state.push_back(t.detach().clone().requires_grad_(true));
  return l;
}

enum class Form { naive, chunkwise };

struct Result {
  std::vector<Tensor> outputs;  // o, then the final state entries
  std::vector<Tensor> grads;    // d(leaves), in Leaves::all() order
};

// Runs a form and differentiates Σ o⊙w_o + Σ S_i⊙w_i for fixed random weights.
inline Result run_with_grads(const Mixer& m, Form form, const MixerInputs& in, const State& state,
                             const MixerOptions& opt, uint64_t seed = 99) {
  auto leaves = make_leaves(in, state);
  auto out = form == Form::naive ? m.naive(leaves.in, leaves.state, opt)
                                 : m.chunkwise(leaves.in, leaves.state, opt);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Result r;
  r.outputs.push_back(out.o.detach());
  auto loss = (out.o * at::randn(out.o.sizes(), gen, out.o.options())).sum();
  for (auto& s : out.final_state) {
    r.outputs.push_back(s.detach());
    loss = loss + (s * at::randn(s.sizes(), gen, s.options())).sum();
  }
  auto xs = leaves.all();
  auto gs = torch::autograd::grad({loss}, xs, {}, false, false, /*allow_unused=*/true);
  for (size_t i = 0; i < gs.size(); ++i) r.grads.push_back(gs[i].defined() ? gs[i] : at::zeros_like(xs[i]));
  return r;
}

}  // namespace carry::testing
