// A carry rwkv7 model built as FLA's RWKV7ForCausalLM (model.norm "layer_norm", model.pre_norm, the channel
// mix, an untied head) against an independent fp64 re-statement of FLA's model written here
// (fla/models/rwkv7/modeling_rwkv7.py: embeddings, the first block's pre_norm, each block's
// attn_norm → RWKV7Attention → residual, ffn_norm → RWKV7FeedForward → residual, the final LayerNorm,
// lm_head; fla/layers/rwkv7.py for the attention): the logits and the gradient of every parameter. The
// recurrent decoder reading the sequence piece by piece gives the full forward's logits, recomputation gives
// the same gradient bits, and the LayerNorm parameters are named and initialized as FLA's.
#include "framework/infer/recurrent_decoder.h"
#include "framework/model/model.h"
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <map>
#include <string>
#include <vector>

namespace carry {
namespace {

constexpr int64_t kV = 23, kD = 16, kL = 3, kH = 2, kDk = 8, kDv = 8, kT = 24;

ModelConfig fla_like_config() {
  ModelConfig m;
  m.set_vocab_size(kV);
  m.set_d_model(kD);
  m.set_n_layers(kL);
  m.set_n_heads(kH);
  m.set_head_dim_k(kDk);
  m.set_head_dim_v(kDv);
  m.set_mlp_ratio(4.0);
  m.set_norm_eps(1e-5);
  m.set_tie_embeddings(false);
  m.set_feed_forward("rwkv7_channel_mix");
  m.set_norm("layer_norm");
  m.set_pre_norm(true);
  m.add_mixers("rwkv7");
  m.add_mixer_options()->set_chunk_size(8);
  return m;
}

// FLA's initial values plus noise of std 0.3 (o_proj, the LoRAs' first factors, the channel mix's value and
// the LayerNorms' biases start at 0).
Model make_model(const ModelConfig& cfg, uint64_t seed) {
  Model m = build_model(cfg, seed, at::TensorOptions().dtype(at::kDouble));
  testing::perturb_parameters(m.parameters(), seed + 100, 0.3);
  return m;
}

Tensor tokens_of(int64_t B, int64_t T, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(kV, {B, T}, gen, at::TensorOptions().dtype(at::kLong));
}

double rel(const Tensor& a, const Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-300);
}

// ---- The re-statement of FLA's RWKV7ForCausalLM, fp64, parameters read by carry's names. ----

struct Params {
  std::map<std::string, Tensor> p;
  const Tensor& operator()(const std::string& n) const { return p.at(n); }
};

// nn.LayerNorm: biased variance over the last dimension.
Tensor fla_layer_norm(const Params& P, const std::string& name, const Tensor& x) {
  Tensor mean = x.mean(-1, true);
  Tensor var = (x - mean).pow(2).mean(-1, true);
  return (x - mean) / at::sqrt(var + 1e-5) * P(name + ".weight") + P(name + ".bias");
}

// ZeroPad2d((0, 0, 1, -1)) − x.
Tensor fla_delta(const Tensor& x) { return at::constant_pad_nd(x, {0, 0, 1, -1}) - x; }

Tensor fla_lora(const Params& P, const std::string& name, const Tensor& x, const char* act, bool bias) {
  Tensor h = at::matmul(x, P(name + ".lora.0.weight").t());
  if (std::string(act) == "tanh") h = at::tanh(h);
  if (std::string(act) == "sigmoid") h = at::sigmoid(h);
  h = at::matmul(h, P(name + ".lora.2.weight").t());
  return bias ? h + P(name + ".lora.2.bias") : h;
}

Tensor fla_attention(const Params& P, const std::string& a, const Tensor& x, Tensor& v_first, bool first) {
  const int64_t B = x.size(0), T = x.size(1);
  Tensor delta = fla_delta(x);
  auto mix = [&](const char* n) { return at::addcmul(x, delta, P(a + n)); };
  Tensor xr = mix("x_r"), xw = mix("x_w"), xk = mix("x_k"), xv = mix("x_v"), xa = mix("x_a"), xg = mix("x_g");
  Tensor r = at::matmul(xr, P(a + "r_proj.weight").t());
  Tensor w = -0.6065306597126334 * at::sigmoid(fla_lora(P, a + "w_lora", xw, "tanh", true));
  Tensor k = at::matmul(xk, P(a + "k_proj.weight").t());
  Tensor v = at::matmul(xv, P(a + "v_proj.weight").t());
  if (first) v_first = v;
  else v = at::lerp(v, v_first, at::sigmoid(fla_lora(P, a + "v_lora", xv, "", true)));
  Tensor lr = at::sigmoid(fla_lora(P, a + "a_lora", xa, "", true));
  Tensor g = fla_lora(P, a + "g_lora", xg, "sigmoid", false);
  Tensor kk = (k * P(a + "k_k")).view({B, T, kH, kDk});
  kk = kk / at::clamp_min(at::linalg_vector_norm(kk, 2, {-1}, true), 1e-12);
  k = k.addcmul(k * (lr - 1), P(a + "k_a"));
  auto heads = [&](const Tensor& t, int64_t d) { return t.reshape({B, T, kH, d}); };
  Tensor rh = heads(r, kDk), wh = heads(w, kDk), kh = heads(k, kDk), vh = heads(v, kDv), ah = heads(lr, kDk);
  Tensor alpha = -kk, beta = kk * ah;
  Tensor S = at::zeros({B, kH, kDk, kDv}, x.options());
  std::vector<Tensor> o;
  for (int64_t t = 0; t < T; ++t) {  // FLA's dplr_recurrence
    Tensor kv = kh.select(1, t).unsqueeze(-1) * vh.select(1, t).unsqueeze(-2) +
                (S * alpha.select(1, t).unsqueeze(-1)).sum(-2, true) * beta.select(1, t).unsqueeze(-1);
    S = S * wh.select(1, t).exp().unsqueeze(-1) + kv;
    o.push_back(at::einsum("bhd,bhdm->bhm", {rh.select(1, t), S}));
  }
  Tensor out = at::stack(o, 1);
  out = at::group_norm(out.reshape({B * T, kH * kDv}), kH, P(a + "g_norm.weight"), P(a + "g_norm.bias"), kDk * 1e-5)
            .view({B, T, kH * kDv});
  Tensor bonus = ((rh * kh * P(a + "r_k")).sum(-1, true) * vh).view({B, T, kH * kDv});
  return at::matmul((out + bonus) * g, P(a + "o_proj.weight").t());
}

Tensor fla_feed_forward(const Params& P, const std::string& f, const Tensor& x) {
  Tensor h = at::relu(at::matmul(x.addcmul(fla_delta(x), P(f + "x_k")), P(f + "key.weight").t()));
  return at::matmul(h * h, P(f + "value.weight").t());
}

Tensor fla_logits(const Model& model, const Tensor& tokens) {
  Params P;
  for (auto& [n, t] : model.parameters()) P.p[n] = t;
  Tensor h = at::embedding(P("embedding.weight"), tokens), v_first;
  for (int64_t i = 0; i < kL; ++i) {
    const std::string l = "layers." + std::to_string(i) + ".";
    Tensor residual = i == 0 ? fla_layer_norm(P, l + "pre_norm", h) : h;
    Tensor a = fla_attention(P, l + "mixer.", fla_layer_norm(P, l + "mixer_norm", residual), v_first, i == 0);
    h = residual + a;
    h = h + fla_feed_forward(P, l + "ffn.", fla_layer_norm(P, l + "mlp_norm", h));
  }
  return at::matmul(fla_layer_norm(P, "norm", h), P("lm_head.weight").t());
}

TEST(FlaRwkv7Model, EqualsFlaRestatementInLogitsAndEveryGradient) {
  Model model = make_model(fla_like_config(), 3);
  Tensor tokens = tokens_of(2, kT, 4);
  Tensor carry = model.forward(tokens), fla = fla_logits(model, tokens);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  Tensor w = at::randn(carry.sizes(), gen, carry.options());
  std::vector<Tensor> wrt;
  std::vector<std::string> names;
  for (auto& [n, p] : model.parameters()) wrt.push_back(p), names.push_back(n);
  auto gc = torch::autograd::grad({(carry * w).sum()}, wrt);
  auto gf = torch::autograd::grad({(fla * w).sum()}, wrt);
  const double e = rel(carry, fla);
  double worst = 0;
  std::string worst_name;
  for (size_t i = 0; i < wrt.size(); ++i) {
    EXPECT_GT(gf[i].abs().max().item<double>(), 1e-8) << names[i] << ": gradient all but zero";
    const double g = rel(gc[i], gf[i]);
    if (g >= worst) worst = g, worst_name = names[i];
  }
  std::printf("[ errors   ] FLA RWKV7ForCausalLM re-statement: logits %.2e, gradients %.2e (worst %s)\n", e, worst,
              worst_name.c_str());
  EXPECT_LT(e, 1e-12);
  EXPECT_LT(worst, 1e-10) << worst_name;
}

TEST(FlaRwkv7Model, RecurrentDecoderGivesTheFullForwardsLogits) {
  Model model = make_model(fla_like_config(), 6);
  Tensor tokens = tokens_of(2, kT, 7);
  at::NoGradGuard no_grad;
  Tensor full = model.forward(tokens);
  for (const std::vector<int64_t>& pieces : {std::vector<int64_t>{19, 1, 1, 1, 1, 1}, std::vector<int64_t>{3, 8, 13}}) {
    RecurrentDecoder decoder(model, kT);
    std::vector<Tensor> out;
    int64_t at = 0;
    for (int64_t n : pieces) out.push_back(decoder.feed(tokens.narrow(1, at, n))), at += n;
    const double e = rel(at::cat(out, 1), full);
    std::printf("[ errors   ] decoder pieces of %lld first: %.2e\n", static_cast<long long>(pieces[0]), e);
    EXPECT_LT(e, 1e-11);
  }
}

std::vector<Tensor> loss_gradients(const Model& model, const Tensor& tokens, const Tensor& targets,
                                   const ModelContext& ctx) {
  for (auto& [n, p] : model.parameters()) p.mutable_grad() = Tensor();
  model.loss(tokens, targets, {}, ctx).backward();
  std::vector<Tensor> g;
  for (auto& [n, p] : model.parameters()) g.push_back(p.grad().clone());
  return g;
}

TEST(FlaRwkv7Model, RecomputationGivesTheSameGradientBits) {
  Model model = make_model(fla_like_config(), 8);
  Tensor tokens = tokens_of(2, 16, 9), targets = tokens_of(2, 16, 10);
  auto kept = loss_gradients(model, tokens, targets, {});
  for (bool keeps_mixer : {false, true}) {
    ModelContext ctx;
    ctx.recompute = true;
    ctx.recompute_keeps_mixer = keeps_mixer;
    auto again = loss_gradients(model, tokens, targets, ctx);
    ASSERT_EQ(again.size(), kept.size());
    for (size_t i = 0; i < kept.size(); ++i)
      EXPECT_TRUE(at::equal(kept[i], again[i])) << "parameter " << i << (keeps_mixer ? ", kept mixer cores" : "");
  }
}

TEST(FlaRwkv7Model, LayerNormParametersAreNamedAndInitializedAsFlas) {
  Model model = build_model(fla_like_config(), 1, at::TensorOptions().dtype(at::kDouble));
  std::vector<std::string> norms;
  for (auto& [n, p] : model.parameters()) {
    if (n.find("norm.") == std::string::npos || n.find("g_norm") != std::string::npos) continue;
    norms.push_back(n);
    const bool bias = n.size() > 5 && n.substr(n.size() - 5) == ".bias";
    EXPECT_TRUE(at::equal(p, at::full({kD}, bias ? 0.0 : 1.0, p.options()))) << n;
  }
  ASSERT_EQ(norms.size(), 2u + 4u * kL + 2u);
  EXPECT_EQ(norms[0], "layers.0.pre_norm.weight");
  EXPECT_EQ(norms[1], "layers.0.pre_norm.bias");
  EXPECT_EQ(norms[2], "layers.0.mixer_norm.weight");
  EXPECT_EQ(norms[3], "layers.0.mixer_norm.bias");
  EXPECT_EQ(norms.back(), "norm.bias");
  // The default stays RMSNorm: one weight a norm, no pre-norm.
  ModelConfig rms = fla_like_config();
  rms.clear_norm();
  rms.clear_pre_norm();
  for (auto& [n, p] : build_model(rms, 1, at::TensorOptions().dtype(at::kDouble)).parameters())
    EXPECT_TRUE(n.find("pre_norm") == std::string::npos &&
                (n.find("g_norm") != std::string::npos || n.substr(n.size() - 10) != "_norm.bias"))
        << n;
}

TEST(FlaRwkv7Model, UnknownNormIsRefused) {
  ModelConfig m = fla_like_config();
  m.set_norm("batch_norm");
  auto errors = model_config_errors(m);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].find("norm: must be \"rms_norm\" or \"layer_norm\", got \"batch_norm\""), std::string::npos) << errors[0];
}

}  // namespace
}  // namespace carry
