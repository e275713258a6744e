// Two GPUs of one host adding one flat fp32 buffer by their copy engines (CUDA IPC), for the weight
// gradients' sum during the backward (parallel/gradient_sum.h).
//
// NCCL's all-reduce runs as kernels: a bucket's kernel sits on SMs from the moment its stream reaches it
// until the other rank's arrives, and in the ordered chain the two ranks reach a bucket a reverse walk
// apart, so buckets sent during the backward took SMs from it. Here each rank instead copies its bucket
// into the other rank's receive buffer with cudaMemcpyAsync (a DMA copy over NVLink: no SM), and the
// GPUs signal each other with stream memory operations on flags in each other's memory
// (cuStreamWriteValue32 after a copy, cuStreamWaitValue32 before an add): a waiting stream holds no SM
// either. Each rank then adds the other's bucket to its own, one IEEE addition an element, which rounds
// the same in either order: the bits of NCCL's two-rank all-reduce and of tree_sum over two.
//
// Ordering, per step n (1, 2, ...), buckets in the fixed order the backward sends them:
//   copy stream:  [first bucket of the step: wait until the partner consumed step n-1's]
//                 copy bucket b into the partner's receive buffer; write the partner's `arrived` flag
//   sum stream:   after this rank's copy of b: wait for the partner's `arrived` >= b's number; add b
//   finish:       the caller's stream waits for the sum stream; write the partner's `consumed` = n
// Every flag only grows (a bucket's number is (n-1)·buckets + its position), so a wait can never see a
// stale value as new, and nothing waits on the host.
#pragma once

#include "parallel/process_group.h"

#include <memory>
#include <string>

namespace carry::parallel {

class PeerSum {
 public:
  // Collective over `comm` (both ranks call it): maps a receive buffer of `like`'s size and dtype on
  // each rank into the other's address space. Null where it cannot (not two ranks, not CUDA, the GPUs
  // cannot reach each other, the driver refuses IPC or stream memory operations); `why` then says what
  // failed. Both ranks get the same answer.
  static std::unique_ptr<PeerSum> open(Communicator& comm, const Tensor& like, std::string* why);
  virtual ~PeerSum() = default;

  // A new step's buckets follow (call before the first send of each step).
  virtual void begin_step() = 0;
  // Sends `piece` (this rank's values at element `offset` of the flat buffer) to the partner, then adds
  // the partner's values of the same elements into `piece`, both ordered after the caller's current
  // stream and off it. Both ranks send the same buckets of a step in the same order.
  virtual void exchange_and_add(Tensor piece, int64_t offset) = 0;
  // The caller's current stream waits for every add of the step, then the partner may reuse its buffer.
  virtual void finish_step() = 0;
};

}  // namespace carry::parallel
