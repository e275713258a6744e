// RWKV-7's layer kind `rwkv7` (layers/rwkv7/time_mix.h): three layers stacked with residuals (the first
// one's values feeding the value residual of the other two), with nonzero random parameters, against an
// independent fp64 re-statement of FLA's RWKV7Attention forward written here (token shift by padding, torch's
// lerp, group_norm and normalize, the dplr recurrence token by token as FLA's naive dplr_recurrence writes
// it): the output and the gradient of every parameter and of the input; the chunkwise and naive forms of
// the family give the same layers; packed documents restart the token shift; the parameter names are FLA's
// state-dict keys of RWKV7Attention and the initial values FLA's `_initialize_weights`.
#include "layers/blocks/mixer_layer.h"
#include "layers/rwkv7/time_mix.h"
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>

namespace carry::testing {
namespace {

constexpr int64_t kB = 2, kT = 24, kD = 16, kH = 2, kDk = 8, kDv = 6, kLayers = 3;

MixerLayerSpec spec(int64_t layer, int64_t n_layers = kLayers) {
  MixerLayerSpec s;
  s.kind = "rwkv7";
  s.d_model = kD;
  s.n_heads = kH;
  s.head_dim_k = kDk;
  s.head_dim_v = kDv;
  s.chunk_size = 8;
  s.layer = layer;
  s.n_layers = n_layers;
  s.value_residual = layer > 0;
  return s;
}

struct Stack {
  std::vector<std::unique_ptr<MixerLayer>> layers;
  std::vector<Tensor> parameters() const {
    std::vector<Tensor> out;
    for (auto& l : layers)
      for (auto& [n, p] : l->parameters()) out.push_back(p);
    return out;
  }
};

// FLA's initial values plus noise of std 0.3 (o_proj and the LoRAs' first factors start at 0 in FLA).
Stack make_stack(uint64_t seed) {
  Stack s;
  ParameterInit init(seed, at::TensorOptions().dtype(at::kDouble));
  for (int64_t i = 0; i < kLayers; ++i) {
    s.layers.push_back(std::make_unique<MixerLayer>(spec(i), init));
    perturb_parameters(s.layers.back()->parameters(), seed + 100 + i, 0.3);
  }
  return s;
}

// x_{i+1} = x_i + layer_i(x_i), the first layer's values handed to every layer.
Tensor run_stack(const Stack& s, const Tensor& x0, const MixerLayerContext& ctx = {}) {
  Tensor x = x0, v_first;
  for (auto& l : s.layers) {
    if (!v_first.defined()) v_first = l->value_first(x, ctx);
    x = x + l->forward(x, {}, ctx, v_first).y;
  }
  return x;
}

// ---- The re-statement of FLA's RWKV7Attention (fla/layers/rwkv7.py), fp64, [B, T, ·] tensors. ----

struct Fla {
  std::map<std::string, Tensor> p;
  const Tensor& operator[](const std::string& n) const { return p.at(n); }
};

Fla fla_params(const MixerLayer& l) {
  Fla f;
  for (auto& [n, t] : l.parameters()) f.p[n] = t;
  return f;
}

Tensor fla_lora(const Fla& P, const std::string& name, const Tensor& x, const std::string& act, bool bias) {
  Tensor h = at::matmul(x, P[name + ".lora.0.weight"].t());
  if (act == "tanh") h = at::tanh(h);
  if (act == "sigmoid") h = at::sigmoid(h);
  h = at::matmul(h, P[name + ".lora.2.weight"].t());
  return bias ? h + P[name + ".lora.2.bias"] : h;
}

// One RWKV7Attention forward; v_first in/out as FLA's. document_starts [B,T] bool or undefined (FLA's
// cu_seqlens: token_shift restarts at each sequence).
Tensor fla_attention(const Fla& P, const Tensor& x, Tensor& v_first, bool first_layer, const Tensor& starts = {}) {
  const int64_t B = x.size(0), T = x.size(1);
  // time_shift = ZeroPad2d((0, 0, 1, -1)): x_{t−1}, zero at t = 0.
  Tensor shifted = at::constant_pad_nd(x, {0, 0, 1, -1});
  if (starts.defined()) shifted = shifted * starts.logical_not().unsqueeze(-1).to(x.scalar_type());
  Tensor delta = shifted - x;
  auto mix = [&](const char* n) { return at::addcmul(x, delta, P[n]); };
  Tensor xr = mix("x_r"), xw = mix("x_w"), xk = mix("x_k"), xv = mix("x_v"), xa = mix("x_a"), xg = mix("x_g");
  Tensor r = at::matmul(xr, P["r_proj.weight"].t());
  Tensor w = -0.6065306597126334 * at::sigmoid(fla_lora(P, "w_lora", xw, "tanh", true));
  Tensor k = at::matmul(xk, P["k_proj.weight"].t());
  Tensor v = at::matmul(xv, P["v_proj.weight"].t());
  if (first_layer) v_first = v;
  else v = at::lerp(v, v_first, at::sigmoid(fla_lora(P, "v_lora", xv, "", true)));
  Tensor a = at::sigmoid(fla_lora(P, "a_lora", xa, "", true));
  Tensor g = fla_lora(P, "g_lora", xg, "sigmoid", false);
  Tensor kk = (k * P["k_k"]).view({B, T, kH, kDk});
  kk = kk / at::clamp_min(at::linalg_vector_norm(kk, 2, {-1}, true), 1e-12);  // F.normalize
  k = k.addcmul(k * (a - 1), P["k_a"]);
  auto heads = [&](const Tensor& t, int64_t d) { return t.reshape({B, T, kH, d}); };
  Tensor rh = heads(r, kDk), wh = heads(w, kDk), kh = heads(k, kDk), vh = heads(v, kDv), ah = heads(a, kDk);
  Tensor alpha = -kk, beta = kk * ah;
  // dplr_recurrence: S ← S·e^{gk} + k vᵀ + (Σ_d S ⊙ α) β, o = qᵀ S (scale 1).
  Tensor S = at::zeros({B, kH, kDk, kDv}, x.options());
  std::vector<Tensor> o;
  for (int64_t t = 0; t < T; ++t) {
    if (starts.defined()) S = S * starts.select(1, t).logical_not().to(x.scalar_type()).view({B, 1, 1, 1});
    Tensor kt = kh.select(1, t), vt = vh.select(1, t), qt = rh.select(1, t);
    Tensor at_ = alpha.select(1, t), bt = beta.select(1, t);
    Tensor kv = kt.unsqueeze(-1) * vt.unsqueeze(-2) + (S * at_.unsqueeze(-1)).sum(-2, true) * bt.unsqueeze(-1);
    S = S * wh.select(1, t).exp().unsqueeze(-1) + kv;
    o.push_back(at::einsum("bhd,bhdm->bhm", {qt, S}));
  }
  Tensor out = at::stack(o, 1);  // [B,T,H,dv]
  out = at::group_norm(out.reshape({B * T, kH * kDv}), kH, P["g_norm.weight"], P["g_norm.bias"], kDk * 1e-5)
            .view({B, T, kH * kDv});
  // gate_output_correction_ref
  Tensor correction = ((rh * kh * P["r_k"].unsqueeze(0).unsqueeze(0)).sum(-1, true) * vh).view({B, T, kH * kDv});
  out = (out + correction) * g;
  return at::matmul(out, P["o_proj.weight"].t());
}

Tensor fla_stack(const Stack& s, const Tensor& x0, const Tensor& starts = {}) {
  Tensor x = x0, v_first;
  for (size_t i = 0; i < s.layers.size(); ++i) x = x + fla_attention(fla_params(*s.layers[i]), x, v_first, i == 0, starts);
  return x;
}

double rel(const Tensor& a, const Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-300);
}

Tensor random(std::vector<int64_t> shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kDouble));
}

MixerLayerContext naive_context() {
  MixerLayerContext c;
  c.run_mixer = [](const Mixer& m, const MixerInputs& in, const State& s, const MixerOptions& o) {
    return m.naive(in, s, o);
  };
  return c;
}

// Worst relative error of the output and of the gradients (input, then every parameter) of two runs.
struct Compared {
  double y = 0, grad = 0;
  std::string worst;
};

Compared compare_runs(const Stack& s, const Tensor& x, const Tensor& y_a, const Tensor& y_b) {
  auto w = random({kB, kT, kD}, 77);
  std::vector<Tensor> wrt{x};
  for (auto& p : s.parameters()) wrt.push_back(p);
  auto ga = torch::autograd::grad({(y_a * w).sum()}, wrt, {}, true);
  auto gb = torch::autograd::grad({(y_b * w).sum()}, wrt);
  Compared c;
  c.y = rel(y_a, y_b);
  std::vector<std::string> names{"x"};
  for (size_t i = 0; i < s.layers.size(); ++i)
    for (auto& [n, p] : s.layers[i]->parameters()) names.push_back("layers." + std::to_string(i) + "." + n);
  for (size_t i = 0; i < wrt.size(); ++i) {
    EXPECT_GT(gb[i].abs().max().item<double>(), 1e-8) << names[i] << ": gradient all but zero";
    double e = rel(ga[i], gb[i]);
    if (e >= c.grad) c.grad = e, c.worst = names[i];
  }
  return c;
}

TEST(Rwkv7Layer, EqualsFlaRestatementInOutputAndEveryGradient) {
  Stack s = make_stack(3);
  auto x = random({kB, kT, kD}, 5).set_requires_grad(true);
  auto y = run_stack(s, x), ref = fla_stack(s, x);
  auto c = compare_runs(s, x, y, ref);
  std::printf("[ errors   ] rwkv7 layers x%lld vs FLA's RWKV7Attention re-stated (fp64): y %.2e, worst gradient "
              "%.2e (%s), over %zu tensors\n",
              static_cast<long long>(kLayers), c.y, c.grad, c.worst.c_str(), 1 + s.parameters().size());
  EXPECT_LE(c.y, 1e-10);
  EXPECT_LE(c.grad, 1e-10) << c.worst;
  EXPECT_GT((y - x).abs().max().item<double>(), 1e-2) << "the layers add all but nothing";
}

TEST(Rwkv7Layer, ChunkwiseAndNaiveFormsGiveTheSameLayers) {
  Stack s = make_stack(4);
  auto x = random({kB, kT, kD}, 6).set_requires_grad(true);
  auto c = compare_runs(s, x, run_stack(s, x), run_stack(s, x, naive_context()));
  std::printf("[ errors   ] rwkv7 layers x%lld chunkwise vs naive (fp64): y %.2e, worst gradient %.2e (%s)\n",
              static_cast<long long>(kLayers), c.y, c.grad, c.worst.c_str());
  EXPECT_LE(c.y, 1e-12);
  EXPECT_LE(c.grad, 1e-11) << c.worst;
}

// Packed documents: at a document start the token shift sees zeros and the state restarts (FLA with
// cu_seqlens, re-stated by masking), one start at a chunk boundary and one inside a chunk.
TEST(Rwkv7Layer, DocumentStartsRestartTheTokenShift) {
  Stack s = make_stack(5);
  auto x = random({kB, kT, kD}, 7).set_requires_grad(true);
  auto starts = at::zeros({kB, kT}, at::kBool);
  starts.select(1, 0).fill_(true);
  starts[0][8] = true, starts[1][13] = true;
  MixerLayerContext ctx;
  ctx.document_starts = starts;
  auto c = compare_runs(s, x, run_stack(s, x, ctx), fla_stack(s, x, starts));
  std::printf("[ errors   ] rwkv7 layers x%lld with document starts vs re-stated (fp64): y %.2e, worst gradient %.2e\n",
              static_cast<long long>(kLayers), c.y, c.grad);
  EXPECT_LE(c.y, 1e-10);
  EXPECT_LE(c.grad, 1e-10) << c.worst;
  // And the starts matter: without them the outputs after the first one differ.
  EXPECT_GT(rel(run_stack(s, x), run_stack(s, x, ctx)), 1e-3);
}

TEST(Rwkv7Layer, ParameterNamesAreFlaStateDictKeys) {
  ParameterInit init(1, at::TensorOptions().dtype(at::kDouble));
  std::vector<std::string> lora_w{"w_lora.lora.0.weight", "w_lora.lora.2.weight", "w_lora.lora.2.bias"};
  std::vector<std::string> head{"x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "k_k", "k_a", "r_k",
                                "r_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"};
  std::vector<std::string> first = head, later = head;
  for (auto* n : {"w_lora.lora.0.weight", "w_lora.lora.2.weight", "w_lora.lora.2.bias"}) first.push_back(n), later.push_back(n);
  for (auto* n : {"v_lora.lora.0.weight", "v_lora.lora.2.weight", "v_lora.lora.2.bias"}) later.push_back(n);
  for (auto* n : {"a_lora.lora.0.weight", "a_lora.lora.2.weight", "a_lora.lora.2.bias", "g_lora.lora.0.weight",
                  "g_lora.lora.2.weight", "g_norm.weight", "g_norm.bias"})
    first.push_back(n), later.push_back(n);
  for (int64_t layer : {0, 1}) {
    MixerLayer l(spec(layer), init);
    std::vector<std::string> names;
    for (auto& [n, p] : l.parameters()) names.push_back(n);
    EXPECT_EQ(names, layer == 0 ? first : later) << "layer " << layer;
  }
  // Shapes as RWKV7Attention's at d = 16, H = 2, dk = 8, dv = 6 (LoRA widths 32, the minimum).
  MixerLayer l(spec(1), init);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (auto& [n, p] : l.parameters()) shapes[n] = p.sizes().vec();
  EXPECT_EQ(shapes["x_r"], (std::vector<int64_t>{1, 1, kD}));
  EXPECT_EQ(shapes["r_k"], (std::vector<int64_t>{kH, kDk}));
  EXPECT_EQ(shapes["k_k"], (std::vector<int64_t>{kH * kDk}));
  EXPECT_EQ(shapes["v_proj.weight"], (std::vector<int64_t>{kH * kDv, kD}));
  EXPECT_EQ(shapes["o_proj.weight"], (std::vector<int64_t>{kD, kH * kDv}));
  EXPECT_EQ(shapes["w_lora.lora.0.weight"], (std::vector<int64_t>{32, kD}));
  EXPECT_EQ(shapes["g_lora.lora.2.weight"], (std::vector<int64_t>{kH * kDv, 32}));
  EXPECT_EQ(shapes["g_norm.bias"], (std::vector<int64_t>{kH * kDv}));
}

TEST(Rwkv7Layer, LowRankWidthsAreRwkv7AttentionDefaults) {
  // FLA's RWKV7Attention at hidden_size 768, head_dim 64 (the 0.1B model): decay 64, a 64, v 32, gate 128;
  // at 2048: 128, 128, 64, 224; at 4096, head_dim 128: 320, 320, 224, 320.
  auto r = rwkv7_low_rank_dims(768, 64);
  EXPECT_EQ(std::vector<int64_t>({r.decay, r.a, r.v, r.gate}), (std::vector<int64_t>{64, 64, 32, 128}));
  r = rwkv7_low_rank_dims(2048, 64);
  EXPECT_EQ(std::vector<int64_t>({r.decay, r.a, r.v, r.gate}), (std::vector<int64_t>{128, 128, 64, 224}));
  r = rwkv7_low_rank_dims(4096, 128);
  EXPECT_EQ(std::vector<int64_t>({r.decay, r.a, r.v, r.gate}), (std::vector<int64_t>{320, 320, 224, 320}));
}

// FLA's _initialize_weights for layer 1 of 3 at d = 16 (head_dim 8): the lerp profiles, k_k, k_a, r_k, the
// LoRA biases, the group norm's weight, orthogonal projections (k_proj with gain 0.1) and o_proj at zero.
TEST(Rwkv7Layer, InitialValuesAreFlas) {
  ParameterInit init(2, at::TensorOptions().dtype(at::kDouble));
  const int64_t layer = 1, L = kLayers;
  MixerLayerSpec s = spec(layer, L);
  s.head_dim_v = kDk;  // value_dim = hidden_size, as in FLA's models
  MixerLayer l(s, init);
  Fla P = fla_params(l);
  const double r01 = 1.0 * layer / (L - 1), r10 = 1.0 - 1.0 * layer / L;
  const double tol = 1e-6;  // drawn and stored in fp32
  for (int64_t n = 0; n < kD; ++n) {
    const double ddd = 1.0 * n / kD, linear = 1.0 * n / (kD - 1) - 0.5;
    double z = ((n % kDk) - (kDk - 1) / 2.0) / ((kDk - 1) / 2.0);
    z = z * std::abs(z);
    const double www = -6 + 6 * std::pow(1.0 * n / (kD - 1), 1 + std::pow(r01, 0.3));
    EXPECT_NEAR(P["x_r"][0][0][n].item<double>(), 1 - std::pow(ddd, 0.2 * r10), tol);
    EXPECT_NEAR(P["x_w"][0][0][n].item<double>(), 1 - std::pow(ddd, 0.9 * r10), tol);
    EXPECT_NEAR(P["x_k"][0][0][n].item<double>(), 1 - std::pow(ddd, 0.7 * r10), tol);
    EXPECT_NEAR(P["x_g"][0][0][n].item<double>(), 1 - std::pow(ddd, 0.2 * r10), tol);
    EXPECT_NEAR(P["k_k"][n].item<double>(), 0.71 - linear * 0.1, tol);
    EXPECT_NEAR(P["w_lora.lora.2.bias"][n].item<double>(), www + 0.5 + z * 2.5, 1e-5);
    EXPECT_NEAR(P["a_lora.lora.2.bias"][n].item<double>(), -0.19 + z * 0.3 + linear * 0.4, tol);
    EXPECT_NEAR(P["v_lora.lora.2.bias"][n].item<double>(), 0.73 - linear * 0.4, tol);
  }
  EXPECT_TRUE(at::allclose(P["k_a"], at::full_like(P["k_a"], 1.02)));
  EXPECT_TRUE(at::allclose(P["r_k"], at::full_like(P["r_k"], -0.04)));
  EXPECT_NEAR(P["g_norm.weight"][0].item<double>(), std::pow(2.0 / 3.0, 0.7), tol);
  EXPECT_EQ(P["o_proj.weight"].abs().max().item<double>(), 0.0);
  for (auto* n : {"w_lora.lora.0.weight", "a_lora.lora.0.weight", "v_lora.lora.0.weight", "g_lora.lora.0.weight"})
    EXPECT_EQ(P[n].abs().max().item<double>(), 0.0) << n;
  // Orthogonal: W Wᵀ = gain² I (square here).
  auto eye = at::eye(kD, at::TensorOptions().dtype(at::kDouble));
  auto gram = [&](const char* n) { return at::matmul(P[n], P[n].t()); };
  EXPECT_LT((gram("r_proj.weight") - eye).abs().max().item<double>(), 1e-6);
  EXPECT_LT((gram("k_proj.weight") - 0.01 * eye).abs().max().item<double>(), 1e-7);
  // A LoRA's second factor [out, rank] with rank 32 > out 16: orthonormal columns scaled by 0.1·√(32/16).
  auto B2 = P["w_lora.lora.2.weight"];
  EXPECT_LT((at::matmul(B2, B2.t()) - 0.02 * eye).abs().max().item<double>(), 1e-7);
}

TEST(Rwkv7Layer, RefusesConvolutionsAndMissingFirstValues) {
  ParameterInit init(1, at::TensorOptions().dtype(at::kDouble));
  MixerLayerSpec s = spec(0);
  s.conv_size = 4;
  try {
    MixerLayer l(s, init);
    ADD_FAILURE() << "conv_size 4 accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("conv_size must be 0"), std::string::npos)
        << e.what_without_backtrace();
  }
  MixerLayer later(spec(1), init);
  try {
    later.forward(random({kB, kT, kD}, 1));
    ADD_FAILURE() << "a value-residual layer ran without the first layer's values";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("value residual needs the values"), std::string::npos)
        << e.what_without_backtrace();
  }
}

}  // namespace
}  // namespace carry::testing
