// The fused short convolution and L2 normalization (layers/kernels/blocks/conv_op.h) against their ATen
// forms (causal_conv1d with a tap mask from document_start_of, then silu; x·rsqrt(Σx²+1e−6)), on random
// inputs: outputs and the gradients of x, weight and halo for a random functional of the outputs.
// fp32 inputs against the ATen form in fp32 (relative max error ≤ 1e−5); bf16 inputs (with fp32 or
// bf16 weights) against the ATen form in fp64 on the same (upcast) inputs, next to the ATen form's own
// error in the input dtype (fused ≤ 1e−2, and never worse than 2× the ATen form's where that is
// above 1e−3). With and without halo, with and without packed documents (a document starting
// in the slice's first K−1 tokens, one mid-slice, one before the slice, a sequence with no start
// before its first), K = 2..4, T not a multiple of the kernel's 64-token runs, three channel groups.
// The weight gradient is bitwise reproducible. A MixerLayer (gated_deltanet, packed documents, halo)
// with the fused ops against the same layer with the ATen forms. The GPU tests skip themselves
// without a GPU; the CPU tests check index_documents against the per-layer derivation it replaces.
#include "layers/core/device.h"
#include "layers/core/fused_switch.h"
#include "layers/blocks/mixer_layer.h"
#include "tests/helpers/mixer_testing.h"

#ifdef CARRY_WITH_CUDA
#include "layers/kernels/blocks/conv_op.h"
#endif

#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>

namespace carry::testing {
namespace {

double err(const Tensor& a, const Tensor& ref) {
  if (!a.defined() && !ref.defined()) return 0;
  EXPECT_TRUE(a.defined() && ref.defined());
  if (!a.defined() || !ref.defined()) return 1e30;
  auto x = a.detach().to(at::kCPU, at::kDouble), r = ref.detach().to(at::kCPU, at::kDouble);
  EXPECT_EQ(x.sizes(), r.sizes());
  const double den = r.abs().max().item<double>(), num = (x - r).abs().max().item<double>();
  return den > 0 ? num / den : num;
}

// [B, N] bool: b = 0 has starts before the slice (offset − 10), in its first K−1 tokens (offset + 1) and
// mid-slice (offset + 100); b = 1 none before offset + 70 (so −1 starts), then offset + 70 and + 131.
Tensor packed_starts(int64_t B, int64_t N, int64_t offset) {
  auto s = at::zeros({B, N}, at::kBool);
  s[0][0] = true;
  s[0][offset - 10] = true;
  s[0][offset + 1] = true;
  s[0][offset + 100] = true;
  if (B > 1) {
    s[1][offset + 70] = true;
    s[1][offset + 131] = true;
  }
  return s;
}

TEST(ConvKernel, IndexDocumentsMatchesPerLayerDerivation) {
  const int64_t B = 2, N = 300, offset = 37, T = 200;
  MixerLayerContext ctx;
  ctx.offset = offset;
  ctx.document_starts = packed_starts(B, N, offset);
  index_documents(ctx, T, at::kCPU);
  EXPECT_FALSE(ctx.document_start_at_device.defined());
  EXPECT_TRUE(at::equal(ctx.document_start_at, document_start_of(ctx.document_starts, 0, N)));
  EXPECT_TRUE(at::equal(ctx.document_start_at.narrow(1, offset, T), document_start_of(ctx.document_starts, offset, T)));
  EXPECT_TRUE(at::equal(ctx.slice_document_starts, ctx.document_starts.narrow(1, offset, T)));
  ASSERT_EQ(ctx.slice_document_offsets.size(), 2u);
  EXPECT_EQ(ctx.slice_document_offsets[0], 10);      // its document began at offset − 10
  EXPECT_EQ(ctx.slice_document_offsets[1], offset);  // no start before: the sequence's first document
  // Spot values: the start in force at each position.
  EXPECT_EQ(ctx.document_start_at[0][offset].item<int64_t>(), offset - 10);
  EXPECT_EQ(ctx.document_start_at[0][offset + 1].item<int64_t>(), offset + 1);
  EXPECT_EQ(ctx.document_start_at[0][offset + 150].item<int64_t>(), offset + 100);
  EXPECT_EQ(ctx.document_start_at[1][offset + 69].item<int64_t>(), -1);
  EXPECT_EQ(ctx.document_start_at[1][offset + 140].item<int64_t>(), offset + 131);
  MixerLayerContext bad = ctx;
  bad.offset = N - 10;
  EXPECT_THROW(index_documents(bad, T, at::kCPU), c10::Error);
}

// The layer with the context's index equals the layer deriving the documents itself, bit for bit (CPU).
TEST(ConvKernel, LayerWithDocumentIndexEqualsWithout) {
  MixerLayerSpec spec;
  spec.kind = "gated_deltanet";
  spec.d_model = 32, spec.n_heads = 2, spec.head_dim_k = 16, spec.head_dim_v = 16, spec.chunk_size = 16;
  spec.conv_size = 4;
  ParameterInit init(7, at::TensorOptions().dtype(at::kDouble));
  MixerLayer layer(spec, init);
  const int64_t B = 2, T = 160, offset = 37, N = 300;
  auto x = at::randn({B, T, spec.d_model}, at::make_generator<at::CPUGeneratorImpl>(3), at::kDouble);
  MixerLayerContext plain;
  plain.offset = offset;
  plain.sequence_length = N;
  plain.document_starts = packed_starts(B, N, offset);
  auto halo_src = at::randn({B, 3, 3 * 32}, at::make_generator<at::CPUGeneratorImpl>(4), at::kDouble);
  plain.halo = [halo_src](const Tensor&, int64_t) { return halo_src; };
  MixerLayerContext indexed = plain;
  index_documents(indexed, T, at::kCPU);
  auto a = layer.forward(x, {}, plain).y, b = layer.forward(x, {}, indexed).y;
  EXPECT_TRUE(at::equal(a, b));
}

#ifdef CARRY_WITH_CUDA

struct ConvCase {
  at::ScalarType x_dtype, w_dtype;
  bool halo, documents, silu;
  int64_t K;
  bool bf16_out = false;  // bf16 x, fp32 weight, bf16 output (the kernel-form autocast path)
  bool odd = false;       // odd channel groups (an odd C)
};

struct ConvResult {
  std::vector<Tensor> out;  // y groups, dx, dw, dhalo
};

// The ATen form: per group, causal_conv1d with the tap mask, then silu; grads for Σ r·y.
ConvResult aten_conv(const Tensor& x0, const Tensor& w0, const Tensor& h0, const Tensor& starts, int64_t offset,
                     bool silu, const std::vector<int64_t>& widths, const std::vector<Tensor>& r, at::ScalarType dt,
                     at::ScalarType wdt) {
  auto x = x0.to(dt).detach().requires_grad_(true), w = w0.to(wdt).detach().requires_grad_(true);
  Tensor h = h0.defined() ? h0.to(dt).detach().requires_grad_(true) : Tensor();
  const int64_t B = x.size(0), T = x.size(1), K = w.size(1);
  Tensor mask;
  if (starts.defined()) {
    auto start = document_start_of(starts, offset, T);
    auto source = at::arange(offset - K + 1, offset - K + 1 + T, at::kLong).view({1, T, 1}) +
                  at::arange(K, at::kLong).view({1, 1, K});
    mask = (source >= start.unsqueeze(-1)).to(x.device());
  }
  std::vector<Tensor> ys;
  Tensor loss = at::zeros({}, x.options().dtype(at::kDouble));
  int64_t c0 = 0;
  for (size_t i = 0; i < widths.size(); ++i) {
    auto y = causal_conv1d(x.narrow(-1, c0, widths[i]), w.narrow(0, c0, widths[i]),
                           h.defined() ? h.narrow(-1, c0, widths[i]) : Tensor(), mask);
    if (silu) y = at::silu(y);
    ys.push_back(y.detach());
    loss = loss + (y.to(at::kDouble) * r[i]).sum();
    c0 += widths[i];
  }
  loss.backward();
  (void)B;
  ConvResult res{ys};
  res.out.push_back(x.grad());
  res.out.push_back(w.grad());
  res.out.push_back(h.defined() ? h.grad() : Tensor());
  return res;
}

ConvResult fused_conv(const Tensor& x0, const Tensor& w0, const Tensor& h0, const Tensor& start_dev, int64_t offset,
                      bool silu, const std::vector<int64_t>& widths, const std::vector<Tensor>& r,
                      bool bf16_out = false) {
  auto x = x0.detach().requires_grad_(true), w = w0.detach().requires_grad_(true);
  Tensor h = h0.defined() ? h0.detach().requires_grad_(true) : Tensor();
  auto ys = fused_causal_conv1d(x, w, h, start_dev, offset, silu, widths, bf16_out);
  Tensor loss = at::zeros({}, x.options().dtype(at::kDouble));
  for (size_t i = 0; i < ys.size(); ++i) loss = loss + (ys[i].to(at::kDouble) * r[i]).sum();
  loss.backward();
  ConvResult res;
  for (auto& y : ys) res.out.push_back(y.detach());
  res.out.push_back(x.grad());
  res.out.push_back(w.grad());
  res.out.push_back(h.defined() ? h.grad() : Tensor());
  return res;
}

const char* dname(at::ScalarType t) { return t == at::kFloat ? "fp32" : (t == at::kBFloat16 ? "bf16" : "fp64"); }

TEST(ConvKernel, ConvMatchesAtenForm) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
  const int64_t B = 2, T = 200, offset = 37, N = 300;
  const Tensor starts = packed_starts(B, N, offset);
  const Tensor start_dev = document_start_of(starts, 0, N).to(at::kCUDA);
  std::vector<ConvCase> cases;
  for (auto dt : {at::kFloat, at::kBFloat16})
    for (bool halo : {false, true})
      for (bool docs : {false, true})
        for (bool silu : {false, true}) cases.push_back({dt, at::kFloat, halo, docs, silu, 4});
  cases.push_back({at::kBFloat16, at::kBFloat16, true, true, true, 4});
  cases.push_back({at::kBFloat16, at::kBFloat16, false, false, false, 4});
  cases.push_back({at::kFloat, at::kFloat, true, true, false, 3});
  cases.push_back({at::kFloat, at::kFloat, true, true, true, 2});
  cases.push_back({at::kBFloat16, at::kFloat, true, true, true, 3});
  cases.push_back({at::kBFloat16, at::kFloat, true, true, true, 4, /*bf16_out=*/true});
  cases.push_back({at::kBFloat16, at::kFloat, false, false, false, 4, /*bf16_out=*/true});
  cases.push_back({at::kFloat, at::kFloat, true, true, true, 4, false, /*odd=*/true});
  cases.push_back({at::kBFloat16, at::kFloat, true, true, true, 4, true, /*odd=*/true});
  uint64_t seed = 11;
  for (const auto& c : cases) {
    const std::vector<int64_t> widths = c.odd ? std::vector<int64_t>{95, 97, 71} : std::vector<int64_t>{96, 96, 72};
    const int64_t C = widths[0] + widths[1] + widths[2];
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed++);
    auto x = at::randn({B, T, C}, gen, at::kDouble).to(at::kCUDA).to(c.x_dtype);
    auto w = (at::rand({C, c.K}, gen, at::kDouble) * 2 - 1).to(at::kCUDA).to(c.w_dtype);
    Tensor h = c.halo ? at::randn({B, c.K - 1, C}, gen, at::kDouble).to(at::kCUDA).to(c.x_dtype) : Tensor();
    std::vector<Tensor> r;
    for (auto wd : widths) r.push_back(at::randn({B, T, wd}, gen, at::kDouble).to(at::kCUDA));
    const Tensor st = c.documents ? starts : Tensor();
    auto fused = fused_conv(x, w, h, c.documents ? start_dev : Tensor(), offset, c.silu, widths, r, c.bf16_out);
    const auto out_dt = c.bf16_out ? at::kBFloat16 : at::promote_types(c.x_dtype, c.w_dtype);
    auto ref = aten_conv(x, w, h, st, offset, c.silu, widths, r, at::kDouble, at::kDouble);
    auto aten = aten_conv(x, w, h, st, offset, c.silu, widths, r, c.x_dtype, c.w_dtype);
    // The fused op's output and gradient dtypes are the ATen form's.
    for (size_t i = c.bf16_out ? widths.size() : 0; i < aten.out.size(); ++i)
      if (aten.out[i].defined()) EXPECT_EQ(fused.out[i].scalar_type(), aten.out[i].scalar_type()) << i;
    EXPECT_EQ(fused.out[0].scalar_type(), out_dt);
    const char* names[] = {"y.q", "y.k", "y.v", "dx", "dweight", "dhalo"};
    std::string label = std::string(dname(c.x_dtype)) + " w " + dname(c.w_dtype) + " K=" + std::to_string(c.K) +
                        (c.halo ? " halo" : "") + (c.documents ? " documents" : "") + (c.silu ? " silu" : "") +
                        (c.bf16_out ? " bf16 out" : "") + (c.odd ? " odd groups" : "");
    for (size_t i = 0; i < fused.out.size(); ++i) {
      if (!ref.out[i].defined()) {
        EXPECT_FALSE(fused.out[i].defined()) << label << " " << names[i];
        continue;
      }
      if (c.x_dtype == at::kFloat && c.w_dtype == at::kFloat) {
        const double e = err(fused.out[i], aten.out[i]);
        std::cout << "[ errors   ] conv " << label << " " << names[i] << " fused vs aten fp32 " << e << "\n";
        EXPECT_LE(e, 1e-5) << label << " " << names[i];
      } else {
        const double e = err(fused.out[i], ref.out[i]), ea = err(aten.out[i], ref.out[i]);
        std::cout << "[ errors   ] conv " << label << " " << names[i] << " vs fp64: fused " << e << ", aten " << ea
                  << "\n";
        EXPECT_LE(e, 1e-2) << label << " " << names[i];
        if (ea > 1e-3) EXPECT_LE(e, (c.bf16_out ? 4 : 2) * ea) << label << " " << names[i];
      }
    }
    // Bitwise reproducible gradients (no atomics).
    auto again = fused_conv(x, w, h, c.documents ? start_dev : Tensor(), offset, c.silu, widths, r, c.bf16_out);
    for (size_t i = 0; i < fused.out.size(); ++i)
      if (fused.out[i].defined()) EXPECT_TRUE(at::equal(fused.out[i], again.out[i])) << label << " " << names[i];
  }
}

TEST(ConvKernel, ConvRejectsWhatItDoesNotTake) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
  auto x = at::randn({1, 8, 16}, at::TensorOptions().device(at::kCUDA));
  EXPECT_FALSE(fused_conv_supports(x, at::randn({16, 5}, x.options())));  // K > 4
  EXPECT_FALSE(fused_conv_supports(x.cpu(), at::randn({16, 4})));
  EXPECT_FALSE(fused_conv_supports(x.to(at::kHalf), at::randn({16, 4}, x.options())));
  EXPECT_THROW(fused_causal_conv1d(x, at::randn({16, 4}, x.options()), at::randn({1, 2, 16}, x.options()), Tensor(), 0,
                                   false, {16}),
               c10::Error);  // halo of the wrong length
  EXPECT_THROW(fused_causal_conv1d(x, at::randn({16, 4}, x.options()), Tensor(), Tensor(), 0, false, {8, 4}),
               c10::Error);  // groups not summing to C
}

TEST(ConvKernel, L2NormalizeMatchesAtenForm) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
  auto aten = [](const Tensor& x) { return x * at::rsqrt(x.pow(2).sum(-1, true) + 1e-6); };
  uint64_t seed = 21;
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    for (int64_t dk : {64, 100, 128, 256}) {
      for (bool strided : {false, true}) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(seed++);
        const int64_t B = 2, T = 37, H = 3;
        // strided: q as a channel group of a wider [B,T,C] tensor (the fused convolution's layout).
        auto base = at::randn({B, T, H * dk + (strided ? 40 : 0)}, gen, at::kDouble).to(at::kCUDA).to(dt);
        auto r = at::randn({B, T, H, dk}, gen, at::kDouble).to(at::kCUDA);
        auto run = [&](bool fused, at::ScalarType as) {
          auto b = base.to(as).detach().requires_grad_(true);
          auto x = b.narrow(-1, strided ? 16 : 0, H * dk).view({B, T, H, dk});
          auto y = fused ? fused_l2_normalize(x) : aten(x);
          (y.to(at::kDouble) * r).sum().backward();
          return std::vector<Tensor>{y.detach(), b.grad()};
        };
        auto f = run(true, dt), ref = run(false, at::kDouble), a = run(false, dt);
        std::string label = std::string(dname(dt)) + " dk=" + std::to_string(dk) + (strided ? " strided" : "");
        const char* names[] = {"y", "dx"};
        for (int i = 0; i < 2; ++i) {
          EXPECT_EQ(f[i].scalar_type(), dt);
          const double e = err(f[i], dt == at::kFloat ? a[i] : ref[i]), ea = err(a[i], ref[i]);
          std::cout << "[ errors   ] l2 " << label << " " << names[i] << " fused " << e << ", aten " << ea
                    << (dt == at::kFloat ? " (fused vs aten fp32; aten vs fp64)" : " (vs fp64)") << "\n";
          EXPECT_LE(e, dt == at::kFloat ? 1e-5 : 1e-2) << label << " " << names[i];
        }
      }
    }
  }
}

// The layer with the fused ops equals the layer with the ATen forms (fp32; packed documents; a halo;
// index_documents on the device as Model::hidden does, and the layer deriving it itself).
TEST(ConvKernel, LayerFusedEqualsAten) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
  for (const char* kind : {"gated_deltanet", "mamba2", "mamba1"}) {
    MixerLayerSpec spec;
    spec.kind = kind;
    spec.d_model = 64, spec.n_heads = 2, spec.head_dim_k = 64, spec.head_dim_v = 64, spec.chunk_size = 64;
    spec.conv_size = 4;
    ParameterInit init(7, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
    MixerLayer layer(spec, init);
    const int64_t B = 2, T = 192, offset = 37, N = 300;
    auto x0 = at::randn({B, T, spec.d_model}, at::make_generator<at::CPUGeneratorImpl>(3), at::kFloat).to(at::kCUDA);
    const int64_t C = std::string(kind) == "mamba1" ? 128 : 3 * 128;
    auto halo_src = at::randn({B, 3, C}, at::make_generator<at::CPUGeneratorImpl>(4), at::kFloat).to(at::kCUDA);
    for (bool indexed : {false, true}) {
      auto run = [&](bool fused) {
        set_fused_ops(fused);
        MixerLayerContext ctx;
        ctx.offset = offset;
        ctx.sequence_length = N;
        ctx.document_starts = packed_starts(B, N, offset);
        auto h = halo_src.detach().requires_grad_(true);
        ctx.halo = [h](const Tensor& t, int64_t n) {
          EXPECT_EQ(n, 3);
          return h.to(t.scalar_type());
        };
        if (indexed) index_documents(ctx, T, x0.device());
        auto x = x0.detach().requires_grad_(true);
        auto y = layer.forward(x, {}, ctx).y;
        auto r = at::randn(y.sizes(), at::make_generator<at::CPUGeneratorImpl>(5), at::kFloat).to(at::kCUDA);
        (y * r).sum().backward();
        std::vector<Tensor> out{y.detach(), x.grad(), h.grad()};
        for (auto& [name, p] : layer.parameters()) {
          out.push_back(p.grad().defined() ? p.grad().clone() : Tensor());
          if (p.grad().defined()) p.mutable_grad() = Tensor();
        }
        return out;
      };
      auto f = run(true), a = run(false);
      set_fused_ops(true);
      double e = 0;
      for (size_t i = 0; i < f.size(); ++i) e = std::max(e, err(f[i], a[i]));
      std::cout << "[ errors   ] layer " << kind << (indexed ? " indexed" : "") << " fused vs aten fp32 " << e << "\n";
      EXPECT_LE(e, 1e-4) << kind;
    }
  }
}

#endif  // CARRY_WITH_CUDA

}  // namespace
}  // namespace carry::testing
