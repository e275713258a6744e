// Sampling text from a model: the prompt is read in one piece (chunkwise form for its whole chunks,
// recurrent_decoder.h), then tokens are drawn one at a time, each fed back as a one-token piece
// (the recurrence's O(1) step; softmax attention layers attend over their KV cache).
//
// Sampling is reproducible: draw i of a generation uses a uniform number from carry's counter-based
// generator keyed by (seed, i) (framework/data/synthetic.h), and the probabilities are formed in fp64
// on the host from the logits, so the same seed and the same logits give the same tokens on any
// machine. Filters apply in the usual order: temperature, top-k, then top-p (nucleus: the smallest
// set of most likely tokens whose probability reaches top_p); temperature 0 takes the argmax.
#pragma once

#include "framework/model/model.h"

#include <cstdint>
#include <functional>
#include <vector>

namespace carry {

struct SamplingOptions {
  double temperature = 1.0;  // 0: greedy (argmax)
  int64_t top_k = 0;         // 0: no top-k filter
  double top_p = 1.0;        // 1: no nucleus filter
  uint64_t seed = 0;
};

// One token from logits [V] (any device and floating dtype). `draw` numbers the draws of one
// generation (0, 1, ...). Throws on options out of range (temperature < 0, top_p not in (0, 1]).
int64_t sample_token(const Tensor& logits, const SamplingOptions& opt, int64_t draw);

struct GenerationOptions {
  SamplingOptions sampling;
  int64_t max_new_tokens = 64;
  int64_t stop_token = -1;      // stop after drawing this token (-1: never)
  bool keep_logits = false;     // return the logits of every draw
  // Called after each drawn token (its id and index among the new tokens).
  std::function<void(int64_t token, int64_t index)> on_token;
};

struct Generation {
  std::vector<int64_t> tokens;  // the new tokens (not the prompt)
  Tensor logits;                // [new tokens, V] fp32 on the CPU when keep_logits
  double prefill_seconds = 0, decode_seconds = 0;
  int64_t prompt_length = 0;
};

// Generates from one prompt (at least one token). Runs under no-grad; the caller picks autocast.
Generation generate(const Model& model, const std::vector<int64_t>& prompt, const GenerationOptions& opt);

}  // namespace carry
