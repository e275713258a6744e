// Evaluation of a trained model on held-out sequences: the loss, perplexity, bits per token and per
// byte, next-token accuracy, and the loss at every position of the sequence (the long-context
// diagnostic of the log-linear attention paper: does the loss keep falling as the context grows?).
//
// Sequences are split over the ranks exactly as in training: dp ranks take different sequences, the
// sp ranks of a group one sequence each, rank r of P holding tokens [r·T/P, (r+1)·T/P), with the state
// scan between them (parallel/slice_context.h); so a sequence too long for one GPU is evaluated on
// several. Sequence s (s = 0, 1, ...) is, for token files, window s of T+1 tokens at stride T from the
// start of the stream (the files read one after another, as in training); for MQAR and needle, the
// task's sequence of Split::eval in batch b = s / (dp·B) (the same sequences Trainer::evaluate scores).
// Batch b of dp rank d holds sequences (b·dp + d)·B + i, i < B; windows past the last are scored
// with weight 0, so every rank runs the same number of batches. Per-token losses are summed in fp64
// per position and all-reduced once at the end.
//
// The head is applied to the final hidden states a slice of positions at a time, so a long sequence
// never materializes its [T, V] logits.
#pragma once

#include "framework/config/config.h"
#include "framework/model/model.h"
#include "parallel/process_group.h"
#include "parallel/state_scan.h"

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace carry {

struct EvalSpec {
  // The data: token files, or (when empty) the task of `data` (mqar or needle) with `seed`.
  std::vector<std::string> token_files;
  config::DataConfig data;
  uint64_t seed = 0;
  int64_t seq_len = 0;
  int64_t batch_size = 1;
  // Token files: at most this many sequences (0 = every window of the files). Tasks: this many
  // batches per dp rank (0 = data.eval_batches).
  int64_t max_sequences = 0;
  int64_t batches = 0;
  bool bf16 = false;            // bf16 autocast, as training's precision BF16
  parallel::ScanMode scan_mode = parallel::ScanMode::ordered;
  std::FILE* progress = nullptr;  // world rank 0 prints a progress line per tenth of the batches
  // Called with the first batch's tokens and logits on dp rank 0 when sp == 1 (e.g. to save them).
  std::function<void(const Tensor& tokens, const Tensor& logits)> first_batch;
};

struct EvalResult {
  int64_t sequences = 0;          // scored
  int64_t positions = 0;          // scored targets
  double loss_sum = 0;            // Σ cross entropy (nats) over scored targets
  int64_t correct = 0;            // argmax == target at scored targets
  int64_t byte_targets = 0;       // scored targets that are bytes (< 256): the bits-per-byte divisor
  int64_t sequences_all_right = 0;  // tasks: sequences with every scored target right
  std::vector<double> position_loss, position_count, position_correct;  // per position [T]
  double seconds = 0;
  bool task = false;

  double loss() const { return positions ? loss_sum / static_cast<double>(positions) : 0; }
  double perplexity() const;
  double bits_per_token() const;
  double bits_per_byte() const;  // loss_sum / ln 2 / byte_targets
  double accuracy() const { return positions ? static_cast<double>(correct) / static_cast<double>(positions) : 0; }
};

// Evaluates `model` (its parameters on the device to run on) on this rank's share of `spec`.
// `groups`: the dp × sp grid (null: one process). Collective over the world when groups is set; every
// rank returns the same totals. Throws ConfigError / c10::Error on bad data (too few tokens, ids
// outside the vocabulary, a sequence length the layout cannot split).
EvalResult evaluate_model(const Model& model, const EvalSpec& spec, parallel::ProcessGroups* groups);

// The per-position losses in `buckets` log-spaced ranges of positions (edges at round(T^(i/buckets)),
// duplicates merged): one row per non-empty range.
struct CurveRow {
  int64_t first = 0, last = 0;  // positions [first, last], 0-based token index of the prediction
  double tokens = 0, loss = 0, accuracy = 0;
};
std::vector<CurveRow> loss_curve(const EvalResult& result, int64_t buckets);

// The curve as a TSV table (a header line, then first, last, tokens, mean loss, accuracy) and as an
// SVG line plot of the mean loss against the position (log scale). Throw naming the path when it
// cannot be written.
void write_curve_tsv(const std::string& path, const std::vector<CurveRow>& rows);
void write_curve_svg(const std::string& path, const std::vector<CurveRow>& rows, const std::string& title);

}  // namespace carry
