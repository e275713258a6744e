// Gradients of a mixer run with respect to its inputs and initial state: the one place where inputs
// become autograd leaves and torch::autograd::grad is called for them (`carry mixer`, `carry check`,
// the mixer tests and the sequence-parallel tests all go through here). The design decision: a leaf
// that no output depends on gets zeros of its shape, never an undefined tensor, so that every caller
// can compare and write every gradient alike.
#pragma once

#include "layers/mixer.h"

#include <functional>
#include <vector>

namespace carry {

// Copies of a run's inputs and initial state that require grad.
struct MixerLeaves {
  MixerInputs in;  // the defined inputs, each a leaf
  State state;     // the initial state entries, each a leaf
  // The defined inputs in MixerInputs::names() order, then the state entries.
  std::vector<Tensor> all() const;
};

// Leaves for the defined inputs of `in` and the entries of `state`: detached clones that require grad,
// or what `make_leaf` makes of each (it must return a leaf that requires grad).
MixerLeaves make_mixer_leaves(const MixerInputs& in, const State& state,
                              const std::function<Tensor(const Tensor&)>& make_leaf = {});

// d(sum_i sum(outputs_i * cotangents_i)) / d leaves, detached, one per leaf in order. With no
// cotangents, `outputs` holds one scalar loss. A leaf that no output depends on, or outputs without a
// graph at all, get zeros of the leaf's shape. The graph is freed.
std::vector<Tensor> leaf_grads(const std::vector<Tensor>& outputs, const std::vector<Tensor>& leaves,
                               const std::vector<Tensor>& cotangents = {});

}  // namespace carry
