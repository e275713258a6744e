// Selective recomputation (layers/blocks/recompute.h, MixerCoreStash): a layer recomputed in the backward with
// a stash runs its core once (the stash holds the core's output and graph after the forward, and is
// emptied by the backward), and the gradients of x and of every parameter equal those of the layer
// that keeps its activations, bit for bit (fp64, CPU), for a delta-rule, a decay and a softmax layer.
#include "layers/blocks/mixer_layer.h"
#include "layers/blocks/recompute.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

namespace carry {
namespace {

TEST(Recompute, KeptMixerCoreRunsOnceWithTheSameGradients) {
  for (const std::string kind : {"gated_deltanet", "gla", "softmax_attn"}) {
    MixerLayerSpec spec;
    spec.kind = kind;
    spec.d_model = 32, spec.n_heads = 2, spec.head_dim_k = 16, spec.head_dim_v = 16, spec.chunk_size = 16;
    spec.conv_size = 4;
    ParameterInit init(11, at::TensorOptions().dtype(at::kDouble));
    MixerLayer layer(spec, init);
    std::vector<Tensor> params;
    for (auto& [name, p] : layer.parameters()) params.push_back(p);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    const Tensor x0 = at::randn({2, 48, spec.d_model}, gen, at::kDouble);
    const Tensor gy = at::randn({2, 48, spec.d_model}, gen, at::kDouble);

    auto grads = [&](const std::shared_ptr<MixerCoreStash>& stash) {
      for (auto& p : params) p.mutable_grad() = Tensor();
      Tensor x = x0.clone().requires_grad_(true);
      MixerLayerContext ctx;
      ctx.core_stash = stash;
      Tensor y;
      if (stash) {
        y = recompute_in_backward([&](const Tensor& in) { return layer.forward(in, {}, ctx).y; }, x, params);
        EXPECT_TRUE(stash->o.defined()) << kind << ": the forward kept the core's output";
        EXPECT_FALSE(stash->leaves.empty()) << kind;
      } else {
        y = layer.forward(x, {}, ctx).y;
      }
      y.backward(gy);
      if (stash) EXPECT_FALSE(stash->o.defined()) << kind << ": the backward empties the stash";
      std::vector<Tensor> g{x.grad()};
      for (auto& p : params) g.push_back(p.grad().defined() ? p.grad().clone() : Tensor());
      return g;
    };
    const auto kept = grads(nullptr);
    const auto stashed = grads(std::make_shared<MixerCoreStash>());
    ASSERT_EQ(kept.size(), stashed.size());
    for (size_t i = 0; i < kept.size(); ++i) {
      ASSERT_EQ(kept[i].defined(), stashed[i].defined()) << kind << " gradient " << i;
      if (kept[i].defined()) EXPECT_TRUE(at::equal(kept[i], stashed[i])) << kind << " gradient " << i;
    }
    EXPECT_TRUE(kept[0].abs().sum().item<double>() > 0) << kind;
  }
}

// A recomputed layer's exchanges run once: the forward runs them and records what they returned, the
// recomputation in the backward gets the same tensors back without running them; outside a
// recomputation every call runs. The gradient flows through the replayed value as through the first.
TEST(Recompute, ExchangesRunOnceAndAreReplayed) {
  int runs = 0;
  auto exchange = [&] {
    ++runs;
    return std::vector<Tensor>{at::full({3}, 2.0 + runs, at::kDouble)};  // differs per run
  };
  auto f = [&](const Tensor& x) { return x * received_once(exchange)[0]; };
  auto x = at::arange(3, at::kDouble).requires_grad_(true);
  auto y = recompute_in_backward(f, x, {});
  EXPECT_EQ(runs, 1);
  y.sum().backward();
  EXPECT_EQ(runs, 1) << "the recomputation ran the exchange again";
  EXPECT_TRUE(at::equal(x.grad(), at::full({3}, 3.0, at::kDouble)));  // the forward's value, 2 + 1
  received_once(exchange);
  EXPECT_EQ(runs, 2);
}

// The recomputation in the backward differentiates only the graph of the layer's result, so its last op
// may skip computing values (graph_only_add): recomputing_in_backward() is false in the forward and true
// in the recomputation, the forward's result has its values, and the gradients are those of a + b.
TEST(Recompute, TheRecomputedResultIsAGraphOnly) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto x = at::randn({3, 4}, gen, at::kDouble).requires_grad_(true);
  auto w = at::randn({4}, gen, at::kDouble).requires_grad_(true);
  std::vector<bool> seen;
  auto f = [&](const Tensor& in) {
    const bool values = !recomputing_in_backward();
    seen.push_back(values);
    return graph_only_add(in * w, in.exp(), values);
  };
  auto y = recompute_in_backward(f, x, {w});
  EXPECT_TRUE(at::allclose(y, x.detach() * w.detach() + x.detach().exp(), 0, 0)) << "the forward keeps its values";
  auto gy = at::randn({3, 4}, gen, at::kDouble);
  auto g = torch::autograd::grad({y}, {x, w}, {gy});
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_TRUE(seen[0]) << "the forward computes values";
  EXPECT_FALSE(seen[1]) << "the recomputation builds the graph only";
  EXPECT_FALSE(recomputing_in_backward()) << "the flag ends with the recomputation";
  auto xd = x.detach(), wd = w.detach();
  EXPECT_TRUE(at::allclose(g[0], gy * wd + gy * xd.exp(), 1e-14, 0));
  EXPECT_TRUE(at::allclose(g[1], (gy * xd).sum(0), 1e-14, 0));
  // Where values are asked for, or nothing needs a gradient, it is a plain sum.
  EXPECT_TRUE(at::equal(graph_only_add(xd, xd, false), xd + xd));
}

// Overlapped recomputation (recompute_in_backward's overlap): a chain of four recomputed layers, each with
// its own parameter and an exchange. When a layer's backward starts it first recomputes the layer below
// (on the CPU in place, earlier), so layer i's second forward runs before layer i+1's gradient reaches it;
// every layer still runs twice in all (the forward and one recomputation), each exchange once, and the
// gradients of x and of every parameter are those without overlap, bit for bit.
TEST(Recompute, OverlappedRecomputationRunsEachLayerOnceAheadWithTheSameGradients) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  const Tensor x0 = at::randn({5, 6}, gen, at::kDouble);
  const Tensor gy = at::randn({5, 6}, gen, at::kDouble);
  std::vector<Tensor> w;
  for (int i = 0; i < 4; ++i) w.push_back(at::randn({6}, gen, at::kDouble).requires_grad_(true));
  struct Run {
    std::vector<Tensor> grads;
    std::vector<int> forwards, exchanges;
    std::vector<std::string> order;  // "f<i>": a call of layer i's function; "g<i>": its input's gradient made
  };
  auto run = [&](bool overlap) {
    Run r;
    r.forwards.assign(4, 0);
    r.exchanges.assign(4, 0);
    for (auto& p : w) p.mutable_grad() = Tensor();
    Tensor x = x0.clone().requires_grad_(true), h = x;
    for (int i = 0; i < 4; ++i) {
      auto f = [&r, &w, i](const Tensor& in) {
        ++r.forwards[i];
        r.order.push_back("f" + std::to_string(i));
        if (in.requires_grad())
          in.register_hook([&r, i](const Tensor& g) {
            r.order.push_back("g" + std::to_string(i));
            return g;
          });
        auto got = received_once([&r, i] {
          ++r.exchanges[i];
          return std::vector<Tensor>{at::full({6}, 0.5 + i, at::kDouble)};
        });
        return (in * w[i]).tanh() * got[0] + in;
      };
      h = recompute_in_backward(f, h, {w[i]}, overlap);
    }
    r.order.push_back("backward");
    h.backward(gy);
    r.grads.push_back(x.grad());
    for (auto& p : w) r.grads.push_back(p.grad().clone());
    return r;
  };
  const Run plain = run(false), ahead = run(true);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(ahead.forwards[i], 2) << "layer " << i << ": the forward and one recomputation";
    EXPECT_EQ(ahead.exchanges[i], 1) << "layer " << i << ": the exchange ran again";
  }
  // Without overlap each layer is recomputed when its own backward starts; with it, a layer's backward
  // recomputes the layer below before it differentiates itself.
  const std::vector<std::string> in_turn{"f0", "f1", "f2", "f3", "backward", "f3", "g3", "f2", "g2", "f1", "g1", "f0", "g0"};
  const std::vector<std::string> overlapped{"f0", "f1", "f2", "f3", "backward", "f3", "f2", "g3", "f1", "g2", "f0", "g1", "g0"};
  EXPECT_EQ(plain.order, in_turn);
  EXPECT_EQ(ahead.order, overlapped);
  ASSERT_EQ(plain.grads.size(), ahead.grads.size());
  for (size_t i = 0; i < plain.grads.size(); ++i)
    EXPECT_TRUE(at::equal(plain.grads[i], ahead.grads[i])) << "gradient " << i;
  EXPECT_GT(plain.grads[0].abs().sum().item<double>(), 0);
}

}  // namespace
}  // namespace carry
