// Checking mixers against each other: random valid inputs for any family (never zeros), relative
// errors, and the gradients of a random linear functional of (o, final_state) with respect to every
// input and the initial state, through autograd. Used by the tests and by `carry check`.
#pragma once

#include "layers/mixer.h"

#include <functional>
#include <string>
#include <vector>

namespace carry {

struct Shape {
  int64_t B = 2, T = 64, H = 2, dk = 8, dv = 6;
  int64_t offset = 0;  // absolute position of the first token (log-linear levels)
};

// Levels needed for positions [0, offset+T): 2 + floor(log2(offset+T-1)).
int64_t num_levels(const Shape& s);

// Random inputs for the family's input_names() and optional_input_names(): q, k, v ~ N(0,1); log
// gates log σ(x+3) (decays around 0.95); beta = σ(x); level weights σ(x)+0.1. Families that read beta
// get L2-normalized keys. An input with several rows a token (Mixer::rows_per_token at the default
// options: Gated DeltaProduct's k, v, beta) gets that many rows a token, and an input shared by all
// heads (Mixer::broadcasts_heads: Mamba-1's q, k) one head. A family with a decay rate (Mamba-1) gets
// g = softplus(x), a step size, and decay_rate = −exp(x/2) [H, dk].
MixerInputs random_inputs(const Mixer& m, const Shape& s, at::ScalarType dtype, uint64_t seed,
                          at::Device device = at::kCPU);
State random_state(const Mixer& m, const MixerInputs& in, const MixerOptions& opt, uint64_t seed);

// max|a-b| / max|b| (max-norm relative error); 0 for empty tensors, infinite where either holds a NaN.
double rel_err(const Tensor& a, const Tensor& b);
// The largest rel_err over paired lists (which must have equal lengths).
double max_rel_err(const std::vector<Tensor>& a, const std::vector<Tensor>& b);

struct FormResult {
  std::vector<Tensor> outputs;  // o, then the final state entries
  std::vector<Tensor> grads;    // d(q,k,v,g,gk,beta,l that are defined), then d(initial state entries)
};

// Runs a form and differentiates Σ o⊙w_o + Σ S_i⊙w_i for fixed random weights w (seeded; drawn in
// the output's dtype, fp32 at least, so a bf16 run and an fp32 run see the same weights). The leaves
// are detached clones of the inputs and the state, or what `make_leaf` makes of each (a leaf that
// requires grad: e.g. a copy placed off alignment).
FormResult run_with_grads(const Mixer& m, Form form, const MixerInputs& in, const State& state,
                          const MixerOptions& opt, uint64_t seed = 99,
                          const std::function<Tensor(const Tensor&)>& make_leaf = {});

}  // namespace carry
