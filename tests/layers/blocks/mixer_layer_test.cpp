// Tests of layers/blocks/mixer_layer.*: for every kind (linear attention with both of its feature maps),
// the layer with the family's chunkwise form equals it with the naive form (fp64, outputs and input
// gradients); the short convolution and the whole layer are causal; a sequence cut in two slices, the
// second given the first's final state, its halo and its offset, gives the whole sequence's outputs (what
// sequence parallelism will rely on); bad kinds, feature maps and inputs are refused with clear messages.
#include "layers/blocks/mixer_layer.h"

#include "layers/core/device.h"
#include "layers/layout.h"
#include "layers/blocks/precision.h"
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>

#include <iostream>
#include <tuple>

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

namespace carry {
namespace {

constexpr int64_t kD = 16, kT = 32, kB = 2;

MixerLayerSpec small_spec(const std::string& kind, int64_t conv_size, int64_t window = 0,
                          const std::string& feature_map = "elu") {
  MixerLayerSpec s;
  s.kind = kind;
  s.d_model = kD;
  s.n_heads = 2;
  s.head_dim_k = 8;
  s.head_dim_v = 6;
  s.chunk_size = 8;
  s.conv_size = conv_size;
  s.window = window;
  s.normalize = kind == "linear_attn";
  s.feature_map = feature_map;
  s.num_features = 12;  // Performer: a block of 8 orthogonal features and 4 of a second
  s.n_layers = 2;
  s.init_std = 0.3;  // larger than a model's 0.02, so that every term matters in the comparisons
  return s;
}

struct Case {
  std::string kind;
  int64_t conv_size;
  int64_t window;
  std::string feature_map = "elu";
};

MixerLayerSpec small_spec(const Case& c) { return small_spec(c.kind, c.conv_size, c.window, c.feature_map); }

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (auto& k : mixer_layer_kinds()) {
    if (k == "softmax_attn") {
      cases.push_back({k, 0, 0});
      cases.push_back({k, 0, 11});
    } else if (k == "rwkv7") {
      cases.push_back({k, 0, 0});  // no short convolutions: its token shift takes their place
    } else {
      cases.push_back({k, 4, 0});
    }
  }
  cases.push_back({"gla", 0, 0});
  cases.push_back({"linear_attn", 4, 0, "performer"});
  return cases;
}

std::string case_name(const Case& c) {
  return c.kind + " conv " + std::to_string(c.conv_size) + " window " + std::to_string(c.window) +
         (c.feature_map == "elu" ? "" : " " + c.feature_map);
}

Tensor random_x(uint64_t seed, int64_t T = kT) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn({kB, T, kD}, gen, at::TensorOptions().dtype(at::kDouble));
}

double rel(const Tensor& a, const Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-300);
}

MixerLayerContext naive_context() {
  MixerLayerContext c;
  c.run_mixer = [](const Mixer& m, const MixerInputs& in, const State& s, const MixerOptions& o) {
    return m.naive(in, s, o);
  };
  return c;
}

TEST(MixerLayer, EveryConfigKindHasARegisteredFamily) {
  auto names = mixer_names();
  for (auto& k : mixer_layer_kinds()) {
    auto f = mixer_layer_family(k);
    EXPECT_NE(std::find(names.begin(), names.end(), f), names.end()) << k << " -> " << f;
  }
  EXPECT_EQ(mixer_layer_family("mamba2"), "scalar_decay");
  EXPECT_EQ(mixer_layer_family("nonsense"), "");
}

TEST(MixerLayer, ChunkwiseEqualsNaiveForEveryKind) {
  for (auto& c : all_cases()) {
    ParameterInit init(3, at::TensorOptions().dtype(at::kDouble));
    MixerLayer layer(small_spec(c), init);
    if (c.kind == "rwkv7") testing::perturb_parameters(layer.parameters(), 17, 0.3);  // its o_proj starts at 0
    auto x = random_x(5).set_requires_grad(true);
    auto w = random_x(6);
    auto y_chunk = layer.forward(x).y;
    auto y_naive = layer.forward(x, {}, naive_context()).y;
    auto g_chunk = torch::autograd::grad({(y_chunk * w).sum()}, {x})[0];
    auto g_naive = torch::autograd::grad({(y_naive * w).sum()}, {x})[0];
    double ey = rel(y_chunk, y_naive), eg = rel(g_chunk, g_naive);
    std::printf("[ errors   ] mixer layer %-36s chunkwise vs naive: y %.2e, dx %.2e\n", case_name(c).c_str(), ey,
                eg);
    EXPECT_LE(ey, 1e-10) << case_name(c);
    EXPECT_LE(eg, 1e-10) << case_name(c);
    EXPECT_GT(y_chunk.abs().max().item<double>(), 1e-3) << case_name(c) << ": outputs all but zero";
  }
}

// Under bf16 autocast (CPU here) the projections run in bf16 but the family's core gets fp32 inputs
// and returns an fp32 state, for every kind; the output stays close to the fp32 layer's.
TEST(MixerLayer, AutocastRunsTheCoreInFp32) {
  for (auto& c : all_cases()) {
    ParameterInit init(3, at::TensorOptions().dtype(at::kFloat));
    MixerLayer layer(small_spec(c), init);
    if (c.kind == "rwkv7") testing::perturb_parameters(layer.parameters(), 17, 0.3);  // its o_proj starts at 0
    auto x = random_x(5).to(at::kFloat);
    std::vector<at::ScalarType> core_dtypes;
    MixerLayerContext ctx;
    ctx.run_mixer = [&](const Mixer& m, const MixerInputs& in, const State& st, const MixerOptions& o) {
      for (auto& n : m.input_names()) core_dtypes.push_back(in.get(n).scalar_type());
      auto out = m.chunkwise(in, st, o);
      core_dtypes.push_back(out.o.scalar_type());
      return out;
    };
    auto y32 = layer.forward(x, {}, ctx).y;
    core_dtypes.clear();
    MixerLayerOutput out16;
    {
      AutocastScope autocast(at::kCPU, at::kBFloat16);
      out16 = layer.forward(x, {}, ctx);
    }
    for (auto d : core_dtypes) EXPECT_EQ(d, at::kFloat) << case_name(c);
    for (auto& t : out16.final_state) EXPECT_EQ(t.scalar_type(), at::kFloat) << case_name(c);
    EXPECT_EQ(out16.y.scalar_type(), at::kBFloat16) << case_name(c) << ": the output projection ran in bf16";
    double e = rel(out16.y.to(at::kFloat), y32);
    std::printf("[ errors   ] mixer layer %-36s bf16 autocast vs fp32: %.2e\n", case_name(c).c_str(), e);
    EXPECT_LE(e, 5e-2) << case_name(c);
    EXPECT_GT(e, 0) << case_name(c) << ": autocast changed nothing";
  }
}

// On CUDA under bf16 autocast a slice context's core (run_mixer: the tree, allgather and ordered scans)
// gets what the layer's own kernel call gets: q, k, v in bf16, the gates in fp32. Until this test an
// fp32 copy went to the scans that summarize, and the kernels' fp32 path ran several times slower.
// The layer through a run_mixer that calls the family's forward equals the layer without one, bit for
// bit, outputs and gradients. Skips itself without a GPU.
TEST(MixerLayer, ScanContextsGetTheKernelInputsUnderAutocast) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
  for (const char* kind : {"gated_deltanet", "deltanet", "gla", "mamba2", "retnet", "linear_attn"}) {
    MixerLayerSpec spec;
    spec.kind = kind;
    spec.d_model = 128, spec.n_heads = 2, spec.head_dim_k = 64, spec.head_dim_v = 64, spec.chunk_size = 64;
    spec.conv_size = 4;
    spec.n_layers = 2;
    ParameterInit init(7, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
    MixerLayer layer(spec, init);
    auto x0 = at::randn({1, 256, spec.d_model}, at::make_generator<at::CPUGeneratorImpl>(3), at::kFloat).to(at::kCUDA);
    auto r = at::randn({1, 256, spec.d_model}, at::make_generator<at::CPUGeneratorImpl>(4), at::kFloat).to(at::kCUDA);
    std::vector<at::ScalarType> seen;
    auto run = [&](bool through_context) {
      MixerLayerContext ctx;
      if (through_context)
        ctx.run_mixer = [&](const Mixer& m, const MixerInputs& in, const State& st, const MixerOptions& o) {
          for (auto& n : m.input_names()) seen.push_back(in.get(n).scalar_type());
          return m.forward(in, st, o);
        };
      auto x = x0.detach().requires_grad_(true);
      Tensor y;
      {
        AutocastScope autocast(at::kCUDA, at::kBFloat16);
        y = layer.forward(x, {}, ctx).y;
      }
      (y.to(at::kFloat) * r).sum().backward();
      std::vector<Tensor> out{y.detach(), x.grad()};
      for (auto& [name, p] : layer.parameters()) {
        out.push_back(p.grad().defined() ? p.grad().clone() : Tensor());
        if (p.grad().defined()) p.mutable_grad() = Tensor();
      }
      return out;
    };
    auto plain = run(false), routed = run(true);
    ASSERT_FALSE(seen.empty()) << kind;
    for (size_t i = 0; i < seen.size(); ++i) {
      const auto& names = layer.mixer().input_names();
      const auto& n = names[i % names.size()];
      const auto want = MixerInputs::is_gate(n) ? at::kFloat : at::kBFloat16;
      EXPECT_EQ(seen[i], want) << kind << ": input " << n;
    }
    for (size_t i = 0; i < plain.size(); ++i) {
      ASSERT_EQ(plain[i].defined(), routed[i].defined()) << kind << " output " << i;
      if (plain[i].defined()) EXPECT_TRUE(at::equal(plain[i], routed[i])) << kind << " output " << i;
    }
  }
}

// state_product's bf16 form (the one-pass scans' share of S_in on CUDA: bf16 operands on tensor
// cores, fp32 accumulation and result; S's gradient summed in pieces of tokens) against its fp64 form
// on the same inputs: the output and both gradients within bf16 rounding, the gradients in the inputs'
// dtypes. T = 8448 sums S's gradient in 33 pieces of 256 tokens, T = 8192 in 2 of 4096. Skips itself
// without a GPU.
TEST(MixerLayer, StateProductInBf16MatchesFp64OnCuda) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
  for (int64_t T : {int64_t{256}, int64_t{8192}, int64_t{8448}}) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(11 + T);
    Tensor x0 = at::randn({2, T, 3, 64}, gen, at::kFloat).to(at::kBFloat16);
    Tensor s0 = at::randn({2, 3, 64, 128}, gen, at::kFloat);
    Tensor gy = at::randn({2, T, 3, 128}, gen, at::kFloat);
    auto x = x0.to(at::kCUDA).requires_grad_(true), S = s0.to(at::kCUDA).requires_grad_(true);
    Tensor y = state_product(x, S);
    EXPECT_EQ(y.scalar_type(), at::kFloat);
    auto g = torch::autograd::grad({y}, {x, S}, {gy.to(at::kCUDA)});
    EXPECT_EQ(g[0].scalar_type(), at::kBFloat16);
    EXPECT_EQ(g[1].scalar_type(), at::kFloat);
    auto xr = x0.to(at::kDouble).requires_grad_(true), sr = s0.to(at::kDouble).requires_grad_(true);
    Tensor yr = state_product(xr, sr);
    auto gr = torch::autograd::grad({yr}, {xr, sr}, {gy.to(at::kDouble)});
    auto err = [](const Tensor& a, const Tensor& b) {
      return (a.cpu().to(at::kDouble) - b).abs().max().item<double>() / b.abs().max().item<double>();
    };
    const double ey = err(y, yr), ex = err(g[0], gr[0]), es = err(g[1], gr[1]);
    std::cout << "[ errors   ] state_product bf16, T=" << T << ": y " << ey << " dx " << ex << " dS " << es << "\n";
    EXPECT_LE(ey, 1e-2);
    EXPECT_LE(ex, 1e-2);
    EXPECT_LE(es, 1e-2);
  }
}

TEST(MixerLayer, ConvolutionIsCausalAndTakesItsHaloExactly) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  auto opt = at::TensorOptions().dtype(at::kDouble);
  auto x = at::randn({2, 12, 5}, gen, opt), w = at::randn({5, 4}, gen, opt);
  auto y = causal_conv1d(x, w);
  for (int64_t t0 = 0; t0 < 12; ++t0) {
    auto x2 = x.clone();
    x2.narrow(1, t0 + 1, 12 - t0 - 1).add_(at::randn({2, 12 - t0 - 1, 5}, gen, opt));
    auto y2 = causal_conv1d(x2, w);
    EXPECT_TRUE(at::equal(y2.narrow(1, 0, t0 + 1), y.narrow(1, 0, t0 + 1))) << "t0 " << t0;
    if (t0 + 1 < 12) EXPECT_FALSE(at::equal(y2, y));  // the perturbation is seen later
  }
  // A slice with the 3 tokens before it as halo gives the whole sequence's outputs, bit for bit.
  auto tail = causal_conv1d(x.narrow(1, 5, 7), w, x.narrow(1, 2, 3));
  EXPECT_TRUE(at::equal(tail, y.narrow(1, 5, 7)));
  // Known values: y_t = Σ_j w[:,j] x_{t-3+j}.
  auto expect = w.select(1, 3) * x.select(1, 2) + w.select(1, 2) * x.select(1, 1) + w.select(1, 1) * x.select(1, 0);
  EXPECT_LE((y.select(1, 2) - expect).abs().max().item<double>(), 1e-14);
  try {
    causal_conv1d(x, w, at::zeros({2, 2, 5}, opt));
    ADD_FAILURE() << "a halo of the wrong length was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("halo must be [2, 3, 5]"), std::string::npos)
        << e.what_without_backtrace();
  }
}

TEST(MixerLayer, LayerIsCausalForEveryKind) {
  for (auto& c : all_cases()) {
    ParameterInit init(4, at::TensorOptions().dtype(at::kDouble));
    MixerLayer layer(small_spec(c), init);
    if (c.kind == "rwkv7") testing::perturb_parameters(layer.parameters(), 17, 0.3);  // its o_proj starts at 0
    auto x = random_x(7);
    auto y = layer.forward(x).y;
    for (int64_t t0 : {3, 8, 20}) {
      auto x2 = x.clone();
      x2.narrow(1, t0 + 1, kT - t0 - 1).mul_(-2.0).add_(0.5);
      auto y2 = layer.forward(x2).y;
      double before = (y2.narrow(1, 0, t0 + 1) - y.narrow(1, 0, t0 + 1)).abs().max().item<double>();
      double after = (y2 - y).abs().max().item<double>();
      EXPECT_LE(before, 1e-13 * y.abs().max().item<double>()) << case_name(c) << " t0 " << t0;
      EXPECT_GT(after, 1e-6) << case_name(c) << ": later inputs change nothing";
    }
  }
}

// The sequence in two slices: the second gets the first's final state, the tokens before it through
// `halo`, its absolute offset and the whole sequence's length. Same outputs as one slice (softmax_attn
// only with a window, whose keys the halo brings; full causal attention cannot be cut).
TEST(MixerLayer, TwoSlicesWithStateHaloAndOffsetEqualTheWholeSequence) {
  for (auto& c : all_cases()) {
    if (c.kind == "softmax_attn" && c.window == 0) continue;
    ParameterInit init(8, at::TensorOptions().dtype(at::kDouble));
    MixerLayer layer(small_spec(c), init);
    if (c.kind == "rwkv7") testing::perturb_parameters(layer.parameters(), 17, 0.3);  // its o_proj starts at 0
    auto x = random_x(9);
    auto whole = layer.forward(x).y;
    const int64_t T1 = kT / 2;
    std::vector<Tensor> seen;  // what the first slice handed to `halo`, in call order
    MixerLayerContext first;
    first.sequence_length = kT;
    first.halo = [&](const Tensor& t, int64_t) {
      seen.push_back(t);
      return Tensor();  // the first slice starts the sequence
    };
    auto a = layer.forward(x.narrow(1, 0, T1), {}, first);
    size_t call = 0;
    MixerLayerContext second;
    second.offset = T1;
    second.sequence_length = kT;
    second.halo = [&](const Tensor& t, int64_t n) {
      EXPECT_LT(call, seen.size());
      auto& prev = seen.at(call++);
      EXPECT_EQ(prev.sizes(), t.sizes());
      return prev.narrow(1, prev.size(1) - n, n);
    };
    auto b = layer.forward(x.narrow(1, T1, kT - T1), a.final_state, second);
    EXPECT_EQ(call, seen.size()) << case_name(c);
    auto cut = at::cat({a.y, b.y}, 1);
    double e = rel(cut, whole);
    std::printf("[ errors   ] mixer layer %-36s two slices vs whole: %.2e\n", case_name(c).c_str(), e);
    EXPECT_LE(e, 1e-12) << case_name(c);
  }
}

TEST(MixerLayer, ParametersAreNamedLeavesInAFixedOrder) {
  ParameterInit init(1, at::TensorOptions().dtype(at::kDouble));
  MixerLayer layer(small_spec("gated_deltanet", 4), init);
  std::vector<std::string> names;
  for (auto& [n, t] : layer.parameters()) {
    names.push_back(n);
    EXPECT_TRUE(t.requires_grad() && t.is_leaf()) << n;
    EXPECT_EQ(t.scalar_type(), at::kDouble) << n;
  }
  std::vector<std::string> expect = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv.weight",
                                     "k_conv.weight", "v_conv.weight", "a_proj.weight", "dt_bias",
                                     "A_log",         "b_proj.weight", "z_proj.weight", "o_norm.weight",
                                     "o_proj.weight"};
  EXPECT_EQ(names, expect);
  // Decays at initialization: exp(−A·softplus(dt_bias)) within [exp(−16·0.1), exp(−0.001)] (zero input).
  MixerLayer mamba(small_spec("mamba2", 4), init);
  auto p = mamba.parameters();
  Tensor A_log, dt_bias;
  for (auto& [n, t] : p) {
    if (n == "A_log") A_log = t;
    if (n == "dt_bias") dt_bias = t;
  }
  auto decay = at::exp(-at::exp(A_log) * at::softplus(dt_bias));
  EXPECT_GE(decay.min().item<double>(), std::exp(-1.6) - 1e-12);
  EXPECT_LE(decay.max().item<double>(), std::exp(-0.001) + 1e-12);
}

// Grouped value heads (n_v_heads = 2·n_heads): the layer equals the layer with n_v_heads query/key heads whose
// query and key projections and convolutions repeat each head's rows for its group (value head h reading
// query/key head h / 2, FLA's GVA), every other parameter the same: outputs and input gradients, naive and
// chunkwise, DeltaNet and Gated DeltaNet; the shapes of the per-value-head parameters.
TEST(MixerLayer, GroupedValueHeadsEqualRepeatedQueryKeyHeads) {
  for (const std::string kind : {"deltanet", "gated_deltanet"}) {
    MixerLayerSpec gs = small_spec(kind, 4);
    gs.n_v_heads = 2 * gs.n_heads;
    ParameterInit init(21, at::TensorOptions().dtype(at::kDouble));
    MixerLayer grouped(gs, init);
    MixerLayerSpec fs = small_spec(kind, 4);
    fs.n_heads = gs.n_v_heads;
    ParameterInit init2(22, at::TensorOptions().dtype(at::kDouble));
    MixerLayer full(fs, init2);
    const int64_t dk = gs.head_dim_k, dv = gs.head_dim_v, Hv = gs.n_v_heads;
    auto gp = grouped.parameters(), fp = full.parameters();
    ASSERT_EQ(gp.size(), fp.size());
    {
      at::NoGradGuard ng;
      for (size_t i = 0; i < gp.size(); ++i) {
        const auto& [name, g] = gp[i];
        const Tensor& f = fp[i].second;
        ASSERT_EQ(fp[i].first, name);
        const bool qk = name == "q_proj.weight" || name == "k_proj.weight" || name == "q_conv.weight" ||
                        name == "k_conv.weight";
        if (qk) {
          // Rows (h d): head h's dk rows repeated twice, consecutively.
          auto rows = g.reshape({gs.n_heads, dk, g.size(1)}).repeat_interleave(2, 0).reshape(f.sizes());
          f.copy_(rows);
        } else {
          ASSERT_EQ(g.sizes(), f.sizes()) << kind << " " << name;
          f.copy_(g);
        }
        if (name == "v_proj.weight" || name == "z_proj.weight") EXPECT_EQ(g.size(0), Hv * dv) << name;
        if (name == "o_proj.weight") EXPECT_EQ(g.size(1), Hv * dv) << name;
        if (name == "b_proj.weight" || name == "a_proj.weight") EXPECT_EQ(g.size(0), Hv) << name;
        if (name == "q_proj.weight") EXPECT_EQ(g.size(0), gs.n_heads * dk) << name;
      }
    }
    for (bool naive : {false, true}) {
      auto ctx = naive ? naive_context() : MixerLayerContext{};
      auto x = random_x(23).set_requires_grad(true);
      auto w = random_x(24);
      auto yg = grouped.forward(x, {}, ctx).y, yf = full.forward(x, {}, ctx).y;
      auto gg = torch::autograd::grad({(yg * w).sum()}, {x})[0];
      auto gf = torch::autograd::grad({(yf * w).sum()}, {x})[0];
      EXPECT_LE(rel(yg, yf), 1e-12) << kind << (naive ? " naive" : " chunkwise");
      EXPECT_LE(rel(gg, gf), 1e-12) << kind << (naive ? " naive" : " chunkwise");
      EXPECT_GT(yg.abs().max().item<double>(), 1e-3) << kind;
    }
  }
  MixerLayerSpec bad = small_spec("gla", 0);
  bad.n_v_heads = 4;
  ParameterInit init(1, at::TensorOptions().dtype(at::kDouble));
  try {
    MixerLayer l(bad, init);
    ADD_FAILURE() << "gla with n_v_heads was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("n_v_heads (4) must be a multiple of n_heads (2) and differ"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

TEST(MixerLayer, RefusesUnknownKindsAndBadInputs) {
  ParameterInit init(1, at::TensorOptions().dtype(at::kDouble));
  try {
    MixerLayer layer(small_spec("mamba3", 0), init);
    ADD_FAILURE() << "unknown kind accepted";
  } catch (const c10::Error& e) {
    std::string m = e.what_without_backtrace();
    EXPECT_NE(m.find("unknown mixer kind 'mamba3'"), std::string::npos) << m;
    EXPECT_NE(m.find("gated_deltanet"), std::string::npos) << m;
  }
  MixerLayer layer(small_spec("gla", 0), init);
  try {
    layer.forward(at::randn({2, 16, kD + 1}, at::kDouble));
    ADD_FAILURE() << "wrong width accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("x must be [B, T, 16]"), std::string::npos);
  }
  try {
    layer.forward(at::randn({2, 12, kD}, at::kDouble));  // 12 is not a multiple of chunk_size 8
    ADD_FAILURE() << "partial chunk accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("multiple of chunk_size=8"), std::string::npos)
        << e.what_without_backtrace();
  }
  // Feature maps: a name that is none, and one on a kind that applies none.
  for (auto [kind, map, needle] : {std::tuple<const char*, const char*, const char*>{
                                       "linear_attn", "relu", "feature_map must be \"elu\" or \"performer\", got \"relu\""},
                                   {"gla", "performer", "applies to linear_attn layers only"}}) {
    try {
      MixerLayer bad(small_spec(kind, 0, 0, map), init);
      ADD_FAILURE() << kind << " with feature map " << map << " accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find(needle), std::string::npos) << e.what_without_backtrace();
    }
  }
}

}  // namespace
}  // namespace carry
