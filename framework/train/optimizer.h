// AdamW (Loshchilov & Hutter) with decoupled weight decay, a linear warmup then cosine learning-rate
// schedule, and global gradient-norm clipping. For every parameter p with gradient g at step t
// (1-based), learning rate η and weight decay λ:
//   p ← p·(1 − η·λ)                       (only parameters with 2+ dims: matrices, embeddings,
//                                          convolutions; norms, biases and per-head scalars are not
//                                          decayed)
//   m ← β1·m + (1−β1)·g,   v ← β2·v + (1−β2)·g²
//   p ← p − η · (m / (1−β1^t)) / (sqrt(v / (1−β2^t)) + ε)
// The state is two tensors per parameter, named "exp_avg.<param>" and "exp_avg_sq.<param>" (as stored
// in checkpoints), in the parameters' dtype and device; the step count t is the trainer's step. All
// operations are elementwise and in place, in a fixed parameter order: the same state and gradients
// give the same bits.
#pragma once

#include "framework/config/carry.pb.h"
#include "layers/parameters.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace carry {

// The learning rate of step `step` (0-based: the step about to be taken): lr·(step+1)/warmup_steps
// during the warmup, then a cosine from lr down to min_lr_ratio·lr at total_steps, constant after.
double learning_rate(const config::OptimizerConfig& opt, int64_t step);

// Scales every defined gradient so that the global L2 norm (over all of them, accumulated in fp64)
// is at most max_norm (max_norm <= 0: no clipping). Returns the norm before clipping.
double clip_grad_norm(const NamedParameters& params, double max_norm);

class AdamW {
 public:
  AdamW(NamedParameters params, const config::OptimizerConfig& opt);

  // One update with learning rate `lr` from the parameters' .grad() (a parameter without a gradient
  // is treated as having a zero gradient: its moments still decay). Advances steps().
  void step(double lr);
  int64_t steps() const { return steps_; }

  // The state as named tensors: "exp_avg.<param>" for every parameter in order, then
  // "exp_avg_sq.<param>". Shares storage with the optimizer (copy before mutating).
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  // Restores state() output (any order; every name required, shapes must match; values are copied
  // into the optimizer's tensors, converting dtype and device) and the step count.
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state, int64_t steps);

  const NamedParameters& parameters() const { return params_; }

 private:
  NamedParameters params_;
  config::OptimizerConfig opt_;
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;
  int64_t steps_ = 0;
};

}  // namespace carry
