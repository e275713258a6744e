// The trainer's promises about its outputs and its inputs (README.md, "Reliability"), on one CPU
// process: checkpoint.resume AUTO / REQUIRED / NEVER and what each says; checkpoints of another run or
// damaged ones are never deleted; a checkpoint whose config differs in what makes a run is refused
// with the differences listed (and accepted with allow_config_change); a second run on a locked
// checkpoint.dir is refused; unwritable destinations stop the run before its first step, a full disk
// at the first metrics line; a resumed run does not duplicate metrics lines and logs what a run that
// never stopped logs; an out-of-vocabulary token is found before the first step and a token file
// truncated during training is an error, not a SIGBUS; a model too large for the host is refused
// before anything is allocated; a symbolic link in place of the resolved config's temporary file is
// refused.
#include "framework/data/token_file.h"
#include "framework/io/checkpoint.h"
#include "framework/train/trainer.h"
#include "tests/helpers/temp_dir.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <regex>
#include <stdexcept>

#include <unistd.h>

namespace carry::testing {
namespace {

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "missing '" << (part) << "' in: " << (text)

const char* kTiny = R"(
name: "reliability_test"
seed: 7
model { vocab_size: 32 d_model: 16 n_layers: 1 n_heads: 2 mixers: "gla" mixer_options { chunk_size: 8 } }
data { mqar { num_kv_pairs: 2 num_queries: 2 vocab_size: 32 } seq_len: 16 batch_size: 2 eval_batches: 1 }
optimizer { lr: 1e-2 warmup_steps: 1 total_steps: 4 }
logging { every_steps: 1 }
)";

RunConfig tiny(const std::vector<std::string>& overrides = {}) {
  return run_config_from_text(kTiny, "reliability_test.textproto", overrides);
}

TrainerOptions quiet(int* steps = nullptr) {
  TrainerOptions o;
  o.log = nullptr;
  o.force_cpu = true;
  if (steps) o.on_step = [steps](const StepStats&) { ++*steps; };
  return o;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// Runs a trainer on `cfg` (run()), returning its value, or -1 with the message in *error; stderr in *err.
int run_capturing(const RunConfig& cfg, const TrainerOptions& o, std::string* error, std::string* err) {
  ::testing::internal::CaptureStderr();
  int rc = -1;
  try {
    Trainer t(cfg, nullptr, o);
    rc = t.run();
  } catch (const c10::Error& e) {
    *error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    *error = e.what();
  }
  *err = ::testing::internal::GetCapturedStderr();
  return rc;
}

class TrainerReliability : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = make_temp_dir("carry_reliability"); }
  void TearDown() override { remove_tree(dir_); }
  std::string dir_;
};

TEST_F(TrainerReliability, ResumeAutoSaysWhyItStartsFromStepZero) {
  const std::string ck = dir_ + "/ck";
  std::string error, err;
  // No directory: said, created, trained.
  EXPECT_EQ(run_capturing(tiny({"checkpoint.dir=" + ck, "optimizer.total_steps=2", "checkpoint.every_steps=1",
                                "checkpoint.keep_last=0"}), quiet(), &error, &err), 0) << error;
  EXPECT_CONTAINS(err, "checkpoint.dir " + ck + " does not exist: starting from step 0");
  EXPECT_EQ(list_checkpoint_steps(ck), (std::vector<int64_t>{1, 2}));
  // Every checkpoint damaged: said, and they are kept (the new run's checkpoints of the same steps
  // take their names; the damaged ones are renamed, not deleted).
  std::remove((ck + "/step_00000001/optimizer.safetensors").c_str());
  std::remove((ck + "/step_00000002/manifest.textproto").c_str());
  int steps = 0;
  EXPECT_EQ(run_capturing(tiny({"checkpoint.dir=" + ck, "optimizer.total_steps=2", "checkpoint.keep_last=1"}),
                          quiet(&steps), &error, &err), 0) << error;
  EXPECT_EQ(steps, 2);
  EXPECT_CONTAINS(err, "none of the 2 checkpoint(s) in " + ck + " can be used (see above): starting from step 0");
  EXPECT_CONTAINS(err, "optimizer.safetensors is missing; skipped");
  EXPECT_CONTAINS(err, "cannot read manifest.textproto");
  EXPECT_TRUE(exists(ck + "/step_00000002.kept.damaged"));
  EXPECT_EQ(load_checkpoint(ck + "/step_00000002").step, 2);  // the new run's
  EXPECT_THROW(load_checkpoint(ck + "/step_00000001"), c10::Error);  // not this run's: keep_last 1 leaves it
  EXPECT_EQ(list_checkpoint_steps(ck), (std::vector<int64_t>{1, 2}));
}

TEST_F(TrainerReliability, ResumeRequiredIsAnErrorWithoutACheckpoint) {
  const std::string ck = dir_ + "/ck";
  std::string error, err;
  int steps = 0;
  EXPECT_EQ(run_capturing(tiny({"checkpoint.dir=" + ck, "checkpoint.resume=REQUIRED"}), quiet(&steps), &error, &err), -1);
  EXPECT_EQ(error, "checkpoint.resume is REQUIRED but checkpoint.dir " + ck + " does not exist (or is not a directory)");
  EXPECT_FALSE(exists(ck)) << "the directory was created";
  make_dirs(ck);
  EXPECT_EQ(run_capturing(tiny({"checkpoint.dir=" + ck, "checkpoint.resume=REQUIRED"}), quiet(&steps), &error, &err), -1);
  EXPECT_EQ(error, "checkpoint.resume is REQUIRED but checkpoint.dir " + ck + " holds no checkpoint");
  EXPECT_EQ(steps, 0);
  // With one, it resumes.
  EXPECT_EQ(run_capturing(tiny({"checkpoint.dir=" + ck, "optimizer.total_steps=2"}), quiet(), &error, &err), 0);
  Trainer t(tiny({"checkpoint.dir=" + ck, "checkpoint.resume=REQUIRED", "optimizer.total_steps=3"}), nullptr, quiet());
  ASSERT_TRUE(t.resume());
  EXPECT_EQ(t.step(), 2);
  EXPECT_THROW(run_config_from_text(kTiny, "x.textproto", {"checkpoint.resume=REQUIRED"}), ConfigError);
}

TEST_F(TrainerReliability, ResumeNeverStartsOverAndKeepsTheOtherRunsCheckpoints) {
  const std::string ck = dir_ + "/ck";
  std::string error, err;
  ASSERT_EQ(run_capturing(tiny({"checkpoint.dir=" + ck, "optimizer.total_steps=3", "checkpoint.every_steps=1",
                                "checkpoint.keep_last=0"}), quiet(), &error, &err), 0) << error;
  const std::string first_run = load_latest_checkpoint(ck)->run_id;
  int steps = 0;
  ASSERT_EQ(run_capturing(tiny({"checkpoint.dir=" + ck, "optimizer.total_steps=2", "checkpoint.every_steps=1",
                                "checkpoint.keep_last=1", "checkpoint.resume=NEVER"}), quiet(&steps), &error, &err), 0)
      << error;
  EXPECT_EQ(steps, 2);
  EXPECT_CONTAINS(err, "checkpoint.resume is NEVER: starting from step 0; the 3 checkpoint(s) already in " + ck);
  EXPECT_CONTAINS(err, "was written by another run (run id '" + first_run + "')");
  // The first run's step 3, and its steps 1 and 2 under other names; the new run's step 2 only
  // (keep_last 1 pruned its own step 1).
  EXPECT_EQ(list_checkpoint_steps(ck), (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(exists(ck + "/step_00000001.kept." + first_run));
  EXPECT_TRUE(exists(ck + "/step_00000002.kept." + first_run));
  auto latest = load_latest_checkpoint(ck);
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 2) << "the new run's, not the first run's newer step 3";
  EXPECT_NE(latest->run_id, first_run);
}

TEST_F(TrainerReliability, ChangedConfigIsRefusedListingTheDifferences) {
  const std::string ck = dir_ + "/ck";
  {
    Trainer t(tiny({"checkpoint.dir=" + ck}), nullptr, quiet());
    t.train_step();
    t.save_checkpoint();
  }
  auto changed = tiny({"checkpoint.dir=" + ck, "seed=8", "optimizer.lr=0.02", "model.mixer_options[0].chunk_size=4",
                       "data.batch_size=4"});
  try {
    Trainer t(changed, nullptr, quiet());
    t.resume();
    ADD_FAILURE() << "a checkpoint of another config was resumed";
  } catch (const c10::Error& e) {
    std::string m = e.what_without_backtrace();
    EXPECT_CONTAINS(m, "resume from " + ck + "/step_00000001: this run's config differs from the one the checkpoint "
                       "was written with in what makes a run:\n  seed: 7 -> 8\n");
    EXPECT_CONTAINS(m, "\n  model.mixer_options: [{chunk_size: 8}] -> [{chunk_size: 4}]\n");
    EXPECT_CONTAINS(m, "\n  optimizer.lr: 0.01 -> 0.02\n");
    EXPECT_CONTAINS(m, "\n  the global batch (parallel.dp x data.batch_size): 2 -> 4 sequences");
    EXPECT_CONTAINS(m, "--allow-config-change");
    EXPECT_EQ(m.find("data.batch_size: 2 -> 4"), std::string::npos) << m;
  }
  // What may change: the layout, logging, checkpoint options, total_steps, precision, the name.
  {
    Trainer t(tiny({"checkpoint.dir=" + ck, "optimizer.total_steps=9", "logging.every_steps=3", "name=other",
                    "checkpoint.keep_last=7", "precision=BF16", "parallel.recompute=true"}), nullptr, quiet());
    EXPECT_TRUE(t.resume());
  }
  // allow_config_change continues, saying what changed.
  auto o = quiet();
  o.allow_config_change = true;
  ::testing::internal::CaptureStderr();
  Trainer t(changed, nullptr, o);
  EXPECT_TRUE(t.resume());
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(t.step(), 1);
  EXPECT_CONTAINS(err, "with a changed config (--allow-config-change):\n  seed: 7 -> 8");
}

TEST_F(TrainerReliability, SecondRunOnTheSameDirectoryIsRefused) {
  const std::string ck = dir_ + "/ck";
  std::string inner;
  auto o = quiet();
  o.on_step = [&](const StepStats& s) {
    if (s.step != 1) return;
    std::string error, err;
    int steps = 0;
    run_capturing(tiny({"checkpoint.dir=" + ck}), quiet(&steps), &error, &err);
    inner = error + (steps ? " (it trained)" : "");
  };
  Trainer t(tiny({"checkpoint.dir=" + ck, "optimizer.total_steps=2"}), nullptr, o);
  EXPECT_EQ(t.run(), 0);
  EXPECT_CONTAINS(inner, "checkpoint.dir " + ck + " is in use by another run (pid " + std::to_string(::getpid()));
  // Once the first run has returned, the directory is free.
  std::string error, err;
  EXPECT_EQ(run_capturing(tiny({"checkpoint.dir=" + ck, "optimizer.total_steps=3"}), quiet(), &error, &err), 0) << error;
}

// The resolved config that a run writes beside its checkpoints goes through a temporary file; a
// symbolic link planted there is refused (the run stops before its first step) and its target keeps
// its bytes.
TEST_F(TrainerReliability, ALinkInPlaceOfTheResolvedConfigsTemporaryIsRefused) {
  const std::string ck = dir_ + "/ck", victim = dir_ + "/victim";
  make_dirs(ck);
  std::ofstream(victim) << "precious\n";
  ASSERT_EQ(::symlink(victim.c_str(), (ck + "/config.textproto.tmp").c_str()), 0);
  int steps = 0;
  std::string error, err;
  EXPECT_EQ(run_capturing(tiny({"checkpoint.dir=" + ck}), quiet(&steps), &error, &err), -1);
  EXPECT_CONTAINS(error, "checkpoint.dir: the resolved config: " + ck + "/config.textproto.tmp is a symbolic link; "
                         "carry writes no file through a link");
  EXPECT_EQ(read_text(victim), "precious\n");
  EXPECT_EQ(steps, 0);
}

TEST_F(TrainerReliability, UnwritableDestinationsStopTheRunBeforeItsFirstStep) {
  std::ofstream(dir_ + "/file") << "x";
  int steps = 0;
  std::string error, err;
  // every_steps 0: the only checkpoint would come at the end, after all the work.
  EXPECT_EQ(run_capturing(tiny({"checkpoint.dir=" + dir_ + "/file/ck"}), quiet(&steps), &error, &err), -1);
  EXPECT_CONTAINS(error, "checkpoint.dir: cannot create the directory " + dir_ + "/file/ck");
  EXPECT_CONTAINS(error, "Not a directory");
  EXPECT_EQ(run_capturing(tiny({"checkpoint.dir=/proc"}), quiet(&steps), &error, &err), -1);
  EXPECT_CONTAINS(error, "checkpoint.dir: cannot create a file in /proc");
  EXPECT_EQ(run_capturing(tiny({"logging.metrics_file=" + dir_ + "/file/m.jsonl"}), quiet(&steps), &error, &err), -1);
  EXPECT_CONTAINS(error, "logging.metrics_file: " + dir_ + "/file exists and is not a directory");
  EXPECT_EQ(steps, 0);
  // A full disk: the first metrics line fails, the run stops there with the reason.
  EXPECT_EQ(run_capturing(tiny({"logging.metrics_file=/dev/full"}), quiet(&steps), &error, &err), -1);
  EXPECT_EQ(error, "logging.metrics_file: cannot write to /dev/full: No space left on device");
  EXPECT_EQ(steps, 0) << "on_step runs after the metrics line";
}

// A run that stops without a checkpoint at its last step (here an error after the metrics line of
// step 3, the last checkpoint at step 2) and is resumed logs steps 3 and 4 once, with the values a run
// that never stopped logs.
TEST_F(TrainerReliability, ResumedRunDoesNotDuplicateMetricsLines) {
  const std::string ck = dir_ + "/ck", straight = dir_ + "/straight.jsonl", resumed = dir_ + "/resumed.jsonl";
  std::string error, err;
  ASSERT_EQ(run_capturing(tiny({"logging.metrics_file=" + straight}), quiet(), &error, &err), 0) << error;
  auto o = quiet();
  o.on_step = [](const StepStats& s) {
    if (s.step == 3) throw std::runtime_error("a crash after step 3");
  };
  auto cfg = tiny({"logging.metrics_file=" + resumed, "checkpoint.dir=" + ck, "checkpoint.every_steps=2"});
  EXPECT_EQ(run_capturing(cfg, o, &error, &err), -1);
  EXPECT_EQ(error, "a crash after step 3");
  ASSERT_EQ(run_capturing(cfg, quiet(), &error, &err), 0) << error;
  // The values that depend on the state (tokens/s, MFU and memory differ from run to run).
  auto values = [](const std::string& path) {
    // {"step":N,"time":...,"elapsed_s":...,"loss":...,"grad_norm":...,"lr":...,...}
    static const std::regex re(
        "\\{\"step\":([0-9]+),\"time\":[^,]+,\"elapsed_s\":[^,]+,\"loss\":([^,]+),\"grad_norm\":([^,]+),"
        "\"lr\":([^,]+),");
    std::string out, text = read_text(path);
    for (std::sregex_iterator it(text.begin(), text.end(), re), end; it != end; ++it)
      out += (*it)[1].str() + " " + (*it)[2].str() + " " + (*it)[3].str() + " " + (*it)[4].str() + "\n";
    return out;
  };
  const std::string want = values(straight);
  EXPECT_EQ(std::count(want.begin(), want.end(), '\n'), 4) << want;
  EXPECT_EQ(values(resumed), want);
}

TEST_F(TrainerReliability, OutOfVocabularyTokenIsFoundBeforeTheFirstStep) {
  std::vector<uint32_t> tokens(5000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i * 7 % 32);
  tokens[4321] = 40;
  const std::string path = dir_ + "/train.tok";
  write_token_file(path, tokens);
  auto cfg = tiny({"data.token_files={paths: \"" + path + "\"}"});
  try {
    Trainer t(cfg, nullptr, quiet());
    ADD_FAILURE() << "a token file with id 40 was accepted for vocab_size 32";
  } catch (const c10::Error& e) {
    const std::string m = e.what_without_backtrace();
    EXPECT_CONTAINS(m, path + ": token 4321 (id 40) is not below model.vocab_size = 32");
  }
}

// The file is read with pread, so a file cut short under a running trainer is an error naming it.
TEST_F(TrainerReliability, TokenFileTruncatedDuringTrainingIsAnError) {
  std::vector<uint32_t> tokens(4000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i * 5 % 32);
  const std::string path = dir_ + "/train.tok";
  write_token_file(path, tokens);
  Trainer t(tiny({"data.token_files={paths: \"" + path + "\"}"}), nullptr, quiet());
  t.train_step();
  ASSERT_EQ(::truncate(path.c_str(), 100), 0);
  try {
    // Step 2's batch was read ahead during step 1 (the prefetch), before the truncation: step 3 reads.
    t.train_step();
    t.train_step();
    ADD_FAILURE() << "a truncated token file was read";
  } catch (const std::exception& e) {
    const auto* c = dynamic_cast<const c10::Error*>(&e);
    std::string m = c ? c->what_without_backtrace() : e.what();
    EXPECT_CONTAINS(m, path + ": the file ends at byte ");
    EXPECT_CONTAINS(m, "(it has 100 bytes now, 8024 when it was opened)");
    EXPECT_CONTAINS(m, "it was truncated or replaced while in use");
  }
}

TEST_F(TrainerReliability, ModelTooLargeForTheHostIsRefusedBeforeAllocating) {
  auto cfg = tiny({"model.d_model=65536", "model.n_heads=64", "model.n_layers=64", "model.vocab_size=65536",
                   "data.mqar.vocab_size=32"});
  try {
    Trainer t(cfg, nullptr, quiet());
    ADD_FAILURE() << "a model of about 3e12 parameters was built";
  } catch (const c10::Error& e) {
    std::string m = e.what_without_backtrace();
    EXPECT_CONTAINS(m, "trainer: the model (model.vocab_size = 65536, d_model = 65536, n_layers = 64) has ");
    EXPECT_CONTAINS(m, "of available memory; lower model.d_model, model.n_layers or model.vocab_size");
  }
}

}  // namespace
}  // namespace carry::testing
