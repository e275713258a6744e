// NVTX ranges (layers/core/nvtx.h) through the test observer: ranges nest and balance, and a model
// forward names each layer ("layer i kind") with its mixer and MLP inside; with recomputation the
// backward rebuilds each layer under the same names.
#include "layers/core/nvtx.h"

#include "framework/model/model.h"
#include "tests/helpers/one_thread.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace carry {
namespace {

using testing::OneCpuThread;

std::vector<std::string> g_events;

void record(const char* name, bool push) { g_events.push_back(push ? std::string("+") + name : "-"); }

struct Observe {
  Observe() {
    g_events.clear();
    set_nvtx_observer(record);
  }
  ~Observe() { set_nvtx_observer(nullptr); }
};

TEST(Nvtx, RangesNestAndBalance) {
  Observe o;
  {
    NvtxRange a("outer");
    NvtxRange b(std::string("inner ") + "1");
  }
  EXPECT_EQ(g_events, (std::vector<std::string>{"+outer", "+inner 1", "-", "-"}));
}

TEST(Nvtx, ModelLayersAreNamed) {
  OneCpuThread one_thread;
  ModelConfig mc;
  mc.set_vocab_size(16), mc.set_d_model(16), mc.set_n_layers(2), mc.set_n_heads(2);
  mc.add_mixers("gated_deltanet");
  mc.add_mixers("softmax_attn");
  auto* o = mc.add_mixer_options();
  o->set_chunk_size(8);
  auto model = build_model(mc, 1);
  auto tokens = at::randint(16, {1, 16}, at::kLong);
  const std::vector<std::string> forward{"+layer 0 gated_deltanet", "+mixer gated_deltanet", "-", "+mlp", "-", "-",
                                         "+layer 1 softmax_attn",   "+mixer softmax_attn",   "-", "+mlp", "-", "-"};
  {
    Observe ob;
    model.forward(tokens);
    EXPECT_EQ(g_events, forward);
  }
  {
    Observe ob;
    ModelContext ctx;
    ctx.recompute = true;
    auto loss = model.forward(tokens, ctx).sum();
    EXPECT_EQ(g_events, forward);
    g_events.clear();
    loss.backward();
    // The backward rebuilds layer 1, then layer 0.
    std::vector<std::string> rebuilt(forward.begin() + 6, forward.end());
    rebuilt.insert(rebuilt.end(), forward.begin(), forward.begin() + 6);
    EXPECT_EQ(g_events, rebuilt);
  }
}

}  // namespace
}  // namespace carry
