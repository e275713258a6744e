// The optimizer's update split over the ranks of one sequence (sp), as ZeRO's first stage splits it
// over data-parallel replicas.
//
// Without it every rank of the sp group sums the whole flat gradient over the group (tree_sum: one
// all-reduce over two ranks), clips it and runs AdamW on every parameter: the same update P times.
// Here the ranks reduce-scatter the gradients (tree_reduce_scatter: half an all-reduce's bytes over
// two), each clips and updates only the parameters of its piece of the flat layout (parallel/
// flat_layout.h: a run of whole parameters, 1/P of them), then they all-gather the updated parameters
// (tree_all_gather: the other half). The same bytes on the wire as the all-reduce; 1/P of the update's
// and the clipping's passes over memory on each rank (at Gated DeltaNet 125M on an H200 the update is
// about 1.4 ms of an 88 ms step).
//
// The same bits as the update on every rank: each summed element is tree_sum's; AdamW is elementwise;
// the clipping's norm is assembled from per-tensor parts (gradient_norm_parts), each rank computing
// its own parameters' parts into a zero vector of all of them, the vectors summed over the group (each
// entry one part and zeros: exact) and added up as clip_grad_norm_on_device adds them.
//
// The parameters live in a flat buffer of the layout (every parameter a view, rebound with set_data), so
// that a gather is one collective. AdamW's moments are held only for this rank's piece (a flat buffer of
// the piece, every moment a view): each rank keeps 1/P of the moments, which are twice the parameters'
// size in their dtype. whole_optimizer_state() gathers them to rank 0's host memory, a piece at a time,
// when a checkpoint is written; a resumed run hands each rank the whole moments and it keeps its piece
// (AdamW::load_state).
//
// With data-parallel replicas (a dp communicator of a power of two of ranks), each sp piece is split
// again over the replicas: the layout has sp·dp pieces, sp piece j being pieces [j·dp, (j+1)·dp). The
// replicas sum their sp piece's gradients as before (the same bits), each rank clips and updates its
// dp sub-piece only and holds only its moments (1/(sp·dp) of them), the updated sub-pieces are
// all-gathered over dp, then the sp pieces over sp. The clipping norm's parts come from every rank of
// the world (each parameter's from the one rank that updates it).
//
// On CUDA the parameters' all-gather runs on a side stream and the next step does not wait for it at
// once: its forward waits (before_block, ModelContext::before_block) at the first block that reads a
// parameter of another rank's piece. At sp = 2 the first rank's piece holds the embedding and the first
// blocks, so the first rank starts its next forward at once, and its first state reaches the last rank
// sooner; the last rank waits for the gather before its embedding as before. Everything else that reads
// the parameters (evaluation, checkpoints, the trainer's model()) calls wait_parameters() first.
// parallel.gather_overlap: false makes the step wait for the gather at its end instead.
#pragma once

#include "framework/train/optimizer.h"
#include "layers/blocks/parameters.h"
#include "parallel/flat_layout.h"
#include "parallel/process_group.h"

#include <memory>

namespace carry {

// Every parameter's gradient copied into one buffer of `layout` (zeros where a parameter has none and
// in the gaps).
at::Tensor flat_gradients(const NamedParameters& params, const parallel::FlatLayout& layout);
// The inverse for parameters [first, last): each one's gradient becomes its view of `buffer` (the
// buffer is the step's own; the next backward starts from no gradients). last < 0: to the end.
void set_gradients(const NamedParameters& params, const at::Tensor& buffer, const parallel::FlatLayout& layout,
                   int first = 0, int last = -1);

class ShardedUpdate {
 public:
  // Whether the update can be split over `sp`: a power of two of ranks above one, and every parameter of
  // one dtype and device. "" if so, else why not.
  static std::string unavailable(const NamedParameters& params, const parallel::Communicator* sp);
  // Moves the parameters and `optimizer`'s moments into the layout's flat buffers and limits `optimizer`
  // to this rank's piece. `sp` must outlive this object. gather_overlap: on CUDA, the gather runs on a
  // side stream and the next forward waits where it needs another rank's parameters (else the step waits
  // for it at its end).
  // dp (may be null, or of one rank): the data-parallel replicas of this rank's sp group, the same sp
  // rank in each; world: every rank (sp × dp) when dp has more than one.
  ShardedUpdate(NamedParameters params, AdamW& optimizer, parallel::Communicator* sp, bool gather_overlap = true,
                parallel::Communicator* dp = nullptr, parallel::Communicator* world = nullptr);
  // Whether the pieces are split over dp too: "" if so, else why not.
  static std::string dp_unavailable(const parallel::Communicator* dp, const parallel::Communicator* world);
  ~ShardedUpdate();  // waits for a gather in flight (its buffer goes with this object)
  ShardedUpdate(const ShardedUpdate&) = delete;
  ShardedUpdate& operator=(const ShardedUpdate&) = delete;

  const parallel::FlatLayout& layout() const { return layout_; }
  // This rank's piece and the parameters [first, last) it updates.
  int piece() const { return piece_; }
  int first() const { return first_; }
  int last() const { return last_; }
  // The ranks over which the moments are split (sp, times dp where split over it too).
  int ranks() const { return layout_.pieces; }
  // This rank's piece of a flat buffer of the layout.
  at::Tensor mine(const at::Tensor& flat) const;
  // This rank's sp piece of a flat buffer (its piece when not split over dp): what the dp replicas sum.
  at::Tensor sp_piece(const at::Tensor& flat) const;

  // After the gradients' reduce-scatter (tree_reduce_scatter into `flat`; the dp replicas' sum of the
  // sp piece after it, if any): this rank's parameters take their gradients from its piece; the others
  // have none.
  void set_gradients(const at::Tensor& flat) const;
  // Collective over sp (over every rank when split over dp): the global gradient norm
  // (clip_grad_norm_on_device's bits, a 0-dim fp64 tensor on the device), this rank's gradients scaled as
  // it scales them.
  at::Tensor clip(double max_norm) const;
  // Collective over sp (and dp when split over it), after the update: every rank's parameters from the
  // rank that updated them (on CUDA with gather_overlap, finished only for what is enqueued after
  // wait_parameters()).
  void gather_parameters();
  // The current stream waits for the last gather, if it has not yet (const: it only orders streams).
  void wait_parameters() const;
  // The forward's hook (ModelContext::before_block): waits at the first part that reads another rank's
  // parameters. `part`: -1 the embedding, i block i, the block count the final norm and head.
  void before_block(int64_t part) const;
  // The first part whose parameters include another rank's (for the log and tests).
  int64_t first_foreign_part() const { return first_foreign_part_; }
  // Collective over the ranks the moments are split over (sp, or every rank when split over dp): every
  // parameter's moments on the rank of rank 0's group that is its rank 0 (world rank 0 writes the
  // checkpoint), in host memory, named and ordered as AdamW::state() names them; empty on the others. The
  // pieces travel one at a time: a rank needs one more piece of device memory meanwhile.
  std::vector<std::pair<std::string, at::Tensor>> whole_optimizer_state() const;

 private:
  // Every rank's piece of `flat` from the rank holding it: over dp (the sub-pieces), then over sp.
  void gather_pieces(at::Tensor& flat) const;

  NamedParameters params_;
  parallel::Communicator* sp_;
  parallel::Communicator* dp_ = nullptr;     // non-null: the pieces are split over it too
  parallel::Communicator* world_ = nullptr;  // with dp_: every rank, for the clipping norm's parts
  parallel::FlatLayout layout_;
  int sp_piece_ = 0, sub_pieces_ = 1;  // the sp piece and the dp sub-pieces in it
  int piece_ = 0, first_ = 0, last_ = 0;
  int64_t first_foreign_part_ = 0;
  at::Tensor params_flat_, exp_avg_flat_, exp_avg_sq_flat_;
  struct Overlap;  // the side stream and its events (CUDA)
  std::shared_ptr<Overlap> overlap_;
};

}  // namespace carry
