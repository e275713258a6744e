// Softmax attention's kernel form (layers/kernels/softmax_attn/) against its chunkwise form in fp32 on
// the same (upcast) inputs: the output and the gradients of q, k, v for a random output gradient, full
// causal and sliding windows (1, 63, 64, 100, 2048 and one longer than T), T up to 4096, B = 2, H = 3,
// dk = dv ∈ {64, 128}. Relative max error ≤ 1e-4 for fp32 inputs, ≤ 1e-2 for bf16 (a CPU model of the bf16
// kernels' rounding put it at 2e-3 to 6e-3 on these shapes). Outputs are poisoned
// (NaN) before each kernel run so that unwritten elements show. Then what sequence parallelism relies
// on, bit for bit: a run on a suffix that starts with a halo of zero-query rows (what MixerLayer
// prepends) gives the whole run's o, dq, dk, dv on the suffix's own rows, and two runs give the same
// bits. Unsupported inputs are refused by the kernel form and run chunkwise under automatic dispatch.
// Skips itself without a GPU (and on builds without CUDA).
#include "layers/core/device.h"
#include "tests/helpers/mixer_testing.h"

#ifdef CARRY_WITH_CUDA
#include "layers/kernels/softmax_attn/api.h"
#endif

#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

namespace carry::testing {
namespace {

const Mixer& attn() { return get_mixer("softmax_attn"); }

const char* kNames[] = {"o", "dq", "dk", "dv"};

// q, k, v [B,T,H,d] and an output gradient, N(0,1) in fp32 on the GPU.
std::vector<Tensor> attn_inputs(int64_t B, int64_t T, int64_t H, int64_t d, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<Tensor> x;
  for (int n = 0; n < 4; ++n) x.push_back(at::randn({B, T, H, d}, gen, at::kFloat).to(at::kCUDA));
  return x;
}

std::vector<Tensor> cast(const std::vector<Tensor>& x, at::ScalarType dt) {
  std::vector<Tensor> y;
  for (auto& t : x) y.push_back(t.to(dt));
  return y;
}

// {o, dq, dk, dv} of the form `form` for inputs x = {q, k, v, d_o}.
std::vector<Tensor> run_attn(Form form, const std::vector<Tensor>& x, int64_t window) {
  MixerOptions opt;
  opt.form = form;
  opt.window = window;
  MixerInputs in;
  in.q = x[0].detach().requires_grad_(true);
  in.k = x[1].detach().requires_grad_(true);
  in.v = x[2].detach().requires_grad_(true);
  auto o = attn().forward(in, {}, opt).o;
  auto g = torch::autograd::grad({o}, {in.q, in.k, in.v}, {x[3]});
  return {o.detach(), g[0], g[1], g[2]};
}

#ifdef CARRY_WITH_CUDA
// Poisons the kernels' outputs for the test's duration.
struct Poison {
  Poison() { carry::kernels::softmax_attn::attn_set_poison(true); }
  ~Poison() { carry::kernels::softmax_attn::attn_set_poison(false); }
};
#endif

TEST(SoftmaxAttnKernel, MatchesChunkwise) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  Poison poison;
  const int64_t B = 2, H = 3;
  struct Case {
    int64_t T, window;
  };
  const Case cases[] = {{64, 0},    {1024, 1},   {1024, 63}, {1024, 64},
                        {1024, 100}, {4096, 2048}, {4096, 0}, {256, 5000}};
  for (int64_t d : {64, 128}) {
    for (const Case& c : cases) {
      auto x = attn_inputs(B, c.T, H, d, 1000 + c.T + c.window + d);
      for (auto dt : {at::kFloat, at::kBFloat16}) {
        auto low = cast(x, dt);
        auto up = cast(low, at::kFloat);  // the reference sees the same values, upcast
        MixerOptions opt;
        opt.window = c.window;
        ASSERT_TRUE(attn().kernel_supports({low[0], low[1], low[2]}, opt));
        ASSERT_EQ(attn().resolve_form({low[0], low[1], low[2]}, opt), Form::kernel);
        auto ref = run_attn(Form::chunkwise, up, c.window);
        auto ker = run_attn(Form::kernel, low, c.window);
        const double bound = dt == at::kFloat ? 1e-4 : 1e-2;
        // With window 1 a query sees only itself: P = 1, dS = dO·v − dO·o = 0, so dq and dk vanish in
        // exact arithmetic and both forms return rounding noise; it is measured against dv's scale.
        const double dv_scale = ref[3].abs().max().item<double>();
        std::string line;
        for (size_t n = 0; n < ref.size(); ++n) {
          EXPECT_EQ(ker[n].scalar_type(), dt) << kNames[n];
          EXPECT_TRUE(at::isfinite(ker[n]).all().item<bool>()) << kNames[n] << " has NaN (unwritten?)";
          const bool vanishing = c.window == 1 && (n == 1 || n == 2);
          const double e = vanishing ? (ker[n].to(at::kFloat) - ref[n]).abs().max().item<double>() / dv_scale
                                     : rel_err(ker[n].to(at::kFloat), ref[n]);
          EXPECT_LE(e, bound) << dt << " d=" << d << " T=" << c.T << " window=" << c.window << ": " << kNames[n];
          line += std::string(" ") + kNames[n] + " " + std::to_string(e);
        }
        std::cout << "[ errors   ] softmax_attn kernel " << dt << " B=" << B << " T=" << c.T << " H=" << H
                  << " d=" << d << " window=" << c.window << ":" << line << "\n";
      }
    }
  }
#endif
}

// MixerLayer's sliding window across ranks: a slice starting at token c runs on [c − halo, T) with the
// halo's query rows and output gradients zero (halo = whole 64-blocks covering window − 1 keys, here
// also one block more). Its own rows then get the whole run's bits: o and dq of queries ≥ c, and dk, dv
// of keys ≥ c, which only queries ≥ c reach. The halo keys' gradients (this slice's share, sent back to
// the previous slice) plus the previous slice's own equal the whole run's, to rounding.
TEST(SoftmaxAttnKernel, SuffixWithHaloGivesTheBitsOfTheWhole) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  Poison poison;
  const int64_t B = 2, T = 640, H = 3, c = 320;
  for (int64_t d : {64, 128}) {
    for (auto dt : {at::kBFloat16, at::kFloat}) {
      auto x = cast(attn_inputs(B, T, H, d, 77 + d), dt);
      for (int64_t w : {1, 63, 64, 65, 100, 200}) {
        auto whole = run_attn(Form::kernel, x, w);
        for (int64_t extra : {0, 64}) {
          const int64_t halo = (w - 1 + 63) / 64 * 64 + extra, s = c - halo;
          auto suffix = [&](const Tensor& t, bool zero_halo) {
            auto y = t.narrow(1, s, T - s).clone();
            if (zero_halo) y.narrow(1, 0, halo).zero_();
            return y;
          };
          auto part = run_attn(Form::kernel, {suffix(x[0], true), suffix(x[1], false), suffix(x[2], false),
                                              suffix(x[3], true)}, w);
          std::string differ;
          for (size_t n = 0; n < whole.size(); ++n)
            if (!at::equal(part[n].narrow(1, halo, T - c), whole[n].narrow(1, c, T - c))) differ += std::string(" ") + kNames[n];
          EXPECT_TRUE(differ.empty()) << dt << " d=" << d << " window=" << w << " halo=" << halo << ": rows >= "
                                      << c << " differ in" << differ;
          EXPECT_TRUE((part[1].narrow(1, 0, halo) == 0).all().item<bool>()) << "zero-gradient halo queries got dq";
          double e_halo = 0;
          if (halo > 0) {
            std::vector<Tensor> prefix_x;
            for (auto& t : x) prefix_x.push_back(t.narrow(1, 0, c));
            auto prefix = run_attn(Form::kernel, prefix_x, w);
            for (size_t n : {2, 3}) {
              auto sum = prefix[n].narrow(1, s, halo).to(at::kFloat) + part[n].narrow(1, 0, halo).to(at::kFloat);
              e_halo = std::max(e_halo, rel_err(sum, whole[n].narrow(1, s, halo).to(at::kFloat)));
            }
            EXPECT_LE(e_halo, dt == at::kFloat ? 1e-5 : 1e-2) << dt << " d=" << d << " window=" << w;
          }
          std::cout << "[ errors   ] softmax_attn kernel " << dt << " d=" << d << " window=" << w << " suffix from "
                    << s << " (halo " << halo << "): rows >= " << c << (differ.empty() ? " bitwise equal" : " DIFFER")
                    << "; halo keys' dk, dv (prefix + suffix vs whole) " << e_halo << "\n";
        }
      }
    }
  }
#endif
}

TEST(SoftmaxAttnKernel, TwoRunsGiveTheSameBits) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  for (auto dt : {at::kBFloat16, at::kFloat}) {
    auto x = cast(attn_inputs(2, 1024, 3, 128, 5), dt);
    for (int64_t w : {0, 100}) {
      auto a = run_attn(Form::kernel, x, w), b = run_attn(Form::kernel, x, w);
      for (size_t n = 0; n < a.size(); ++n)
        EXPECT_TRUE(at::equal(a[n], b[n])) << dt << " window=" << w << ": " << kNames[n] << " differs run to run";
    }
  }
#endif
}

TEST(SoftmaxAttnKernel, UnsupportedInputsAreRefusedAndRunChunkwise) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  auto make = [](int64_t T, int64_t dk, int64_t dv, at::ScalarType dq, at::ScalarType dkv) {
    auto o = at::TensorOptions().device(at::kCUDA);
    return MixerInputs{at::randn({1, T, 2, dk}, o.dtype(dq)), at::randn({1, T, 2, dk}, o.dtype(dkv)),
                       at::randn({1, T, 2, dv}, o.dtype(dkv))};
  };
  struct Bad {
    const char* what;
    MixerInputs in;
    int64_t chunk_size;
    const char* needle;
  };
  const Bad bad[] = {
      {"dtype mix", make(128, 64, 64, at::kBFloat16, at::kFloat), 64, "must share one dtype"},
      {"dk=96", make(128, 96, 96, at::kBFloat16, at::kBFloat16), 64, "dk = dv in {64, 128}"},
      {"dk != dv", make(128, 64, 128, at::kFloat, at::kFloat), 64, "dk = dv in {64, 128}"},
      {"fp16", make(128, 64, 64, at::kHalf, at::kHalf), 64, "bf16 or fp32"},
      {"T=96", make(96, 64, 64, at::kBFloat16, at::kBFloat16), 32, "T a multiple of 64"},
  };
  for (const Bad& b : bad) {
    MixerOptions opt;
    opt.chunk_size = b.chunk_size;
    opt.window = 40;
    EXPECT_FALSE(attn().kernel_supports(b.in, opt)) << b.what;
    EXPECT_EQ(attn().resolve_form(b.in, opt), Form::chunkwise) << b.what;
    expect_error([&] { attn().kernel(b.in, {}, opt); }, b.needle);
    if (std::string(b.what) == "dtype mix") continue;  // no form takes it
    auto o = attn().forward(b.in, {}, opt).o;  // automatic: the chunkwise form
    EXPECT_EQ(o.sizes(), b.in.v.sizes()) << b.what;
    std::cout << "[ errors   ] softmax_attn kernel refuses " << b.what << "; automatic dispatch ran chunkwise\n";
  }
  // A supported shape with an unsupported option: a negative window is refused by every form.
  MixerOptions neg;
  neg.window = -1;
  expect_error([&] { attn().kernel(make(128, 64, 64, at::kFloat, at::kFloat), {}, neg); }, "window must be >= 0");
#endif
}

}  // namespace
}  // namespace carry::testing
