// The fused-ops switch and its GPU check (layers/core/fused_switch.h).
#include "layers/core/fused_switch.h"

#include "layers/core/device.h"

#include <gtest/gtest.h>

namespace carry {
namespace {

TEST(FusedSwitch, KernelsRunOnHopperOnly) {
  EXPECT_EQ(fused_ops_gpu_message(9, 0, "NVIDIA H200"), "");
  for (auto [major, minor] : {std::pair{8, 0}, {8, 9}, {9, 1}, {10, 0}, {12, 0}, {7, 0}}) {
    const std::string m = fused_ops_gpu_message(major, minor, "GPU X");
    SCOPED_TRACE(m);
    EXPECT_NE(m.find("GPU X"), std::string::npos);                                          // where
    EXPECT_NE(m.find(std::to_string(major) + "." + std::to_string(minor)), std::string::npos);  // what was found
    EXPECT_NE(m.find("sm_90a"), std::string::npos);                                         // what was expected
    EXPECT_NE(m.find("ATen"), std::string::npos);                                           // what runs instead
    EXPECT_EQ(m.find('\n'), std::string::npos);                                             // one line
  }
}

TEST(FusedSwitch, FollowsTheSettingWhereTheKernelsRun) {
  const int cc = cuda_device_count() > 0 ? cuda_compute_capability(0) : 90;
  const bool runs = fused_ops_gpu_message(cc / 10, cc % 10, "x").empty();
  const bool was = fused_ops_enabled();
  set_fused_ops(false);
  EXPECT_FALSE(fused_ops_enabled());
  set_fused_ops(true);
  EXPECT_EQ(fused_ops_enabled(), runs);
  set_fused_ops(was);
}

}  // namespace
}  // namespace carry
