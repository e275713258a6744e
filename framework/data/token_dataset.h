// Token files as training data: which windows of which files make the sequence of global index g.
//
// A *source* is a list of token files (paths or glob patterns, a pattern's matches taken in sorted
// order) read one after another as one stream. The stream is cut into windows of seq_len+1 tokens at
// stride seq_len (a window's last token is the next window's first: the target of its last
// position), so a source of N tokens holds W = (N-1)/seq_len windows. Several sources are blended by
// weight; the trainer asks for the sequence of a global index g (a pure function of the seed, the
// config and g, so a run resumes, and changes its dp x sp layout, without a data cursor):
//   1. source: a fixed interleave of period kBlendPeriod in which source s takes round(w_s/Σw * period)
//      slots, spread evenly (the greedy rule "the source furthest behind its share goes next");
//      g's slot gives the source s and k, how many of g's predecessors went to s;
//   2. window: visit k of source s is in epoch e = k / W_s at place j = k mod W_s; with shuffling the
//      window is π_{seed,s,e}(j), a pseudo-random permutation of [0, W_s) drawn afresh every epoch
//      (a 4-round Feistel network on the next power of four, cycle-walked into [0, W_s): O(1) time and
//      memory, whatever the size), without shuffling j itself. Every window is visited once an epoch.
// Evaluation reads its own files in order (no shuffling, one source).
//
// check_token_files reads every token of every file once (threads over the files' token ranges) and
// throws on the first id >= vocab_size, naming the file, the token index and the id; the trainer calls
// it on world rank 0 before any rank trains.
#pragma once

#include "framework/data/token_file.h"

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace carry {

// Expands glob patterns (*, ?, [...]) into the sorted list of files they match; a path without
// pattern characters is kept as it is (opening it reports a missing file). A pattern that matches
// nothing throws std::runtime_error naming `field` and the pattern.
std::vector<std::string> expand_token_paths(const std::vector<std::string>& patterns, const std::string& field);

// Several token files read as one stream.
class TokenStream {
 public:
  explicit TokenStream(const std::vector<std::string>& paths);
  int64_t size() const { return total_; }  // tokens
  int64_t windows(int64_t seq_len) const { return total_ > 0 ? (total_ - 1) / seq_len : 0; }
  // Tokens [pos, pos+count) of the stream into `out` (across file boundaries).
  void read(int64_t pos, int64_t count, int64_t* out) const;
  const std::vector<TokenFile>& files() const { return files_; }

 private:
  std::vector<TokenFile> files_;
  std::vector<int64_t> starts_;  // first stream position of each file
  int64_t total_ = 0;
};

// A pseudo-random permutation of [0, n), evaluated at one point: permute_index(key, n, i) for
// i = 0..n-1 gives every value of [0, n) once.
int64_t permute_index(uint64_t key, int64_t n, int64_t i);

struct TokenSourceSpec {
  std::string name;                 // for messages ("data.token_files.sources[1]")
  std::vector<std::string> paths;   // files or glob patterns
  double weight = 1;
};

class TokenDataset {
 public:
  static constexpr int64_t kBlendPeriod = 1 << 16;

  // Opens every file (errors name the source, the pattern or the file). Throws when a source has
  // fewer than seq_len+1 tokens or a weight is not positive.
  TokenDataset(const std::vector<TokenSourceSpec>& sources, int64_t seq_len, bool shuffle, uint64_t seed);

  struct Pick {
    int source = 0;
    int64_t window = 0;  // in that source
    int64_t epoch = 0;   // how many times that source was read through before this window
  };
  Pick pick(int64_t global_index) const;
  // The seq_len+1 tokens of the sequence with this global index.
  void sequence(int64_t global_index, int64_t* out) const;

  int num_sources() const { return static_cast<int>(streams_.size()); }
  const TokenStream& stream(int s) const { return streams_[s]; }
  const std::string& source_name(int s) const { return names_[s]; }
  int64_t windows(int s) const { return windows_[s]; }
  // Slots of source s in one blend period (its share of the sequences is this / kBlendPeriod).
  int64_t slots(int s) const { return period_count_[s]; }
  int64_t seq_len() const { return seq_len_; }

 private:
  std::vector<TokenStream> streams_;
  std::vector<std::string> names_;
  std::vector<int64_t> windows_;
  int64_t seq_len_;
  bool shuffle_;
  uint64_t seed_;
  // The blend: source and ordinal (its slots before this one in the period) of every slot.
  std::vector<int32_t> slot_source_, slot_ordinal_;
  std::vector<int64_t> period_count_;
};

// Reads every token of `paths` and throws std::runtime_error on the first id >= vocab_size ("<file>:
// token 1234 (id 50304) is not below model.vocab_size = 50304 ..."); opening errors propagate. Prints
// a progress line to `progress` (may be null) every few seconds on long scans. Returns the number of
// tokens checked.
int64_t check_token_files(const std::vector<std::string>& paths, int64_t vocab_size, std::FILE* progress);

}  // namespace carry
