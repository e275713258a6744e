// The memory one rank needs for a run (`carry train RUN --dry-run`), before any GPU is touched.
//
// Every rank holds the full parameters, their gradients and AdamW's two moments (fp32: 4 bytes each
// per parameter, whatever the precision; bf16 autocast keeps fp32 masters). Activations are measured,
// not modelled: each distinct layer of the model runs forward once on the CPU in the run's dtype and
// precision, under a counting CPU allocator; what is still allocated when the forward returns (the
// tensors autograd keeps for the backward, and the layer's output) is that layer's activation memory.
// It is measured at the run's data.batch_size and three slice lengths a, a+s, a+2s (multiples of the
// chunk sizes, past any sliding window) and extrapolated to the rank's slice of seq_len/sp tokens by
// the parabola through them (exact for costs linear or quadratic in the length: chunkwise forms are
// linear, full causal attention quadratic; the batch is measured whole, as ATen's cost of B sequences
// is not always B times one). The head (the
// final norm and the chunked head + cross entropy, which keeps the gradients of the hidden states and
// of the head but never the logits) is measured the same way, and so is the peak each
// one's backward allocates on top of what it kept (the gradients of its activations). Peaks:
//   kept:       fixed + Σ layers + head + the larger of the head's and a layer's backward peak;
//   recomputed: fixed + every layer's input (B·t·d fp32 values) + head + the larger of the head's
//               backward peak and (a layer rebuilt + its backward peak);
//   around kept mixers (parallel.recompute_keeps_mixer): as recomputed, plus every layer's mixer core
//               (its stash, measured by running the layer's forward without autograd through one).
// What it does not see: the ATen forms measured here are what the CPU and a GPU without a kernel form
// run; the CUDA kernel forms keep other tensors (their per-chunk states: on an H200 a Gated DeltaNet
// 125M step at 32768 tokens peaked 17.7 GiB kept where this estimates 13.46). The caching allocator's
// fragmentation and NCCL's buffers come on top.
#pragma once

#include "framework/config/config.h"

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace carry {

struct MemoryEstimate {
  int64_t parameters = 0;
  double parameter_bytes = 0, gradient_bytes = 0, optimizer_bytes = 0;
  bool moments_split = false;  // optimizer_bytes is one rank's piece (parallel.shard_update)
  int64_t moment_ranks = 1;    // the ranks the moments are split over (sp, times dp at a power-of-two dp)
  int64_t batch = 0, slice_tokens = 0;  // per rank: sequences a micro-batch, tokens of each (seq_len / sp)
  std::vector<int64_t> measured_at;     // slice lengths measured
  struct Layer {
    int64_t index = 0;
    std::string kind;
    double kept_bytes = 0;      // activations kept for the backward, at batch x slice_tokens
    double backward_bytes = 0;  // the peak its backward allocates on top (gradients of its activations)
    double input_bytes = 0;  // the layer's input: what a recomputed layer keeps
    double core_bytes = 0;   // what its mixer core keeps (parallel.recompute_keeps_mixer), beside the input
  };
  std::vector<Layer> layers;
  double head_bytes = 0, head_backward_bytes = 0;
  double activations_kept = 0, activations_recomputed = 0, activations_keeps_mixer = 0;
  double total_kept = 0, total_recomputed = 0, total_keeps_mixer = 0;
};

// Measures and extrapolates (see the top). `progress` (may be null) gets a line per measured layer kind.
MemoryEstimate estimate_memory(const RunConfig& config, std::FILE* progress = nullptr);
// A table: the parts, per layer, the totals with and without recomputation, and which one the config uses.
std::string memory_report(const MemoryEstimate& m, const RunConfig& config);

// Bytes allocated by the CPU allocator and still alive when `f` returns, and the peak during it
// (counting only allocations made while `f` runs). Used by estimate_memory and its test.
struct CpuAllocation {
  double live_bytes = 0, peak_bytes = 0;
};
CpuAllocation measure_cpu_allocation(const std::function<void()>& f);

// MemAvailable of /proc/meminfo in bytes, or -1 when unknown.
double available_memory_bytes();

// The bytes at `length` tokens from measurements ys at three lengths xs (ascending): the parabola through
// them, but never below the line through the last two (memory grows at least linearly with the slice; a
// parabola bent down by measurement noise would fall far below it hundreds of times past the points) nor
// below the last measurement.
double extrapolate_bytes(const std::vector<double>& xs, const std::vector<double>& ys, double length);

}  // namespace carry
