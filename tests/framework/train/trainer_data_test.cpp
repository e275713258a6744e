// The trainer on token files and the run as one watches it (CPU, one process): shards named by a glob
// train; a token id >= vocab_size stops the run before any step, naming the file and the token;
// gradient accumulation of 2 half batches equals one full batch (fp64, losses and parameters); the
// step and eval lines (elapsed, ETA, no MFU on the CPU, perplexity on language data); an eval at a
// --max-steps stop is not lost; a crash after a checkpoint leaves no duplicate record once resumed,
// and the TensorBoard file agrees with the JSON lines.
#include "framework/data/token_file.h"
#include "framework/io/tfevents.h"
#include "framework/io/tfevents.pb.h"
#include "framework/train/run_log.h"
#include "framework/train/trainer.h"
#include "tests/helpers/temp_dir.h"
#include "tests/helpers/one_thread.h"

#include <gtest/gtest.h>

#include <dirent.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <random>

namespace carry::testing {
namespace {

const char* kTokenRun = R"(
name: "token_run"
seed: 3
model {
  vocab_size: 64 d_model: 32 n_layers: 1 n_heads: 2
  mixers: "gated_deltanet"
  mixer_options { chunk_size: 16 }
}
data { seq_len: 32 batch_size: 4 eval_batches: 1 }
optimizer { lr: 1e-2 warmup_steps: 1 total_steps: 6 }
logging { every_steps: 1 }
)";

TrainerOptions quiet() {
  TrainerOptions o;
  o.log = nullptr;
  o.force_cpu = true;
  return o;
}

// Token ids with some structure (a noisy counter), so that the loss falls.
void write_shard(const std::string& path, int n, unsigned seed, uint32_t vocab = 64) {
  std::mt19937 gen(seed);
  std::vector<uint32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = (i % 2 == 0 ? (i / 2) % (vocab - 1) : gen() % vocab);
  write_token_file(path, t);
}

class TrainerData : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = make_temp_dir("carry_trainer_data");
    for (int s = 0; s < 3; ++s) write_shard(dir_ + "/train_00" + std::to_string(s) + ".tok", 700, s);
    write_shard(dir_ + "/eval.tok", 300, 99);
  }
  void TearDown() override { remove_tree(dir_); }
  RunConfig config(std::vector<std::string> overrides = {}) const {
    overrides.insert(overrides.begin(), {"data.token_files={paths: \"" + dir_ + "/train_*.tok\" eval_paths: \"" + dir_ +
                                         "/eval.tok\"}"});
    return run_config_from_text(kTokenRun, "token_run.textproto", overrides);
  }
  std::string dir_;
};

std::string read_all(std::FILE* f) {
  std::rewind(f);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  return out;
}

// CARRY_TRACE: a Chrome trace of the chosen steps for this rank (on the CPU, its ATen calls), and a
// malformed CARRY_TRACE_STEPS refused with what it expects.
TEST_F(TrainerData, TraceWritesTheChosenSteps) {
  OneCpuThread one_thread;
  const std::string trace_dir = dir_ + "/trace";
  struct Env {  // set for this test only
    Env(const std::string& dir, const char* steps) {
      setenv("CARRY_TRACE", dir.c_str(), 1);
      setenv("CARRY_TRACE_STEPS", steps, 1);
    }
    ~Env() {
      unsetenv("CARRY_TRACE");
      unsetenv("CARRY_TRACE_STEPS");
    }
  };
  {
    Env env(trace_dir, "2:3");
    Trainer t(config(), nullptr, quiet());
    EXPECT_EQ(t.run(), 0);
  }
  std::ifstream f(trace_dir + "/trace_rank0.json");
  ASSERT_TRUE(f.good()) << "no trace written to " << trace_dir;
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"traceEvents\""), std::string::npos);
  EXPECT_NE(text.find("aten::"), std::string::npos) << "the CPU's ATen calls are the trace on a CPU";
  {
    Env env(trace_dir, "3:1");
    Trainer t(config(), nullptr, quiet());
    try {
      t.run();
      ADD_FAILURE() << "CARRY_TRACE_STEPS=3:1 was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("CARRY_TRACE_STEPS: expected 'A:B' with 1 <= A <= B"),
                std::string::npos)
          << e.what_without_backtrace();
    }
  }
}

TEST_F(TrainerData, GlobShardsTrainAndTheLinesSayWhatTheyShould) {
  OneCpuThread one_thread;
  std::FILE* log = std::tmpfile();
  auto o = quiet();
  o.log = log;
  Trainer t(config({"logging.eval_every_steps=3"}), nullptr, o);
  EXPECT_EQ(t.run(), 0);
  auto text = read_all(log);
  std::fclose(log);
  EXPECT_NE(text.find("data check: 4 token files, 2400 tokens, every id below model.vocab_size = 64"), std::string::npos)
      << text;
  EXPECT_NE(text.find("data: data.token_files: 3 files, 2100 tokens, 65 windows of 33 tokens (shuffled every epoch)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("| elapsed "), std::string::npos) << text;
  EXPECT_NE(text.find("| eta "), std::string::npos) << text;
  EXPECT_EQ(text.find("MFU"), std::string::npos) << "MFU is printed only on GPUs:\n" << text;
  EXPECT_NE(text.find("eval step 3 | loss "), std::string::npos) << text;
  EXPECT_NE(text.find("| perplexity "), std::string::npos) << text;
  EXPECT_NE(text.find("| next-token accuracy "), std::string::npos) << text;
  EXPECT_NE(text.find("| 128 tokens"), std::string::npos) << text;
  EXPECT_EQ(text.find("sequences all right"), std::string::npos) << "an MQAR-only figure on language data:\n" << text;
}

TEST_F(TrainerData, AnIdOutsideTheVocabularyStopsTheRunBeforeAnyStep) {
  std::vector<uint32_t> t(500, 5);
  t[377] = 64;
  write_token_file(dir_ + "/train_003.tok", t);
  try {
    Trainer tr(config(), nullptr, quiet());
    ADD_FAILURE() << "the trainer started";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("data check: " + dir_ + "/train_003.tok: token 377 (id 64) is not below "
                                         "model.vocab_size = 64"),
              std::string::npos)
        << e.what();
  }
  try {
    Trainer tr(config({"data.token_files.paths=" + dir_ + "/nothing_*.bin"}), nullptr, quiet());
    ADD_FAILURE() << "the trainer started";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("nothing_*.bin' matches no file"), std::string::npos) << e.what();
  }
}

// The losses and parameters after 2 steps of (batch 4) and of (2 micro-batches of 2), in fp64, on token
// files and on MQAR; and a check that the comparison can fail (other sequences give other losses).
TEST_F(TrainerData, GradAccumulationOfHalfBatchesEqualsTheFullBatch) {
  OneCpuThread one_thread;
  for (bool tokens : {true, false}) {
    auto run = [&](std::vector<std::string> o) {
      if (!tokens) {
        o.insert(o.begin(), {"data.mqar={num_kv_pairs: 4 num_queries: 4 vocab_size: 64}"});
      }
      auto cfg = tokens ? config(o) : run_config_from_text(kTokenRun, "mqar.textproto", o);
      auto opt = quiet();
      opt.dtype = at::kDouble;
      Trainer t(cfg, nullptr, opt);
      std::vector<double> losses;
      for (int i = 0; i < 2; ++i) losses.push_back(t.train_step().loss);
      std::vector<at::Tensor> params;
      for (auto& [n, p] : t.model().parameters()) params.push_back(p.detach().clone());
      EXPECT_EQ(t.tokens_seen(), 2 * 4 * 32);
      return std::make_pair(losses, params);
    };
    auto full = run({"data.batch_size=4"});
    auto accum = run({"data.batch_size=2", "optimizer.grad_accum_steps=2"});
    double worst_loss = 0, worst_param = 0;
    for (int i = 0; i < 2; ++i)
      worst_loss = std::max(worst_loss, std::abs(full.first[i] - accum.first[i]) / std::abs(full.first[i]));
    for (size_t i = 0; i < full.second.size(); ++i)
      worst_param = std::max(worst_param, (full.second[i] - accum.second[i]).abs().max().item<double>());
    EXPECT_LT(worst_loss, 1e-13) << (tokens ? "token files" : "mqar");
    EXPECT_LT(worst_param, 1e-12) << (tokens ? "token files" : "mqar");
    if (tokens) {  // other sequences (a batch of 4 twice as long): the comparison can fail
      auto other = run({"data.batch_size=2", "data.seq_len=64"});
      EXPECT_GT(std::abs(full.first[1] - other.first[1]), 1e-6);
    }
  }
}

std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (auto* e = ::readdir(d))
      if (std::string(e->d_name).find("tfevents") != std::string::npos) out.push_back(dir + "/" + e->d_name);
    ::closedir(d);
  }
  return out;
}

// --max-steps 3 with an eval every 3 steps: the eval of step 3 is written before the stop. Then a run
// that dies after step 5 (its checkpoint is step 4): resumed, step 5 is written once.
TEST_F(TrainerData, StopsAndCrashesLoseNoEvalAndLeaveNoDuplicate) {
  OneCpuThread one_thread;
  const std::string metrics = dir_ + "/run/metrics.jsonl";
  auto cfg = config({"logging.eval_every_steps=3", "checkpoint.dir=" + dir_ + "/ck", "checkpoint.every_steps=2",
                     "logging.metrics_file=" + metrics});
  {
    auto o = quiet();
    o.max_steps = 3;
    Trainer t(cfg, nullptr, o);
    EXPECT_EQ(t.run(), kExitStoppedBySignal);
  }
  {
    auto o = quiet();
    o.on_step = [](const StepStats& s) {
      if (s.step == 5) throw std::runtime_error("simulated crash after step 5");
    };
    Trainer t(cfg, nullptr, o);
    EXPECT_THROW(t.run(), std::runtime_error);
  }
  {
    Trainer t(cfg, nullptr, quiet());
    EXPECT_EQ(t.run(), 0);
  }
  std::ifstream in(metrics);
  std::map<int64_t, int> step_records, eval_records;
  std::vector<std::string> markers;
  std::vector<std::pair<int64_t, double>> losses;
  double last_time = 0, last_elapsed = -1;
  for (std::string line; std::getline(in, line);) {
    RunLogRecord r;
    ASSERT_TRUE(parse_run_log_line(line, &r)) << line;
    std::map<std::string, RunLogField> f;
    for (auto& x : r) f[x.key] = x;
    ASSERT_TRUE(f.count("step") && f.count("time")) << line;
    EXPECT_GE(f["time"].number, last_time) << line;
    EXPECT_GT(f["time"].number, 1.6e9) << "a Unix time: " << line;
    last_time = f["time"].number;
    const auto step = static_cast<int64_t>(f["step"].number);
    if (f.count("event")) {
      markers.push_back(f["event"].text + "@" + std::to_string(step));
    } else if (f.count("eval_loss")) {
      ++eval_records[step];
      EXPECT_TRUE(f.count("eval_perplexity")) << line;
      EXPECT_FALSE(f.count("eval_sequence_accuracy")) << line;
    } else {
      ++step_records[step];
      losses.emplace_back(step, f["loss"].number);
      EXPECT_FALSE(f.count("mfu")) << "no MFU on the CPU: " << line;
      EXPECT_GE(f["elapsed_s"].number, last_elapsed) << line;
      last_elapsed = f["elapsed_s"].number;
    }
  }
  EXPECT_EQ(markers, (std::vector<std::string>{"start@0", "resume@3", "resume@4"}));
  for (int64_t s = 1; s <= 6; ++s) EXPECT_EQ(step_records[s], 1) << "step " << s;
  EXPECT_EQ(eval_records, (std::map<int64_t, int>{{3, 1}, {6, 1}}));
  // TensorBoard: one file, the same losses.
  auto files = event_files(dir_ + "/run");
  ASSERT_EQ(files.size(), 1u);
  std::vector<std::pair<int64_t, double>> tb;
  int evals = 0;
  for (auto& rec : read_event_records(files[0])) {
    tfevents::Event e;
    ASSERT_TRUE(e.ParseFromString(rec));
    for (auto& v : e.summary().value()) {
      if (v.tag() == "train/loss") tb.emplace_back(e.step(), v.simple_value());
      evals += v.tag() == "eval/perplexity";
    }
  }
  ASSERT_EQ(tb.size(), losses.size());
  for (size_t i = 0; i < tb.size(); ++i) {
    EXPECT_EQ(tb[i].first, losses[i].first);
    EXPECT_FLOAT_EQ(static_cast<float>(tb[i].second), static_cast<float>(losses[i].second));
  }
  EXPECT_EQ(evals, 2);
}

}  // namespace
}  // namespace carry::testing
