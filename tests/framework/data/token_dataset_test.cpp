// Tests for framework/data/token_dataset.h: glob patterns (sorted matches, a clear error for no
// match), the stream across files, the permutation (a bijection, another one per key), shuffled epochs
// (every window once an epoch, a new order every epoch), blend weights (exact shares per period,
// every source's windows once an epoch), and the start-of-run check (the first id >= vocab_size
// named by file and index).
#include "framework/data/token_dataset.h"

#include "tests/helpers/temp_dir.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

namespace carry {
namespace {

using testing::make_temp_dir;
using testing::remove_tree;

class TokenDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = make_temp_dir("carry_dataset_test"); }
  void TearDown() override { remove_tree(dir_); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  // A file of `n` tokens first, first+1, ... (mod 60000).
  std::string counting_file(const std::string& name, uint32_t first, int n) const {
    std::vector<uint32_t> t(n);
    for (int i = 0; i < n; ++i) t[i] = (first + i) % 60000;
    write_token_file(path(name), t);
    return path(name);
  }
  static std::string error_of(const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "(no error)";
  }
  std::string dir_;
};

TEST_F(TokenDatasetTest, GlobPatternsExpandSortedAndNoMatchIsAnError) {
  counting_file("shard_002.tok", 0, 10);
  counting_file("shard_000.tok", 0, 10);
  counting_file("shard_001.tok", 0, 10);
  counting_file("other.tok", 0, 10);
  auto files = expand_token_paths({path("shard_*.tok"), path("other.tok")}, "data.token_files.paths");
  ASSERT_EQ(files.size(), 4u);
  EXPECT_EQ(files[0], path("shard_000.tok"));
  EXPECT_EQ(files[1], path("shard_001.tok"));
  EXPECT_EQ(files[2], path("shard_002.tok"));
  EXPECT_EQ(files[3], path("other.tok"));
  auto msg = error_of([&] { expand_token_paths({path("other.tok"), path("fineweb_train_*.bin")}, "data.token_files.paths"); });
  EXPECT_NE(msg.find("data.token_files.paths[1]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("fineweb_train_*.bin' matches no file"), std::string::npos) << msg;
}

TEST_F(TokenDatasetTest, StreamReadsAcrossFiles) {
  TokenStream s({counting_file("a.tok", 0, 5), counting_file("b.tok", 5, 3), counting_file("c.tok", 8, 7)});
  EXPECT_EQ(s.size(), 15);
  std::vector<int64_t> out(12);
  s.read(2, 12, out.data());
  for (int i = 0; i < 12; ++i) EXPECT_EQ(out[i], 2 + i);
  EXPECT_THROW(s.read(10, 6, out.data()), std::logic_error);
}

TEST_F(TokenDatasetTest, PermutationIsABijectionAndDependsOnTheKey) {
  for (int64_t n : {1, 2, 3, 7, 64, 100, 1000, 4097}) {
    std::vector<int64_t> seen;
    for (int64_t i = 0; i < n; ++i) seen.push_back(permute_index(42, n, i));
    std::vector<int64_t> sorted = seen;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(sorted[i], i) << "n = " << n;
    if (n >= 100) {
      int fixed = 0, same = 0;
      for (int64_t i = 0; i < n; ++i) {
        fixed += seen[i] == i;
        same += permute_index(43, n, i) == seen[i];
      }
      EXPECT_LT(fixed, n / 10) << "n = " << n << ": nearly the identity";
      EXPECT_LT(same, n / 10) << "n = " << n << ": keys 42 and 43 give nearly the same order";
    }
  }
}

TEST_F(TokenDatasetTest, ShuffledEpochsVisitEveryWindowOnceInANewOrder) {
  const int64_t T = 8;
  auto f = counting_file("data.tok", 0, 8 * 50 + 1);  // 50 windows
  TokenDataset ordered({{"src", {f}, 1}}, T, false, 1);
  TokenDataset shuffled({{"src", {f}, 1}}, T, true, 1);
  TokenDataset reseeded({{"src", {f}, 1}}, T, true, 2);
  ASSERT_EQ(shuffled.windows(0), 50);
  std::vector<int64_t> epoch0, epoch1, other_seed;
  for (int64_t g = 0; g < 50; ++g) {
    EXPECT_EQ(ordered.pick(g).window, g);
    EXPECT_EQ(shuffled.pick(g).epoch, 0);
    EXPECT_EQ(shuffled.pick(g + 50).epoch, 1);
    epoch0.push_back(shuffled.pick(g).window);
    epoch1.push_back(shuffled.pick(g + 50).window);
    other_seed.push_back(reseeded.pick(g).window);
  }
  for (auto* e : {&epoch0, &epoch1, &other_seed}) {
    auto s = *e;
    std::sort(s.begin(), s.end());
    for (int64_t i = 0; i < 50; ++i) ASSERT_EQ(s[i], i);
  }
  EXPECT_NE(epoch0, epoch1);
  EXPECT_NE(epoch0, other_seed);
  // A sequence is its window's seq_len+1 tokens.
  std::vector<int64_t> seq(T + 1);
  shuffled.sequence(7, seq.data());
  for (int64_t i = 0; i <= T; ++i) EXPECT_EQ(seq[i], epoch0[7] * T + i);
}

TEST_F(TokenDatasetTest, BlendGivesEachSourceItsShare) {
  const int64_t T = 4;
  auto a = counting_file("a.tok", 0, 4 * 30 + 1);      // 30 windows, ids 0..120
  auto b = counting_file("b.tok", 1000, 4 * 7 + 1);    // 7 windows, ids 1000..1028
  auto c = counting_file("c.tok", 5000, 4 * 11 + 1);   // 11 windows
  TokenDataset d({{"a", {a}, 3}, {"b", {b}, 1}, {"c", {c}, 0.5}}, T, true, 9);
  const int64_t P = TokenDataset::kBlendPeriod;
  EXPECT_EQ(d.slots(0) + d.slots(1) + d.slots(2), P);
  EXPECT_NEAR(static_cast<double>(d.slots(0)) / P, 3 / 4.5, 1.0 / P);
  EXPECT_NEAR(static_cast<double>(d.slots(1)) / P, 1 / 4.5, 1.0 / P);
  std::vector<int64_t> count(3, 0);
  std::vector<std::vector<int64_t>> windows(3);
  for (int64_t g = 0; g < 2 * P; ++g) {
    auto p = d.pick(g);
    ++count[p.source];
    if (static_cast<int64_t>(windows[p.source].size()) < 3 * d.windows(p.source)) windows[p.source].push_back(p.window);
  }
  for (int s = 0; s < 3; ++s) EXPECT_EQ(count[s], 2 * d.slots(s)) << "source " << s;
  // Within a source, every window once an epoch.
  for (int s = 0; s < 3; ++s) {
    const int64_t W = d.windows(s);
    for (int e = 0; e < 3; ++e) {
      std::vector<int64_t> epoch(windows[s].begin() + e * W, windows[s].begin() + (e + 1) * W);
      std::sort(epoch.begin(), epoch.end());
      for (int64_t i = 0; i < W; ++i) ASSERT_EQ(epoch[i], i) << "source " << s << " epoch " << e;
    }
  }
  // The shares hold over short stretches too: any 90 consecutive sequences have 60 +- 2 of source a.
  for (int64_t start : {0, 1000, 12345}) {
    int in_a = 0;
    for (int64_t g = start; g < start + 90; ++g) in_a += d.pick(g).source == 0;
    EXPECT_NEAR(in_a, 60, 2) << "from " << start;
  }
  // Tokens come from the picked source's file.
  std::vector<int64_t> seq(T + 1);
  for (int64_t g = 0; g < 20; ++g) {
    d.sequence(g, seq.data());
    auto p = d.pick(g);
    const int64_t base = p.source == 0 ? 0 : p.source == 1 ? 1000 : 5000;
    EXPECT_EQ(seq[0], base + p.window * T);
  }
}

TEST_F(TokenDatasetTest, ErrorsNameTheSource) {
  auto small = counting_file("small.tok", 0, 5);
  auto msg = error_of([&] { TokenDataset({{"data.token_files.sources[1]", {small}, 1}}, 8, true, 0); });
  EXPECT_NE(msg.find("data.token_files.sources[1]: 5 tokens in 1 file(s) are fewer than one window of data.seq_len+1 = 9"),
            std::string::npos)
      << msg;
  msg = error_of([&] { TokenDataset({{"data.token_files", {path("missing.tok")}, 1}}, 8, true, 0); });
  EXPECT_NE(msg.find("missing.tok: cannot open token file"), std::string::npos) << msg;
}

TEST_F(TokenDatasetTest, CheckNamesTheFirstTokenOutOfRange) {
  auto good = counting_file("good.tok", 0, 3000);
  std::vector<uint32_t> t(5000, 7);
  t[4321] = 50304;
  t[4500] = 60000;
  write_token_file(path("bad.tok"), t);
  EXPECT_EQ(check_token_files({good}, 3000, nullptr), 3000);
  auto msg = error_of([&] { check_token_files({good, path("bad.tok")}, 50304, nullptr); });
  EXPECT_NE(msg.find(path("bad.tok") + ": token 4321 (id 50304) is not below model.vocab_size = 50304"), std::string::npos)
      << msg;
  msg = error_of([&] { check_token_files({good}, 2999, nullptr); });
  EXPECT_NE(msg.find("good.tok: token 2999 (id 2999)"), std::string::npos) << msg;
}

}  // namespace
}  // namespace carry
