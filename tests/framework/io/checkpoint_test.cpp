// Checkpoints: a round trip gives every tensor back bitwise (several dtypes, NaN and -0.0, a
// non-contiguous input, the saved order) and every field equal, the writer's version and commit
// recorded; keep_last prunes the oldest of the writer's own run only; the newest valid step of
// `latest`'s run wins over a stale `latest`, another run's checkpoints are not resumed; corrupt or
// partial checkpoints (a flipped tensor byte, a changed manifest field, a truncated file, a missing
// manifest, a missing file, an interrupted write's temporary directory) are reported with their path
// and skipped in favour of the previous good one; format_version 1 and 2 (FNV-1a 64 checksums) still
// load and are still checked, an unknown checksum algorithm is refused; a process SIGKILLed in the
// middle of writing a 200 MB checkpoint leaves the previous one loadable bitwise; the directory lock
// refuses a second holder; a symbolic link in place of a file carry writes is refused and its target
// left alone; a FIFO in place of a file carry reads is skipped at once; an oversized `latest` or
// manifest is refused by its size, unread.
#include "framework/io/checkpoint.h"

#include "framework/config/carry.pb.h"
#include "framework/io/safetensors.h"
#include "framework/io/xxh64.h"
#include "framework/version.h"
#include "tests/helpers/temp_dir.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/text_format.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <fstream>
#include <iterator>
#include <thread>

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

namespace carry {
namespace {

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "missing '" << (part) << "' in: " << (text)

using Named = std::vector<std::pair<std::string, at::Tensor>>;

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::make_temp_dir("carry_checkpoint") + "/run"; }
  void TearDown() override { testing::remove_tree(dir_.substr(0, dir_.rfind('/'))); }
  std::string step_path(int64_t step) const { return dir_ + "/" + checkpoint_dir_name(step); }
  std::string dir_;
};

// A checkpoint whose values depend on `step`; `scale` multiplies the model's tensor sizes.
CheckpointData make_data(int64_t step, int64_t scale = 1) {
  at::manual_seed(1000 + step);
  CheckpointData d;
  d.step = step;
  d.tokens_seen = step * 4096 + 7;
  d.data_cursor = step + 3;
  d.rng_seed = 0xfedcba9876543210ULL + static_cast<uint64_t>(step);
  d.config_text = "name: \"run \\\"x\\\"\"\nseed: 7\nmodel {\n  d_model: 64\n}\n";
  at::Tensor w = at::randn({8 * scale, 16});
  w[0][0] = std::nan("");
  w[0][1] = -0.0f;
  d.model = {{"tok_embed.weight", w},
             {"layers.0.norm.weight", at::randn({16}).to(at::kBFloat16)},
             {"layers.0.mixer.q_proj.weight", at::randn({16, 12}).t()},  // non-contiguous
             {"a_first_by_name_but_saved_last", at::randn({3, 2, 5}, at::kDouble)}};
  d.optimizer = {{"exp_avg.tok_embed.weight", at::randn({8 * scale, 16})},
                 {"exp_avg_sq.tok_embed.weight", at::rand({8 * scale, 16})},
                 {"step_count", at::full({}, step, at::kLong)}};
  d.extra = {{"loss", "2.718281828459045"}, {"note", "multi\nline \"quoted\""}};
  return d;
}

::testing::AssertionResult bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type())
    return ::testing::AssertionFailure() << "dtype " << a.scalar_type() << " vs " << b.scalar_type();
  if (a.sizes() != b.sizes()) return ::testing::AssertionFailure() << "shape " << a.sizes() << " vs " << b.sizes();
  at::Tensor x = a.contiguous(), y = b.contiguous();
  if (std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) != 0)
    return ::testing::AssertionFailure() << "bytes differ";
  return ::testing::AssertionSuccess();
}

void expect_same(const CheckpointData& got, const CheckpointData& want) {
  EXPECT_EQ(got.step, want.step);
  EXPECT_EQ(got.tokens_seen, want.tokens_seen);
  EXPECT_EQ(got.data_cursor, want.data_cursor);
  EXPECT_EQ(got.rng_seed, want.rng_seed);
  EXPECT_EQ(got.config_text, want.config_text);
  EXPECT_EQ(got.extra, want.extra);
  for (auto [g, w] : {std::pair(&got.model, &want.model), std::pair(&got.optimizer, &want.optimizer)}) {
    ASSERT_EQ(g->size(), w->size());
    for (size_t i = 0; i < g->size(); ++i) {
      EXPECT_EQ((*g)[i].first, (*w)[i].first) << "order of tensors";
      EXPECT_TRUE(bitwise_equal((*g)[i].second, (*w)[i].second)) << (*w)[i].first;
    }
  }
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return names;
  while (struct dirent* e = ::readdir(d))
    if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..")) names.push_back(e->d_name);
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

// load_latest_checkpoint with its stderr captured.
std::optional<CheckpointData> load_latest_capturing(const std::string& dir, std::string* err) {
  ::testing::internal::CaptureStderr();
  auto out = load_latest_checkpoint(dir);
  *err = ::testing::internal::GetCapturedStderr();
  return out;
}

TEST_F(CheckpointTest, RoundTripIsBitwise) {
  CheckpointData want = make_data(42);
  save_checkpoint(dir_, want, 0);
  EXPECT_TRUE(testing::exists(step_path(42) + "/model.safetensors"));
  EXPECT_TRUE(testing::exists(step_path(42) + "/optimizer.safetensors"));
  EXPECT_TRUE(testing::exists(step_path(42) + "/manifest.textproto"));
  EXPECT_EQ(checkpoint_dir_name(42), "step_00000042");
  expect_same(load_checkpoint(step_path(42)), want);
  std::string err;
  auto latest = load_latest_capturing(dir_, &err);
  ASSERT_TRUE(latest.has_value());
  expect_same(*latest, want);
  EXPECT_EQ(err, "");
  // The manifest is readable text with the fields and checksums.
  std::string manifest = read_text(step_path(42) + "/manifest.textproto");
  EXPECT_CONTAINS(manifest, "step: 42");
  EXPECT_CONTAINS(manifest, "format_version: 3");
  EXPECT_CONTAINS(manifest, "checksum_algorithm: \"xxh64\"");
  EXPECT_CONTAINS(manifest, "manifest_checksum: ");
  EXPECT_CONTAINS(manifest, "tok_embed.weight");
  EXPECT_EQ(manifest.find("fnv1a64"), std::string::npos) << manifest;
  // Each tensor's checksum is XXH64 of its bytes as the file holds them.
  config::CheckpointManifest m;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(manifest, &m));
  auto tensors = load_safetensors(step_path(42) + "/model.safetensors");
  int checked = 0;
  for (const auto& e : m.tensors()) {
    if (e.file() != "model.safetensors") continue;
    const at::Tensor& t = tensors.at(e.name());
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(xxh64(t.data_ptr(), t.nbytes())));
    EXPECT_EQ(e.checksum(), hex) << e.name();
    ++checked;
  }
  EXPECT_EQ(checked, 4);
  // The carry that wrote it: this build's version and commit, in the manifest and in the model file.
  EXPECT_EQ(m.carry_version(), version());
  EXPECT_EQ(m.carry_commit(), git_commit());
  EXPECT_FALSE(m.carry_commit().empty());
  EXPECT_EQ(load_checkpoint(step_path(42)).carry_commit, git_commit());
  std::map<std::string, std::string> metadata;
  load_safetensors(step_path(42) + "/model.safetensors", &metadata);
  EXPECT_EQ(metadata["carry_commit"], git_commit());
}

TEST_F(CheckpointTest, EmptyOptimizerAndExtra) {
  CheckpointData want = make_data(0);
  want.optimizer.clear();
  want.extra.clear();
  want.config_text.clear();
  save_checkpoint(dir_, want, 1);
  expect_same(load_checkpoint(step_path(0)), want);
}

TEST_F(CheckpointTest, KeepLastRemovesTheOldest) {
  for (int64_t s = 1; s <= 5; ++s) save_checkpoint(dir_, make_data(s), 2);
  EXPECT_EQ(list_checkpoint_steps(dir_), (std::vector<int64_t>{4, 5}));
  for (int64_t s = 6; s <= 8; ++s) save_checkpoint(dir_, make_data(s), 0);
  EXPECT_EQ(list_checkpoint_steps(dir_), (std::vector<int64_t>{4, 5, 6, 7, 8}));
  save_checkpoint(dir_, make_data(9), 1);
  EXPECT_EQ(list_checkpoint_steps(dir_), (std::vector<int64_t>{9}));
  // Nothing but the step directories and `latest` is left (no temporaries).
  EXPECT_EQ(read_text(dir_ + "/latest"), "step_00000009\n");
  EXPECT_EQ(entries(dir_), (std::vector<std::string>{"latest", "step_00000009"}));
}

// `latest` names the run to continue, and the newest valid checkpoint of that run is loaded: also when
// `latest` lags behind it (a writer that died between the rename of its step directory and the
// update of `latest`), which is said. Writing a step again replaces it.
TEST_F(CheckpointTest, NewestValidStepOfTheRunWinsOverAStaleLatest) {
  save_checkpoint(dir_, make_data(10), 0);
  save_checkpoint(dir_, make_data(20), 0);
  EXPECT_EQ(read_text(dir_ + "/latest"), "step_00000020\n");
  EXPECT_EQ(load_latest_checkpoint(dir_)->step, 20);
  write_text(dir_ + "/latest", "step_00000010\n");
  std::string err;
  auto got = load_latest_capturing(dir_, &err);
  ASSERT_TRUE(got.has_value());
  expect_same(*got, make_data(20));
  EXPECT_CONTAINS(err, "`latest` names step_00000010 but step_00000020 is newer and valid");
  CheckpointData again = make_data(20);
  again.extra["note"] = "second";
  save_checkpoint(dir_, again, 0);
  EXPECT_EQ(read_text(dir_ + "/latest"), "step_00000020\n");
  expect_same(*load_latest_checkpoint(dir_), again);
  EXPECT_EQ(list_checkpoint_steps(dir_), (std::vector<int64_t>{10, 20}));
}

// Two runs in one directory (a run started over with checkpoint.resume NEVER): the loader continues
// the run `latest` names, not the other run's newer checkpoints, and says so; keep_last prunes only
// the writer's own checkpoints, never another run's nor one whose manifest cannot be read.
TEST_F(CheckpointTest, AnotherRunsCheckpointsAreNeitherResumedNorPruned) {
  auto of_run = [](int64_t step, const std::string& run) {
    CheckpointData d = make_data(step);
    d.run_id = run;
    return d;
  };
  for (int64_t s : {10, 20, 30}) save_checkpoint(dir_, of_run(s, "aaaa"), 0);
  testing::make_dirs(step_path(40));  // a damaged one: no manifest
  for (int64_t s = 1; s <= 5; ++s) save_checkpoint(dir_, of_run(s, "bbbb"), 2);
  EXPECT_EQ(list_checkpoint_steps(dir_), (std::vector<int64_t>{4, 5, 10, 20, 30, 40}));
  std::string err;
  auto got = load_latest_capturing(dir_, &err);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->step, 5);
  EXPECT_EQ(got->run_id, "bbbb");
  EXPECT_CONTAINS(err, step_path(30) + ": valid, but written by another run (run id 'aaaa'");
  EXPECT_CONTAINS(err, step_path(40));
  // Without `latest`, the newest valid checkpoint of any run.
  std::remove((dir_ + "/latest").c_str());
  got = load_latest_capturing(dir_, &err);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->step, 30);
  EXPECT_EQ(got->run_id, "aaaa");
}

std::string hex64_of(uint64_t v) {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(v));
  return hex;
}

// The manifest's own checksum as the writer computes it: of the deterministic binary serialization
// with the checksum field cleared, XXH64 into manifest_checksum (format_version 3) or FNV-1a 64 into
// manifest_fnv1a64 (format_version 2) (an implementation of the documented rule independent of
// checkpoint.cpp's).
void seal(config::CheckpointManifest& m) {
  const bool v3 = m.format_version() >= 3;
  if (v3) m.clear_manifest_checksum();
  else m.clear_manifest_fnv1a64();
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream raw(&bytes);
    google::protobuf::io::CodedOutputStream out(&raw);
    out.SetSerializationDeterministic(true);
    ASSERT_TRUE(m.SerializeToCodedStream(&out));
  }
  if (v3) m.set_manifest_checksum(hex64_of(xxh64(bytes.data(), bytes.size())));
  else m.set_manifest_fnv1a64(hex64_of(fnv1a64(bytes.data(), bytes.size())));
}

// Rewrites a manifest's checksum after a test changed its fields, as the writer would have.
void reseal_manifest(const std::string& path) {
  config::CheckpointManifest m;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(read_text(path), &m)) << path;
  seal(m);
  std::string text;
  ASSERT_TRUE(google::protobuf::TextFormat::PrintToString(m, &text));
  write_text(path, text);
}

// Rewrites the manifest of the checkpoint in step_dir as a format_version 2 writer wrote it: FNV-1a 64
// of every tensor's bytes (from the files) in fnv1a64, the manifest's in manifest_fnv1a64, no
// checksum_algorithm. Returns the manifest.
config::CheckpointManifest as_format_version_2(const std::string& step_dir) {
  const std::string path = step_dir + "/manifest.textproto";
  config::CheckpointManifest m;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(read_text(path), &m)) << path;
  std::map<std::string, std::map<std::string, at::Tensor>> files;
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) files[f] = load_safetensors(step_dir + "/" + f);
  m.set_format_version(2);
  m.clear_checksum_algorithm();
  m.clear_manifest_checksum();
  for (auto& e : *m.mutable_tensors()) {
    const at::Tensor& t = files.at(e.file()).at(e.name());
    e.clear_checksum();
    e.set_fnv1a64(hex64_of(fnv1a64(t.data_ptr(), t.nbytes())));
  }
  seal(m);
  std::string text;
  EXPECT_TRUE(google::protobuf::TextFormat::PrintToString(m, &text));
  write_text(path, text);
  return m;
}

TEST_F(CheckpointTest, NothingToLoad) {
  EXPECT_FALSE(load_latest_checkpoint(dir_ + "/does_not_exist").has_value());
  testing::make_dirs(dir_);
  EXPECT_FALSE(load_latest_checkpoint(dir_).has_value());
}

// Saves steps 1 and 2, damages step 2 with `damage`, and checks that loading falls back to step 1
// with a message naming step 2's path and each of `expected` parts.
void check_fallback(const std::string& dir, const std::function<void(const std::string&)>& damage,
                    const std::vector<std::string>& expected) {
  CheckpointData good = make_data(1);
  save_checkpoint(dir, good, 0);
  save_checkpoint(dir, make_data(2), 0);
  std::string bad = dir + "/" + checkpoint_dir_name(2);
  damage(bad);
  std::string err;
  auto got = load_latest_capturing(dir, &err);
  ASSERT_TRUE(got.has_value());
  expect_same(*got, good);
  EXPECT_CONTAINS(err, bad);
  EXPECT_CONTAINS(err, "skipped");
  for (const auto& part : expected) EXPECT_CONTAINS(err, part);
  // load_checkpoint of the damaged one throws with the same message.
  try {
    load_checkpoint(bad);
    ADD_FAILURE() << "load_checkpoint accepted " << bad;
  } catch (const c10::Error& e) {
    EXPECT_CONTAINS(e.what_without_backtrace(), bad);
    for (const auto& part : expected) EXPECT_CONTAINS(e.what_without_backtrace(), part);
  }
}

TEST_F(CheckpointTest, CorruptTensorByteIsSkipped) {
  check_fallback(dir_, [](const std::string& bad) {
    std::string path = bad + "/model.safetensors";
    std::string bytes = read_text(path);
    bytes[bytes.size() - 3] ^= 0x10;  // inside the last tensor's data
    write_text(path, bytes);
  }, {"model.safetensors", "checksum", "corrupt"});
}

TEST_F(CheckpointTest, TruncatedFileIsSkipped) {
  check_fallback(dir_, [](const std::string& bad) {
    std::string path = bad + "/optimizer.safetensors";
    std::string bytes = read_text(path);
    write_text(path, bytes.substr(0, bytes.size() - 100));
  }, {"optimizer.safetensors"});
}

TEST_F(CheckpointTest, MissingManifestIsSkipped) {
  check_fallback(dir_, [](const std::string& bad) { std::remove((bad + "/manifest.textproto").c_str()); },
                 {"manifest.textproto"});
}

TEST_F(CheckpointTest, BadManifestIsSkipped) {
  check_fallback(dir_, [](const std::string& bad) {
    std::string path = bad + "/manifest.textproto";
    write_text(path, read_text(path) + "\nno_such_field: 3\n");
  }, {"manifest.textproto", "bad manifest", "no_such_field"});
}

TEST_F(CheckpointTest, ManifestDisagreeingWithTheFileIsSkipped) {
  check_fallback(dir_, [](const std::string& bad) {
    std::string path = bad + "/manifest.textproto";
    std::string text = read_text(path);
    size_t at = text.find("name: \"layers.0.norm.weight\"");
    ASSERT_NE(at, std::string::npos);
    text.replace(at, 28, "name: \"layers.0.norm.weighu\"");
    write_text(path, text);
    reseal_manifest(path);  // past the manifest's own checksum, to the file check
  }, {"layers.0.norm.weighu", "missing from the file"});
}

// The manifest's own fields are under its checksum: tokens_seen, the config and the extra entries
// (no tensor check would notice them) are each caught.
TEST_F(CheckpointTest, ChangedManifestFieldIsSkipped) {
  for (auto [from, to] : {std::pair<std::string, std::string>{"tokens_seen: 8199", "tokens_seen: 8200"},
                          {"seed: 7", "seed: 8"},
                          {"2.718281828459045", "2.718281828459046"}}) {
    SCOPED_TRACE(from);
    testing::remove_tree(dir_);
    check_fallback(dir_, [from = from, to = to](const std::string& bad) {
      std::string path = bad + "/manifest.textproto";
      std::string text = read_text(path);
      size_t at = text.find(from);
      ASSERT_NE(at, std::string::npos) << text;
      text.replace(at, from.size(), to);
      write_text(path, text);
    }, {"manifest's checksum", "the manifest was changed or is corrupt"});
  }
}

// A checkpoint of format_version 2 (FNV-1a 64 checksums) still loads, silently, and its checksums are
// still checked: a flipped tensor byte and a changed field are caught, naming FNV-1a 64.
TEST_F(CheckpointTest, FormatVersionTwoStillLoadsAndIsChecked) {
  CheckpointData d = make_data(3);
  save_checkpoint(dir_, d, 0);
  as_format_version_2(step_path(3));
  std::string manifest = read_text(step_path(3) + "/manifest.textproto");
  EXPECT_CONTAINS(manifest, "format_version: 2");
  EXPECT_CONTAINS(manifest, "manifest_fnv1a64: ");
  EXPECT_EQ(manifest.find("xxh64"), std::string::npos) << manifest;
  std::string err;
  auto got = load_latest_capturing(dir_, &err);
  ASSERT_TRUE(got.has_value());
  expect_same(*got, d);
  EXPECT_EQ(got->format_version, 2);
  EXPECT_EQ(err, "");
  // A later save of the same run writes format_version 3 next to it.
  save_checkpoint(dir_, make_data(4), 0);
  EXPECT_CONTAINS(read_text(step_path(4) + "/manifest.textproto"), "format_version: 3");
  EXPECT_EQ(load_checkpoint(step_path(4)).format_version, 3);
  testing::remove_tree(dir_);

  check_fallback(dir_, [](const std::string& bad) {
    as_format_version_2(bad);
    std::string path = bad + "/model.safetensors";
    std::string bytes = read_text(path);
    bytes[bytes.size() - 3] ^= 0x10;
    write_text(path, bytes);
  }, {"model.safetensors", "checksum (FNV-1a 64) of its bytes", "corrupt"});
  testing::remove_tree(dir_);
  check_fallback(dir_, [](const std::string& bad) {
    as_format_version_2(bad);
    std::string path = bad + "/manifest.textproto";
    std::string text = read_text(path);
    size_t at = text.find("seed: 7");
    ASSERT_NE(at, std::string::npos) << text;
    text.replace(at, 7, "seed: 8");
    write_text(path, text);
  }, {"manifest's checksum (FNV-1a 64 of its fields)", "the manifest was changed or is corrupt"});
}

// A format_version 3 manifest must name its algorithm, one this build knows.
TEST_F(CheckpointTest, UnknownChecksumAlgorithmIsRefused) {
  check_fallback(dir_, [](const std::string& bad) {
    std::string path = bad + "/manifest.textproto";
    config::CheckpointManifest m;
    ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(read_text(path), &m));
    m.set_checksum_algorithm("sha3");
    seal(m);
    std::string text;
    ASSERT_TRUE(google::protobuf::TextFormat::PrintToString(m, &text));
    write_text(path, text);
  }, {"checksum_algorithm 'sha3' is not one this build reads (xxh64, fnv1a64)"});
  testing::remove_tree(dir_);
  check_fallback(dir_, [](const std::string& bad) {
    std::string path = bad + "/manifest.textproto";
    config::CheckpointManifest m;
    ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(read_text(path), &m));
    m.clear_checksum_algorithm();
    seal(m);
    std::string text;
    ASSERT_TRUE(google::protobuf::TextFormat::PrintToString(m, &text));
    write_text(path, text);
  }, {"checksum_algorithm is missing"});
}

// A checkpoint of format_version 1 (before run ids and manifest checksums) still loads, with a note.
TEST_F(CheckpointTest, FormatVersionOneStillLoads) {
  CheckpointData d = make_data(3);
  save_checkpoint(dir_, d, 0);
  std::string path = step_path(3) + "/manifest.textproto";
  config::CheckpointManifest m = as_format_version_2(step_path(3));
  m.set_format_version(1);
  m.clear_run_id();
  m.clear_manifest_fnv1a64();
  std::string text;
  ASSERT_TRUE(google::protobuf::TextFormat::PrintToString(m, &text));
  write_text(path, text);
  std::string err;
  auto got = load_latest_capturing(dir_, &err);
  ASSERT_TRUE(got.has_value());
  expect_same(*got, d);
  EXPECT_EQ(got->format_version, 1);
  EXPECT_CONTAINS(err, "format_version 1 (no manifest checksum");
  // Version 2 without its checksum is damaged, not old.
  m.set_format_version(2);
  ASSERT_TRUE(google::protobuf::TextFormat::PrintToString(m, &text));
  write_text(path, text);
  EXPECT_FALSE(load_latest_capturing(dir_, &err).has_value());
  EXPECT_CONTAINS(err, "manifest_fnv1a64 (its checksum) is missing");
}

TEST_F(CheckpointTest, MissingFileIsSkipped) {
  check_fallback(dir_, [](const std::string& bad) { std::remove((bad + "/model.safetensors").c_str()); },
                 {"model.safetensors is missing"});
}

TEST_F(CheckpointTest, LeftoverTemporaryDirectoryIsIgnored) {
  CheckpointData good = make_data(1);
  save_checkpoint(dir_, good, 0);
  // An interrupted write of step 2 (a writer that died), and a step directory missing its files.
  std::string tmp = dir_ + "/.tmp_step_00000002_999999999";
  testing::make_dirs(tmp);
  write_text(tmp + "/model.safetensors", "garbage");
  testing::make_dirs(step_path(3));
  write_text(step_path(3) + "/model.safetensors", "garbage");
  std::string err;
  auto got = load_latest_capturing(dir_, &err);
  ASSERT_TRUE(got.has_value());
  expect_same(*got, good);
  EXPECT_CONTAINS(err, tmp);
  EXPECT_CONTAINS(err, "interrupted write");
  EXPECT_CONTAINS(err, step_path(3));  // newer than `latest`'s step 1, tried and reported
  // `latest` naming a directory that is gone: reported, then the scan tries step 3 (reported) and
  // finds step 1.
  write_text(dir_ + "/latest", "step_00000007\n");
  got = load_latest_capturing(dir_, &err);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->step, 1);
  EXPECT_CONTAINS(err, step_path(7));
  EXPECT_CONTAINS(err, step_path(3));
  EXPECT_CONTAINS(err, "manifest.textproto");
  // The next save removes the dead writer's temporary directory.
  save_checkpoint(dir_, make_data(4), 0);
  EXPECT_FALSE(testing::exists(tmp));
}

// One run per directory: a second lock, from this process or another, is refused naming the
// directory and the holder; the lock is free again once its holder is gone.
TEST_F(CheckpointTest, DirectoryLockRefusesASecondHolder) {
  {
    CheckpointDirLock first(dir_);
    try {
      CheckpointDirLock second(dir_);
      ADD_FAILURE() << "a second lock on " << dir_ << " was granted";
    } catch (const c10::Error& e) {
      EXPECT_CONTAINS(e.what_without_backtrace(), "checkpoint.dir " + dir_ + " is in use by another run (pid " +
                                                      std::to_string(::getpid()) + " on host ");
      EXPECT_CONTAINS(e.what_without_backtrace(), "two runs must not share a checkpoint directory");
    }
    pid_t pid = ::fork();
    if (pid == 0) {
      try {
        CheckpointDirLock other(dir_);
      } catch (const c10::Error&) {
        ::_exit(3);
      }
      ::_exit(0);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << "another process got the lock";
  }
  CheckpointDirLock again(dir_);
}

// A `.lock` that is a symbolic link (to a file of the user's, here `victim`) is refused, naming it;
// the victim keeps its bytes. The same for a link planted where `latest`'s temporary file goes.
TEST_F(CheckpointTest, SymbolicLinksInPlaceOfWrittenFilesAreRefused) {
  save_checkpoint(dir_, make_data(1), 0);
  const std::string parent = dir_.substr(0, dir_.rfind('/'));
  const std::string victim = parent + "/victim";
  write_text(victim, "precious\n");
  ASSERT_EQ(::symlink(victim.c_str(), (dir_ + "/.lock").c_str()), 0);
  try {
    CheckpointDirLock lock(dir_);
    ADD_FAILURE() << "a lock through a symbolic link was granted";
  } catch (const c10::Error& e) {
    EXPECT_CONTAINS(e.what_without_backtrace(), "checkpoint.dir " + dir_ + ": the lock file: " + dir_ +
                                                    "/.lock is a symbolic link; carry writes no file through a link");
  }
  EXPECT_EQ(read_text(victim), "precious\n");
  ASSERT_EQ(::unlink((dir_ + "/.lock").c_str()), 0);

  const std::string planted = dir_ + "/.latest.tmp." + std::to_string(::getpid());
  ASSERT_EQ(::symlink(victim.c_str(), planted.c_str()), 0);
  try {
    save_checkpoint(dir_, make_data(2), 0);
    ADD_FAILURE() << "a checkpoint was written through a planted link";
  } catch (const c10::Error& e) {
    EXPECT_CONTAINS(e.what_without_backtrace(), planted + " is a symbolic link");
  }
  EXPECT_EQ(read_text(victim), "precious\n");
  ASSERT_EQ(::unlink(planted.c_str()), 0);
  save_checkpoint(dir_, make_data(2), 0);
  EXPECT_EQ(load_latest_checkpoint(dir_)->step, 2);
  // A FIFO as the lock file: refused without blocking.
  ASSERT_EQ(::mkfifo((dir_ + "/.lock").c_str(), 0644), 0);
  try {
    CheckpointDirLock lock(dir_);
    ADD_FAILURE() << "a FIFO was taken as the lock file";
  } catch (const c10::Error& e) {
    EXPECT_CONTAINS(e.what_without_backtrace(), "/.lock is a FIFO, not a regular file");
  }
}

// A FIFO in place of a checkpoint's manifest or tensor file, or of `latest`, is reported and skipped at
// once (a plain open would wait for a writer forever): the previous checkpoint loads.
TEST_F(CheckpointTest, FifoInACheckpointIsSkippedWithoutBlocking) {
  save_checkpoint(dir_, make_data(1), 0);
  save_checkpoint(dir_, make_data(2), 0);
  save_checkpoint(dir_, make_data(3), 0);
  for (const char* file : {"manifest.textproto", "model.safetensors"}) {
    const int64_t step = std::string(file) == "manifest.textproto" ? 3 : 2;
    const std::string path = step_path(step) + "/" + file;
    ASSERT_EQ(::unlink(path.c_str()), 0);
    ASSERT_EQ(::mkfifo(path.c_str(), 0644), 0);
  }
  const std::string latest = dir_ + "/latest";
  ASSERT_EQ(::unlink(latest.c_str()), 0);
  ASSERT_EQ(::mkfifo(latest.c_str(), 0644), 0);
  const auto start = std::chrono::steady_clock::now();
  CheckpointSearch found = find_latest_checkpoint(dir_);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  ASSERT_TRUE(found.loaded);
  EXPECT_EQ(found.loaded->step, 1);
  std::string notes;
  for (auto& n : found.notes) notes += n + "\n";
  EXPECT_CONTAINS(notes, "checkpoint " + latest + ": cannot read it: is a FIFO, not a regular file");
  EXPECT_CONTAINS(notes, "cannot read manifest.textproto: is a FIFO, not a regular file");
  EXPECT_CONTAINS(notes, step_path(2) + "/model.safetensors: cannot open: is a FIFO, not a regular file");
}

// `latest` and a manifest larger than such a file can be are refused from their size, before a byte is
// read (sparse files of 1 GiB and 2 GiB: reading them would take seconds and gigabytes).
TEST_F(CheckpointTest, OversizedControlFilesAreRefusedUnread) {
  save_checkpoint(dir_, make_data(1), 0);
  save_checkpoint(dir_, make_data(2), 0);
  ASSERT_EQ(::truncate((dir_ + "/latest").c_str(), int64_t{1} << 30), 0);
  ASSERT_EQ(::truncate((step_path(2) + "/manifest.textproto").c_str(), int64_t{2} << 30), 0);
  const auto start = std::chrono::steady_clock::now();
  CheckpointSearch found = find_latest_checkpoint(dir_);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  ASSERT_TRUE(found.loaded);
  EXPECT_EQ(found.loaded->step, 1);
  std::string notes;
  for (auto& n : found.notes) notes += n + "\n";
  EXPECT_CONTAINS(notes, "latest: cannot read it: 1073741824 bytes, more than the 4096 such a file may hold");
  EXPECT_CONTAINS(notes, "cannot read manifest.textproto: 2147483648 bytes, more than the 67108864");
}

// A binary `latest` is quoted on one line, its newlines and control bytes escaped.
TEST_F(CheckpointTest, BinaryLatestIsQuotedOnOneLine) {
  save_checkpoint(dir_, make_data(1), 0);
  write_text(dir_ + "/latest", std::string("\x7f" "ELF\n\x01\x02\x1b[2J\nstep_1\n\n"));
  CheckpointSearch found = find_latest_checkpoint(dir_);
  ASSERT_TRUE(found.loaded);
  EXPECT_EQ(found.loaded->step, 1);
  ASSERT_FALSE(found.notes.empty());
  const std::string& note = found.notes[0];
  EXPECT_CONTAINS(note, "latest: does not name a step directory (holds '\\x7fELF\\x0a\\x01\\x02\\x1b[2J\\x0astep_1')");
  EXPECT_EQ(note.find('\n'), std::string::npos) << note;
}

// A write that fails part way (here the file size limit, as a full disk would: the write returns an
// error) throws naming the file and the system's reason, leaves no temporary directory, and the
// previous checkpoint stays the one that loads.
TEST_F(CheckpointTest, FailedWriteThrowsAndKeepsThePreviousOne) {
  save_checkpoint(dir_, make_data(1), 0);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    struct rlimit limit {16 << 10, 16 << 10};
    ::signal(SIGXFSZ, SIG_IGN);
    ::setrlimit(RLIMIT_FSIZE, &limit);
    try {
      save_checkpoint(dir_, make_data(2, 64), 0);  // a 32 KiB tensor
    } catch (const c10::Error& e) {
      std::string m = e.what_without_backtrace();
      if (::write(fds[1], m.data(), m.size()) < 0) ::_exit(4);
      ::_exit(3);
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string message;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) message.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << "the write did not fail: " << status;
  EXPECT_CONTAINS(message, dir_ + "/.tmp_step_00000002_");
  EXPECT_CONTAINS(message, "File too large");
  EXPECT_EQ(entries(dir_), (std::vector<std::string>{"latest", "step_00000001"}));
  auto got = load_latest_checkpoint(dir_);
  ASSERT_TRUE(got.has_value());
  expect_same(*got, make_data(1));
}

TEST_F(CheckpointTest, BadInputsAreRefused) {
  CheckpointData d = make_data(1);
  d.model.emplace_back("tok_embed.weight", at::zeros({2}));
  EXPECT_THROW(save_checkpoint(dir_, d, 0), c10::Error);
  d = make_data(1);
  d.step = -1;
  EXPECT_THROW(save_checkpoint(dir_, d, 0), c10::Error);
  EXPECT_THROW(save_checkpoint(dir_, make_data(1), -2), c10::Error);
  EXPECT_TRUE(list_checkpoint_steps(dir_).empty());
  EXPECT_THROW(load_checkpoint(dir_ + "/nothing"), c10::Error);
}

// Forks a child that saves `data` (SIGKILLing itself after die_after files, through the write hook, when > 0); when
// die_after is 0 the parent SIGKILLs it as soon as its temporary directory appears. Returns whether the
// child died by SIGKILL.
bool save_in_child_and_kill(const std::string& dir, const CheckpointData& data, int die_after) {
  pid_t pid = ::fork();
  if (pid == 0) {
    if (die_after > 0)
      set_checkpoint_write_hook([die_after](int files) {
        if (files == die_after) ::raise(SIGKILL);
      });
    try {
      save_checkpoint(dir, data, 0);
    } catch (...) {
      ::_exit(2);
    }
    ::_exit(0);
  }
  if (pid < 0) return false;
  if (die_after == 0) {
    std::string tmp = dir + "/.tmp_" + checkpoint_dir_name(data.step) + "_" + std::to_string(pid);
    for (int i = 0; i < 20000 && !testing::exists(tmp); ++i)
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ::kill(pid, SIGKILL);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
}

TEST_F(CheckpointTest, KilledDuringWriteLeavesThePreviousOne) {
  CheckpointData previous = make_data(1);
  save_checkpoint(dir_, previous, 0);
  // 1: after the model file (200 MB of tensors), 2: after the optimizer file, 3: after the manifest,
  // before the rename; 0: killed from outside while it writes.
  const int64_t big = 200'000'000 / (3 * 8 * 16 * 4);  // model + two optimizer tensors of 8*scale x 16 fp32
  for (int die_after : {1, 2, 3, 0}) {
    SCOPED_TRACE("die_after " + std::to_string(die_after));
    CheckpointData next = make_data(2, die_after <= 1 ? big : 1);
    ASSERT_TRUE(save_in_child_and_kill(dir_, next, die_after)) << "the child was not killed";
    std::string err;
    auto got = load_latest_capturing(dir_, &err);
    ASSERT_TRUE(got.has_value());
    expect_same(*got, previous);
    EXPECT_CONTAINS(err, "interrupted write");
    EXPECT_FALSE(testing::exists(step_path(2)));
    EXPECT_EQ(read_text(dir_ + "/latest"), "step_00000001\n");
  }
  // The next save works and cleans up.
  CheckpointData next = make_data(2);
  save_checkpoint(dir_, next, 0);
  std::string err;
  auto got = load_latest_capturing(dir_, &err);
  ASSERT_TRUE(got.has_value());
  expect_same(*got, next);
  EXPECT_EQ(err, "");
  EXPECT_EQ(entries(dir_), (std::vector<std::string>{"latest", "step_00000001", "step_00000002"}));
}

}  // namespace
}  // namespace carry
