// Relay along the ranks: rank r receives rows from rank r−1, builds what it passes on from those rows and
// its own, and sends that to rank r+1 — a prefix that grows in rank order (softmax attention's global
// tokens and summary columns with the window's halo, layers/softmax_attn/softmax_attn.h). Forward: receive
// from r−1, then send to r+1; backward: receive the gradient of what was sent from r+1, then send the
// gradient of what was received to r−1. One message a rank in each direction, in the order of the ordered
// scan, so it also runs over ordered segments (parallel/segments.h), which have no collectives.
// Differentiable in the rows and the received; every rank calls it, and runs the backward, in the same order.
#pragma once

#include "parallel/process_group.h"

namespace carry::parallel {

// rows: this rank's [B, T, C]. index: [B, N] int64 on the CPU, the rows sent to rank r+1, each an index into
// cat(received, rows) along dim 1 (−1: a zero row); ignored on the last rank. incoming_rows: the N of rank
// r−1's index (0 on rank 0). Returns the received [B, incoming_rows, C]. The communicator must outlive the
// backward.
Tensor relay_exchange(Communicator& sp, const Tensor& rows, const Tensor& index, int64_t incoming_rows);

}  // namespace carry::parallel
