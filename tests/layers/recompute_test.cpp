// Selective recomputation (layers/recompute.h, MixerCoreStash): a layer recomputed in the backward with
// a stash runs its core once (the stash holds the core's output and graph after the forward, and is
// emptied by the backward), and the gradients of x and of every parameter equal those of the layer
// that keeps its activations, bit for bit (fp64, CPU), for a delta-rule, a decay and a softmax layer.
#include "layers/mixer_layer.h"
#include "layers/recompute.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace carry
