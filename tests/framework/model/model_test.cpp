// Tests of framework/model/model.*: every model preset builds at a tiny scale and trains a step's worth
// (forward, backward, finite loss and gradients); the parameter count of a small config equals the hand
// count; the same seed gives the same parameters bit for bit; finite differences agree with autograd in
// fp64 for a tiny model of every mixer kind; the masked loss is the masked mean; config kinds without
// a layer are refused.
#include "tests/paths.h"
#include "framework/model/model.h"
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>

#include <torch/csrc/autograd/autograd.h>

#include <c10/core/GradMode.h>

#include <dirent.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace carry {
namespace {

ModelConfig tiny_config(const std::vector<std::string>& mixers) {
  ModelConfig m;
  m.set_vocab_size(16);
  m.set_d_model(8);
  m.set_n_layers(2);
  m.set_n_heads(2);
  m.set_head_dim_k(4);
  m.set_head_dim_v(4);
  m.set_mlp_ratio(2.0);
  m.set_init_std(0.2);
  for (auto& k : mixers) m.add_mixers(k);
  auto* o = m.add_mixer_options();
  o->set_chunk_size(8);
  // rwkv7 layers take no short convolutions (their token shift reads the token before).
  if (std::find(mixers.begin(), mixers.end(), "rwkv7") == mixers.end()) o->set_conv_size(4);
  return m;
}

Tensor random_tokens(int64_t B, int64_t T, int64_t V, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(V, {B, T}, gen, at::TensorOptions().dtype(at::kLong));
}

std::vector<std::string> preset_files() {
  std::string dir = std::string(CARRY_SOURCE_DIR) + "/configs/models/";
  std::vector<std::string> files;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (auto* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n.size() > 10 && n.substr(n.size() - 10) == ".textproto") files.push_back(dir + n);
    }
    ::closedir(d);
  }
  std::sort(files.begin(), files.end());
  return files;
}

TEST(Model, EveryKnownConfigKindHasALayer) {
  for (auto& k : known_mixer_kinds()) {
    EXPECT_FALSE(mixer_layer_family(k).empty()) << "config kind '" << k << "' has no mixer layer";
    auto m = tiny_config({k});
    EXPECT_EQ(mixer_layer_spec(m, 0).kind, k);
  }
}

TEST(Model, EveryPresetBuildsSmallAndRunsForwardBackward) {
  auto files = preset_files();
  ASSERT_GE(files.size(), 5u);
  for (auto& f : files) {
    auto m = load_model_config(f);
    for (const char* o : {"vocab_size=64", "d_model=32", "n_heads=2", "head_dim_k=8", "head_dim_v=16"})
      apply_override(m, o);
    m.set_n_layers(std::max(2, m.mixers_size()));
    auto model = build_model(m, 1);
    std::printf("%s: %s\n", f.substr(f.rfind('/') + 1).c_str(), model.summary().c_str());
    auto tokens = random_tokens(2, 64, 64, 2);
    auto targets = random_tokens(2, 64, 64, 3);
    auto loss = model.loss(tokens, targets);
    ASSERT_TRUE(std::isfinite(loss.item<double>())) << f;
    EXPECT_NEAR(loss.item<double>(), std::log(64.0), 1.0) << f << ": a fresh model should be near uniform";
    loss.backward();
    for (auto& [n, p] : model.parameters()) {
      ASSERT_TRUE(p.grad().defined()) << f << ": " << n << " got no gradient";
      EXPECT_TRUE(at::isfinite(p.grad()).all().item<bool>()) << f << ": " << n;
    }
  }
}

// Full-size presets on the meta device (shapes only): the parameter count matches the size in the name.
TEST(Model, PresetSizesMatchTheirNames) {
  for (auto& f : preset_files()) {
    auto model = build_model(load_model_config(f), 0, at::TensorOptions().device(at::kMeta));
    std::string name = f.substr(f.rfind('/') + 1);
    std::printf("%s: %s\n", name.c_str(), model.summary().c_str());
    double millions = static_cast<double>(model.num_parameters()) / 1e6;
    double nominal = name.find("_125m") != std::string::npos ? 125 : name.find("_340m") != std::string::npos ? 340 : 0;
    ASSERT_GT(nominal, 0) << name << ": no size in the name";
    EXPECT_NEAR(millions, nominal, 0.25 * nominal) << name;
  }
}

TEST(Model, ParameterCountEqualsHandCount) {
  // Gated DeltaNet, V=50, d=16, 2 layers, 2 heads of dk=dv=8, conv 4, SwiGLU hidden ceil(2.5·16)=40 -> 64.
  ModelConfig m;
  m.set_vocab_size(50);
  m.set_d_model(16);
  m.set_n_layers(2);
  m.set_n_heads(2);
  m.set_mlp_ratio(2.5);
  m.add_mixers("gated_deltanet");
  m.add_mixer_options()->set_conv_size(4);
  const int64_t V = 50, d = 16, H = 2, dk = 8, dv = 8, K = 4, hidden = 64;
  const int64_t mixer = 2 * H * dk * d + H * dv * d  // q, k, v projections
                        + (2 * H * dk + H * dv) * K  // convolutions
                        + H * d + H + H              // a_proj, dt_bias, A_log
                        + H * d                      // b_proj (beta)
                        + H * dv * d + dv            // z_proj (output gate), o_norm
                        + d * H * dv;                // o_proj
  const int64_t block = d + mixer + d + 3 * d * hidden;
  const int64_t tied = V * d + 2 * block + d;
  auto model = build_model(m, 0);
  EXPECT_EQ(mixer, 1548);
  EXPECT_EQ(model.num_parameters(), tied);
  m.set_tie_embeddings(false);
  EXPECT_EQ(build_model(m, 0).num_parameters(), tied + V * d);
  std::printf("%s\n", model.summary().c_str());

  // Softmax attention: q, k, v, o projections only.
  ModelConfig a = m;
  a.set_tie_embeddings(true);
  a.clear_mixers();
  a.add_mixers("softmax_attn");
  a.clear_mixer_options();
  EXPECT_EQ(build_model(a, 0).num_parameters(), V * d + 2 * (d + 4 * d * H * dk + d + 3 * d * hidden) + d);
}

TEST(Model, SameSeedSameParametersBitwise) {
  auto m = tiny_config({"gated_deltanet", "softmax_attn", "gla", "mamba2"});
  m.set_n_layers(4);
  auto a = build_model(m, 123), b = build_model(m, 123), c = build_model(m, 124);
  auto pa = a.parameters(), pb = b.parameters(), pc = c.parameters();
  ASSERT_EQ(pa.size(), pb.size());
  bool all_same_c = true;
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i].first, pb[i].first);
    EXPECT_TRUE(at::equal(pa[i].second, pb[i].second)) << pa[i].first;
    all_same_c = all_same_c && at::equal(pa[i].second, pc[i].second);
  }
  EXPECT_FALSE(all_same_c) << "another seed gave the same parameters";
  // An fp64 model holds exactly the fp32 model's values.
  auto d = build_model(m, 123, at::TensorOptions().dtype(at::kDouble));
  auto pd = d.parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pd[i].second.scalar_type(), at::kDouble);
    EXPECT_TRUE(at::equal(pd[i].second.to(at::kFloat), pa[i].second)) << pa[i].first;
  }
  auto tokens = random_tokens(2, 16, 16, 5);
  EXPECT_TRUE(at::equal(a.forward(tokens), b.forward(tokens)));
}

// d/dε loss(p + ε u) at 0 by central differences with one Richardson step (error O(h⁴)).
double directional_fd(const std::function<double()>& f, Tensor p, const Tensor& u, double h) {
  c10::AutoGradMode no_grad(false);
  auto eval = [&](double e) {
    p.add_(u, e);
    double v = f();
    p.sub_(u, e);
    return v;
  };
  double d1 = (eval(h) - eval(-h)) / (2 * h);
  double d2 = (eval(h / 2) - eval(-h / 2)) / h;
  return (4 * d2 - d1) / 3;
}

TEST(Model, FiniteDifferencesMatchAutogradForEveryKind) {
  for (auto& kind : known_mixer_kinds()) {
    auto m = tiny_config({kind});
    if (kind == "softmax_attn") m.mutable_mixer_options(0)->clear_conv_size();
    auto model = build_model(m, 11, at::TensorOptions().dtype(at::kDouble));
    if (kind == "rwkv7") testing::perturb_parameters(model.parameters(), 21, 0.3);  // its o_proj starts at 0
    auto tokens = random_tokens(1, 16, 16, 12), targets = random_tokens(1, 16, 16, 13);
    auto mask = (random_tokens(1, 16, 2, 14) > 0) | (at::arange(16).view({1, 16}) == 0);
    auto loss = [&] { return model.loss(tokens, targets, mask).item<double>(); };
    auto params = model.parameters();
    std::vector<Tensor> leaves;
    for (auto& [n, p] : params) leaves.push_back(p);
    auto grads = torch::autograd::grad({model.loss(tokens, targets, mask)}, leaves);
    double worst = 0;
    std::string worst_name;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(15);
    for (size_t i = 0; i < params.size(); ++i) {
      auto& [name, p] = params[i];
      // Every parameter of the first mixer layer, plus the embedding and the last MLP's output.
      bool pick = name.rfind("layers.0.mixer.", 0) == 0 || name == "embedding.weight" ||
                  name == "layers.1.mlp.w2.weight";
      if (!pick) continue;
      auto u = at::randn(p.sizes(), gen, p.options().requires_grad(false));
      double ad = (grads[i] * u).sum().item<double>();
      double fd = directional_fd(loss, p, u, 1e-4);
      // Relative error; directional derivatives below 1e-4 (parameters that barely matter at
      // initialization, e.g. A_log) are held to 1e-10 absolute, about ten times the rounding floor of the
      // differences (eps·loss/h ≈ 1e-11 with h = 1e-4).
      double e = std::abs(fd - ad) / std::max(std::abs(ad), 1e-4);
      EXPECT_LE(e, 1e-6) << kind << " " << name << ": finite difference " << fd << ", autograd " << ad;
      if (e > worst) worst = e, worst_name = name;
    }
    std::printf("[ errors   ] model %-17s finite differences vs autograd: worst %.2e (%s)\n", kind.c_str(),
                worst, worst_name.c_str());
  }
}

// Every parameter's gradient of the model's loss under `ctx`. With `calls`, the mixer cores run through
// the slice's run_mixer (the chunkwise form) and are counted there.
std::vector<Tensor> loss_gradients(const Model& model, const Tensor& tokens, const Tensor& targets, ModelContext ctx,
                                   int* calls = nullptr) {
  if (calls) {
    *calls = 0;
    ctx.slice.run_mixer = [calls](const Mixer& m, const MixerInputs& in, const State& st, const MixerOptions& o) {
      ++*calls;
      return m.chunkwise(in, st, o);
    };
  }
  for (auto& [n, p] : model.parameters()) p.mutable_grad() = Tensor();
  model.loss(tokens, targets, {}, ctx).backward();
  std::vector<Tensor> g;
  for (auto& [n, p] : model.parameters()) g.push_back(p.grad().clone());
  return g;
}

void expect_same_bits(const std::vector<Tensor>& a, const std::vector<Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << what << ", parameter " << i;
}

ModelContext recomputing(int64_t keep_last, bool keeps_mixer = false) {
  ModelContext ctx;
  ctx.recompute = true;
  ctx.recompute_keep_last = keep_last;
  ctx.recompute_keeps_mixer = keeps_mixer;
  return ctx;
}

// Recomputation really recomputes: with ModelContext::recompute each layer's core runs twice per
// forward + backward (once without autograd, once in backward), and the gradients of every parameter
// equal those of the run that keeps its activations, bit for bit (fp64, every mixer kind). With
// recompute_keep_last = N the last N layers are not recomputed (their mixers run once), the others are,
// and the gradients are the same bits again.
TEST(Model, RecomputationRunsEachLayerAgainWithTheSameGradients) {
  for (const std::string& kind : known_mixer_kinds()) {
    auto model = build_model(tiny_config({kind}), 4, at::TensorOptions().dtype(at::kDouble));
    if (kind == "rwkv7") testing::perturb_parameters(model.parameters(), 21, 0.3);  // its o_proj starts at 0
    ASSERT_EQ(model.blocks().size(), 2u);
    auto tokens = random_tokens(2, 16, 16, 5), targets = random_tokens(2, 16, 16, 6);
    int calls = 0;
    auto kept = loss_gradients(model, tokens, targets, {}, &calls);
    EXPECT_EQ(calls, 2) << kind;
    expect_same_bits(kept, loss_gradients(model, tokens, targets, recomputing(0), &calls), kind + " recomputed");
    EXPECT_EQ(calls, 4) << kind << ": each of the 2 layers runs in forward and again in backward";
    for (int64_t keep_last : {1, 2, 5}) {
      const std::string what = kind + " recomputed, keep_last " + std::to_string(keep_last);
      expect_same_bits(kept, loss_gradients(model, tokens, targets, recomputing(keep_last), &calls), what);
      EXPECT_EQ(calls, keep_last >= 2 ? 2 : 3) << what << ": only the layers not kept run again";
    }
  }
}

// RWKV-7 with its channel mix (feed_forward "rwkv7_channel_mix", nonzero random parameters): the parameters
// are named ffn.*, and recomputation, with and without the kept mixer core, gives every gradient's bits.
TEST(Model, Rwkv7ChannelMixNamesAndRecomputation) {
  auto cfg = tiny_config({"rwkv7"});
  cfg.set_n_layers(3);
  cfg.set_feed_forward("rwkv7_channel_mix");
  auto model = build_model(cfg, 4, at::TensorOptions().dtype(at::kDouble));
  testing::perturb_parameters(model.parameters(), 22, 0.3);
  std::vector<std::string> ffn;
  for (auto& [n, p] : model.parameters())
    if (n.rfind("layers.1.ffn.", 0) == 0 || n.rfind("layers.1.mlp.", 0) == 0) ffn.push_back(n);
  EXPECT_EQ(ffn, (std::vector<std::string>{"layers.1.ffn.x_k", "layers.1.ffn.key.weight", "layers.1.ffn.value.weight"}));
  auto tokens = random_tokens(2, 16, 16, 5), targets = random_tokens(2, 16, 16, 6);
  auto kept = loss_gradients(model, tokens, targets, {});
  for (auto& g : kept) EXPECT_GT(g.abs().max().item<double>(), 0.0);
  expect_same_bits(kept, loss_gradients(model, tokens, targets, recomputing(0)), "rwkv7 + channel mix recomputed");
  expect_same_bits(kept, loss_gradients(model, tokens, targets, recomputing(1, true)),
                   "rwkv7 + channel mix around kept mixer cores");
}

// ModelContext::before_block (the split update's wait for other ranks' parameters, sharded_update.h) is
// called once per forward before each part reads its parameters, in order: -1 (the embedding), each block,
// then the block count (the final norm and head); not again when a block is recomputed in the backward.
TEST(Model, BeforeBlockHookSeesEveryPartInOrderOnce) {
  auto model = build_model(tiny_config({"gated_deltanet", "gla"}), 4, at::TensorOptions().dtype(at::kDouble));
  auto tokens = random_tokens(2, 16, 16, 5), targets = random_tokens(2, 16, 16, 6);
  for (bool recompute : {false, true}) {
    std::vector<int64_t> parts;
    ModelContext ctx = recompute ? recomputing(0) : ModelContext{};
    ctx.before_block = [&parts](int64_t part) { parts.push_back(part); };
    auto with_hook = loss_gradients(model, tokens, targets, ctx);
    EXPECT_EQ(parts, (std::vector<int64_t>{-1, 0, 1, 2})) << (recompute ? "recomputed" : "kept");
    expect_same_bits(with_hook, loss_gradients(model, tokens, targets, recompute ? recomputing(0) : ModelContext{}),
                     recompute ? "recomputed, with the hook" : "kept, with the hook");
  }
}

// Recomputation that keeps each layer's mixer core (ModelContext::recompute_keeps_mixer, sp = 1: no
// run_mixer) gives every parameter the gradient of the run that keeps all its activations, bit for bit
// (fp64, every mixer kind), also with the last layer kept whole. That the core runs once is
// Recompute.KeptMixerCoreRunsOnceWithTheSameGradients.
TEST(Model, RecomputationKeepingTheMixerCoreGivesTheSameGradients) {
  for (const std::string& kind : known_mixer_kinds()) {
    auto model = build_model(tiny_config({kind}), 4, at::TensorOptions().dtype(at::kDouble));
    if (kind == "rwkv7") testing::perturb_parameters(model.parameters(), 21, 0.3);  // its o_proj starts at 0
    auto tokens = random_tokens(2, 16, 16, 5), targets = random_tokens(2, 16, 16, 6);
    auto kept = loss_gradients(model, tokens, targets, {});
    for (int64_t keep_last : {0, 1})
      expect_same_bits(kept, loss_gradients(model, tokens, targets, recomputing(keep_last, true)),
                       kind + " around kept mixer cores, keep_last " + std::to_string(keep_last));
  }
}

// The chunked head + cross entropy (chunked_loss.h) behind Model::loss gives the full-logits form's
// loss and every parameter's gradient (fp64, tied and untied head, chunks of 5 tokens not dividing
// B·T = 32, the default chunk), and token_losses without grad mode gives its per-token losses.
TEST(Model, ChunkedLossEqualsTheFullLogitsForm) {
  for (bool tied : {true, false}) {
    auto cfg = tiny_config({"gla"});
    cfg.set_tie_embeddings(tied);
    auto model = build_model(cfg, 4, at::TensorOptions().dtype(at::kDouble));
    auto tokens = random_tokens(2, 16, 16, 5), targets = random_tokens(2, 16, 16, 6);
    auto mask = random_tokens(2, 16, 3, 7).to(at::kDouble);  // weights 0, 1, 2
    std::vector<Tensor> leaves;
    for (auto& [n, p] : model.parameters()) leaves.push_back(p);
    auto logp = at::log_softmax(model.forward(tokens), -1);
    auto ce = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1);
    auto ref = (ce * mask).sum() / mask.sum();
    auto ref_grads = torch::autograd::grad({ref}, leaves);
    for (int64_t chunk : {5, 0}) {
      ModelContext ctx;
      ctx.loss_chunk_tokens = chunk;
      auto loss = model.loss(tokens, targets, mask, ctx);
      auto grads = torch::autograd::grad({loss}, leaves);
      const std::string tag = std::string(tied ? "tied" : "untied") + " chunk " + std::to_string(chunk);
      EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-12) << tag;
      double worst = 0;
      auto params = model.parameters();
      for (size_t i = 0; i < leaves.size(); ++i) {
        double scale = std::max(ref_grads[i].abs().max().item<double>(), 1e-30);
        double e = (grads[i] - ref_grads[i]).abs().max().item<double>() / scale;
        EXPECT_LE(e, 1e-11) << tag << " " << params[i].first;
        worst = std::max(worst, e);
      }
      std::printf("[ errors   ] model chunked loss vs full logits (fp64, %s): gradients %.3e\n", tag.c_str(), worst);
      at::NoGradGuard no_grad;
      EXPECT_LE((model.token_losses(tokens, targets, ctx) - ce.detach()).abs().max().item<double>(), 1e-12) << tag;
    }
  }
}

TEST(Model, LossIsTheMaskedMeanCrossEntropy) {
  auto model = build_model(tiny_config({"gla"}), 2, at::TensorOptions().dtype(at::kDouble));
  auto tokens = random_tokens(2, 16, 16, 1), targets = random_tokens(2, 16, 16, 2);
  auto logits = model.forward(tokens);
  ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{2, 16, 16}));
  auto mask = random_tokens(2, 16, 2, 3).to(at::kBool);
  double manual = 0, count = 0;
  auto lsm = at::log_softmax(logits, -1);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < 16; ++t)
      if (mask[b][t].item<bool>()) {
        manual -= lsm[b][t][targets[b][t].item<int64_t>()].item<double>();
        count += 1;
      }
  EXPECT_NEAR(model.loss(tokens, targets, mask).item<double>(), manual / count, 1e-12);
  EXPECT_NEAR(model.loss(tokens, targets).item<double>(), model.token_losses(tokens, targets).mean().item<double>(),
              1e-14);
  // A mask that selects no token: loss 0 and zero gradients, without a host read.
  auto empty = model.loss(tokens, targets, at::zeros({2, 16}, at::kBool));
  EXPECT_EQ(empty.item<double>(), 0.0);
  auto head_grad = torch::autograd::grad({empty}, {model.head_weight()});
  EXPECT_EQ(head_grad[0].abs().max().item<double>(), 0.0);
  try {
    model.forward(tokens + 16);
    ADD_FAILURE() << "out-of-range token accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("vocab_size=16"), std::string::npos);
  }
}

TEST(Model, BadConfigsAreRefusedWithTheirReason) {
  auto m = tiny_config({"gla", "mamba3"});
  try {
    build_model(m, 0);
    ADD_FAILURE() << "unknown kind accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown mixer kind 'mamba3'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace carry
