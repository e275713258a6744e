// AdamW (Loshchilov & Hutter) with decoupled weight decay, a linear warmup then a learning-rate schedule
// (cosine, linear, constant or warmup-stable-decay), and global gradient-norm clipping. For every
// parameter p with gradient g at step t (1-based), learning rate η and weight decay λ:
//   p ← p·(1 − η·λ)                       (only parameters with 2+ dims: matrices, embeddings,
//                                          convolutions; norms, biases and per-head scalars are not
//                                          decayed)
//   m ← β1·m + (1−β1)·g,   v ← β2·v + (1−β2)·g²
//   p ← p − η · (m / (1−β1^t)) / (sqrt(v / (1−β2^t)) + ε)
// The state is two tensors per parameter, named "exp_avg.<param>" and "exp_avg_sq.<param>" (as stored
// in checkpoints), in the parameters' dtype and device; the step count t is the trainer's step. All
// operations are elementwise and in place, in a fixed parameter order: the same state and gradients
// give the same bits.
//
// Two forms of the same update. CPU parameters (and every parameter when `fused` is false) take the
// per-parameter loop of ATen ops above (the reference). CUDA parameters take ATen's fused multi-tensor
// AdamW, at::_fused_adamw_ (a few kernels for all parameters), in two calls: the decayed parameters
// (2+ dims) with weight decay λ, the rest with 0. Its math is the loop's (decoupled decay p −= η·λ·p
// first, the moments, then p −= η/(1−β1^t) · m / (sqrt(v)/sqrt(1−β2^t) + ε)), computed per element in
// the parameters' opmath type with the bias corrections in that type (the loop takes them in fp64): the
// two agree to rounding (tests/framework/train/optimizer_test.cpp, the GPU test). No amsgrad, no
// maximize, no gradient scaling; the step count travels as a one-element fp32 tensor on the device.
#pragma once

#include "framework/config/carry.pb.h"
#include "layers/blocks/parameters.h"

#include <cstdint>
#include <unordered_map>
#include <string>
#include <utility>
#include <vector>

namespace carry {

// The learning rate of step `step` (0-based: the step about to be taken), a function of the step and
// the config only (a resumed run continues the same rates). During the warmup lr·(step+1)/warmup_steps;
// then, by optimizer.schedule, with r = min_lr_ratio and p the progress through the decay (0 at its
// first step, 1 at total_steps and after):
//   COSINE    lr·(r + (1−r)·(1 + cos πp)/2), p = (step − warmup_steps)/(total_steps − warmup_steps)
//   LINEAR    lr·(r + (1−r)·(1 − p)), the same p
//   CONSTANT  lr
//   WSD       lr until the last D = round(decay_fraction·total_steps) steps, then lr·(r + (1−r)·f(p))
//             with p = (step − (total_steps − D))/D and f of decay_shape: 1 − p, (1 + cos πp)/2 or 1 − √p.
double learning_rate(const config::OptimizerConfig& opt, int64_t step);
// WSD's decay steps D (above).
int64_t wsd_decay_steps(const config::OptimizerConfig& opt);

// Scales every defined gradient so that the global L2 norm (over all of them, accumulated in fp64)
// is at most max_norm (max_norm <= 0: no clipping). Returns the norm before clipping.
double clip_grad_norm(const NamedParameters& params, double max_norm);
// The same without a host read: the norm stays a 0-dim fp64 tensor on the gradients' device (undefined
// when no gradient is defined) and the scale min(1, max_norm/(norm + 1e-6)) is applied there (a scale
// of exactly 1 leaves the gradients' bits as they are). Same bits as clip_grad_norm.
at::Tensor clip_grad_norm_on_device(const NamedParameters& params, double max_norm);

// The global norm's parts: each gradient's squared L2 norm in fp64, stacked in the given order (on
// CUDA fp32 gradients of one device each tensor's norm in fp32 by one multi-tensor launch, then squared
// in fp64; elsewhere each sum of squares in fp64). clip_grad_norm_on_device's norm is their sum's square
// root. A tensor's part does not depend on the other tensors of the list (the multi-tensor kernel sums
// each tensor's chunks on their own), so ranks holding different parameters compute the same parts.
at::Tensor gradient_norm_parts(const std::vector<at::Tensor>& grads);
// Scales `grads` by min(1, max_norm / (norm + 1e-6)) on their device (norm: 0-dim fp64; max_norm <= 0:
// nothing); a scale of exactly 1 leaves their bits.
void scale_gradients(const std::vector<at::Tensor>& grads, const at::Tensor& norm, double max_norm);

class AdamW {
 public:
  // fused: CUDA parameters take at::_fused_adamw_ (false: the loop on every device).
  AdamW(NamedParameters params, const config::OptimizerConfig& opt, bool fused = true);

  // One update with learning rate `lr` from the parameters' .grad() (a parameter without a gradient
  // is treated as having a zero gradient: its moments still decay). Advances steps().
  void step(double lr);
  int64_t steps() const { return steps_; }

  // The state as named tensors: "exp_avg.<param>" for every parameter in order, then
  // "exp_avg_sq.<param>". Shares storage with the optimizer (copy before mutating). A moment this
  // optimizer does not hold (place_state with a range) is an undefined tensor.
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  // Restores state() output (any order; every name required, shapes must match; values are copied
  // into the optimizer's tensors, converting dtype and device) and the step count. The moments it does
  // not hold are checked (name and shape) and not kept.
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state, int64_t steps);

  const NamedParameters& parameters() const { return params_; }

  // The update split over ranks (sharded_update.h): step() updates parameters [first, last) only and
  // leaves the others and their moments as they are (another rank updates them).
  void update_only(int first, int last);
  // The moments move into `exp_avg` and `exp_avg_sq` (flat buffers of the parameters' dtype and device):
  // parameter i's at element offset[i], their values kept. state() still names one tensor a parameter.
  void place_state(const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, const std::vector<int64_t>& offset);
  // Only parameters [first, last) keep moments, in `exp_avg` and `exp_avg_sq` at element offset[i] − base
  // (buffers of that piece alone), their values kept; the others' moments are released: another rank
  // holds and updates them. step() must then update only [first, last) (update_only).
  void place_state(const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, const std::vector<int64_t>& offset,
                   int first, int last, int64_t base);
  // Whether this optimizer holds parameter i's moments.
  bool holds(size_t i) const { return exp_avg_.at(i).defined(); }

 private:
  NamedParameters params_;
  config::OptimizerConfig opt_;
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;
  int64_t steps_ = 0;
  int first_ = 0, last_ = -1;  // the parameters step() updates; last_ < 0: to the end
  bool fused_ = true;
  std::unordered_map<at::Device, at::Tensor> step_tensors_;  // the fused form's step count, one per CUDA device
};

}  // namespace carry
