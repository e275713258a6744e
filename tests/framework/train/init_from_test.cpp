// Tests of a run's init_from (framework/train/trainer.cpp, Trainer::resume): a new run starts from
// another run's checkpoint or from an FLA folder with exactly those weights, at step 0 with a fresh
// optimizer; a checkpoint of the run itself wins over init_from; a model section that does not match
// the weights is refused with a message that names the parameter and says what init_from needs.
#include "framework/io/fla_format.h"
#include "framework/train/trainer.h"
#include "tests/helpers/one_thread.h"
#include "tests/helpers/temp_dir.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace carry {
namespace {

using testing::make_temp_dir;
using testing::remove_tree;

const char* kRun = R"(
name: "init_from_test"
seed: 5
model { vocab_size: 24 d_model: 16 n_layers: 2 n_heads: 2 mixers: "gated_deltanet" mixer_options { chunk_size: 8 conv_size: 4 } }
data { mqar { num_kv_pairs: 2 num_queries: 4 vocab_size: 24 } seq_len: 16 batch_size: 2 eval_batches: 1 }
optimizer { lr: 1e-2 total_steps: 6 }
)";

TrainerOptions quiet() {
  TrainerOptions o;
  o.log = nullptr;
  o.force_cpu = true;
  return o;
}

void expect_same_weights(const Model& a, const Model& b) {
  auto pa = a.parameters(), pb = b.parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(at::equal(pa[i].second, pb[i].second)) << pa[i].first;
}

TEST(InitFrom, StartsFromACheckpointOrAnFlaFolderWithItsWeights) {
  testing::OneThread one_thread;
  auto dir = make_temp_dir("carry_init_from");
  Trainer source(run_config_from_text(kRun, "a.textproto", {"checkpoint.dir=" + dir + "/a"}), nullptr, quiet());
  for (int i = 0; i < 3; ++i) source.train_step();
  source.save_checkpoint();
  export_fla_folder(dir + "/fla", source.config().model(), source.model().parameters(), {});

  for (const std::string& from : {dir + "/a", dir + "/a/step_00000003", dir + "/fla"}) {
    SCOPED_TRACE(from);
    auto cfg = run_config_from_text(kRun, "b.textproto", {"init_from=" + from, "checkpoint.dir=" + dir + "/b"});
    Trainer t(cfg, nullptr, quiet());
    EXPECT_FALSE(t.resume());  // weights only: not a resumed run
    EXPECT_EQ(t.step(), 0);
    expect_same_weights(t.model(), source.model());
    auto s = t.train_step();  // and it trains on from there
    EXPECT_TRUE(std::isfinite(s.loss));
  }

  // Once the run has a checkpoint of its own, that one is resumed and init_from is not read.
  {
    auto cfg = run_config_from_text(kRun, "c.textproto", {"init_from=" + dir + "/fla", "checkpoint.dir=" + dir + "/c"});
    Trainer t(cfg, nullptr, quiet());
    t.train_step();
    t.save_checkpoint();
    Trainer again(cfg, nullptr, quiet());
    EXPECT_TRUE(again.resume());
    EXPECT_EQ(again.step(), 1);
    expect_same_weights(again.model(), t.model());
  }

  // A different model is refused, naming the parameter.
  auto wrong = run_config_from_text(kRun, "d.textproto", {"init_from=" + dir + "/a", "model.n_heads=4"});
  Trainer w(wrong, nullptr, quiet());
  try {
    w.resume();
    FAIL() << "a mismatched init_from was accepted";
  } catch (const std::exception& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("init_from carry checkpoint " + dir + "/a/step_00000003 (step 3): parameter "
                       "'layers.0.mixer.a_proj.weight' has shape [2, 16], the model's is [4, 16]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("model { } must describe the same model"), std::string::npos) << msg;
  }
  auto missing = run_config_from_text(kRun, "e.textproto", {"init_from=" + dir + "/none"});
  Trainer m(missing, nullptr, quiet());
  EXPECT_THROW(m.resume(), std::exception);
  remove_tree(dir);
}

}  // namespace
}  // namespace carry
