// The fused-ops switch (fused_switch.h).
#include "layers/core/fused_switch.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace carry {
namespace {
std::atomic<int>& state() {  // -1: not read yet, 0: ATen forms, 1: fused ops
  static std::atomic<int> s{-1};
  return s;
}
}  // namespace

bool fused_ops_enabled() {
  int s = state().load();
  if (s < 0) {
    const char* env = std::getenv("CARRY_FUSED_OPS");
    s = (env && std::strcmp(env, "0") == 0) ? 0 : 1;
    int expected = -1;
    if (!state().compare_exchange_strong(expected, s)) s = expected;
  }
  return s == 1;
}

void set_fused_ops(bool enabled) { state().store(enabled ? 1 : 0); }

}  // namespace carry
