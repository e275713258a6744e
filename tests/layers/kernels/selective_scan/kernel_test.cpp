// The selective-scan kernels (layers/kernels/selective_scan/, through the autograd op of op.h) against the
// token recurrence in fp64 on the GPU (reference.h) on the same inputs rounded to the kernel's dtype: y, h_T
// and the gradients of u, Δ, A, B, C and h0 for the loss Σ y·dy + Σ h_T·dh_T with random dy, dh_T (rounded
// to y's dtype and to fp32, as the kernel receives them).
// Max-norm relative error ≤ 1e-4 for fp32 inputs, ≤ 1e-2 for bf16. B = 2, T ∈ {1, 63, 200, 1000},
// D ∈ {5, 64, 200}, N ∈ {4, 16}; the segments chosen by the grid, one segment, and 3 asked for. Realistic
// inputs (Δ a softplus, A = −exp(·), a nonzero h0). Outputs and intermediates are poisoned (NaN) before
// each run so that unwritten elements show. With serial states (one segment) a sequence cut at any token,
// the second piece from the first's final state, gives the bits of the whole: y, h_T, the gradients of u,
// Δ, B, C and h0 (dA, a sum over the tokens split with the sequence, to 1e-5). Skips itself without a GPU
// (and on builds without CUDA). Inputs it does not take are refused with a message that says what it takes.
#include "framework/cli/mixer_check.h"
#include "layers/core/device.h"
#include "tests/layers/kernels/selective_scan/reference.h"

#ifdef CARRY_WITH_CUDA
#include "layers/kernels/selective_scan/api.h"
#include "layers/kernels/selective_scan/op.h"
#endif

#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

namespace carry::testing::selective_scan {
namespace {

#ifdef CARRY_WITH_CUDA
// The scan's inputs in the kernel's dtypes on the GPU: u, Δ, B, C in `dt`, A and h0 fp32.
ScanInputs on_gpu(const ScanInputs& in, at::ScalarType dt) {
  return ScanInputs{in.u.to(at::kCUDA, dt),      in.delta.to(at::kCUDA, dt), in.A.to(at::kCUDA, at::kFloat),
                    in.B.to(at::kCUDA, dt),      in.C.to(at::kCUDA, dt),     in.h0.to(at::kCUDA, at::kFloat)};
}

// y, h_T, then du, dΔ, dA, dB, dC, dh0 for Σ y·dy + Σ h_T·dh; kernel or the fp64 token recurrence on
// the same values.
std::vector<at::Tensor> run(const ScanInputs& in, const at::Tensor& dy, const at::Tensor& dh, bool kernel,
                            bool serial_states = false) {
  std::vector<at::Tensor> leaves;
  for (const at::Tensor* t : {&in.u, &in.delta, &in.A, &in.B, &in.C, &in.h0}) {
    at::Tensor x = t->detach();
    if (!kernel) x = x.to(at::kDouble);
    leaves.push_back(x.requires_grad_(true));
  }
  auto [y, h] = kernel ? selective_scan_kernel(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5],
                                               serial_states)
                       : token_recurrence(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5]);
  auto g = torch::autograd::grad({(y.to(at::kDouble) * dy).sum() + (h.to(at::kDouble) * dh).sum()}, leaves);
  std::vector<at::Tensor> r{y.detach(), h.detach()};
  for (auto& x : g) r.push_back(x);
  return r;
}
#endif

const char* const kNames[] = {"y", "h_final", "du", "ddelta", "dA", "dB", "dC", "dh0"};

TEST(SelectiveScanKernel, MatchesTheTokenRecurrence) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  namespace ss = carry::kernels::selective_scan;
  ss::selective_scan_set_poison(true);
  for (int64_t T : {1, 63, 200, 1000})
    for (int64_t D : {5, 64, 200})
      for (int64_t N : {4, 16}) {
        const ScanInputs in = scan_inputs(2, T, D, N, 31 + T + D + N);
        auto gen = at::make_generator<at::CPUGeneratorImpl>(5 + T);
        const at::Tensor dy = at::randn({2, T, D}, gen, at::kDouble).to(at::kCUDA);
        const at::Tensor dh = at::randn({2, D, N}, gen, at::kDouble).to(at::kCUDA);
        for (auto dt : {at::kFloat, at::kBFloat16}) {
          const ScanInputs low = on_gpu(in, dt);
          ASSERT_TRUE(selective_scan_kernel_supports(low.u, low.delta, low.A, low.B, low.C));
          // The output gradients as the kernel receives them (y's in its dtype, h_T's in fp32).
          const at::Tensor dyr = dy.to(dt).to(at::kDouble), dhr = dh.to(at::kFloat).to(at::kDouble);
          const auto ref = run(low, dyr, dhr, /*kernel=*/false);
          for (int segments : {0, 1, 3}) {
            ss::selective_scan_set_segments(segments);
            const auto ker = run(low, dyr, dhr, /*kernel=*/true);
            ASSERT_EQ(ker.size(), ref.size());
            const double bound = dt == at::kFloat ? 1e-4 : 1e-2;
            std::string line;
            for (size_t i = 0; i < ref.size(); ++i) {
              ASSERT_TRUE(ker[i].defined()) << kNames[i];
              EXPECT_TRUE(at::isfinite(ker[i]).all().item<bool>()) << kNames[i] << " has NaN (unwritten?)";
              const double e = rel_err(ker[i].to(at::kDouble), ref[i]);
              EXPECT_LE(e, bound) << kNames[i] << " " << dt << " T=" << T << " D=" << D << " N=" << N
                                  << " segments " << segments;
              char buf[48];
              std::snprintf(buf, sizeof buf, " %s %.1e", kNames[i], e);
              line += buf;
            }
            std::cout << "[ errors   ] " << dt << " T=" << T << " D=" << D << " N=" << N << " segments "
                      << segments << ":" << line << "\n";
          }
        }
      }
  ss::selective_scan_set_segments(0);
  ss::selective_scan_set_poison(false);
#endif
}

TEST(SelectiveScanKernel, SerialStatesGiveTheBitsOfTheWhole) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  const int64_t Bs = 2, T = 200, D = 64;
  for (int64_t N : {4, 16})
    for (auto dt : {at::kBFloat16, at::kFloat}) {
      const ScanInputs low = on_gpu(scan_inputs(Bs, T, D, N, 3 + N), dt);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
      const at::Tensor dy = at::randn({Bs, T, D}, gen, at::kDouble).to(at::kCUDA);
      const at::Tensor dh = at::randn({Bs, D, N}, gen, at::kDouble).to(at::kCUDA);
      const auto whole = run(low, dy, dh, /*kernel=*/true, /*serial_states=*/true);
      for (int64_t cut : {1, 63, 64, 150, 199}) {
        std::vector<at::Tensor> leaves;
        for (const at::Tensor* t : {&low.u, &low.delta, &low.A, &low.B, &low.C, &low.h0})
          leaves.push_back(t->detach().requires_grad_(true));
        auto piece = [&](int64_t t0, int64_t t1, const at::Tensor& h0) {
          auto part = [&](int i) { return leaves[i].narrow(1, t0, t1 - t0); };
          return selective_scan_kernel(part(0), part(1), leaves[2], part(3), part(4), h0, /*serial_states=*/true);
        };
        auto [y1, h1] = piece(0, cut, leaves[5]);
        auto [y2, h2] = piece(cut, T, h1);
        const at::Tensor y = at::cat({y1, y2}, 1);
        auto g = torch::autograd::grad({(y.to(at::kDouble) * dy).sum() + (h2.to(at::kDouble) * dh).sum()}, leaves);
        std::vector<at::Tensor> cut_run{y.detach(), h2.detach()};
        for (auto& x : g) cut_run.push_back(x);
        size_t unequal = 0;
        std::string which;
        for (size_t i = 0; i < whole.size(); ++i) {
          if (std::string(kNames[i]) == "dA") {
            EXPECT_LE(rel_err(cut_run[i], whole[i]), 1e-5) << dt << " N=" << N << " cut at " << cut;
            continue;
          }
          if (!at::equal(cut_run[i], whole[i])) ++unequal, which += std::string(" ") + kNames[i];
        }
        std::cout << "[ errors   ] " << dt << " N=" << N << " cut at " << cut << ": " << unequal
                  << " tensors differ" << which << "; dA " << rel_err(cut_run[4], whole[4]) << "\n";
        EXPECT_EQ(unequal, 0u) << dt << " N=" << N << " cut at " << cut << ":" << which;
      }
    }
#endif
}

TEST(SelectiveScanKernel, RefusesInputsItDoesNotTake) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  const ScanInputs ok = on_gpu(scan_inputs(1, 8, 5, 4, 1), at::kFloat);
  auto refused = [&](const ScanInputs& in, const std::string& needle) {
    try {
      selective_scan_kernel(in.u, in.delta, in.A, in.B, in.C, in.h0);
      ADD_FAILURE() << "accepted; expected an error naming '" << needle << "'";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  ScanInputs bad = on_gpu(scan_inputs(1, 8, 5, 5, 1), at::kFloat);  // N = 5
  refused(bad, "N in {4, 8, 16}; got u [1, 8, 5] Float on cuda:0, delta [1, 8, 5] Float, A [5, 5]");
  bad = ok;
  bad.delta = ok.delta.to(at::kBFloat16);  // mixed dtypes
  refused(bad, "delta [1, 8, 5] BFloat16");
  bad = ok;
  bad.u = ok.u.cpu(), bad.delta = ok.delta.cpu(), bad.B = ok.B.cpu(), bad.C = ok.C.cpu();
  refused(bad, "got u [1, 8, 5] Float on cpu");
  bad = ok;
  bad.h0 = ok.h0.narrow(2, 0, 2);  // [1,5,2] for N = 4
  refused(bad, "initial_state must be contiguous fp32 [1,5,4] on cuda:0; got [1, 5, 2]");
#endif
}

}  // namespace
}  // namespace carry::testing::selective_scan
