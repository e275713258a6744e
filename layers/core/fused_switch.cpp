// The fused-ops switch (fused_switch.h).
#include "layers/core/fused_switch.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace carry {
namespace {
std::atomic<bool>& state() {
  static std::atomic<bool> s{true};
  return s;
}
}  // namespace

bool fused_ops_enabled() { return state().load(); }

void set_fused_ops(bool enabled) { state().store(enabled); }

}  // namespace carry
