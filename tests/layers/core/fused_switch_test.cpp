// The fused-ops switch and its GPU check (layers/core/fused_switch.h).
#include "layers/core/fused_switch.h"

#include "layers/core/device.h"

#include <gtest/gtest.h>

namespace carry {
namespace {

TEST(FusedSwitch, KernelsRunOnHopperAndAllButTheDeltaRulesOnBlackwell) {
  EXPECT_EQ(fused_ops_gpu_message(9, 0, "NVIDIA H200"), "");
  EXPECT_TRUE(fused_ops_run_on(9, 0));
  EXPECT_TRUE(hopper_kernels_run_on(9, 0));
  // sm_100a: the kernels run but the delta rule's, whose layers are named.
  EXPECT_TRUE(fused_ops_run_on(10, 0));
  EXPECT_FALSE(hopper_kernels_run_on(10, 0));
  const std::string b = fused_ops_gpu_message(10, 0, "NVIDIA B200");
  for (const char* part : {"NVIDIA B200", "10.0", "sm_90a", "deltanet, gated_deltanet, gated_deltaproduct and "
                           "loglinear_gdn", "ATen", "sm_100a"})
    EXPECT_NE(b.find(part), std::string::npos) << part << " in: " << b;
  EXPECT_EQ(b.find('\n'), std::string::npos);
  for (auto [major, minor] : {std::pair{8, 0}, {8, 9}, {9, 1}, {10, 3}, {12, 0}, {7, 0}}) {
    const std::string m = fused_ops_gpu_message(major, minor, "GPU X");
    SCOPED_TRACE(m);
    EXPECT_FALSE(fused_ops_run_on(major, minor));
    EXPECT_FALSE(hopper_kernels_run_on(major, minor));
    EXPECT_NE(m.find("GPU X"), std::string::npos);                                          // where
    EXPECT_NE(m.find(std::to_string(major) + "." + std::to_string(minor)), std::string::npos);  // what was found
    EXPECT_NE(m.find("sm_90a"), std::string::npos);                                         // what was expected
    EXPECT_NE(m.find("sm_100a"), std::string::npos);
    EXPECT_NE(m.find("every op runs its ATen form"), std::string::npos);                    // what runs instead
    EXPECT_EQ(m.find('\n'), std::string::npos);                                             // one line
  }
}

TEST(FusedSwitch, FollowsTheSettingWhereTheKernelsRun) {
  const int cc = cuda_device_count() > 0 ? cuda_compute_capability(0) : 90;
  const bool runs = fused_ops_run_on(cc / 10, cc % 10);
  const bool was = fused_ops_enabled();
  set_fused_ops(false);
  EXPECT_FALSE(fused_ops_enabled());
  set_fused_ops(true);
  EXPECT_EQ(fused_ops_enabled(), runs);
  set_fused_ops(was);
  EXPECT_EQ(gpu_runs_hopper_kernels(), cuda_device_count() == 0 || hopper_kernels_run_on(cc / 10, cc % 10));
}

}  // namespace
}  // namespace carry
