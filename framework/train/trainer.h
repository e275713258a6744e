// The training loop (README.md, Design §4): a dp × sp grid of ranks, every rank holding the full parameters.
// Per step:
//   batch     dp rank d takes sequences [d·A·B, (d+1)·A·B) of the step's global batch of dp·A·B
//             (A = optimizer.grad_accum_steps micro-batches of B = data.batch_size, forward and
//             backward one after another, gradients summed); every sequence is a pure function of
//             (seed, step, global index): MQAR / needle draw it, token files pick a window
//             (framework/data/token_dataset.h); sp rank r keeps tokens [r·T/P, (r+1)·T/P);
//   forward   the model in the slice context of parallel::make_slice_context (the state scan over the
//             sp communicator in the config's scan_mode, the halo exchange; sp == 1: the plain
//             forward of each family);
//   loss      the global mean Σ ce·mask / Σ mask over all dp × sp ranks: Σ mask is all-reduced first,
//             each rank back-propagates its own Σ ce·mask / N_global (the sp backward passes the
//             state gradients between the sp ranks), so the gradients summed over all ranks are
//             those of the global loss;
//   update    all-reduce (sum) of the flattened gradients over the world, clip to grad_clip, AdamW
//             with the learning rate of optimizer.schedule (a function of the step).
// Checkpoints (framework/io/checkpoint.h): rank 0 writes model + optimizer every checkpoint.every_steps
// and at the end; a run starts from the newest valid checkpoint of checkpoint.dir as
// checkpoint.resume says (AUTO, REQUIRED, NEVER) and continues bit-identically (the batches depend
// only on the step, the state is stored exactly), after comparing the checkpoint's config with its
// own. Rank 0 prints one log line per logging.every_steps and appends a JSON line to
// logging.metrics_file; every logging.eval_every_steps it evaluates data.eval_batches fixed held-out
// batches (split "eval") and prints the loss and the accuracy at the masked positions.
// Reliability (README.md, "Reliability"): before the first step rank 0 locks checkpoint.dir, checks
// that it and logging.metrics_file can be written and have room; every write is checked after.
#pragma once

#include "framework/config/config.h"
#include "framework/model/model.h"
#include "framework/train/optimizer.h"
#include "framework/train/sharded_update.h"
#include "framework/train/step_graph.h"
#include "layers/core/device.h"
#include "parallel/gradient_sum.h"
#include "parallel/process_group.h"
#include "parallel/segments.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace carry {

struct CheckpointData;  // framework/io/checkpoint.h
class CheckpointDirLock;
class TokenDataset;     // framework/data/token_dataset.h
struct StepStats;

// The peak rates the MFU estimate divides by (per rank): an assumed figure, not a measurement.
constexpr double kAssumedCpuPeakFlopsPerRank = 1.0e11;  // one x86 core, fp32 FMA: ~100 GFLOP/s
constexpr double kAssumedGpuPeakFlopsPerRank = 9.89e14; // H100 SXM, dense bf16

struct TrainerOptions {
  // Parameter dtype (fp32 for training; fp64 for exactness tests). Undefined device = pick: CUDA
  // device local_rank when the build has CUDA and GPUs are present, else the CPU.
  at::ScalarType dtype = at::kFloat;
  bool force_cpu = false;
  // Where rank 0 prints its lines (nullptr: silent).
  std::FILE* log = stdout;
  // Called by run() on every rank after each step (progress hooks, tests).
  std::function<void(const StepStats&)> on_step;
  // Limits of one run() (0 = none): after max_steps steps, or the first step that ends past
  // max_minutes, run() stops as on a stop signal (checkpoint, kExitStoppedBySignal). The schedule
  // still runs to optimizer.total_steps: the next invocation continues it.
  int64_t max_steps = 0;
  double max_minutes = 0;
  // Resume from a checkpoint whose config differs from this run's in the seed, the model, the data or
  // the optimizer (carry train --allow-config-change): each difference is printed. Without it such a
  // resume is refused, listing the differences.
  bool allow_config_change = false;
};

// run()'s return value when a stop signal or a limit ended the run early (after a checkpoint): EX_TEMPFAIL,
// "run the same command again to continue".
constexpr int kExitStoppedBySignal = 75;

struct StepStats {
  int64_t step = 0;           // steps done after this one
  double loss = 0;            // global mean loss of the step
  double grad_norm = 0;       // global gradient norm before clipping
  double lr = 0;
  int64_t tokens = 0;         // tokens of the step's global batch
  double seconds = 0;
  // Some rank had received a stop signal (SIGTERM, SIGINT, SIGHUP, SIGUSR1) when the step's loss was summed
  // over the ranks: the same on every rank, so all of them stop after the same step.
  bool stop_requested = false;
};

struct EvalStats {
  double loss = 0;
  double accuracy = 0;           // masked positions predicted right / masked positions
  double sequence_accuracy = 0;  // sequences with every masked position right / sequences
  int64_t positions = 0;
};

class Trainer {
 public:
  // `groups`: the dp × sp grid (its layout must equal config.parallel's), or null for one process
  // on its own (then dp = sp = 1 is required). The config must be resolved (load_run_config).
  Trainer(const RunConfig& config, std::shared_ptr<parallel::ProcessGroups> groups,
          TrainerOptions options = {});

  // Loads the newest valid checkpoint of checkpoint.dir as checkpoint.resume says; returns whether it
  // did. AUTO: the checkpoint if there is one, else step 0, saying why on stderr (no directory, none
  // there yet, or none valid: those are kept); REQUIRED: throws when there is none; NEVER: step 0.
  // Throws when the checkpoint's config differs from this run's in what makes a run (seed, model,
  // data, optimizer other than total_steps, the global batch) unless allow_config_change. World
  // rank 0 reads it and broadcasts it to the others (checkpoint.dir need only exist on rank 0's host,
  // where save_checkpoint writes); every rank throws alike. Without a checkpoint, a config's init_from
  // is read the same way (weights only; the run starts at step 0 and resume() returns false).
  bool resume();
  // One optimizer step on the next batch.
  StepStats train_step();
  // The held-out evaluation (every rank calls it).
  EvalStats evaluate();
  // Writes a checkpoint of the current step (rank 0 writes; every rank calls it). No-op without
  // checkpoint.dir. Throws (on every rank, before anything is written or `latest` is touched) when a
  // parameter is not finite, naming the step and the first such tensor.
  void save_checkpoint();
  // The whole run: locks checkpoint.dir (CheckpointDirLock: a second run on it is refused), resumes,
  // checks that checkpoint.dir can take a checkpoint (written, fsynced, room for one) and that
  // logging.metrics_file can be appended to, drops the metrics lines of steps after the checkpoint
  // (a resumed run logs them again), prints the resolved config and the model, trains to
  // optimizer.total_steps with logging, evaluation and checkpoints. Returns 0. While it runs,
  // SIGTERM, SIGINT, SIGHUP and SIGUSR1 (mpirun forwards SIGUSR1 to the ranks) ask for a stop: every rank
  // finishes the step, a checkpoint is written and run() returns kExitStoppedBySignal; a second
  // signal ends the process at once. A non-finite loss or gradient norm throws before the update
  // (the parameters stay those of the last step).
  int run();

  int64_t step() const { return step_; }
  int64_t tokens_seen() const { return tokens_seen_; }
  // With logging.comm_timing PHASES: the time of each phase of the steps since the last call, in seconds,
  // in the order the phases came: "forward", "backward", "gradient sum and clip" (the gradients' sums
  // over ranks and segments, the loss sums, the clipping), "update" (the step's host read and the
  // optimizer) and "between steps" (from one step's end to the next one's start); a step replayed as a
  // CUDA graph (parallel.cuda_graph) has "forward, backward and clip" for its first three. Measured on the
  // device's stream (CUDA events at train_step's phase boundaries, read here, which waits for them) or
  // by the host clock on the CPU. Empty when the timing is off.
  std::vector<std::pair<std::string, double>> take_phase_seconds();
  // The model, its parameters complete (after the split update's gather, when one is in flight).
  const Model& model() const {
    if (sharded_) sharded_->wait_parameters();
    return model_;
  }
  // The byte budget of this rank's deferred head gradient (parallel.deferred_head_gradient_mib where it
  // applies), 0 where none is deferred.
  int64_t deferred_head_bytes() const { return deferred_head_bytes_; }
  const AdamW& optimizer() const { return *optimizer_; }
  // The update split over the sp ranks (parallel.shard_update where it applies), else null.
  ShardedUpdate* sharded_update() const { return sharded_.get(); }
  const RunConfig& config() const { return config_; }
  int rank() const;  // world rank

 private:
  struct Batch {
    at::Tensor tokens, targets, loss_mask;  // this rank's slice [B, T/sp]
    at::Tensor document_starts;             // the whole sequence [B, T], CPU bool (eod_token set), else undefined
  };
  // Micro-batch `micro` (of optimizer.grad_accum_steps) of a step; eval: batch `step` of the evaluation.
  Batch batch_for(int64_t step, int64_t micro, bool eval) const;
  // This step's micro-batches: made ahead by the previous step (prefetch_batches, before its host read,
  // so the host makes and uploads them while the GPU runs that step's backward), or made now. batch_for
  // is a function of the step alone, so a batch made ahead is the batch made now.
  std::vector<Batch> step_batches();
  void prefetch_batches(int64_t step);
  std::optional<std::pair<int64_t, std::vector<Batch>>> prefetched_;
  int64_t grad_accum_steps() const { return std::max<int64_t>(1, config_.optimizer().grad_accum_steps()); }
  void open_token_data();
  // The model context of this rank's slice (sequence parallelism, recomputation).
  ModelContext context() const { return context_; }
  ModelContext context(const Batch& b) const {
    ModelContext c = context_;
    c.document_starts = b.document_starts;
    return c;
  }
  // Segment j of this rank's slice of `b` (parallel/segments.h), with the model context that runs it;
  // the segment communicator is set to it.
  std::pair<Batch, ModelContext> segment_of(const Batch& b, int j) const;
  // Forward and backward of the step's micro-batches over ordered segments (parallel/segments.h);
  // sets `gradients` to every parameter's gradient, flat in parameter order, summed over the sp group
  // by the segment tree (not yet over dp), and returns [Σ ce·mask over the sp group, global Σ mask,
  // stop signals] (fp64, on the device).
  at::Tensor segmented_forward_backward(const std::vector<Batch>& micro, const at::Tensor& stop,
                                        at::Tensor& gradients);
  // The two halves every path of a step runs: the forward of one batch or segment under the run's
  // autocast (Σ ce·mask through the chunked head), and the backward of this rank's share of the mean,
  // Σ ce·mask / the global token count (a device tensor: no host read).
  LinearCrossEntropy forward_loss(const Batch& b, const ModelContext& ctx, int64_t defer_head_bytes = 0);
  static void backward_share(const LinearCrossEntropy& ce, const at::Tensor& token_count);
  ModelContext context_;  // built once (the sp layout is agreed then, not per layer call)
  // Ordered segments (parallel.segments, or sp under the ORDERED scan when that is more than one):
  // the virtual ranks the layers talk through; null: no segments.
  std::shared_ptr<parallel::SegmentCommunicator> segments_;
  // One segment a rank, sp > 1 and parallel.gradient_sum BUCKETS: the weight gradients' tree sum goes in
  // buckets during the backward (parallel/gradient_sum.h). Null otherwise.
  std::unique_ptr<parallel::OverlappedGradientSum> gradient_sum_;
  // The update split over the sp ranks (parallel.shard_update), and the flat gradients' layout (its
  // layout when split, else one piece).
  std::unique_ptr<ShardedUpdate> sharded_;
  std::string update_line_;  // how the update runs over the sp ranks, for the run's header ("" at sp = 1)
  parallel::FlatLayout grad_layout_;
  // Bytes of the loss's last chunks' logit gradients whose head weight gradient waits until the end of
  // the backward (parallel.deferred_head_gradient_mib: ORDERED, sp > 1, one segment a rank, sp ranks
  // after the first); 0: none.
  int64_t deferred_head_bytes_ = 0;
  // parallel.cuda_graph: the step's forward, backward and clipping as one CUDA graph, captured at this
  // process's second step (the first one runs eagerly and initializes what the capture cannot: the
  // libraries' handles, the kernels' attributes); null without it.
  std::unique_ptr<StepGraph> graph_;
  int64_t eager_steps_ = 0;  // steps this process ran without the graph
  // logging.comm_timing PHASES: the GPU time the step's stream waits on the sp group's messages (the state
  // chain, halos, loss sums; the gradients too when they are summed after the backward) and on the
  // gradient buckets after the backward, summed since the last log line (metrics comm_wait_s,
  // gradient_wait_s: the mean over the ranks).
  bool comm_timing_ = false;
  double comm_wait_s_ = 0, gradient_wait_s_ = 0;
  bool wait_order_ = false;  // logging.comm_timing ORDER
  std::vector<std::pair<std::string, double>> last_wait_sequence_;  // the last step's waits one by one (s)
  std::map<std::string, double> waits_by_kind_;  // this rank's, by parallel::message_kind, since the last log line
  bool phase_timing_ = false;  // logging.comm_timing PHASES or order, on any layout (take_phase_seconds)
  struct PhaseSpan {
    std::string phase;
    TimingMark from, to;
  };
  std::vector<PhaseSpan> phase_spans_;  // since the last take_phase_seconds, read there
  std::optional<TimingMark> phase_last_;  // the latest mark
  void phase_mark(const char* phase_ending_here);
  long host_calls_ = 0;      // sp messages this rank enqueued since the last log line (take_host_calls)
  double host_call_s_ = 0;   // and the host seconds it spent enqueuing them
  long host_calls_by_copy_ = 0;  // of host_calls_: by the copy engines (parallel.sp_messages COPY)
  void take_comm_waits();
  void all_reduce(at::Tensor& t, bool sp_only = false) const;
  void log(const char* fmt, ...) const;
  std::string layout_text() const;  // "dp=2 x sp=4"
  std::string divergence_hint() const;  // what to try after a non-finite loss
  // Copies a loaded checkpoint into the model and the optimizer (checking the config, the names and
  // the shapes).
  void apply_checkpoint(const CheckpointData& d);
  // The checkpoint's config against this run's: throws listing what may not change (see resume()).
  void check_config_against(const CheckpointData& d) const;
  // resume(); with `whole_run` (run()) also the lock, the output checks and the metrics trim.
  bool start(bool whole_run);
  // Rank 0, start(true): checkpoint.dir can take a checkpoint (created, a file written and fsynced,
  // room for one); logging.metrics_file can be appended to, and without the lines of the steps after
  // `resumed_from` (the loaded checkpoint, or null).
  void check_checkpoint_dir() const;
  // The run header's data and output lines; the latter writes the resolved config (rank 0) beside the
  // checkpoints and says where.
  std::string data_description() const;
  std::string write_resolved_config() const;
  void prepare_metrics(const CheckpointData* resumed_from) const;
  void warn(const std::string& text) const;  // rank 0: "carry: <text>" on stderr
  // Copies init_from's weights into the model (names and shapes must match); returns its description.
  std::string initialize_from(const std::string& path);

  RunConfig config_;
  std::shared_ptr<parallel::ProcessGroups> groups_;
  TrainerOptions options_;
  at::Device device_ = at::kCPU;
  Model model_;
  std::unique_ptr<AdamW> optimizer_;
  int dp_ = 1, sp_ = 1, dp_rank_ = 0, sp_rank_ = 0;
  bool bf16_ = false;  // precision BF16: forward under bf16 autocast
  int64_t logged_mallocs_ = 0;  // the caching allocator's cudaMalloc count at the last step line
  bool time_is_up_ = false;  // max_minutes passed on this rank (sent with the next step's loss sum)
  int64_t step_ = 0, tokens_seen_ = 0;
  std::string run_id_;  // rank 0: the id of the run its checkpoints carry (new, or the resumed one's)
  std::shared_ptr<CheckpointDirLock> lock_;  // rank 0 during run()
  std::shared_ptr<TokenDataset> train_data_, eval_data_;
};

}  // namespace carry
