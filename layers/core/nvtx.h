// NVTX ranges: names on a profiler's timeline (Nsight Systems, nsys) for each model layer, mixer core,
// cross-rank scan and collective, so a trace reads "layer 3 gated_deltanet > scan tree gated_deltanet >
// all_gather sp" instead of anonymous kernels. With CUDA (CARRY_WITH_CUDA) a range is
// nvtxRangePushA/nvtxRangePop from NVTX 3 (header-only, shipped with the CUDA toolkit; inert unless
// a profiler is attached). Without CUDA a range costs a branch: nothing is recorded, unless a test has
// set an observer, which then sees every push and pop on its thread's ranges in order.
#pragma once

#include <string>

namespace carry {

class NvtxRange {
 public:
  explicit NvtxRange(const char* name);
  explicit NvtxRange(const std::string& name) : NvtxRange(name.c_str()) {}
  ~NvtxRange();
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

// Tests: called with (name, true) on every push and (nullptr, false) on every pop; null to stop.
using NvtxObserver = void (*)(const char* name, bool push);
void set_nvtx_observer(NvtxObserver observer);

}  // namespace carry
