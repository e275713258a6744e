// Ordered segments (parallel.segments): what makes the ordered scan give the same bits on any number
// of ranks (README.md, Design §3).
//
// The chunk operations of the ordered chain are the same wherever a sequence is cut, but a training
// step also sums over tokens: every weight gradient and the loss. One GEMM over T tokens and two
// over T/2 added afterwards round differently, so sp = 2 and sp = 1 drift apart from the second step.
// Segments fix the cut instead: the sequence is cut into N equal segments, the same for every layout;
// sp rank r holds segments [r·k, (r+1)·k), k = N/sp, and runs them one after another (forward in
// order, backward in reverse), each with its own loss sum and weight gradients, as N ranks would. The
// N partial sums then meet in one fixed binary tree over the segment indices (tree_sum). So every
// layout with the same N (sp = 1 with N segments, sp = N with one each, ...) computes the same
// operations on the same values: the same bits.
//
// Inside one rank the segments talk through SegmentCommunicator: it stands for N virtual ranks, the
// messages between two segments of this rank wait in a mailbox, the others go to the real rank.
// Segments of one rank run one after another, so k > 1 serializes what k ranks would overlap; k = 1
// (N = sp) is the fast layout, k > 1 the reference runs on fewer GPUs.
#pragma once

#include "parallel/process_group.h"

#include <map>
#include <memory>
#include <mutex>
#include <tuple>

namespace carry::parallel {

class SegmentCommunicator final : public Communicator {
 public:
  // `sp`: this rank's sp group (null: one rank); `per_rank`: the segments each rank holds;
  // `device`: where messages between this rank's segments live.
  SegmentCommunicator(std::shared_ptr<Communicator> sp, int per_rank, at::Device device);

  // The local segment (0..per_rank−1) the following calls, and the backward they start, run for.
  void set_segment(int j);
  int segment() const { return segment_; }
  int per_rank() const { return per_rank_; }
  Communicator* sp() const { return sp_.get(); }

  int rank() const override { return sp_rank_ * per_rank_ + segment_; }
  int size() const override { return sp_size_ * per_rank_; }
  int world_rank_of(int r) const override;
  std::string backend() const override;
  at::Device device() const override { return device_; }
  const CommOptions& options() const override { return sp_ ? sp_->options() : options_; }

  // Between two segments of this rank: through the mailbox (a receive finds what the earlier segment
  // sent, since segments run in order); otherwise the real rank's send_recv.
  void send_recv(const Tensor& out, int dst, Tensor& in, int src, int tag) override;
  // Collectives are not defined over segments (they would need all segments at once): these throw.
  std::vector<Tensor> all_gather(const Tensor& t) override;
  void all_reduce_sum(Tensor& t) override;
  void broadcast(Tensor& t, int root) override;
  void barrier() override;
  void synchronize() override {
    if (sp_) sp_->synchronize();
  }
  // The real rank's waits (between segments of one rank nothing waits).
  void set_wait_timing(bool on) override {
    if (sp_) sp_->set_wait_timing(on);
  }
  double take_waited_seconds() override { return sp_ ? sp_->take_waited_seconds() : 0; }
  std::map<std::string, double> take_waits_by_kind() override {
    return sp_ ? sp_->take_waits_by_kind() : std::map<std::string, double>{};
  }
  std::vector<std::pair<std::string, double>> take_wait_sequence() override {
    return sp_ ? sp_->take_wait_sequence() : std::vector<std::pair<std::string, double>>{};
  }
  HostCalls take_host_calls() override { return sp_ ? sp_->take_host_calls() : HostCalls{}; }

 private:
  bool local(int r) const { return r / per_rank_ == sp_rank_; }
  std::shared_ptr<Communicator> sp_;
  int per_rank_, sp_rank_, sp_size_;
  int segment_ = 0;
  at::Device device_;
  CommOptions options_;
  std::mutex mutex_;  // the autograd engine may run a backward on its own thread
  std::map<std::tuple<int, int, int>, std::vector<Tensor>> mailbox_;  // (src, dst, tag) -> in order
};

// Σ of the N = sp·k partial sums `local` (this rank's k segments in order; the same shape and dtype
// on every rank) by one binary tree over the segment indices: [a, b) adds [a, m) and [m, b) at
// m = a + the largest power of two below b − a. With k a power of two, this rank's segments are one
// subtree; the ranks' subtrees meet over `sp` (null: one rank) by recursive doubling when sp is a
// power of two, else by an all_gather. Every rank gets the same bits, for every sp with the same N.
// Two ranks add their subtrees with one all_reduce_sum: each element is then one addition of the two,
// which rounds the same in either order, so it is the tree's sum, in less time than an exchange of
// whole buffers and an add (NCCL's all-reduce moves half each way). The sum may be written over
// local's tensors (a rank with one segment: its only partial sum).
Tensor tree_sum(const std::vector<Tensor>& local, Communicator* sp);

// tree_sum in two halves, for the update split over the sp group (framework/train/sharded_update.h).
// The partial sums are 1-D buffers of P = sp->size() (a power of two) equal pieces. After
// tree_reduce_scatter, piece tree_piece(rank, P) of the returned buffer holds tree_sum's bits for those
// elements and the other pieces are unspecified; tree_all_gather then gives every rank every piece from
// the rank holding it. Two ranks: one reduce-scatter and one all-gather (half an all-reduce each);
// more: the halving rounds and the gathering rounds of tree_sum's large-buffer form. The result may be
// written over local's tensors (a rank with one segment: its only partial sum).
int tree_piece(int rank, int P);
Tensor tree_reduce_scatter(const std::vector<Tensor>& local, Communicator* sp);
void tree_all_gather(Tensor& flat, Communicator* sp);

}  // namespace carry::parallel
