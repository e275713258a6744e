// Tests of layers/log_linear/level_walk.*: log-linear Gated DeltaNet's levels above the chunk in one walk.
//
// The pieces come from the delta rule's chunk pieces of random inputs (unit keys, sigmoid β, decays with
// half-lives from 2 to 10^5 tokens), the level weights positive, a random initial state of every level and
// random cotangents of the read-outs and of every final state.
//
// CPU, fp64: the walk with its hand-written backward equals the chunk-by-chunk ATen reference (autograd) in
// the read-outs, the final states and the gradients of every piece, the level weights and the initial states,
// at offsets at and across block boundaries.
// GPU (skips without one): the kernels on bf16 pieces against the reference in fp32 on the same values (every
// result within 1e-2 relative), outputs and gradients poisoned-free (finite), and two runs bit for bit.
#include "layers/log_linear/level_walk.h"
#include "layers/core/device.h"
#include "layers/delta_rule/delta_rule.h"
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <iostream>

namespace carry::testing {
namespace {

struct Case {
  int64_t BH, T, dk, dv, chunk, offset, J;
  bool x0;
};

struct Walk {
  std::vector<Tensor> inputs;  // W, U, K̃, P, gamma, lam, X0 (leaves)
  Tensor d_o, d_final;
};

// Pieces of `c` in dtype `dt` (gamma, lam and X0 in the accumulation dtype acc).
Walk make_walk(const Case& c, at::ScalarType dt, at::ScalarType acc, const at::Device& dev, uint64_t seed) {
  at::manual_seed(seed);
  const int64_t N = c.T / c.chunk;
  auto o64 = at::TensorOptions().dtype(at::kDouble);
  auto unit = [&](int64_t d) {
    auto x = at::randn({c.BH, N, c.chunk, d}, o64);
    return x / x.norm(2, -1, true);
  };
  auto q = unit(c.dk), k = unit(c.dk), v = at::randn({c.BH, N, c.chunk, c.dv}, o64);
  auto beta = at::sigmoid(at::randn({c.BH, N, c.chunk}, o64));
  // Half-lives 10^[0.3, 5] tokens: g = ln(1/2) / half-life.
  auto half_life = at::pow(10.0, at::rand({c.BH, N, c.chunk}, o64) * 4.7 + 0.3);
  auto g = std::log(0.5) / half_life;
  auto p = delta_rule_chunk(q, k, v, beta, g, 1.0, ChunkParts::walk);
  auto rows = [&](const Tensor& x) { return x.reshape({c.BH, c.T, x.size(-1)}).to(dt).to(dev).detach(); };
  Walk w;
  w.inputs = {rows(p.w), rows(p.u), rows(p.k_out), rows(p.query_state),
              p.gate_last.to(acc).to(dev).detach(),
              (0.5 + at::rand({c.BH, c.J, c.T}, o64)).to(acc).to(dev),
              c.x0 ? (0.3 * at::randn({c.J, c.BH, c.dk, c.dv}, o64)).to(acc).to(dev) : Tensor()};
  for (auto& t : w.inputs)
    if (t.defined()) t.requires_grad_(true);
  w.d_o = at::randn({c.BH, c.T, c.dv}, o64).to(acc).to(dev);
  w.d_final = at::randn({c.J, c.BH, c.dk, c.dv}, o64).to(acc).to(dev);
  return w;
}

using WalkFn = std::function<std::pair<Tensor, Tensor>(const std::vector<Tensor>&, const LevelWalkPlace&)>;

// o, the final states, then the gradient of every defined input.
std::vector<Tensor> results(const WalkFn& f, const Walk& w, const LevelWalkPlace& pl) {
  auto [o, finals] = f(w.inputs, pl);
  std::vector<Tensor> leaves;
  for (const auto& t : w.inputs)
    if (t.defined()) leaves.push_back(t);
  auto loss = (o * w.d_o.to(o.scalar_type())).sum() + (finals * w.d_final.to(finals.scalar_type())).sum();
  auto grads = torch::autograd::grad({loss}, leaves);
  std::vector<Tensor> out{o.detach(), finals.detach()};
  for (auto& g : grads) out.push_back(g);
  return out;
}

const char* kNames[] = {"o", "final states", "dW", "dU", "dK̃", "dP", "dgamma", "dlam", "dX0"};

WalkFn walk_of(bool reference) {
  return [reference](const std::vector<Tensor>& x, const LevelWalkPlace& pl) {
    return (reference ? level_walk_reference : level_walk)(x[0], x[1], x[2], x[3], x[4], x[5], x[6], pl);
  };
}

TEST(LevelWalk, HandBackwardEqualsTheReferenceInFp64) {
  // Chunk 16 (levels from 5, blocks of 32 tokens and up): from 0; from a multiple of 32 but not 64; across a
  // 256-boundary; many blocks of the low levels; an offset with many set bits; inside a large block's second
  // half.
  for (const Case& c : {Case{2, 64, 8, 6, 16, 0, 2, false}, Case{2, 96, 8, 6, 16, 32, 3, true},
                        Case{1, 80, 8, 4, 16, 224, 4, true}, Case{2, 512, 4, 6, 16, 0, 5, true},
                        Case{1, 160, 8, 6, 16, 368, 5, true}, Case{2, 64, 8, 6, 16, 1536, 7, true}}) {
    const LevelWalkPlace pl{c.offset, c.chunk, 5};
    Walk w = make_walk(c, at::kDouble, at::kDouble, at::kCPU, 7 + c.offset + c.T);
    auto ref = results(walk_of(true), w, pl);
    auto got = results(walk_of(false), w, pl);
    ASSERT_EQ(ref.size(), got.size());
    double worst = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      const double e = rel_err(got[i], ref[i]);
      worst = std::max(worst, e);
      EXPECT_LE(e, 1e-11) << "offset " << c.offset << " T=" << c.T << ": " << kNames[i];
    }
    std::cout << "[ errors   ] level walk, offset " << c.offset << " T=" << c.T << " J=" << c.J << ": worst of "
              << ref.size() << " results " << worst << "\n";
  }
}

TEST(LevelWalk, BadPiecesAreRefusedClearly) {
  Walk w = make_walk(Case{1, 64, 8, 6, 16, 0, 2, false}, at::kDouble, at::kDouble, at::kCPU, 1);
  auto& x = w.inputs;
  expect_error([&] { level_walk(x[0], x[1], x[2], x[3], x[4], x[5], x[6], LevelWalkPlace{8, 16, 5}); },
               "the chunk must be a power of two dividing T and the offset");
  expect_error([&] { level_walk(x[0], x[1], x[2], x[3], x[4], x[5], x[6], LevelWalkPlace{0, 16, 4}); },
               "the first level's halves must hold whole chunks");
  expect_error([&] { level_walk(x[0], x[1], x[2], x[3], x[4].narrow(1, 0, 2), x[5], x[6], LevelWalkPlace{0, 16, 5}); },
               "gamma must be");
}

TEST(LevelWalk, KernelsMatchTheReferenceOnGpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
  const at::Device dev(at::kCUDA);
  for (const Case& c : {Case{2, 1024, 128, 128, 64, 0, 4, false}, Case{1, 768, 128, 256, 64, 320, 5, true},
                        Case{3, 512, 64, 64, 64, 1 << 12, 7, true}, Case{1, 4096, 128, 128, 64, 0, 6, true},
                        Case{1, 1536, 64, 256, 64, 64 * 37, 9, true}}) {
    const LevelWalkPlace pl{c.offset, c.chunk, 7};
    Walk w = make_walk(c, at::kBFloat16, at::kFloat, dev, 5 + c.offset + c.T);
    ASSERT_TRUE(level_walk_uses_kernels(w.inputs[0], w.inputs[1], c.chunk));
    Walk w32 = w;  // the same bf16 values, in fp32, for the reference
    for (auto& t : w32.inputs)
      if (t.defined()) t = t.detach().to(at::kFloat).requires_grad_(true);
    auto ref = results(walk_of(true), w32, pl);
    auto got = results(walk_of(false), w, pl);
    auto again = results(walk_of(false), w, pl);
    ASSERT_EQ(ref.size(), got.size());
    double worst = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_TRUE(at::isfinite(got[i]).all().item<bool>()) << kNames[i];
      const double e = rel_err(got[i].to(at::kFloat), ref[i].to(at::kFloat));
      worst = std::max(worst, e);
      EXPECT_LE(e, 1e-2) << "dk " << c.dk << " dv " << c.dv << " offset " << c.offset << " T=" << c.T << ": "
                         << kNames[i];
      EXPECT_TRUE(at::equal(got[i], again[i])) << "two runs differ: " << kNames[i];
    }
    std::cout << "[ errors   ] level walk kernels, dk " << c.dk << " dv " << c.dv << " offset " << c.offset
              << " T=" << c.T << " J=" << c.J << ": worst of " << ref.size() << " results " << worst << "\n";
  }
}

}  // namespace
}  // namespace carry::testing
