// A profiler trace of chosen training steps: CARRY_TRACE=DIR records the steps in CARRY_TRACE_STEPS
// ("A:B", 1-based and inclusive, or "A"; default "3:4": past the first steps' allocations and autotuning)
// with PyTorch's Kineto profiler: on GPUs every kernel, copy and memset with its stream (and the CPU's
// ATen calls with CARRY_TRACE_CPU=1), on CPUs the ATen calls, and writes one Chrome-trace JSON a
// rank, DIR/trace_rank<r>.json (chrome://tracing, ui.perfetto.dev, or tools/trace_summary for the
// busy and idle time of each rank's streams).
// Nothing is recorded without CARRY_TRACE. Recording slows the traced steps; the other steps do not
// pay for it.
#pragma once

#include <cstdint>
#include <string>

namespace carry {

class StepTrace {
 public:
  // Reads CARRY_TRACE and CARRY_TRACE_STEPS; a malformed CARRY_TRACE_STEPS throws with what it expects.
  StepTrace(int rank, bool cuda);
  ~StepTrace();
  bool enabled() const { return !dir_.empty(); }
  // Around train_step(): `step` is the 1-based number of the step about to run / just run.
  void before_step(int64_t step);
  void after_step(int64_t step);
  // The range, as "steps A..B to DIR", for the run's log.
  std::string describe() const;

 private:
  std::string dir_;
  int64_t first_ = 3, last_ = 4;
  int rank_ = 0;
  bool cuda_ = false;
  bool on_ = false;
};

}  // namespace carry
