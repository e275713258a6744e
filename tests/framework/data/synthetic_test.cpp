// Tests for framework/data/synthetic.h: the counter-based generator, MQAR and needle batches as pure
// functions of (seed, split, step, dp_rank, index) -- same arguments give the same batch whatever
// was generated before, any changed argument changes it, re-cutting the global batch over dp ranks
// does not -- their structure (every query's answer is the value paired with its key; the needle's
// answer is the value written after its key), and the masked accuracy.
#include "framework/data/synthetic.h"

#include <gtest/gtest.h>

#include <map>
#include <set>

namespace carry {
namespace {

TEST(CounterRng, PureAndInRange) {
  CounterRng a(7, {1, 2, 3}), b(7, {1, 2, 3}), c(7, {1, 2, 4}), d(8, {1, 2, 3});
  std::vector<uint64_t> xa, xb;
  for (int i = 0; i < 100; ++i) xa.push_back(a.next()), xb.push_back(b.next());
  EXPECT_EQ(xa, xb);
  EXPECT_NE(xa[0], c.next());
  EXPECT_NE(xa[0], d.next());
  // below(n): in range, and every value of a small range is hit about equally often.
  CounterRng r(1, {});
  std::vector<int> hits(7, 0);
  for (int i = 0; i < 70000; ++i) {
    auto v = r.below(7);
    ASSERT_LT(v, 7u);
    ++hits[v];
  }
  for (int h : hits) EXPECT_NEAR(h, 10000, 500);
  EXPECT_EQ(r.below(1), 0u);
}

bool equal(const SyntheticBatch& x, const SyntheticBatch& y) {
  return x.tokens.equal(y.tokens) && x.targets.equal(y.targets) && x.loss_mask.equal(y.loss_mask);
}

const MqarSpec kMqar{/*seq_len=*/256, /*num_kv_pairs=*/16, /*num_queries=*/24, /*vocab_size=*/201};

TEST(Mqar, SameArgumentsSameBatchAndAnyChangeDiffers) {
  auto base = mqar_batch(kMqar, 11, 5, 1, 4);
  mqar_batch(kMqar, 11, 6, 0, 8);  // generating something else in between changes nothing
  EXPECT_TRUE(equal(base, mqar_batch(kMqar, 11, 5, 1, 4)));
  EXPECT_FALSE(base.tokens.equal(mqar_batch(kMqar, 11, 6, 1, 4).tokens));   // step
  EXPECT_FALSE(base.tokens.equal(mqar_batch(kMqar, 11, 5, 0, 4).tokens));   // dp rank
  EXPECT_FALSE(base.tokens.equal(mqar_batch(kMqar, 12, 5, 1, 4).tokens));   // seed
  EXPECT_FALSE(base.tokens.equal(mqar_batch(kMqar, 11, 5, 1, 4, Split::eval).tokens));  // split
  // Rows within a batch differ from each other.
  for (int i = 1; i < 4; ++i) EXPECT_FALSE(base.tokens[0].equal(base.tokens[i]));
  // The global batch cut differently over dp ranks: rank 1 of 4-per-rank = rows 4..7 of 8-per-rank.
  auto whole = mqar_batch(kMqar, 11, 5, 0, 8);
  EXPECT_TRUE(base.tokens.equal(whole.tokens.slice(0, 4, 8)));
  EXPECT_TRUE(base.targets.equal(whole.targets.slice(0, 4, 8)));
}

TEST(Mqar, EveryQueryIsAnsweredByTheValuePairedWithItsKey) {
  for (auto spec : {kMqar, MqarSpec{64, 8, 24, 64}, MqarSpec{44, 20, 1, 41}}) {
    const int64_t T = spec.seq_len, N = spec.num_kv_pairs, K = (spec.vocab_size - 1) / 2;
    auto b = mqar_batch(spec, 3, 0, 0, 16);
    ASSERT_EQ(b.tokens.sizes(), (std::vector<int64_t>{16, T}));
    auto x = b.tokens.accessor<int64_t, 2>();
    auto y = b.targets.accessor<int64_t, 2>();
    auto m = b.loss_mask.accessor<bool, 2>();
    for (int64_t r = 0; r < 16; ++r) {
      std::map<int64_t, int64_t> value_of;
      for (int64_t i = 0; i < N; ++i) {
        int64_t k = x[r][2 * i], v = x[r][2 * i + 1];
        ASSERT_TRUE(k >= 1 && k < 1 + K) << "key " << k;
        ASSERT_TRUE(v >= 1 + K && v < spec.vocab_size) << "value " << v;
        ASSERT_TRUE(value_of.emplace(k, v).second) << "key " << k << " used twice";
        ASSERT_FALSE(m[r][2 * i] || m[r][2 * i + 1]);
      }
      int64_t queries = 0;
      for (int64_t t = 2 * N; t < T; ++t) {
        if (!m[r][t]) {
          ASSERT_EQ(y[r][t], kIgnoreIndex);
          continue;
        }
        ++queries;
        ASSERT_EQ((t - 2 * N) % 2, 0) << "queries sit at even offsets";
        ASSERT_TRUE(value_of.count(x[r][t])) << "query " << x[r][t] << " is not a key of this sequence";
        ASSERT_EQ(y[r][t], value_of[x[r][t]]);
        ASSERT_EQ(x[r][t + 1], y[r][t]) << "the answer follows the query";
        ASSERT_FALSE(m[r][t + 1]);
        ++t;
      }
      ASSERT_EQ(queries, spec.num_queries);
      // Everything outside the pairs and the queries pads with 0.
      for (int64_t t = 2 * N; t < T; ++t)
        if (!m[r][t] && !(t > 2 * N && m[r][t - 1])) ASSERT_EQ(x[r][t], 0) << t;
    }
  }
}

TEST(Mqar, QueriesAskDistinctKeysWhenTheyCan) {
  auto b = mqar_batch(MqarSpec{128, 8, 8, 101}, 1, 0, 0, 8);
  for (int64_t r = 0; r < 8; ++r) {
    auto row = b.tokens[r];
    std::set<int64_t> asked;
    for (int64_t t = 16; t < 128; ++t)
      if (b.loss_mask[r][t].item<bool>()) asked.insert(row[t].item<int64_t>());
    EXPECT_EQ(asked.size(), 8u);
  }
}

// min_kv_pairs: each sequence's pair count is drawn from [min_kv_pairs, num_kv_pairs]. The pairs are the
// leading run of distinct keys each followed by a value; every query asks one of them and is answered.
TEST(Mqar, PairCountsDrawnFromTheRange) {
  const MqarSpec spec{/*seq_len=*/96, /*num_kv_pairs=*/16, /*num_queries=*/8, /*vocab_size=*/101, /*min_kv_pairs=*/4};
  const int64_t K = (spec.vocab_size - 1) / 2;
  auto b = mqar_batch(spec, 7, 0, 0, 64);
  EXPECT_TRUE(equal(b, mqar_batch(spec, 7, 0, 0, 64)));
  auto x = b.tokens.accessor<int64_t, 2>();
  auto y = b.targets.accessor<int64_t, 2>();
  auto m = b.loss_mask.accessor<bool, 2>();
  std::set<int64_t> counts;
  for (int64_t r = 0; r < 64; ++r) {
    std::map<int64_t, int64_t> value_of;
    int64_t n = 0;
    while (n < spec.num_kv_pairs && x[r][2 * n] >= 1 && x[r][2 * n] < 1 + K && !m[r][2 * n] &&
           !value_of.count(x[r][2 * n])) {
      ASSERT_GE(x[r][2 * n + 1], 1 + K);
      value_of[x[r][2 * n]] = x[r][2 * n + 1];
      ++n;
    }
    ASSERT_GE(n, spec.min_kv_pairs);
    ASSERT_LE(n, spec.num_kv_pairs);
    counts.insert(n);
    int64_t queries = 0;
    for (int64_t t = 2 * n; t < spec.seq_len; ++t) {
      if (!m[r][t]) continue;
      ++queries;
      ASSERT_TRUE(value_of.count(x[r][t])) << "row " << r << ": query " << x[r][t] << " asks no pair";
      ASSERT_EQ(y[r][t], value_of[x[r][t]]);
    }
    ASSERT_EQ(queries, spec.num_queries);
  }
  // 64 draws from 13 counts: both ends and most counts between are met.
  EXPECT_GE(counts.size(), 10u);
  EXPECT_EQ(*counts.begin(), spec.min_kv_pairs);
  EXPECT_EQ(*counts.rbegin(), spec.num_kv_pairs);
  // min_kv_pairs = 0 keeps the fixed count and the batches generated without it.
  MqarSpec fixed = spec;
  fixed.min_kv_pairs = 0;
  EXPECT_TRUE(equal(mqar_batch(fixed, 7, 0, 0, 4), mqar_batch(MqarSpec{96, 16, 8, 101}, 7, 0, 0, 4)));
  EXPECT_FALSE(mqar_batch(fixed, 7, 0, 0, 4).tokens.equal(mqar_batch(spec, 7, 0, 0, 4).tokens));
}

TEST(Mqar, SpecErrors) {
  EXPECT_THROW(mqar_batch(MqarSpec{30, 8, 8, 101}, 1, 0, 0, 1), c10::Error);  // 2*(8+8) > 30
  EXPECT_THROW(mqar_batch(MqarSpec{64, 8, 8, 15}, 1, 0, 0, 1), c10::Error);   // 7 keys < 8 pairs
  EXPECT_THROW(mqar_batch(MqarSpec{64, 8, 8, 101, 9}, 1, 0, 0, 1), c10::Error);  // min_kv_pairs > num_kv_pairs
}

const NeedleSpec kNeedle{/*seq_len=*/512, /*vocab_size=*/403, /*value_len=*/3, /*num_distractors=*/4};

TEST(Needle, PureAndStructured) {
  auto b = needle_batch(kNeedle, 5, 2, 1, 6);
  EXPECT_TRUE(equal(b, needle_batch(kNeedle, 5, 2, 1, 6)));
  EXPECT_FALSE(b.tokens.equal(needle_batch(kNeedle, 5, 3, 1, 6).tokens));
  EXPECT_FALSE(b.tokens.equal(needle_batch(kNeedle, 5, 2, 0, 6).tokens));
  const int64_t T = kNeedle.seq_len, n = kNeedle.value_len, K = (kNeedle.vocab_size - 3) / 4;
  auto x = b.tokens.accessor<int64_t, 2>();
  auto y = b.targets.accessor<int64_t, 2>();
  auto m = b.loss_mask.accessor<bool, 2>();
  std::set<int64_t> depths;
  for (int64_t r = 0; r < 6; ++r) {
    const int64_t q = T - (2 + n);
    ASSERT_EQ(x[r][q], 2) << "QUERY marker";
    int64_t key = x[r][q + 1];
    ASSERT_TRUE(key >= 3 && key < 3 + K);
    // Needles in the haystack: markers followed by distinct keys and values; the asked key once.
    std::map<int64_t, int64_t> needle_at;  // key -> position of its marker
    for (int64_t t = 0; t < q; ++t) {
      if (x[r][t] == 1) {
        ASSERT_LE(t + 2 + n, q);
        ASSERT_TRUE(needle_at.emplace(x[r][t + 1], t).second) << "two needles with one key";
        for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(x[r][t + 2 + i] >= 3 + K && x[r][t + 2 + i] < 3 + 2 * K);
        t += 1 + n;
      } else {
        ASSERT_GE(x[r][t], 3 + 2 * K) << "filler";
      }
    }
    ASSERT_EQ(needle_at.size(), static_cast<size_t>(kNeedle.num_distractors + 1));
    ASSERT_TRUE(needle_at.count(key));
    depths.insert(needle_at[key]);
    int64_t masked = 0;
    for (int64_t t = 0; t < T; ++t) masked += m[r][t];
    ASSERT_EQ(masked, n);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_TRUE(m[r][q + 1 + i]);
      ASSERT_EQ(y[r][q + 1 + i], x[r][needle_at[key] + 2 + i]) << "the answer is the needle's value";
      ASSERT_EQ(x[r][q + 2 + i], y[r][q + 1 + i]);
    }
  }
  EXPECT_GT(depths.size(), 1u) << "the needle's depth varies";
}

TEST(Synthetic, SpecsFromTheConfig) {
  config::DataConfig d;
  d.set_seq_len(300);
  d.mutable_mqar()->set_num_kv_pairs(5);
  auto s = mqar_spec(d);
  EXPECT_EQ(s.seq_len, 300);
  EXPECT_EQ(s.num_kv_pairs, 5);
  EXPECT_EQ(s.num_queries, 16);  // the schema's default
  EXPECT_THROW(needle_spec(d), c10::Error);
  d.mutable_needle()->set_value_len(2);
  EXPECT_EQ(needle_spec(d).value_len, 2);
}

TEST(Synthetic, MaskedAccuracy) {
  auto b = mqar_batch(kMqar, 1, 0, 0, 4);
  auto perfect = b.targets.clone();
  auto a = masked_accuracy(perfect, b.targets, b.loss_mask);
  EXPECT_EQ(a.total, 4 * kMqar.num_queries);
  EXPECT_EQ(a.correct, a.total);
  EXPECT_EQ(a.sequences_correct, 4);
  EXPECT_DOUBLE_EQ(a.value(), 1.0);
  // Unmasked positions never count; one wrong answer costs one position and one sequence.
  auto preds = at::zeros_like(b.targets);
  preds.masked_scatter_(b.loss_mask, b.targets.masked_select(b.loss_mask));
  auto first = b.loss_mask[2].nonzero()[0][0].item<int64_t>();
  preds[2][first] = 0;
  a = masked_accuracy(preds, b.targets, b.loss_mask);
  EXPECT_EQ(a.correct, a.total - 1);
  EXPECT_EQ(a.sequences_correct, 3);
  EXPECT_EQ(a.sequences, 4);
  // Logits: argmax over the last dimension.
  auto logits = at::one_hot(preds, kMqar.vocab_size).to(at::kFloat);
  auto c = masked_accuracy(logits, b.targets, b.loss_mask);
  EXPECT_EQ(c.correct, a.correct);
  EXPECT_EQ(c.sequences_correct, 3);
}

}  // namespace
}  // namespace carry
