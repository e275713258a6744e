// Synthetic tasks generated on the fly: multi-query associative recall (MQAR, Zoology) and
// needle-in-a-haystack. Every sequence is a pure function of (seed, split, step, global index) where
// global index = dp_rank * batch_size + index in the batch: a counter-based generator hashes that
// tuple (splitmix64 mixing), so a batch never depends on call order, on what was generated before,
// or on how the global batch is cut into dp ranks (dp=2, batch 4 gives the sequences of dp=1,
// batch 8). Sequence-parallel ranks generate the same sequence and take their slice.
//
// A batch is next-token prediction with a loss mask: `tokens` is the model's input, `targets[b,t]` is
// the token the model must predict after reading tokens[b, ..t] where `loss_mask[b,t]`, and
// kIgnoreIndex elsewhere.
//
// MQAR layout (T = seq_len, N kv pairs, Q queries, vocabulary V): token 0 pads; keys come from
// [1, 1+K) with K = (V-1)/2, values from [1+K, V). Positions 0..2N-1 hold k_1 v_1 ... k_N v_N (N
// distinct keys); then Q of the pairs are asked again at distinct random even offsets of [2N, T):
// the query key at p, its value at p+1, and the target at p is that value. Everything else is 0.
//
// Needle layout: token 0 pads, 1 = NEEDLE, 2 = QUERY, keys [3, 3+K), values [3+K, 3+2K),
// filler [3+2K, V) with K = (V-3)/4. Random filler everywhere; 1 + num_distractors needles
// [NEEDLE key v_1..v_n] with distinct keys at random non-overlapping places before the query; the
// sequence ends with [QUERY key v_1..v_n] asking the true needle's key; the targets are v_1..v_n
// (predicted after the query key, then after each value).
#pragma once

#include "framework/config/carry.pb.h"

#include <ATen/ATen.h>

#include <cstdint>

namespace carry {

constexpr int64_t kIgnoreIndex = -100;  // targets where the loss mask is off (cross_entropy's default)

// splitmix64's finalizer: a bijective 64-bit mix.
uint64_t mix64(uint64_t x);

// A counter-based random stream keyed by a tuple of integers: draw i is mix(key, i), so the stream
// is a pure function of the key.
class CounterRng {
 public:
  CounterRng(uint64_t seed, std::initializer_list<uint64_t> coordinates);
  uint64_t next();                // 64 random bits
  uint64_t below(uint64_t n);     // uniform in [0, n), n > 0, unbiased
 private:
  uint64_t key_;
  uint64_t counter_ = 0;
};

enum class Split : uint64_t { train = 0, eval = 1 };

struct MqarSpec {
  int64_t seq_len = 256;
  int64_t num_kv_pairs = 16;
  int64_t num_queries = 16;
  int64_t vocab_size = 8192;
  int64_t min_kv_pairs = 0;  // > 0: a sequence's pair count is uniform in [min_kv_pairs, num_kv_pairs]
};

struct NeedleSpec {
  int64_t seq_len = 2048;
  int64_t vocab_size = 8192;
  int64_t value_len = 4;
  int64_t num_distractors = 0;
};

MqarSpec mqar_spec(const config::DataConfig& data);      // data.mqar with data.seq_len
NeedleSpec needle_spec(const config::DataConfig& data);  // data.needle with data.seq_len

struct SyntheticBatch {
  at::Tensor tokens;     // [B, T] int64
  at::Tensor targets;    // [B, T] int64, kIgnoreIndex where loss_mask is false
  at::Tensor loss_mask;  // [B, T] bool
};

SyntheticBatch mqar_batch(const MqarSpec& spec, uint64_t seed, int64_t step, int64_t dp_rank,
                          int64_t batch_size, Split split = Split::train);
SyntheticBatch needle_batch(const NeedleSpec& spec, uint64_t seed, int64_t step, int64_t dp_rank,
                            int64_t batch_size, Split split = Split::train);

// Accuracy at the masked positions. `predictions` is [B,T] token ids or [B,T,V] logits (argmax taken).
struct Accuracy {
  int64_t correct = 0;              // masked positions predicted right
  int64_t total = 0;                // masked positions
  int64_t sequences_correct = 0;    // sequences whose every masked position is right
  int64_t sequences = 0;            // sequences with at least one masked position
  double value() const { return total ? static_cast<double>(correct) / static_cast<double>(total) : 0.0; }
};
Accuracy masked_accuracy(const at::Tensor& predictions, const at::Tensor& targets, const at::Tensor& loss_mask);

}  // namespace carry
