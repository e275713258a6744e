// The ordered segments' gradient sum, started during the backward (parallel/segments.h, tree_sum).
//
// With one segment a rank, a step's weight gradients are tree_sum({flat gradients}, sp): the ranks
// exchange the whole flat buffer once the backward is over, and the step waits for it (0.5 GB at the
// 125M presets, 1.5 GB at 340M). The buffer is elementwise, so it can travel in buckets: a bucket (a
// run of whole parameters, in the flat order) goes as soon as the backward has produced all of its
// gradients, while the backward runs on. Each element still meets the same partner's element in the
// same rounds of the same tree, so the sum has tree_sum's bits (two ranks: one in-place all-reduce a
// bucket, one addition an element, as tree_sum does over two).
//
// When a gradient is final: autograd adds every contribution to a leaf before its AccumulateGrad runs
// once a backward, so a parameter's post-accumulate hook fires once, with its whole gradient. That is
// checked, not assumed: the first backward only counts the hooks (and is summed the plain way), and the
// buckets go early from the next step on only if every rank saw each parameter's hook at most once.
// A parameter without a gradient in that step (unused) is not waited for: its part is zeros.
//
// Buckets go in a fixed order (the last bucket first: the backward finishes the last layers first), so
// every rank issues the same messages in the same order on `comm`, which must be a communicator of its
// own (NCCL: its own stream), or the state chain's messages would queue behind gradient buckets. On
// CUDA the buckets' messages and sums run on a side stream, so the backward's stream never waits for
// them; finish() makes the caller's stream wait.
//
// Over two GPUs of one host the buckets can go by the copy engines instead of NCCL's kernels
// (use_copy_engines, parallel/peer_sum.h): no SM is taken from the backward while a bucket waits for
// the other rank. The same bits: each element is still one addition of the two ranks' values.
#pragma once

#include "layers/blocks/parameters.h"
#include "parallel/process_group.h"

#include <memory>
#include <vector>

namespace carry::parallel {

class OverlappedGradientSum {
 public:
  // `params`: the parameters in the flat order (every rank the same); `comm`: the sp group's
  // communicator for gradients, a power of two of ranks; buckets of about `bucket_bytes`.
  OverlappedGradientSum(NamedParameters params, std::shared_ptr<Communicator> comm, int64_t bucket_bytes);
  ~OverlappedGradientSum();
  OverlappedGradientSum(const OverlappedGradientSum&) = delete;
  OverlappedGradientSum& operator=(const OverlappedGradientSum&) = delete;

  // Before the backward whose gradients are to be summed: clears the parameters' gradients' record and
  // arms the hooks. Until the hooks are known to fire once (see the top), they only count.
  void begin();
  // After that backward: the flat gradients summed over `comm` (tree_sum's bits), on the caller's
  // stream. The parameters' own gradients are left as the backward wrote them.
  Tensor finish();
  // Whether the buckets went during the backward (false on the first, counting step, or if a parameter's
  // hook fired twice somewhere).
  bool overlapping() const;
  // Collective, before the first begin(): the buckets go by the copy engines (two ranks of one host,
  // NCCL, CUDA). "" if so; otherwise why not, and the buckets stay on the communicator.
  std::string use_copy_engines();
  bool copy_engines() const;
  // With timing on (CUDA): the GPU time the caller's stream stood still in finish() for the sums the
  // backward did not hide, summed over the finished steps since the last call.
  void set_timing(bool on);
  double take_waited_seconds();

  struct State;  // shared with the hooks

 private:
  std::shared_ptr<State> state_;
};

}  // namespace carry::parallel
