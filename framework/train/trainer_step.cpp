// One training step and evaluation (see trainer.h): the batches, the forward and backward of every path
// (one batch, accumulated micro-batches, ordered segments) through one pair of helpers, the gradients'
// sum over the ranks, clipping, the step's one host read and the update.
#include "framework/train/trainer.h"
#include "framework/train/trainer_util.h"

#include "framework/io/checkpoint.h"
#include "framework/io/model_source.h"
#include "framework/io/output_file.h"
#include "framework/printable.h"
#include "framework/train/memory_estimate.h"
#include "framework/train/run_log.h"
#include "framework/train/step_trace.h"
#include "framework/data/synthetic.h"
#include "framework/data/token_dataset.h"
#include "framework/data/token_file.h"
#include "layers/core/device.h"
#include "layers/core/fused_switch.h"
#include "layers/core/knobs.h"
#include "layers/blocks/precision.h"
#include "parallel/slice_context.h"
#include "parallel/state_scan.h"

#ifdef CARRY_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

namespace carry {

using namespace trainer_util;

namespace {
// CARRY_SYNC_DEBUG=error (CUDA builds): inside a training step, any synchronizing CUDA call (a
// device-to-host copy, .item(), a stream synchronization through PyTorch) throws, naming the
// operation, except the batch's upload and the two reads the step line needs (the loss sums and the
// gradient norm), which run with the check paused. The audit that a step does not stall the GPU on the host.
class SyncAudit {
 public:
  SyncAudit() { set(enabled()); }
  ~SyncAudit() { set(false); }
  template <class F>
  static auto allowed(F f) {  // a sanctioned host read
    set(false);
    auto r = f();
    set(enabled());
    return r;
  }

 private:
  static bool enabled() {
    static const bool on = [] {
      const char* v = knob_value("CARRY_SYNC_DEBUG");
      return v && std::string(v) == "error";
    }();
    return on;
  }
  static void set(bool on) {
#ifdef CARRY_WITH_CUDA
    c10::cuda::warning_state().set_sync_debug_mode(on ? c10::cuda::SyncDebugMode::L_ERROR
                                                      : c10::cuda::SyncDebugMode::L_DISABLED);
#else
    (void)on;
#endif
  }
};
}  // namespace

Trainer::Batch Trainer::batch_for(int64_t step, int64_t micro, bool eval) const {
  const auto& data = config_.data();
  const int64_t B = data.batch_size(), T = data.seq_len();
  const auto split = eval ? Split::eval : Split::train;
  // A step's global batch is dp x accum x B sequences; dp rank d's micro-batch m holds the global
  // indices [((step*dp + d)*accum + m)*B, ... + B), so accum micro-batches of B make the sequences of
  // one batch of accum*B (and accum = 1 is the plain dp x B cut).
  const int64_t accum = eval ? 1 : grad_accum_steps();
  const int64_t block = (step * dp_ + dp_rank_) * accum + micro;  // in units of B sequences
  at::Tensor tokens, targets, mask;
  if (data.has_mqar() || data.has_needle()) {
    // The synthetic tasks number sequences (step, dp_rank * B + i): block b of step s is their "dp rank" b - s*dp*accum.
    const int64_t as_rank = block - step * dp_ * accum;
    auto b = data.has_mqar() ? mqar_batch(mqar_spec(data), config_.seed(), step, as_rank, B, split)
                             : needle_batch(needle_spec(data), config_.seed(), step, as_rank, B, split);
    tokens = b.tokens, targets = b.targets, mask = b.loss_mask;
  } else {
    const TokenDataset* source = eval ? eval_data_.get() : train_data_.get();
    TORCH_CHECK(source, "trainer: evaluation needs data.token_files.eval_paths");
    auto window = at::empty({B, T + 1}, at::kLong);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t g = block * B + b;
      if (eval) {  // in order, wrapping around
        const int64_t windows = source->windows(0);
        source->stream(0).read((g % windows) * T, T + 1, window[b].data_ptr<int64_t>());
      } else {
        source->sequence(g, window[b].data_ptr<int64_t>());
      }
    }
    const int64_t V = config_.model().vocab_size();
    auto hi = window.max().item<int64_t>();
    TORCH_CHECK(hi < V, "data.token_files: token id ", hi, " does not fit model.vocab_size = ", V);
    tokens = window.narrow(1, 0, T).contiguous();
    targets = window.narrow(1, 1, T).contiguous();
    mask = at::ones({B, T}, at::kBool);
  }
  at::Tensor starts;  // packed documents: a document starts at every end-of-document token
  if (data.has_token_files() && data.token_files().eod_token() >= 0) starts = tokens.eq(data.token_files().eod_token());
  const int64_t Tp = T / sp_;
  // On CUDA through pinned memory without a host wait: a pageable upload synchronizes the host with the
  // stream, so the GPU finished the previous step's update before the host went on to queue this step.
  auto slice = [&](const at::Tensor& x) {
    auto part = x.narrow(1, sp_rank_ * Tp, Tp).contiguous();
    return device_.is_cuda() ? part.pin_memory().to(device_, /*non_blocking=*/true) : part.to(device_);
  };
  return {slice(tokens), slice(targets), slice(mask), starts};
}

std::pair<Trainer::Batch, ModelContext> Trainer::segment_of(const Batch& b, int j) const {
  segments_->set_segment(j);
  const int64_t L = b.tokens.size(1) / segments_->per_rank();
  auto part = [&](const at::Tensor& x) { return x.narrow(1, j * L, L); };
  Batch s{part(b.tokens), part(b.targets), part(b.loss_mask), b.document_starts};
  ModelContext c = context(s);
  c.slice.offset = segments_->rank() * L;
  return {s, c};
}

void Trainer::prefetch_batches(int64_t step) {
  std::vector<Batch> micro;
  for (int64_t m = 0; m < grad_accum_steps(); ++m)
    micro.push_back(SyncAudit::allowed([&] { return batch_for(step, m, false); }));  // the input upload
  prefetched_ = {step, std::move(micro)};
}

std::vector<Trainer::Batch> Trainer::step_batches() {
  if (!prefetched_ || prefetched_->first != step_) prefetch_batches(step_);
  auto micro = std::move(prefetched_->second);
  prefetched_.reset();
  return micro;
}

LinearCrossEntropy Trainer::forward_loss(const Batch& b, const ModelContext& ctx, int64_t defer_head_bytes) {
  AutocastScope autocast(device_.type(), at::kBFloat16, bf16_);
  return model_.loss_sum(b.tokens, b.targets, b.loss_mask, ctx, /*predictions=*/false, defer_head_bytes);
}

void Trainer::backward_share(const LinearCrossEntropy& ce, const at::Tensor& token_count) {
  (ce.loss / token_count.to(ce.loss.scalar_type())).backward();
}


at::Tensor Trainer::segmented_forward_backward(const std::vector<Batch>& micro, const at::Tensor& stop,
                                               at::Tensor& gradients) {
  const int k = segments_->per_rank();
  auto params = model_.parameters();
  // The global token count first (exact in any order): every segment's loss is divided by it.
  auto masked = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device_));
  for (auto& b : micro) masked += b.loss_mask.to(at::kDouble).sum();
  all_reduce(masked);
  // Per local segment: [Σ ce·mask, stop signals] and the gradients, each summed over the micro-batches in order (the
  // same order on every layout), then over the data-parallel replicas (a replica's micro-batches come after
  // the one before it, as one rank's would: dp = 2 replicas of one micro-batch give the bits of one rank with
  // two), then over the segments by the tree.
  parallel::Communicator* dp = dp_ > 1 && groups_ ? groups_->dp.get() : nullptr;
  std::vector<at::Tensor> losses(k), grads(k);
  for (auto& batch : micro) {
    std::vector<LinearCrossEntropy> ce(k);
    for (int j = 0; j < k; ++j) {
      auto [seg, ctx] = segment_of(batch, j);
      ce[j] = forward_loss(seg, ctx, deferred_head_bytes_);
      auto l = at::stack({ce[j].loss.detach().to(at::kDouble), at::zeros({}, masked.options())});
      losses[j] = losses[j].defined() ? losses[j] + l : l;
    }
    // One segment, one micro-batch and no replicas: the gradients' sum goes in buckets while the backward runs.
    const bool overlap = gradient_sum_ && micro.size() == 1 && !dp;
    phase_mark("forward");
    for (int j = k - 1; j >= 0; --j) {  // the state gradients flow right to left
      segments_->set_segment(j);
      if (overlap) gradient_sum_->begin();
      backward_share(ce[j], masked[0]);
      ce[j] = LinearCrossEntropy{};
      if (overlap) gradients = gradient_sum_->finish();
      else {
        auto g = flat_gradients(params, grad_layout_);
        grads[j] = grads[j].defined() ? grads[j] + g : g;
      }
      for (auto& [name, p] : params) p.mutable_grad() = at::Tensor();
    }
    phase_mark("backward");
  }
  auto* sp = segments_->sp();
  losses[0] = losses[0] + at::stack({at::zeros({}, stop.options()), stop});  // the stop signals ride along
  if (dp) {
    for (auto& g : grads) dp->all_reduce_sum(g);
    auto all = at::stack(losses);  // the segments' loss sums in one message
    dp->all_reduce_sum(all);
    for (int j = 0; j < k; ++j) losses[j] = all[j];
  }
  // Split over the sp ranks: each holds its piece's sum (sharded_update.h).
  if (!gradients.defined()) gradients = sharded_ ? parallel::tree_reduce_scatter(grads, sp) : parallel::tree_sum(grads, sp);
  grads.clear();
  auto loss = parallel::tree_sum(losses, sp);
  return at::stack({loss[0], masked[0], loss[1]});
}

StepStats Trainer::train_step() {
  const double t0 = now_s();
  phase_mark("between steps");
  SyncAudit audit;
  const auto& data = config_.data();
  // A captured step graph writes the gradients where its capture left them: they stay.
  if (!graph_ || !graph_->captured())
    for (auto& [name, p] : model_.parameters()) p.mutable_grad() = at::Tensor();
  const int64_t accum = grad_accum_steps();
  const auto stop_flag = [&](const at::TensorOptions& o) {
    return at::scalar_tensor(stop_signal() != 0 || time_is_up_ ? 1.0 : 0.0, o.dtype(at::kDouble));
  };
  // No host read until the step's one sanctioned read after the backward and the clipping: the global
  // token count divides the loss as a device tensor, the loss sums, the stop flag and the gradient norm
  // travel to the host together, and the checks (a token selected, a finite loss and norm) come before
  // the update.
  at::Tensor sums;  // [Σ ce·mask, Σ mask, stop signals] over all ranks, fp64 on the device
  at::Tensor gradients;  // with segments: the flat gradients summed over the sp group
  at::Tensor norm;
  auto params = model_.parameters();
  const bool graphed = graph_ && eager_steps_ > 0;  // validation: one rank, one micro-batch, no segments
  if (graphed) {
    auto batch = step_batches()[0];
    const double clip = config_.optimizer().grad_clip();
    auto body = [&](const at::Tensor& tokens, const at::Tensor& targets, const at::Tensor& mask) {
      Batch b{tokens, targets, mask, {}};
      LinearCrossEntropy ce = forward_loss(b, context(b));
      auto w = mask.to(ce.token_losses.options());
      auto s = at::stack({ce.loss.detach().to(at::kDouble), w.sum().to(at::kDouble)});
      backward_share(ce, s[1]);
      auto n = clip_grad_norm_on_device(params, clip);
      return StepGraph::Outputs{s, n.defined() ? n : at::zeros({}, s.options())};
    };
    auto replay = [&] { return graph_->run(batch.tokens, batch.targets, batch.loss_mask, body); };
    // The capture waits for the device once (the allocator's cache goes back first); a host read inside
    // the captured work fails the capture whatever the audit says.
    auto out = graph_->captured() ? replay() : SyncAudit::allowed(replay);
    sums = at::cat({out.sums, stop_flag(out.sums.options()).view({1})});
    norm = out.norm;
    phase_mark("forward, backward and clip");
  } else if (segments_) {
    std::vector<Batch> micro = step_batches();
    // Summed over the data-parallel replicas, then over the sp group by the segment tree.
    sums = segmented_forward_backward(micro, stop_flag(at::TensorOptions().device(device_)), gradients);
  } else if (accum == 1) {
    auto batch = step_batches()[0];
    // The head and cross entropy run chunk by chunk (chunked_loss.h): Σ ce·mask, never the logits.
    // Ignored targets (kIgnoreIndex < 0) contribute 0.
    LinearCrossEntropy ce = forward_loss(batch, context(batch));
    auto w = batch.loss_mask.to(ce.token_losses.options());
    // The loss each rank back-propagates is its share of the mean. The stop flag rides along so that
    // every rank decides the same.
    sums = at::stack({ce.loss.detach().to(at::kDouble), w.sum().to(at::kDouble), stop_flag(w.options())});
    all_reduce(sums);
    phase_mark("forward");
    backward_share(ce, sums[1]);
    phase_mark("backward");
  } else {
    // Gradient accumulation: the micro-batches' masks give the global token count first (one small
    // all-reduce), then each micro-batch back-propagates its share Σ ce·mask / count, so the summed
    // gradients are those of the whole batch's mean; the loss sums and the stop flag travel after.
    std::vector<Batch> micro = step_batches();
    auto masked = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device_));
    for (auto& b : micro) masked += b.loss_mask.to(at::kDouble).sum();
    all_reduce(masked);
    at::Tensor local_sum;
    for (auto& batch : micro) {
      LinearCrossEntropy ce = forward_loss(batch, context(batch));
      auto part = ce.loss.detach().to(at::kDouble);
      local_sum = local_sum.defined() ? local_sum + part : part;
      phase_mark("forward");
      backward_share(ce, masked[0]);
      phase_mark("backward");
    }
    auto local = at::stack({local_sum, stop_flag(local_sum.options())});
    all_reduce(local);
    sums = at::stack({local[0], masked[0], local[1]});
  }

  // Sum the gradients over all ranks in one message (with segments the replicas and the sp group summed them
  // already).
  parallel::Communicator* grad_comm = !groups_ || segments_ ? nullptr : groups_->world.get();
  if (!graphed && grad_comm && grad_comm->size() > 1) {
    if (!gradients.defined()) gradients = flat_gradients(params, grad_layout_);
    grad_comm->all_reduce_sum(gradients);
  }
  if (!graphed) {  // the graph clipped already
    if (sharded_) {
      sharded_->set_gradients(gradients);
      norm = sharded_->clip(config_.optimizer().grad_clip());
    } else {
      if (gradients.defined()) set_gradients(params, gradients, grad_layout_);
      norm = clip_grad_norm_on_device(params, config_.optimizer().grad_clip());
    }
    if (!norm.defined()) norm = at::zeros({}, sums.options());
    phase_mark("gradient sum and clip");
  }
  // The next step's batches, made on the host while the GPU still runs this step's backward. A batch
  // that cannot be made (a token id past the vocabulary) is left for the next step to report, after this
  // step's update, as without the prefetch.
  if (step_ + 1 < config_.optimizer().total_steps()) {
    try {
      prefetch_batches(step_ + 1);
    } catch (const std::exception&) {
      prefetched_.reset();
    }
  }
  // The step's one host read.
  auto host = SyncAudit::allowed([&] { return at::cat({sums, norm.view({1}).to(sums.device())}).cpu(); });
  const double* h = host.data_ptr<double>();
  const double loss_sum = h[0], count = h[1], grad_norm = h[3];
  const bool stop_requested = h[2] > 0;
  TORCH_CHECK(count > 0, "trainer: step ", step_ + 1, ": the loss mask selects no token in the global batch");
  TORCH_CHECK(std::isfinite(loss_sum), "trainer: step ", step_ + 1, ": the loss is ", number_text(loss_sum / count),
              "; the parameters were not updated. ", divergence_hint());
  TORCH_CHECK(std::isfinite(grad_norm), "trainer: step ", step_ + 1, ": the gradient norm is ", number_text(grad_norm),
              " (loss ", number_text(loss_sum / count), "); the parameters were not updated. ", divergence_hint());
  const double lr = learning_rate(config_.optimizer(), step_);
  optimizer_->step(lr);
  if (!graphed) ++eager_steps_;
  if (sharded_) sharded_->gather_parameters();
  phase_mark("update");
  ++step_;
  const int64_t tokens = static_cast<int64_t>(dp_) * accum * data.batch_size() * data.seq_len();
  tokens_seen_ += tokens;
  StepStats s;
  s.step = step_;
  s.loss = loss_sum / count;
  s.grad_norm = grad_norm;
  s.lr = lr;
  s.tokens = tokens;
  s.seconds = now_s() - t0;
  s.stop_requested = stop_requested;
  return s;
}

EvalStats Trainer::evaluate() {
  at::NoGradGuard no_grad;
  if (sharded_) sharded_->wait_parameters();
  const int64_t batches = config_.data().eval_batches();
  // Per rank: [Σ ce·mask, Σ mask, correct]; per sequence (summed over sp): [masked, correct].
  auto totals = at::zeros({3}, at::kDouble);
  double sequences = 0, sequences_correct = 0;
  for (int64_t e = 0; e < batches; ++e) {
    auto whole = batch_for(e, 0, true);
    at::Tensor per_seq;  // [B,2]
    for (int j = 0; j < (segments_ ? segments_->per_rank() : 1); ++j) {  // ordered segments in order
      auto [batch, ctx] = segments_ ? segment_of(whole, j) : std::pair{whole, context(whole)};
      // Chunk by chunk (chunked_loss.h): the losses and the argmax tokens, never the [B,T,V] logits.
      LinearCrossEntropy r;
      {
        AutocastScope autocast(device_.type(), at::kBFloat16, bf16_);
        r = model_.loss_sum(batch.tokens, batch.targets, {}, ctx, /*predictions=*/true);
      }
      const auto& ce = r.token_losses;
      auto w = batch.loss_mask.to(ce.options());
      auto right = (r.predictions == batch.targets).logical_and(batch.loss_mask).to(at::kDouble);
      auto part = at::stack({batch.loss_mask.to(at::kDouble).sum(1), right.sum(1)}, 1).cpu();
      per_seq = per_seq.defined() ? per_seq + part : part;
      totals += at::stack({(ce * w).sum().to(at::kDouble).cpu(), w.sum().to(at::kDouble).cpu(),
                           right.sum().cpu()});
    }
    all_reduce(per_seq, /*sp_only=*/true);
    auto masked = per_seq.select(1, 0), correct = per_seq.select(1, 1);
    auto has = masked > 0;
    double n_seq = has.sum().item<double>();
    double n_ok = (has.logical_and(correct == masked)).sum().item<double>();
    // Sequences count once per dp rank: only sp rank 0 contributes them to the world sum below.
    if (sp_rank_ == 0) sequences += n_seq, sequences_correct += n_ok;
  }
  auto all = at::cat({totals, at::tensor({sequences, sequences_correct}, at::kDouble)});
  all_reduce(all);
  EvalStats r;
  double count = all[1].item<double>();
  r.positions = static_cast<int64_t>(count);
  r.loss = count > 0 ? all[0].item<double>() / count : 0;
  r.accuracy = count > 0 ? all[2].item<double>() / count : 0;
  r.sequence_accuracy = all[3].item<double>() > 0 ? all[4].item<double>() / all[3].item<double>() : 0;
  return r;
}

// ---- checkpoints ----

}  // namespace carry
