// Synthetic tasks (see synthetic.h): each sequence is written from its own CounterRng, keyed by
// (seed, task, split, step, global index); draws within a sequence follow a fixed order, so the
// sequence is a pure function of that key.
#include "framework/data/synthetic.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <unordered_map>
#include <vector>

namespace carry {

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kMqarTask = 1, kNeedleTask = 2;

// k distinct values of [0, n) in random order (a partial Fisher-Yates shuffle over a sparse array).
std::vector<int64_t> sample_distinct(CounterRng& rng, int64_t n, int64_t k) {
  TORCH_INTERNAL_ASSERT(0 <= k && k <= n, "sample_distinct: ", k, " of ", n);
  std::unordered_map<int64_t, int64_t> moved;
  auto value = [&](int64_t i) {
    auto it = moved.find(i);
    return it == moved.end() ? i : it->second;
  };
  std::vector<int64_t> out(k);
  for (int64_t i = 0; i < k; ++i) {
    int64_t j = i + static_cast<int64_t>(rng.below(static_cast<uint64_t>(n - i)));
    int64_t vi = value(i), vj = value(j);
    out[i] = vj;
    moved[j] = vi;
  }
  return out;
}

void check_mqar(const MqarSpec& s) {
  TORCH_CHECK(s.num_kv_pairs > 0 && s.num_queries > 0, "mqar: num_kv_pairs and num_queries must be positive, got ",
              s.num_kv_pairs, " and ", s.num_queries);
  TORCH_CHECK(s.vocab_size >= 3 && (s.vocab_size - 1) / 2 >= s.num_kv_pairs, "mqar: vocab_size ", s.vocab_size,
              " gives ", (s.vocab_size - 1) / 2, " key tokens, fewer than num_kv_pairs ", s.num_kv_pairs);
  TORCH_CHECK(s.min_kv_pairs >= 0 && s.min_kv_pairs <= s.num_kv_pairs, "mqar: min_kv_pairs must be in [0, ",
              s.num_kv_pairs, "], got ", s.min_kv_pairs);
  TORCH_CHECK(2 * (s.num_kv_pairs + s.num_queries) <= s.seq_len, "mqar: 2*(num_kv_pairs + num_queries) = ",
              2 * (s.num_kv_pairs + s.num_queries), " tokens do not fit in seq_len ", s.seq_len);
}

void check_needle(const NeedleSpec& s) {
  TORCH_CHECK(s.value_len > 0 && s.num_distractors >= 0, "needle: value_len must be positive and num_distractors "
              ">= 0, got ", s.value_len, " and ", s.num_distractors);
  TORCH_CHECK(s.vocab_size >= 7 && (s.vocab_size - 3) / 4 >= s.num_distractors + 1, "needle: vocab_size ",
              s.vocab_size, " gives ", (s.vocab_size - 3) / 4, " key tokens, fewer than the ", s.num_distractors + 1,
              " needles");
  TORCH_CHECK((s.num_distractors + 2) * (s.value_len + 2) <= s.seq_len, "needle: the needles and the query take ",
              (s.num_distractors + 2) * (s.value_len + 2), " tokens, more than seq_len ", s.seq_len);
}

void mqar_sequence(const MqarSpec& s, CounterRng& rng, int64_t* x, int64_t* y, bool* m) {
  const int64_t T = s.seq_len, Q = s.num_queries, K = (s.vocab_size - 1) / 2;
  const int64_t N = s.min_kv_pairs > 0 ? s.min_kv_pairs + static_cast<int64_t>(rng.below(static_cast<uint64_t>(
                                                               s.num_kv_pairs - s.min_kv_pairs + 1)))
                                       : s.num_kv_pairs;
  const int64_t value_base = 1 + K, num_values = s.vocab_size - value_base;
  std::fill(x, x + T, 0);
  std::fill(y, y + T, kIgnoreIndex);
  std::fill(m, m + T, false);
  auto keys = sample_distinct(rng, K, N);
  std::vector<int64_t> values(N);
  for (int64_t i = 0; i < N; ++i) {
    keys[i] += 1;
    values[i] = value_base + static_cast<int64_t>(rng.below(static_cast<uint64_t>(num_values)));
    x[2 * i] = keys[i];
    x[2 * i + 1] = values[i];
  }
  auto slots = sample_distinct(rng, (T - 2 * N) / 2, Q);
  std::vector<int64_t> asked = Q <= N ? sample_distinct(rng, N, Q) : std::vector<int64_t>(Q);
  if (Q > N)
    for (auto& a : asked) a = static_cast<int64_t>(rng.below(static_cast<uint64_t>(N)));
  for (int64_t j = 0; j < Q; ++j) {
    int64_t p = 2 * N + 2 * slots[j];
    x[p] = keys[asked[j]];
    x[p + 1] = values[asked[j]];
    y[p] = values[asked[j]];
    m[p] = true;
  }
}

void needle_sequence(const NeedleSpec& s, CounterRng& rng, int64_t* x, int64_t* y, bool* m) {
  constexpr int64_t kNeedle = 1, kQuery = 2;
  const int64_t T = s.seq_len, n = s.value_len, r = s.num_distractors + 1, K = (s.vocab_size - 3) / 4;
  const int64_t key_base = 3, value_base = 3 + K, filler_base = 3 + 2 * K, num_filler = s.vocab_size - filler_base;
  const int64_t len = 2 + n, query_at = T - len, free = query_at - r * len;
  std::fill(y, y + T, kIgnoreIndex);
  std::fill(m, m + T, false);
  for (int64_t t = 0; t < query_at; ++t) x[t] = filler_base + static_cast<int64_t>(rng.below(num_filler));
  auto keys = sample_distinct(rng, K, r);
  std::vector<int64_t> values(r * n);
  for (auto& v : values) v = value_base + static_cast<int64_t>(rng.below(static_cast<uint64_t>(K)));
  // r non-overlapping places in [0, query_at): r sorted distinct a_j of [0, free + r), at a_j + j*(len-1).
  auto offsets = sample_distinct(rng, free + r, r);
  std::sort(offsets.begin(), offsets.end());
  const int64_t truth = static_cast<int64_t>(rng.below(static_cast<uint64_t>(r)));
  for (int64_t j = 0; j < r; ++j) {
    int64_t p = offsets[j] + j * (len - 1);
    x[p] = kNeedle;
    x[p + 1] = key_base + keys[j];
    for (int64_t i = 0; i < n; ++i) x[p + 2 + i] = values[j * n + i];
  }
  x[query_at] = kQuery;
  x[query_at + 1] = key_base + keys[truth];
  for (int64_t i = 0; i < n; ++i) {
    x[query_at + 2 + i] = values[truth * n + i];
    y[query_at + 1 + i] = values[truth * n + i];
    m[query_at + 1 + i] = true;
  }
}

template <class Fill>
SyntheticBatch make_batch(int64_t T, int64_t batch_size, uint64_t seed, uint64_t task, Split split, int64_t step,
                          int64_t dp_rank, Fill fill) {
  TORCH_CHECK(batch_size > 0, "batch_size must be positive, got ", batch_size);
  TORCH_CHECK(step >= 0 && dp_rank >= 0, "step and dp_rank must be >= 0, got ", step, " and ", dp_rank);
  SyntheticBatch b;
  b.tokens = at::empty({batch_size, T}, at::kLong);
  b.targets = at::empty({batch_size, T}, at::kLong);
  b.loss_mask = at::empty({batch_size, T}, at::kBool);
  for (int64_t i = 0; i < batch_size; ++i) {
    uint64_t global_index = static_cast<uint64_t>(dp_rank * batch_size + i);
    CounterRng rng(seed, {task, static_cast<uint64_t>(split), static_cast<uint64_t>(step), global_index});
    fill(rng, b.tokens.data_ptr<int64_t>() + i * T, b.targets.data_ptr<int64_t>() + i * T,
         b.loss_mask.data_ptr<bool>() + i * T);
  }
  return b;
}

}  // namespace

uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

CounterRng::CounterRng(uint64_t seed, std::initializer_list<uint64_t> coordinates) {
  key_ = mix64(seed + kGolden);
  for (auto c : coordinates) key_ = mix64(key_ ^ mix64(c + kGolden));
}

uint64_t CounterRng::next() { return mix64(key_ + (++counter_) * kGolden); }

uint64_t CounterRng::below(uint64_t n) {
  TORCH_INTERNAL_ASSERT(n > 0);
  // Lemire's multiply-shift with rejection of the biased low range.
  unsigned __int128 prod = static_cast<unsigned __int128>(next()) * n;
  auto low = static_cast<uint64_t>(prod);
  if (low < n) {
    uint64_t threshold = (0 - n) % n;
    while (low < threshold) {
      prod = static_cast<unsigned __int128>(next()) * n;
      low = static_cast<uint64_t>(prod);
    }
  }
  return static_cast<uint64_t>(prod >> 64);
}

MqarSpec mqar_spec(const config::DataConfig& data) {
  TORCH_CHECK(data.has_mqar(), "data: the source is not mqar");
  return {data.seq_len(), data.mqar().num_kv_pairs(), data.mqar().num_queries(), data.mqar().vocab_size(),
          data.mqar().min_kv_pairs()};
}

NeedleSpec needle_spec(const config::DataConfig& data) {
  TORCH_CHECK(data.has_needle(), "data: the source is not needle");
  return {data.seq_len(), data.needle().vocab_size(), data.needle().value_len(), data.needle().num_distractors()};
}

SyntheticBatch mqar_batch(const MqarSpec& spec, uint64_t seed, int64_t step, int64_t dp_rank, int64_t batch_size,
                          Split split) {
  check_mqar(spec);
  return make_batch(spec.seq_len, batch_size, seed, kMqarTask, split, step, dp_rank,
                    [&](CounterRng& rng, int64_t* x, int64_t* y, bool* m) { mqar_sequence(spec, rng, x, y, m); });
}

SyntheticBatch needle_batch(const NeedleSpec& spec, uint64_t seed, int64_t step, int64_t dp_rank,
                            int64_t batch_size, Split split) {
  check_needle(spec);
  return make_batch(spec.seq_len, batch_size, seed, kNeedleTask, split, step, dp_rank,
                    [&](CounterRng& rng, int64_t* x, int64_t* y, bool* m) { needle_sequence(spec, rng, x, y, m); });
}

Accuracy masked_accuracy(const at::Tensor& predictions, const at::Tensor& targets, const at::Tensor& loss_mask) {
  TORCH_CHECK(targets.dim() == 2, "masked_accuracy: targets must be [B, T], got ", targets.sizes());
  TORCH_CHECK(loss_mask.sizes() == targets.sizes(), "masked_accuracy: loss_mask ", loss_mask.sizes(),
              " must match targets ", targets.sizes());
  auto pred = predictions.dim() == 3 ? predictions.argmax(-1) : predictions;
  TORCH_CHECK(pred.sizes() == targets.sizes(), "masked_accuracy: predictions must be [B, T] ids or [B, T, V] "
              "logits matching targets ", targets.sizes(), ", got ", predictions.sizes());
  auto mask = loss_mask.to(at::kBool).cpu();
  auto right = pred.cpu().to(at::kLong).eq(targets.cpu().to(at::kLong));
  Accuracy a;
  a.correct = right.logical_and(mask).sum().item<int64_t>();
  a.total = mask.sum().item<int64_t>();
  auto has = mask.any(1);
  a.sequences = has.sum().item<int64_t>();
  a.sequences_correct = right.logical_or(mask.logical_not()).all(1).logical_and(has).sum().item<int64_t>();
  return a;
}

}  // namespace carry
