// Tests of log-linear Gated DeltaNet's chunk-piece kernels (layers/kernels/log_linear/api.h, chunk_pieces_fwd and
// chunk_pieces_bwd; GPU, skip without one). On random inputs (unit keys, sigmoid β, log decays of half-lives from
// 2 to 10^5 tokens, positive level weights) and random cotangents of every output, the kernels on bf16 inputs
// against the delta rule's ATen chunk pieces (layers/delta_rule/delta_rule.h) in fp32 on the same values, through
// autograd: W, U, K̃, P, γ, the weighted levels inside the chunk, and the gradients of q, k, v, g, β and λ, each
// within 1e-2 of its largest entry; outputs poisoned (NaN) first and found finite; two runs bit for bit.
// The same kernels run on the CPU through the warp emulation (tests/emulation/loglinear_chunk_emu.cpp).
#include "layers/core/device.h"
#include "layers/delta_rule/delta_rule.h"
#include "tests/helpers/mixer_testing.h"

#ifdef CARRY_WITH_CUDA
#include "layers/kernels/delta_rule/api.h"
#include "layers/kernels/log_linear/api.h"
#endif

#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <iostream>

namespace carry::testing {
namespace {

constexpr int64_t kC = 64, kLevels = 7;

// One-hot [C, 7, C] of the pair levels inside a chunk: [t, l, s] = 1 where s ≤ t and bit_width(t xor s) = l.
Tensor pair_levels(const at::TensorOptions& o) {
  auto hot = at::zeros({kC, kLevels, kC}, o.dtype(at::kFloat).device(at::kCPU));
  for (int64_t t = 0; t < kC; ++t)
    for (int64_t s = 0; s <= t; ++s) {
      int64_t x = t ^ s, l = 0;
      while (x) ++l, x >>= 1;
      hot[t][l][s] = 1.0;
    }
  return hot.to(o.device());
}

// The reference: ATen's chunk pieces of fp32 [B,T,H,·] inputs → W, U, K̃, P [B,H,T,·], gamma [B,H,N], o [B,H,T,dv].
std::vector<Tensor> reference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                              const Tensor& lam) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), N = T / kC;
  auto chunked = [&](const Tensor& x) {  // [B,T,H,...] → [B,H,N,C,...]
    auto y = x.transpose(1, 2);
    auto sizes = y.sizes().vec();
    std::vector<int64_t> to{B, H, N, kC};
    to.insert(to.end(), sizes.begin() + 3, sizes.end());
    return y.reshape(to);
  };
  auto p = delta_rule_chunk(chunked(q).reshape({B * H, N, kC, q.size(3)}), chunked(k).reshape({B * H, N, kC, k.size(3)}),
                            chunked(v).reshape({B * H, N, kC, v.size(3)}), chunked(beta).reshape({B * H, N, kC}),
                            chunked(g).reshape({B * H, N, kC}), 1.0, ChunkParts::walk);
  auto lc = lam.reshape({B * H, kLevels, N, kC}).permute({0, 2, 3, 1});  // [BH,N,C,7]
  auto weight = at::einsum("bntl,tls->bnts", {lc, pair_levels(q.options())});
  auto o = at::matmul(p.mixing * weight, chunked(v).reshape({B * H, N, kC, v.size(3)}));
  auto bhtd = [&](const Tensor& x) { return x.reshape({B, H, T, x.size(-1)}); };
  return {bhtd(p.w), bhtd(p.u), bhtd(p.k_out), bhtd(p.query_state), p.gate_last.reshape({B, H, N}), bhtd(o)};
}

TEST(LogLinearChunkPieces, KernelsMatchTheDeltaRulesChunkPiecesOnGpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  namespace ll = carry::kernels::log_linear;
  carry::kernels::delta_rule::gdn_set_poison(true);
  const at::Device dev(at::kCUDA);
  struct Case {
    int64_t B, T, H, dk, dv;
  };
  const char* names[] = {"W", "U", "K̃", "P", "gamma", "o", "dq", "dk", "dv", "dg", "dbeta", "dlam"};
  for (const Case& c : {Case{2, 256, 2, 64, 64}, Case{1, 384, 2, 128, 128}, Case{1, 256, 3, 128, 256},
                        Case{2, 192, 1, 64, 256}, Case{1, 128, 2, 128, 64}, Case{1, 256, 1, 64, 128}}) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(17 + c.T + c.dv);
    auto f32 = at::TensorOptions().dtype(at::kFloat);
    auto q = at::randn({c.B, c.T, c.H, c.dk}, gen, f32);
    auto k = at::randn({c.B, c.T, c.H, c.dk}, gen, f32);
    k = k / k.norm(2, -1, true);
    auto v = at::randn({c.B, c.T, c.H, c.dv}, gen, f32);
    const double lo = std::log(2.0), hi = std::log(1e5);
    auto g = -std::log(2.0) / at::exp(at::rand({c.B, c.T, c.H}, gen, f32) * (hi - lo) + lo);
    auto beta = at::sigmoid(at::randn({c.B, c.T, c.H}, gen, f32));
    auto lam = at::rand({c.B, c.H, kLevels, c.T}, gen, f32) + 0.2;
    // bf16 values for both; the reference computes in fp32
    q = q.to(at::kBFloat16).to(dev), k = k.to(at::kBFloat16).to(dev), v = v.to(at::kBFloat16).to(dev);
    g = g.to(dev), beta = beta.to(dev), lam = lam.to(dev);
    const int64_t N = c.T / kC;
    std::vector<Tensor> cot{at::randn({c.B, c.H, c.T, c.dk}, gen, f32), at::randn({c.B, c.H, c.T, c.dv}, gen, f32),
                            at::randn({c.B, c.H, c.T, c.dk}, gen, f32), at::randn({c.B, c.H, c.T, c.dk}, gen, f32),
                            at::randn({c.B, c.H, N}, gen, f32), at::randn({c.B, c.H, c.T, c.dv}, gen, f32)};
    for (auto& t : cot) t = t.to(dev);
    for (size_t i : {0, 1, 2, 3, 5}) cot[i] = cot[i].to(at::kBFloat16).to(at::kFloat);  // what the kernels read

    std::vector<Tensor> in{q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), g, beta, lam};
    for (auto& t : in) t = t.detach().requires_grad_(true);
    auto ref = reference(in[0], in[1], in[2], in[3], in[4], in[5]);
    Tensor loss = at::zeros({}, in[0].options());
    for (size_t i = 0; i < ref.size(); ++i) loss = loss + (ref[i] * cot[i]).sum();
    auto ref_grads = torch::autograd::grad({loss}, in);
    for (auto& t : ref_grads) ref.push_back(t);

    auto run = [&] {
      auto f = ll::chunk_pieces_fwd(q, k, v, g, beta, lam);
      auto b = ll::chunk_pieces_bwd(q, k, v, beta, lam, f[6], f[7], f[0], cot[5], cot[0], cot[1], cot[2], cot[3], cot[4]);
      std::vector<Tensor> r(f.begin(), f.begin() + 6);
      r.insert(r.end(), b.begin(), b.end());
      return r;
    };
    auto got = run(), again = run();
    ASSERT_EQ(got.size(), ref.size());
    double worst = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_TRUE(at::isfinite(got[i]).all().item<bool>()) << names[i] << " has NaN (unwritten?)";
      const double e = rel_err(got[i].to(at::kFloat), ref[i].to(at::kFloat));
      worst = std::max(worst, e);
      EXPECT_LE(e, 1e-2) << "B=" << c.B << " T=" << c.T << " H=" << c.H << " dk " << c.dk << " dv " << c.dv << ": "
                         << names[i];
      EXPECT_TRUE(at::equal(got[i], again[i])) << "two runs differ: " << names[i];
    }
    std::cout << "[ errors   ] chunk pieces, B=" << c.B << " T=" << c.T << " H=" << c.H << " dk " << c.dk << " dv "
              << c.dv << ": worst of " << ref.size() << " results " << worst << "\n";
  }
  carry::kernels::delta_rule::gdn_set_poison(false);
#endif
}

}  // namespace
}  // namespace carry::testing
