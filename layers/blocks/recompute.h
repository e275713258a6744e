// Activation recomputation (per layer): y = f(x) where the forward keeps only x and the layer's
// parameters, not f's intermediate activations. The backward runs f(x) again with autograd on (under
// the autocast setting the forward had) and back-propagates the incoming gradient of y through that
// fresh graph to x and the parameters. f must be deterministic (no dropout). What f receives from
// other ranks through received_once (sequence-parallel states, halos, summaries) is recorded by the
// forward and replayed by the recomputation, which therefore sends nothing and waits for no rank.
// Without grad mode, or when neither x nor a parameter requires grad, this is plain f(x).
#pragma once

#include "layers/mixer.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace carry {

//
// overlap (parallel.recompute_overlap): layers recomputed one after another in the forward form a chain
// (each node links to the one made before it on this thread, if that one's output is its input). When a layer's backward starts, it first
// starts the recomputation of the layer below on one of two side streams (layers/core/side_stream.h),
// so the GPU runs it beside this layer's backward; that layer's backward then differentiates the graph
// made ahead, on that stream, and the caller's stream waits for it. The same operations and bits; one
// more layer's activations alive at a time. On the CPU the layer below is recomputed in place, earlier.
Tensor recompute_in_backward(std::function<Tensor(const Tensor&)> f, const Tensor& x,
                             const std::vector<Tensor>& parameters, bool overlap = false);

// True on this thread while recompute_in_backward runs f again inside the backward. There only the
// graph of f's result is differentiated; its values are never read, so the ops whose output is only
// f's result may build their graph without computing it (graph_only_add; the MLP's last product).
bool recomputing_in_backward();

// a + b for autograd, whose values are computed only when `values` is true: otherwise the result is
// uninitialized memory of the sum's shape and dtype with the sum's graph (the gradient reaches a and b
// as it would through a + b). For the last op of a recomputed layer (recomputing_in_backward()).
Tensor graph_only_add(const Tensor& a, const Tensor& b, bool values);

// A message exchange inside a layer (a sequence-parallel state, a halo): `exchange` sends what it
// sends and returns what it received. Inside the forward of a recomputed layer the result is recorded;
// inside its recomputation the recorded tensors come back in the same order and `exchange` does not
// run, so the recomputation of one rank never waits for another's (they recompute the same values).
// Elsewhere: exchange().
std::vector<Tensor> received_once(const std::function<std::vector<Tensor>()>& exchange);

// Selective recomputation (parallel.recompute_keeps_mixer): a recomputed layer runs its family's core
// once. The forward pass (under recompute_in_backward's no-grad forward) runs the core with autograd
// on over detached copies of its inputs and keeps that graph here (the core's saved tensors: its
// inputs and, for a kernel form, the per-chunk states it keeps for its backward). The recomputation
// in the backward replays the projections, convolutions and everything after the core, takes the
// core's output from here, and differentiates through the kept graph. The core's inputs are
// recomputed bit for bit (the projections are deterministic), so the gradients equal full
// recomputation's. One stash per layer and step; it is emptied by the backward.
struct MixerCoreStash {
  std::vector<std::string> names;  // the core's defined inputs, in MixerInputs::names() order
  std::vector<Tensor> leaves;      // their detached copies, requiring grad where floating
  Tensor o;                        // the core's output, with the kept graph
  State final_state;
};

// The core's output for `in` through `stash`: the first call runs mixer.forward(in, {}, options) and
// keeps its graph (returning the output without it); a second call returns the kept output attached
// to `in` by a node whose backward runs the kept graph.
MixerOutput stashed_mixer_core(const std::shared_ptr<MixerCoreStash>& stash, const Mixer& mixer,
                               const MixerInputs& in, const MixerOptions& options);

}  // namespace carry
