// Tests of layers/softmax_attn/softmax_attn.*: the naive form against a per-query loop over exactly the keys in the
// window; chunkwise vs naive with gradients for windows 1, 5, 17, 64 and one larger than T; the key
// blocks the chunkwise form visits are exactly those the mask reaches, so for a window their number
// grows linearly with T (counted, not timed); bad options refused. The sparse patterns (global tokens,
// summary columns): naive and chunkwise against a per-query loop over the keys the header's rule admits
// (offsets, keys before the slice, packed documents), chunkwise vs naive with the gradients of q, k, v and
// of the keys before the slice, the relay plan's messages walked over 2 and 4 simulated ranks. The generic
// contract tests run the family with window 0 in mixer_test.cpp; the ranks' exchange runs under mpirun in
// sparse_patterns_test_mpi.cpp.
#include "layers/softmax_attn/softmax_attn.h"
#include "framework/train/trainer.h"
#include "layers/core/device.h"
#include "layers/layout.h"
#include "tests/helpers/mixer_testing.h"
#include "tests/paths.h"

#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>

namespace carry::testing {
namespace {

const Mixer& attn() { return get_mixer("softmax_attn"); }

TEST(SoftmaxAttn, NaiveEqualsPerQueryLoop) {
  Shape s;
  s.T = 40;
  auto in = random_inputs(attn(), s, at::kDouble, 1);
  for (int64_t w : {0, 1, 7}) {
    MixerOptions opt;
    opt.window = w;
    auto out = attn().naive(in, {}, opt).o;
    double scale = opt.scale_for(s.dk), err = 0;
    for (int64_t t = 0; t < s.T; ++t) {
      int64_t first = w > 0 ? std::max<int64_t>(0, t - w + 1) : 0;
      auto K = in.k.narrow(1, first, t - first + 1), V = in.v.narrow(1, first, t - first + 1);
      auto qt = in.q.select(1, t).unsqueeze(1);                              // [B,1,H,dk]
      auto p = at::softmax((qt * K).sum(-1) * scale, 1);                   // [B,s,H]
      auto o = (p.unsqueeze(-1) * V).sum(1);                               // [B,H,dv]
      err = std::max(err, rel_err(out.select(1, t), o));
    }
    std::cout << "[ errors   ] softmax_attn naive window=" << w << " vs per-query loop: " << err << "\n";
    EXPECT_LE(err, 1e-12);
  }
}

TEST(SoftmaxAttn, WindowsChunkwiseEqualNaiveWithGradients) {
  Shape s;
  s.T = 96;
  for (int64_t C : {16, 32}) {
    for (int64_t w : {1, 5, 17, 64, 200}) {
      MixerOptions opt;
      opt.chunk_size = C;
      opt.window = w;
      auto in = random_inputs(attn(), s, at::kDouble, 100 + w + C);
      auto a = run_with_grads(attn(), Form::chunkwise, in, {}, opt);
      auto b = run_with_grads(attn(), Form::naive, in, {}, opt);
      double eo = max_rel_err(a.outputs, b.outputs), eg = max_rel_err(a.grads, b.grads);
      std::cout << "[ errors   ] softmax_attn C=" << C << " window=" << w << " forward " << eo
                << " gradients " << eg << "\n";
      EXPECT_LE(eo, 1e-10);
      EXPECT_LE(eg, 1e-10);
      for (auto& g : a.grads) EXPECT_TRUE(at::isfinite(g).all().item<bool>());
      for (auto& g : a.grads) EXPECT_GT(g.abs().max().item<double>(), 0);
    }
  }
}

// Does any (query t, key s) pair of blocks (i, j) lie inside the causal window?
bool block_reachable(int64_t i, int64_t j, int64_t C, int64_t w) {
  for (int64_t t = i * C; t < (i + 1) * C; ++t)
    for (int64_t s = j * C; s < (j + 1) * C; ++s)
      if (s <= t && (w == 0 || s > t - w)) return true;
  return false;
}

TEST(SoftmaxAttn, VisitedKeyBlocksAreExactlyTheReachableOnes) {
  for (int64_t C : {4, 16}) {
    for (int64_t w : {0, 1, 5, 16, 17, 64}) {
      for (int64_t i = 0; i < 24; ++i) {
        auto blocks = softmax_attn_key_blocks(i, C, w);
        ASSERT_FALSE(blocks.empty());
        EXPECT_EQ(blocks.front(), i) << "the diagonal block must come first";
        for (int64_t j = 0; j <= i; ++j) {
          bool visited = std::find(blocks.begin(), blocks.end(), j) != blocks.end();
          EXPECT_EQ(visited, block_reachable(i, j, C, w)) << "C=" << C << " w=" << w << " i=" << i
                                                          << " j=" << j;
        }
      }
    }
  }
}

TEST(SoftmaxAttn, WindowedWorkGrowsLinearlyWithT) {
  const int64_t C = 16;
  auto visits = [&](int64_t num_blocks, int64_t w) {
    int64_t n = 0;
    for (int64_t i = 0; i < num_blocks; ++i) n += softmax_attn_key_blocks(i, C, w).size();
    return n;
  };
  for (int64_t w : {1, 17, 64}) {
    int64_t per_block = 1 + (w - 1 + C - 1) / C;  // most key blocks one query block can reach
    std::vector<int64_t> counts;
    for (int64_t N : {16, 32, 64, 128}) {
      counts.push_back(visits(N, w));
      EXPECT_LE(counts.back(), per_block * N);
    }
    std::cout << "[ errors   ] softmax_attn window=" << w << " key blocks visited for T=256..2048: "
              << counts[0] << " " << counts[1] << " " << counts[2] << " " << counts[3] << "\n";
    // Doubling T adds a fixed number of blocks per added query block: the increments double.
    EXPECT_EQ(counts[2] - counts[1], 2 * (counts[1] - counts[0]));
    EXPECT_EQ(counts[3] - counts[2], 2 * (counts[2] - counts[1]));
  }
  // Full causal attention visits every block up to the diagonal: quadratic.
  EXPECT_EQ(visits(64, 0), 64 * 65 / 2);
}

TEST(SoftmaxAttn, BadOptionsAndStateAreRefused) {
  Shape s;
  s.T = 32;
  auto in = random_inputs(attn(), s, at::kDouble, 3);
  MixerOptions opt;
  opt.chunk_size = 16;
  opt.window = -1;
  EXPECT_THROW(attn().chunkwise(in, {}, opt), c10::Error);
  EXPECT_THROW(attn().naive(in, {}, opt), c10::Error);
  opt.window = 0;
  EXPECT_THROW(attn().chunkwise(in, {at::zeros({2}, at::kDouble)}, opt), c10::Error);
  auto bad = in;
  bad.k = at::randn({s.B, s.T, s.H, s.dk + 1}, at::kDouble);
  EXPECT_THROW(attn().chunkwise(bad, {}, opt), c10::Error);
  EXPECT_FALSE(attn().has_summary());
  EXPECT_TRUE(attn().state_names().empty());
  EXPECT_TRUE(attn().zero_state(in, opt).empty());
  EXPECT_THROW(attn().summarize(in, opt), c10::Error);
}

// ---- sparse patterns ----

struct Memory {  // the keys before the slice: k [B,M,H,dk], v [B,M,H,dv], valid [B,M]
  Tensor k, v, valid;
  State state() const { return k.defined() ? State{k, v, valid} : State{}; }
};

Memory random_memory(const Shape& s, int64_t M, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto o = at::TensorOptions().dtype(at::kDouble);
  Memory m{at::randn({s.B, M, s.H, s.dk}, gen, o), at::randn({s.B, M, s.H, s.dv}, gen, o), at::ones({s.B, M}, o)};
  if (M > 1) m.valid[1].narrow(0, M - 2, 2).zero_();  // padding rows in sequence 1
  return m;
}

// The header's rule, query by query: rows of sequence b at document position offsets[b] + t until its first
// document start (where the keys before the slice count), t − start after it.
Tensor pattern_definition(const MixerInputs& in, const Memory& mem, const Tensor& starts,
                          const std::vector<int64_t>& offsets, const MixerOptions& opt) {
  const int64_t B = in.q.size(0), T = in.q.size(1), w = opt.window, G = opt.global_tokens, S = opt.stride;
  const double scale = opt.scale_for(in.q.size(3));
  auto out = at::zeros({B, T, in.q.size(2), in.v.size(3)}, in.q.options());
  for (int64_t b = 0; b < B; ++b) {
    int64_t start = -1;  // -1: the slice's first piece, continuing its document
    for (int64_t t = 0; t < T; ++t) {
      if (starts.defined() && starts[b][t].item<bool>()) start = t;
      auto position = [&](int64_t s) { return start < 0 ? offsets[b] + s : s - start; };
      std::vector<int64_t> keys;
      for (int64_t s = std::max<int64_t>(start, 0); s <= t; ++s) {
        const int64_t p = position(s);
        if (w == 0 || t - s < w || p < G || (S > 0 && p % S == S - 1)) keys.push_back(s);
      }
      auto idx = at::tensor(keys, at::kLong);
      auto K = in.k[b].index_select(0, idx), V = in.v[b].index_select(0, idx);  // [n,H,d]
      if (start < 0 && mem.k.defined()) {
        auto live = at::nonzero(mem.valid[b]).squeeze(1);
        K = at::cat({mem.k[b].index_select(0, live), K}), V = at::cat({mem.v[b].index_select(0, live), V});
      }
      auto p = at::softmax((in.q[b][t].unsqueeze(0) * K).sum(-1) * scale, 0);  // [n,H]
      out[b][t] = (p.unsqueeze(-1) * V).sum(0);
    }
  }
  return out;
}

struct Run {
  Tensor o;
  std::vector<Tensor> grads;  // q, k, v, then the keys and values before the slice
};

Run run_pattern(Form form, const MixerInputs& in, const Memory& mem, const MixerOptions& opt) {
  auto leaf = [](const Tensor& t) { return t.detach().clone().requires_grad_(true); };
  MixerInputs x;
  x.q = leaf(in.q), x.k = leaf(in.k), x.v = leaf(in.v);
  std::vector<Tensor> leaves{x.q, x.k, x.v};
  State s;
  if (mem.k.defined()) {
    s = {leaf(mem.k), leaf(mem.v), mem.valid};
    leaves.push_back(s[0]), leaves.push_back(s[1]);
  }
  MixerOptions o = opt;
  o.form = form;
  auto out = attn().forward(x, s, o).o;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
  auto loss = (out * at::randn(out.sizes(), gen, out.options())).sum();
  return {out.detach(), torch::autograd::grad({loss}, leaves)};
}

struct Pattern {
  int64_t window, global_tokens, stride;
};
const std::vector<Pattern> kPatterns{{5, 3, 0}, {6, 0, 5}, {1, 2, 4}, {9, 20, 0}, {4, 0, 1}, {3, 6, 7}};

MixerOptions pattern_options(const Pattern& p, int64_t C, int64_t offset) {
  MixerOptions opt;
  opt.window = p.window, opt.global_tokens = p.global_tokens, opt.stride = p.stride;
  opt.chunk_size = C, opt.offset = offset;
  return opt;
}

TEST(SoftmaxAttnPatterns, NaiveAndChunkwiseEqualDefinition) {
  Shape s;
  s.T = 48;
  auto in = random_inputs(attn(), s, at::kDouble, 21);
  double worst = 0;
  for (const auto& p : kPatterns)
    for (int64_t offset : {0, 7})
      for (int64_t M : {0, 5}) {
        auto opt = pattern_options(p, 16, offset);
        Memory mem = M > 0 ? random_memory(s, M, 31 + M) : Memory{};
        auto want = pattern_definition(in, mem, Tensor(), {offset, offset}, opt);
        for (Form f : {Form::naive, Form::chunkwise}) {
          opt.form = f;
          double e = rel_err(attn().forward(in, mem.state(), opt).o, want);
          worst = std::max(worst, e);
          EXPECT_LE(e, 1e-12) << form_name(f) << " w=" << p.window << " G=" << p.global_tokens << " S=" << p.stride
                              << " offset=" << offset << " M=" << M;
        }
      }
  std::cout << "[ errors   ] softmax_attn patterns, naive and chunkwise vs per-query loop: " << worst << "\n";
}

TEST(SoftmaxAttnPatterns, ChunkwiseEqualsNaiveWithGradients) {
  Shape s;
  s.T = 64;
  double eo = 0, eg = 0;
  for (int64_t C : {8, 16})
    for (const auto& p : kPatterns)
      for (int64_t offset : {0, 11}) {
        auto opt = pattern_options(p, C, offset);
        auto in = random_inputs(attn(), s, at::kDouble, 200 + C + p.window + offset);
        Memory mem = offset > 0 ? random_memory(s, 4, 41 + C) : Memory{};
        auto a = run_pattern(Form::chunkwise, in, mem, opt), b = run_pattern(Form::naive, in, mem, opt);
        eo = std::max(eo, rel_err(a.o, b.o));
        eg = std::max(eg, max_rel_err(a.grads, b.grads));
        EXPECT_LE(rel_err(a.o, b.o), 1e-12);
        EXPECT_LE(max_rel_err(a.grads, b.grads), 1e-12);
        for (auto& g : a.grads) EXPECT_GT(g.abs().max().item<double>(), 0) << "every input gets a gradient";
      }
  std::cout << "[ errors   ] softmax_attn patterns chunkwise vs naive: forward " << eo << " gradients " << eg << "\n";
}

// Packed documents: Mixer::forward runs every document on its own, the keys before the slice only in the
// first piece (which continues its document); the dispatched chunkwise form and the naive form against
// the per-query loop, the gradients against each other.
TEST(SoftmaxAttnPatterns, PackedDocumentsEqualDefinition) {
  Shape s;
  s.T = 64;
  auto in = random_inputs(attn(), s, at::kDouble, 51);
  auto starts = at::zeros({s.B, s.T}, at::kBool);
  starts[0][0] = true, starts[0][13] = true, starts[0][40] = true;  // sequence 0 starts a document
  starts[1][29] = true, starts[1][48] = true;                        // sequence 1 continues one
  double worst = 0;
  for (const auto& p : kPatterns) {
    auto opt = pattern_options(p, 16, 0);
    opt.document_starts = starts;
    opt.document_offsets = {0, 9};
    Memory mem = random_memory(s, 5, 61);
    auto want = pattern_definition(in, mem, starts, {0, 9}, opt);
    auto a = run_pattern(Form::chunkwise, in, mem, opt), b = run_pattern(Form::naive, in, mem, opt);
    const double e = std::max({rel_err(a.o, want), rel_err(b.o, want), max_rel_err(a.grads, b.grads)});
    worst = std::max(worst, e);
    EXPECT_LE(e, 1e-12) << "w=" << p.window << " G=" << p.global_tokens << " S=" << p.stride;
  }
  std::cout << "[ errors   ] softmax_attn patterns with packed documents vs per-query loop: " << worst << "\n";
}

TEST(SoftmaxAttnPatterns, BadOptionsAndStatesAreRefused) {
  Shape s;
  s.T = 32;
  auto in = random_inputs(attn(), s, at::kDouble, 3);
  MixerOptions opt;
  opt.chunk_size = 16;
  opt.global_tokens = 4;
  expect_error([&] { attn().chunkwise(in, {}, opt); }, "go with a sliding window");
  opt.window = 8;
  opt.stride = -1;
  expect_error([&] { attn().naive(in, {}, opt); }, "must be >= 0");
  opt.stride = 0;
  Memory mem = random_memory(s, 3, 5);
  EXPECT_NO_THROW(attn().chunkwise(in, mem.state(), opt));
  expect_error([&] { attn().chunkwise(in, {mem.k, mem.v}, opt); }, "valid [B,M]");
  expect_error([&] { attn().chunkwise(in, {mem.k, mem.v.narrow(1, 0, 2), mem.valid}, opt); }, "initial state 'v'");
  opt.global_tokens = 0;
  expect_error([&] { attn().naive(in, mem.state(), opt); }, "must be empty");
}

// The relay plan over simulated ranks: rank r's message is built by its index from cat(what it received,
// its own rows), the rows carrying their positions; every rank must then receive exactly the pattern keys
// of the document in progress at its extended start that lie before it (valid rows, in order), and the
// window's halo.
TEST(SoftmaxAttnPatterns, RelayPlanCarriesThePatternKeysAndTheHalo) {
  const int64_t B = 2, T = 16;
  for (int64_t P : {2, 4})
    for (int64_t halo : {0, 8, 16})
      for (auto [G, S] : std::vector<std::pair<int64_t, int64_t>>{{3, 0}, {0, 5}, {20, 3}, {2, 1}}) {
        const int64_t N = P * T;
        auto starts = at::zeros({B, N}, at::kBool);
        starts[0][0] = true, starts[0][5] = true, starts[0][T + 3] = true;  // sequence 0: short documents
        if (P > 2) starts[0][3 * T] = true;                                  // and one at a rank boundary
        starts[1][0] = true;                                                 // sequence 1: one long document
        auto own = [&](int64_t r) {  // rows carrying position + 1
          return (at::arange(r * T, (r + 1) * T, at::kDouble) + 1).view({1, T, 1}).expand({B, T, 1}).contiguous();
        };
        Tensor got = at::zeros({B, 0, 1}, at::kDouble);
        for (int64_t r = 0; r < P; ++r) {
          auto plan = softmax_attn_relay_plan(starts, B, N, r, T, halo, G, S);
          ASSERT_EQ(got.size(1), plan.memory_rows + plan.halo_rows) << "rank " << r;
          const int64_t E = r * T - plan.halo_rows;
          for (int64_t b = 0; b < B; ++b) {
            int64_t doc = 0;
            for (int64_t u = E; u > 0 && !doc; --u) if (starts[b][u].item<bool>()) doc = u;
            std::vector<int64_t> want;
            for (int64_t p = doc; p < E; ++p) if (softmax_attn_pattern_key(p - doc, G, S)) want.push_back(p);
            std::vector<int64_t> seen;
            for (int64_t m = 0; m < plan.memory_rows; ++m)
              if (plan.valid[b][m].item<bool>()) seen.push_back(static_cast<int64_t>(got[b][m][0].item<double>()) - 1);
              else EXPECT_EQ(got[b][m][0].item<double>(), 0);
            EXPECT_EQ(seen, want) << "P=" << P << " halo=" << halo << " G=" << G << " S=" << S << " rank " << r << " b " << b;
            for (int64_t j = 0; j < plan.halo_rows; ++j)
              EXPECT_EQ(got[b][plan.memory_rows + j][0].item<double>(), E + j + 1);
          }
          if (r + 1 == P) break;
          auto src = at::cat({got, own(r)}, 1);
          auto idx = plan.index;
          got = src.gather(1, idx.clamp_min(0).unsqueeze(-1)) * (idx >= 0).unsqueeze(-1).to(at::kDouble);
        }
      }
}

// The preset with global tokens (configs/models/hybrid_gdn_global_125m.textproto), shrunk, trains a few steps
// of MQAR on the CPU with its window narrowed to 8 so that the global tokens lie beyond it.
TEST(SoftmaxAttnPatterns, GlobalTokensPresetTrainsOnCpu) {
  auto cfg = run_config_from_text(std::string(R"(
name: "hybrid_gdn_global_smoke"
model_preset: ")") + CARRY_SOURCE_DIR + R"(/configs/models/hybrid_gdn_global_125m.textproto"
model { vocab_size: 32 d_model: 32 n_layers: 4 n_heads: 2 }
data { mqar { num_kv_pairs: 4 num_queries: 16 vocab_size: 32 } seq_len: 64 batch_size: 8 }
optimizer { lr: 3e-3 warmup_steps: 0 total_steps: 6 }
)",
                                  "hybrid_gdn_global_smoke.textproto", {"model.mixer_options[2].window=8"});
  auto layer = layer_mixer(cfg.model(), 3);
  ASSERT_EQ(layer.kind, "softmax_attn");
  EXPECT_EQ(layer.options.window(), 8);
  EXPECT_EQ(layer.options.global_tokens(), 64);
  TrainerOptions o;
  o.log = nullptr;
  o.force_cpu = true;
  o.dtype = at::kFloat;
  Trainer t(cfg, nullptr, o);
  std::vector<double> losses;
  for (int i = 0; i < 6; ++i) losses.push_back(t.train_step().loss);
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  std::cout << "[ errors   ] hybrid_gdn_global preset (shrunk), 6 CPU steps of MQAR: loss " << losses.front() << " -> "
            << losses.back() << "\n";
  EXPECT_LT(losses.back(), losses.front());
}

// The config's global_tokens and stride (framework/config/validation.cpp): bounds, a window required, and
// softmax_attn layers only, each a line naming the field.
TEST(SoftmaxAttnPatterns, ConfigOptionsAreValidated) {
  auto errors = [](const std::string& options) {
    ModelConfig m;
    m.set_vocab_size(32), m.set_d_model(16), m.set_n_layers(2), m.set_n_heads(2);
    m.add_mixers("gated_deltanet"), m.add_mixers("softmax_attn");
    EXPECT_TRUE(google::protobuf::TextFormat::MergeFromString(options, &m)) << options;
    return join(model_config_errors(m), "\n");
  };
  EXPECT_EQ(errors("mixer_options { kind: \"softmax_attn\" window: 8 global_tokens: 4 stride: 16 }"), "");
  auto e = errors("mixer_options { kind: \"softmax_attn\" global_tokens: 4 }");
  EXPECT_NE(e.find("model.mixer_options[0].global_tokens"), std::string::npos) << e;
  EXPECT_NE(e.find("goes with a sliding window"), std::string::npos) << e;
  e = errors("mixer_options { kind: \"softmax_attn\" window: 8 stride: -2 }");
  EXPECT_NE(e.find("model.mixer_options[0].stride: must lie in [0, "), std::string::npos) << e;
  e = errors("mixer_options { kind: \"gated_deltanet\" stride: 4 }");
  EXPECT_NE(e.find("only softmax_attn uses 'stride'"), std::string::npos) << e;
}

// On a GPU the kernel form computes the window alone: automatic dispatch runs the patterns in the chunkwise
// form (on shapes the kernel takes otherwise), equal to the per-query loop in fp64 on the CPU to fp32
// rounding, and a forced kernel form refuses them by name. Skipped without a GPU.
TEST(SoftmaxAttnPatterns, CudaRunsTheChunkwiseFormAndRefusesTheKernel) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
  Shape s;
  s.T = 128, s.dk = 64, s.dv = 64;
  auto in = random_inputs(attn(), s, at::kFloat, 7, at::kCUDA);
  auto opt = pattern_options({16, 5, 9}, 64, 0);
#ifdef CARRY_WITH_CUDA
  MixerOptions window_only = pattern_options({16, 0, 0}, 64, 0);
  EXPECT_EQ(attn().resolve_form(in, window_only), Form::kernel);
#endif
  EXPECT_EQ(attn().resolve_form(in, opt), Form::chunkwise);
  MixerInputs cpu;
  cpu.q = in.q.cpu().to(at::kDouble), cpu.k = in.k.cpu().to(at::kDouble), cpu.v = in.v.cpu().to(at::kDouble);
  auto want = pattern_definition(cpu, Memory{}, Tensor(), {0, 0}, opt);
  const double e = rel_err(attn().forward(in, {}, opt).o.cpu().to(at::kDouble), want);
  std::cout << "[ errors   ] softmax_attn patterns on CUDA (fp32, automatic dispatch) vs per-query loop: " << e << "\n";
  EXPECT_LE(e, 1e-5);
  opt.form = Form::kernel;
  expect_error([&] { attn().forward(in, {}, opt); }, "computes the window alone");
}

}  // namespace
}  // namespace carry::testing
