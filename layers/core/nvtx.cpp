// NVTX ranges (see nvtx.h).
#include "layers/core/nvtx.h"

#ifdef CARRY_WITH_CUDA
#include <nvtx3/nvToolsExt.h>
#endif

#include <atomic>

namespace carry {

namespace {
std::atomic<NvtxObserver> g_observer{nullptr};
}  // namespace

NvtxRange::NvtxRange(const char* name) {
  if (auto o = g_observer.load(std::memory_order_relaxed)) o(name, true);
#ifdef CARRY_WITH_CUDA
  nvtxRangePushA(name);
#endif
}

NvtxRange::~NvtxRange() {
#ifdef CARRY_WITH_CUDA
  nvtxRangePop();
#endif
  if (auto o = g_observer.load(std::memory_order_relaxed)) o(nullptr, false);
}

void set_nvtx_observer(NvtxObserver observer) { g_observer.store(observer); }

}  // namespace carry
