// The chunked head + cross entropy (framework/model/chunked_loss.h) against the full-logits form:
// loss, per-token losses, predictions and the gradients of the hidden states, of the head and of a
// tied embedding, in fp64 and fp32, with a float mask and ignored targets, for several chunk sizes
// (one not dividing the token count), under an arbitrary upstream gradient; run-to-run bitwise
// equality; bf16 autocast on the CPU; the GPU against the CPU, and the CUDA cross-entropy kernel
// (layers/kernels/blocks/loss.h) against the ATen form on the same GPU (skip without a GPU); the head
// weight's gradient of the last chunks deferred until after the backward (DeferredHeadGradient): the
// same bits as without, on the CPU and with the CUDA kernel.
#include "framework/model/chunked_loss.h"
#include "layers/core/device.h"
#include "layers/core/fused_switch.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdio>
#include <string>
#include <vector>

namespace carry {
namespace {

using at::Tensor;

double rel_err(const Tensor& a, const Tensor& b) {
  auto ad = a.detach().to(at::kCPU, at::kDouble), bd = b.detach().to(at::kCPU, at::kDouble);
  const double scale = std::max(bd.abs().max().item<double>(), 1e-30);
  return (ad - bd).abs().max().item<double>() / scale;
}

// The problem: tokens [B,T] → h = tanh(E[tokens]·A) [B,T,d]; head W (E itself when tied); targets
// with some ignored (-1); a float mask with some zeros.
struct Problem {
  Tensor E, A, W, tokens, targets, mask;
  bool tied = false;
  const Tensor& head() const { return tied ? E : W; }
  Tensor hidden() const { return at::tanh(at::matmul(at::embedding(E, tokens), A)); }
};

Problem make_problem(at::ScalarType dt, bool tied, int64_t B, int64_t T, int64_t V, int64_t d, uint64_t seed,
                     at::Device device = at::kCPU) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto o = at::TensorOptions().dtype(at::kDouble);
  Problem p;
  p.tied = tied;
  p.E = at::randn({V, d}, gen, o).to(device, dt).set_requires_grad(true);
  p.A = (at::randn({d, d}, gen, o) * 0.7).to(device, dt).set_requires_grad(true);
  p.W = (at::randn({V, d}, gen, o) * 0.5).to(device, dt).set_requires_grad(true);
  p.tokens = at::randint(V, {B, T}, gen, o.dtype(at::kLong)).to(device);
  auto targets = at::randint(V, {B, T}, gen, o.dtype(at::kLong));
  auto ignored = at::rand({B, T}, gen, o) < 0.15;
  p.targets = at::where(ignored, at::full({}, -1, targets.options()), targets).to(device);
  auto mask = at::rand({B, T}, gen, o) * 2;
  p.mask = at::where(at::rand({B, T}, gen, o) < 0.2, at::zeros({}, o), mask).to(device, at::kFloat);
  return p;
}

struct Result {
  Tensor loss, ce;
  std::vector<Tensor> grads;  // E, A, (W when untied)
};

std::vector<Tensor> leaves(const Problem& p) {
  std::vector<Tensor> l{p.E, p.A};
  if (!p.tied) l.push_back(p.W);
  return l;
}

// The full form: logits [B,T,V], log-softmax in fp32 at least, gather; ignored targets give 0.
Result full_form(const Problem& p, double upstream) {
  auto logits = at::linear(p.hidden(), p.head());
  auto dt = at::promote_types(logits.scalar_type(), at::kFloat);
  auto logp = at::log_softmax(logits.to(dt), -1);
  auto picked = -logp.gather(-1, p.targets.clamp_min(0).unsqueeze(-1)).squeeze(-1);
  auto ce = at::where(p.targets.ge(0), picked, at::zeros({}, picked.options()));
  auto loss = (ce * p.mask.to(dt)).sum();
  Result r{loss.detach(), ce.detach(), torch::autograd::grad({loss * upstream}, leaves(p))};
  return r;
}

Result chunked_form(const Problem& p, double upstream, int64_t chunk) {
  auto out = linear_cross_entropy(p.hidden(), p.head(), p.targets, p.mask, chunk);
  Result r{out.loss.detach(), out.token_losses, torch::autograd::grad({out.loss * upstream}, leaves(p))};
  return r;
}

// .backward() into the leaves' .grad (as the trainer runs it), with defer_bytes and the hidden states
// made through the anchor on the embedding's output when asked; the leaves' gradients (undefined where
// none arrived), cleared after.
struct Deferred {
  std::vector<Tensor> grads;
  int64_t chunks = 0, bytes = 0, left_after = -1;  // deferred chunks and bytes; chunks still held after the backward
};
Deferred deferred_form(const Problem& p, double upstream, int64_t chunk, int64_t defer_bytes, bool anchor) {
  auto held = std::make_shared<DeferredHeadGradient>();
  Tensor x = at::embedding(p.E, p.tokens);
  if (anchor) x = anchor_deferred_head_gradient(x, p.head(), held);
  auto out = linear_cross_entropy(at::tanh(at::matmul(x, p.A)), p.head(), p.targets, p.mask, chunk, false, defer_bytes,
                                  held);
  Deferred d;
  if (out.deferred) d.chunks = out.deferred->chunks(), d.bytes = out.deferred->bytes();
  (out.loss * upstream).backward();
  d.left_after = held->chunks();
  for (auto& t : leaves(p)) {
    d.grads.push_back(t.grad().defined() ? t.grad().clone() : Tensor());
    t.mutable_grad() = Tensor();
  }
  return d;
}

// The deferred chunks give the bits of the run without deferral: tied and untied heads, fp32 and bf16
// autocast, 80 tokens in chunks of 9 (the last one short), budgets of no chunk to all of them.
void expect_deferral_exact(at::Device device, bool fused) {
  const bool was = fused_ops_enabled();
  set_fused_ops(fused);
  for (bool bf16 : {false, true}) {
    at::autocast::set_autocast_enabled(device.type(), bf16);
    at::autocast::set_autocast_dtype(device.type(), at::kBFloat16);
    for (bool tied : {true, false}) {
      auto p = make_problem(at::kFloat, tied, 2, 40, 50, 16, 31 + tied, device);
      const int64_t chunk = 9, N = 80, V = 50, elem = bf16 ? 2 : 4;
      auto plain = deferred_form(p, 1.0 / 3, chunk, 0, true);
      EXPECT_EQ(plain.chunks, 0);
      // The last chunk holds 80 - 72 = 8 tokens: budgets for it alone, it and two more, and everything.
      const std::vector<std::pair<int64_t, int64_t>> budgets{
          {8 * V * elem - 1, 0}, {8 * V * elem, 1}, {(8 + 2 * 9) * V * elem, 3}, {int64_t{1} << 40, 9}};
      for (auto [bytes, chunks] : budgets) {
        for (bool anchor : {true, false}) {
          auto d = deferred_form(p, 1.0 / 3, chunk, bytes, anchor);
          // Without the anchor nothing is deferred (no gradient could be lost).
          EXPECT_EQ(d.chunks, anchor ? chunks : 0) << "budget " << bytes;
          EXPECT_EQ(d.left_after, 0) << "the anchor frees the chunks";
          if (d.chunks > 0) EXPECT_EQ(d.bytes, (N - (9 - chunks) * chunk) * V * elem);
          ASSERT_EQ(d.grads.size(), plain.grads.size());
          for (size_t i = 0; i < d.grads.size(); ++i) {
            ASSERT_TRUE(d.grads[i].defined()) << i;
            EXPECT_TRUE(at::equal(d.grads[i], plain.grads[i]))
                << (bf16 ? "bf16" : "fp32") << (tied ? " tied" : " untied") << ", budget " << bytes
                << (anchor ? "" : " unanchored") << ", leaf " << i
                << ": max diff " << (d.grads[i] - plain.grads[i]).abs().max().item<double>();
          }
        }
      }
    }
    at::autocast::set_autocast_enabled(device.type(), false);
    at::autocast::clear_cache();
  }
  set_fused_ops(was);
}

TEST(ChunkedLoss, DeferredHeadGradientGivesTheSameBits) { expect_deferral_exact(at::kCPU, false); }

TEST(ChunkedLoss, DeferredHeadGradientGivesTheSameBitsWithTheCudaKernel) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
  expect_deferral_exact(at::Device(at::kCUDA, 0), true);
}

TEST(ChunkedLoss, MatchesTheFullLogitsForm) {
  const int64_t B = 2, T = 23, V = 37, d = 12;
  for (auto dt : {at::kDouble, at::kFloat}) {
    const double bound = dt == at::kDouble ? 1e-12 : 1e-6;
    for (bool tied : {false, true}) {
      auto p = make_problem(dt, tied, B, T, V, d, tied ? 5 : 6);
      // An arbitrary upstream gradient of the sum (the trainer's 1/count is one).
      const double upstream = 0.37;
      auto ref = full_form(p, upstream);
      // Chunk sizes: one token, one not dividing B·T = 46, exactly B·T, more than B·T, the default.
      for (int64_t chunk : {1, 7, 23, 46, 100, 0}) {
        auto got = chunked_form(p, upstream, chunk);
        std::string tag = std::string(dt == at::kDouble ? "fp64" : "fp32") + (tied ? " tied" : " untied") +
                          " chunk " + std::to_string(chunk);
        double e_loss = rel_err(got.loss, ref.loss), e_ce = rel_err(got.ce, ref.ce);
        EXPECT_EQ(got.ce.scalar_type(), ref.ce.scalar_type()) << tag;
        EXPECT_EQ(got.ce.sizes(), ref.ce.sizes()) << tag;
        EXPECT_LE(e_loss, bound) << tag;
        EXPECT_LE(e_ce, bound) << tag;
        // Ignored targets: exactly 0.
        ASSERT_TRUE(p.targets.lt(0).any().item<bool>());
        EXPECT_EQ((got.ce * p.targets.lt(0)).abs().max().item<double>(), 0.0) << tag;
        const char* names[] = {"embedding", "A", "head"};
        double e_grad = 0;
        for (size_t i = 0; i < ref.grads.size(); ++i) {
          double e = rel_err(got.grads[i], ref.grads[i]);
          EXPECT_LE(e, bound * 10) << tag << " gradient of " << names[i];
          EXPECT_EQ(got.grads[i].scalar_type(), ref.grads[i].scalar_type()) << tag;
          e_grad = std::max(e_grad, e);
        }
        if (chunk == 7)
          std::printf("[ errors   ] chunked CE vs full logits %s: loss %.3e, per token %.3e, gradients %.3e\n",
                      tag.c_str(), e_loss, e_ce, e_grad);
      }
    }
  }
}

// The gradient of the hidden states alone (no embedding in between), and a token whose weight is
// non-zero but whose target is ignored: no loss, no gradient.
TEST(ChunkedLoss, GradientOfTheHiddenStatesAndIgnoredTargets) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
  auto o = at::TensorOptions().dtype(at::kDouble);
  auto h = at::randn({3, 5, 6}, gen, o).set_requires_grad(true);
  auto W = at::randn({11, 6}, gen, o).set_requires_grad(true);
  auto targets = at::randint(11, {3, 5}, gen, o.dtype(at::kLong));
  targets[1][2] = -100;
  auto w = at::ones({3, 5}, o);
  auto out = linear_cross_entropy(h, W, targets, w, 4);
  auto g = torch::autograd::grad({out.loss}, {h, W});
  auto logp = at::log_softmax(at::linear(h, W), -1);
  auto ce = -logp.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1) * targets.ge(0);
  auto ref = torch::autograd::grad({ce.sum()}, {h, W});
  EXPECT_LE(rel_err(g[0], ref[0]), 1e-12);
  EXPECT_LE(rel_err(g[1], ref[1]), 1e-12);
  EXPECT_EQ(out.token_losses[1][2].item<double>(), 0.0);
  EXPECT_EQ(g[0][1][2].abs().max().item<double>(), 0.0);
  // Without weights: all ones.
  auto plain = linear_cross_entropy(h, W, targets, {}, 3);
  EXPECT_LE(rel_err(plain.loss, out.loss), 1e-14);
  // The per-token losses carry no gradient; the sum does.
  EXPECT_FALSE(out.token_losses.requires_grad());
  EXPECT_TRUE(out.loss.requires_grad());
}

// Without grad mode (evaluation) the same values, and the argmax tokens of the full logits.
TEST(ChunkedLoss, NoGradPathAndPredictions) {
  auto p = make_problem(at::kDouble, false, 2, 19, 29, 8, 9);
  auto with = linear_cross_entropy(p.hidden(), p.head(), p.targets, p.mask, 5, true);
  at::NoGradGuard no_grad;
  auto without = linear_cross_entropy(p.hidden(), p.head(), p.targets, p.mask, 5, true);
  EXPECT_FALSE(without.loss.requires_grad());
  EXPECT_TRUE(at::equal(with.loss.detach(), without.loss));
  EXPECT_TRUE(at::equal(with.token_losses, without.token_losses));
  auto argmax = at::linear(p.hidden(), p.head()).argmax(-1);
  EXPECT_TRUE(at::equal(without.predictions, argmax));
  EXPECT_TRUE(at::equal(with.predictions, argmax));
  EXPECT_EQ(without.predictions.scalar_type(), at::kLong);
}

// Same inputs, same bits: the loss and every gradient, twice.
TEST(ChunkedLoss, RunToRunBitwise) {
  auto p = make_problem(at::kFloat, true, 2, 40, 50, 16, 10);
  auto a = chunked_form(p, 1.0 / 3, 9), b = chunked_form(p, 1.0 / 3, 9);
  EXPECT_TRUE(at::equal(a.loss, b.loss));
  EXPECT_TRUE(at::equal(a.ce, b.ce));
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_TRUE(at::equal(a.grads[i], b.grads[i])) << i;
}

// bf16 autocast (CPU): the chunk's matmul runs in bf16 as at::linear does; the result follows the
// full form under autocast closely (per-token losses from the same bf16 logits) and the fp32 run.
TEST(ChunkedLoss, Bf16AutocastFollowsTheFullForm) {
  auto p = make_problem(at::kFloat, false, 2, 64, 96, 32, 11);
  Result full, chunked;
  {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    full = full_form(p, 0.5);
    chunked = chunked_form(p, 0.5, 20);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
  }
  auto fp32 = full_form(p, 0.5);
  double e_ce = rel_err(chunked.ce, full.ce), e_fp32 = rel_err(chunked.loss, fp32.loss), e_grad = 0;
  for (size_t i = 0; i < full.grads.size(); ++i) {
    EXPECT_EQ(chunked.grads[i].scalar_type(), at::kFloat);
    e_grad = std::max(e_grad, rel_err(chunked.grads[i], full.grads[i]));
  }
  std::printf("[ errors   ] chunked CE bf16 autocast: per token vs full form %.3e, gradients vs full form %.3e, "
              "loss vs fp32 %.3e\n", e_ce, e_grad, e_fp32);
  EXPECT_LE(e_ce, 1e-5);      // the same bf16 logits, the same fp32 log-softmax
  EXPECT_LE(e_grad, 2e-2);    // bf16 gradient matmuls, accumulated over chunks in fp32
  EXPECT_LE(e_fp32, 2e-2);    // bf16 logits against fp32
  EXPECT_GT(e_fp32, 0.0) << "autocast did not run in bf16";
}

TEST(ChunkedLoss, DefaultChunkAndBadInputs) {
  EXPECT_EQ(default_loss_chunk_tokens(32000), 512);  // 64 MiB / (4 B · 32000), down to a multiple of 64
  EXPECT_EQ(default_loss_chunk_tokens(1 << 30), 64);
  EXPECT_EQ(default_loss_chunk_tokens(32000, 2), 4160);  // the fused kernel: 256 MiB / (2 B · 32000)
  EXPECT_EQ(default_loss_chunk_tokens(32000, 4), 2048);
  auto h = at::randn({2, 3, 4}, at::kDouble), W = at::randn({5, 4}, at::kDouble);
  auto t = at::zeros({2, 3}, at::kLong);
  auto message = [](auto f) {
    try {
      f();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { linear_cross_entropy(h, at::randn({5, 3}, at::kDouble), t); }).find("weight must be"),
            std::string::npos);
  EXPECT_NE(message([&] { linear_cross_entropy(h, W, at::zeros({2, 4}, at::kLong)); }).find("targets must have"),
            std::string::npos);
  EXPECT_NE(message([&] { linear_cross_entropy(h, W, t.to(at::kInt)); }).find("int64"), std::string::npos);
  EXPECT_NE(message([&] { linear_cross_entropy(h, W, t, at::ones({3, 2})); }).find("token weights"),
            std::string::npos);
}

// GPU: fp64 on CUDA equals the CPU; bf16 autocast on CUDA follows the full form. Skips without a GPU.
TEST(ChunkedLoss, GpuMatchesCpuAndFullForm) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
  for (bool tied : {false, true}) {
    auto cpu = make_problem(at::kDouble, tied, 2, 300, 1000, 64, 12);
    auto gpu = make_problem(at::kDouble, tied, 2, 300, 1000, 64, 12, at::Device(at::kCUDA, 0));
    auto a = chunked_form(cpu, 0.25, 128), b = chunked_form(gpu, 0.25, 128);
    double e = std::max(rel_err(b.loss, a.loss), rel_err(b.ce, a.ce));
    for (size_t i = 0; i < a.grads.size(); ++i) e = std::max(e, rel_err(b.grads[i], a.grads[i]));
    std::printf("[ errors   ] chunked CE cuda vs cpu fp64 %s: %.3e\n", tied ? "tied" : "untied", e);
    EXPECT_LE(e, 1e-12);
  }
  auto p = make_problem(at::kFloat, false, 2, 4096, 32000, 256, 13, at::Device(at::kCUDA, 0));
  Result full, chunked;
  at::autocast::set_autocast_enabled(at::kCUDA, true);
  at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
  full = full_form(p, 1.0 / 8192);
  chunked = chunked_form(p, 1.0 / 8192, 0);
  at::autocast::set_autocast_enabled(at::kCUDA, false);
  at::autocast::clear_cache();
  double e_ce = rel_err(chunked.ce, full.ce), e_grad = 0;
  for (size_t i = 0; i < full.grads.size(); ++i) e_grad = std::max(e_grad, rel_err(chunked.grads[i], full.grads[i]));
  std::printf("[ errors   ] chunked CE cuda bf16 autocast vs full form: per token %.3e, gradients %.3e\n", e_ce, e_grad);
  // cuBLAS may tile a chunk's rows unlike the whole batch's: a logit may then round to the next bf16.
  EXPECT_LE(e_ce, 1e-2);
  EXPECT_LE(e_grad, 2e-2);
}

// The CUDA cross-entropy kernel (fused ops on) against the ATen form of the same chunks (fused ops off)
// and both against the fp64 full form: fp32, and bf16 autocast (where the kernel's weight gradient is
// also summed over chunks in fp32 by cuBLAS instead of rounding each chunk's to bf16). Per-token losses,
// loss, the gradients of every input, and the predictions (equal but for ties among bf16 logits).
TEST(ChunkedLoss, CudaKernelMatchesAtenForm) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
  const bool was = fused_ops_enabled();
  for (bool bf16 : {false, true}) {
    // V = 1000 is a multiple of 8 (16-byte accesses); V = 997 is not (one element per access).
    for (int64_t V : {1000, 997}) {
      auto p = make_problem(at::kFloat, false, 2, 300, V, 64, 21 + V, at::Device(at::kCUDA, 0));
      auto ref = [&] {
        auto q = p;
        q.E = p.E.detach().to(at::kDouble).set_requires_grad(true);
        q.A = p.A.detach().to(at::kDouble).set_requires_grad(true);
        q.W = p.W.detach().to(at::kDouble).set_requires_grad(true);
        return full_form(q, 0.5);
      }();
      auto run = [&](bool fused, Tensor* preds) {
        set_fused_ops(fused);
        at::autocast::set_autocast_enabled(at::kCUDA, bf16);
        at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
        auto out = linear_cross_entropy(p.hidden(), p.head(), p.targets, p.mask, 128, /*predictions=*/true);
        Result r{out.loss.detach(), out.token_losses, torch::autograd::grad({out.loss * 0.5}, leaves(p))};
        *preds = out.predictions;
        at::autocast::set_autocast_enabled(at::kCUDA, false);
        at::autocast::clear_cache();
        return r;
      };
      Tensor pf, pa;
      auto f = run(true, &pf), a = run(false, &pa);
      set_fused_ops(was);
      double e_ce = rel_err(f.ce, a.ce), e_loss = rel_err(f.loss, a.loss), e_grad = 0, e_gf = 0, e_ga = 0;
      for (size_t i = 0; i < f.grads.size(); ++i) {
        EXPECT_EQ(f.grads[i].scalar_type(), a.grads[i].scalar_type());
        e_grad = std::max(e_grad, rel_err(f.grads[i], a.grads[i]));
        e_gf = std::max(e_gf, rel_err(f.grads[i], ref.grads[i]));
        e_ga = std::max(e_ga, rel_err(a.grads[i], ref.grads[i]));
      }
      const int64_t differ = pf.ne(pa).sum().item<int64_t>();
      std::printf("[ errors   ] CE kernel vs ATen form, %s V=%ld: per token %.2e, loss %.2e, gradients %.2e; "
                  "gradients vs fp64: kernel %.2e, ATen %.2e; predictions differing %ld of %ld\n",
                  bf16 ? "bf16 autocast" : "fp32", (long)V, e_ce, e_loss, e_grad, e_gf, e_ga, (long)differ,
                  (long)pf.numel());
      EXPECT_LE(e_ce, bf16 ? 1e-5 : 1e-6);  // the same logits; the log-sum-exp summed in another order
      EXPECT_LE(e_loss, bf16 ? 1e-5 : 1e-6);
      EXPECT_LE(e_grad, bf16 ? 1e-2 : 1e-5);
      EXPECT_LE(e_gf, bf16 ? 1.1 * e_ga + 1e-4 : 1e-5);  // the kernel is no less accurate than the ATen form
      EXPECT_LE(differ, bf16 ? pf.numel() / 100 : 0);
      EXPECT_TRUE(at::isfinite(f.ce).all().item<bool>());
    }
  }
}

}  // namespace
}  // namespace carry
