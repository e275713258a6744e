// Token files as training data (see token_dataset.h): glob expansion, the stream over several files,
// the blend interleave, the per-epoch Feistel permutation and the start-of-run check.
#include "framework/data/token_dataset.h"

#include "framework/data/synthetic.h"  // mix64

#include <glob.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace carry {

namespace {

bool has_glob_characters(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

}  // namespace

std::vector<std::string> expand_token_paths(const std::vector<std::string>& patterns, const std::string& field) {
  std::vector<std::string> out;
  for (size_t i = 0; i < patterns.size(); ++i) {
    std::string p;
    raw_token_width(patterns[i], &p);  // "uint16:PATTERN": the prefix goes on every match
    const std::string raw_prefix = patterns[i].substr(0, patterns[i].size() - p.size());
    if (!has_glob_characters(p)) {
      out.push_back(patterns[i]);
      continue;
    }
    glob_t g{};
    int rc = ::glob(p.c_str(), GLOB_ERR, nullptr, &g);
    if (rc == GLOB_NOMATCH || (rc == 0 && g.gl_pathc == 0)) {
      ::globfree(&g);
      throw std::runtime_error(field + "[" + std::to_string(i) + "]: the pattern '" + p +
                               "' matches no file (relative patterns are taken from the working directory)");
    }
    if (rc != 0) {
      ::globfree(&g);
      throw std::runtime_error(field + "[" + std::to_string(i) + "]: cannot expand the pattern '" + p +
                               "' (a directory on its way could not be read)");
    }
    std::vector<std::string> matches(g.gl_pathv, g.gl_pathv + g.gl_pathc);
    ::globfree(&g);
    std::sort(matches.begin(), matches.end());
    for (auto& m : matches) out.push_back(raw_prefix + m);
  }
  return out;
}

// ---- TokenStream ----

TokenStream::TokenStream(const std::vector<std::string>& paths) {
  for (auto& p : paths) {
    starts_.push_back(total_);
    files_.emplace_back(p);
    total_ += files_.back().size();
  }
}

void TokenStream::read(int64_t pos, int64_t count, int64_t* out) const {
  if (pos < 0 || count < 0 || pos > total_ || count > total_ - pos)
    throw std::logic_error("token stream: read of [" + std::to_string(pos) + ", " + std::to_string(pos + count) +
                           ") past its " + std::to_string(total_) + " tokens");
  // The first file holding pos: the last start <= pos.
  size_t i = std::upper_bound(starts_.begin(), starts_.end(), pos) - starts_.begin();
  i = i > 0 ? i - 1 : 0;
  for (; i < files_.size() && count > 0; ++i) {
    int64_t begin = starts_[i], end = starts_[i] + files_[i].size();
    if (pos >= end) continue;
    int64_t n = std::min(count, end - pos);
    files_[i].read(pos - begin, n, out);
    pos += n, out += n, count -= n;
  }
}

// ---- the permutation ----

int64_t permute_index(uint64_t key, int64_t n, int64_t i) {
  if (n <= 1) return 0;
  // Half width h: 2^(2h) >= n, so cycle walking needs fewer than 4 rounds of the network on average.
  int h = 1;
  while ((int64_t{1} << (2 * h)) < n) ++h;
  const uint64_t mask = (uint64_t{1} << h) - 1;
  uint64_t x = static_cast<uint64_t>(i);
  do {
    uint64_t left = x >> h, right = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      uint64_t f = mix64(key ^ mix64(round * 0x9E3779B97F4A7C15ull + right)) & mask;
      uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    x = (left << h) | right;
  } while (x >= static_cast<uint64_t>(n));
  return static_cast<int64_t>(x);
}

// ---- TokenDataset ----

TokenDataset::TokenDataset(const std::vector<TokenSourceSpec>& sources, int64_t seq_len, bool shuffle, uint64_t seed)
    : seq_len_(seq_len), shuffle_(shuffle), seed_(seed) {
  if (sources.empty()) throw std::invalid_argument("token dataset: no source");
  if (seq_len <= 0) throw std::invalid_argument("token dataset: seq_len must be positive");
  double total_weight = 0;
  for (auto& s : sources) {
    if (!(s.weight > 0) || !std::isfinite(s.weight))
      throw std::runtime_error(s.name + ".weight: must be a positive number, got " + std::to_string(s.weight));
    total_weight += s.weight;
  }
  for (auto& s : sources) {
    streams_.emplace_back(expand_token_paths(s.paths, s.name + ".paths"));
    names_.push_back(s.name);
    const auto& st = streams_.back();
    windows_.push_back(st.windows(seq_len));
    if (windows_.back() == 0)
      throw std::runtime_error(s.name + ": " + std::to_string(st.size()) + " tokens in " +
                               std::to_string(st.files().size()) + " file(s) are fewer than one window of "
                               "data.seq_len+1 = " + std::to_string(seq_len + 1) + " tokens");
  }
  const int S = static_cast<int>(sources.size());
  if (S == 1) {
    period_count_ = {kBlendPeriod};
    return;
  }
  // Slots per period: the largest-remainder rounding of the shares, at least one slot each.
  period_count_.assign(S, 0);
  std::vector<std::pair<double, int>> remainders;
  int64_t given = 0;
  for (int s = 0; s < S; ++s) {
    double exact = sources[s].weight / total_weight * static_cast<double>(kBlendPeriod);
    period_count_[s] = std::max<int64_t>(1, static_cast<int64_t>(std::floor(exact)));
    given += period_count_[s];
    remainders.emplace_back(exact - std::floor(exact), s);
  }
  std::stable_sort(remainders.begin(), remainders.end(), [](auto& a, auto& b) { return a.first > b.first; });
  for (size_t r = 0; given < kBlendPeriod; r = (r + 1) % remainders.size()) ++period_count_[remainders[r].second], ++given;
  while (given > kBlendPeriod) {  // (only when tiny shares were raised to one slot)
    int s = static_cast<int>(std::max_element(period_count_.begin(), period_count_.end()) - period_count_.begin());
    --period_count_[s], --given;
  }
  // The interleave: each slot goes to the source furthest behind its share (integer deficits, ties to
  // the lower index), which ends the period with exactly period_count_[s] slots each.
  slot_source_.resize(kBlendPeriod);
  slot_ordinal_.resize(kBlendPeriod);
  std::vector<int64_t> taken(S, 0);
  for (int64_t t = 0; t < kBlendPeriod; ++t) {
    int best = 0;
    int64_t best_deficit = std::numeric_limits<int64_t>::min();
    for (int s = 0; s < S; ++s) {
      int64_t deficit = period_count_[s] * (t + 1) - taken[s] * kBlendPeriod;
      if (deficit > best_deficit) best = s, best_deficit = deficit;
    }
    slot_source_[t] = best;
    slot_ordinal_[t] = static_cast<int32_t>(taken[best]++);
  }
  for (int s = 0; s < S; ++s)
    if (taken[s] != period_count_[s])
      throw std::logic_error("token dataset: the blend interleave gave source " + std::to_string(s) + " " +
                             std::to_string(taken[s]) + " slots instead of " + std::to_string(period_count_[s]));
}

TokenDataset::Pick TokenDataset::pick(int64_t g) const {
  if (g < 0) throw std::invalid_argument("token dataset: negative sequence index " + std::to_string(g));
  Pick p;
  int64_t k = g;  // visit number within the source
  if (streams_.size() > 1) {
    int64_t period = g / kBlendPeriod, slot = g % kBlendPeriod;
    p.source = slot_source_[slot];
    k = period * period_count_[p.source] + slot_ordinal_[slot];
  }
  const int64_t W = windows_[p.source];
  p.epoch = k / W;
  const int64_t j = k % W;
  p.window = shuffle_ ? permute_index(mix64(seed_ ^ mix64(0xDA7A0000ull + static_cast<uint64_t>(p.source))) ^
                                          mix64(static_cast<uint64_t>(p.epoch) + 0x5EED),
                                      W, j)
                      : j;
  return p;
}

void TokenDataset::sequence(int64_t g, int64_t* out) const {
  auto p = pick(g);
  streams_[p.source].read(p.window * seq_len_, seq_len_ + 1, out);
}

// ---- the start-of-run check ----

int64_t check_token_files(const std::vector<std::string>& paths, int64_t vocab_size, std::FILE* progress) {
  std::vector<TokenFile> files;
  int64_t total = 0;
  for (auto& p : paths) {
    files.emplace_back(p);
    total += files.back().size();
  }
  // Work items: ranges of at most 2^20 tokens of one file.
  struct Range {
    size_t file;
    int64_t begin, end;
  };
  constexpr int64_t kRange = int64_t{1} << 20;  // an 8 MiB buffer a thread
  std::vector<Range> ranges;
  for (size_t f = 0; f < files.size(); ++f)
    for (int64_t b = 0; b < files[f].size(); b += kRange) ranges.push_back({f, b, std::min(files[f].size(), b + kRange)});
  // The first bad token (smallest file, then index) found by any worker.
  std::mutex mu;
  size_t bad_file = files.size();
  int64_t bad_index = -1;
  int64_t bad_id = 0;
  std::atomic<size_t> next{0};
  std::atomic<int64_t> done{0};
  const uint32_t limit = static_cast<uint32_t>(std::min<int64_t>(vocab_size, std::numeric_limits<uint32_t>::max()));
  auto work = [&] {
    std::vector<int64_t> buffer;
    for (size_t r; (r = next.fetch_add(1)) < ranges.size();) {
      const auto& range = ranges[r];
      {
        std::lock_guard<std::mutex> lock(mu);
        if (bad_file < range.file || (bad_file == range.file && bad_index < range.begin && bad_index >= 0)) {
          done += range.end - range.begin;
          continue;  // an earlier bad token is already known
        }
      }
      buffer.resize(static_cast<size_t>(range.end - range.begin));
      files[range.file].read(range.begin, range.end - range.begin, buffer.data());
      int64_t hi = 0;
      int64_t lo = 0;
      for (int64_t v : buffer) hi = std::max(hi, v), lo = std::min(lo, v);
      if (hi >= static_cast<int64_t>(limit) || hi >= vocab_size || lo < 0) {  // (negative: signed Megatron dtypes)
        for (size_t i = 0; i < buffer.size(); ++i)
          if (buffer[i] >= vocab_size || buffer[i] < 0) {
            std::lock_guard<std::mutex> lock(mu);
            int64_t at = range.begin + static_cast<int64_t>(i);
            if (range.file < bad_file || (range.file == bad_file && at < bad_index))
              bad_file = range.file, bad_index = at, bad_id = buffer[i];
            break;
          }
      }
      done += range.end - range.begin;
    }
  };
  const int threads = static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency(), 1, 8));
  std::vector<std::thread> pool;
  for (int t = 0; t < std::min<int>(threads, static_cast<int>(ranges.size())); ++t) pool.emplace_back(work);
  const auto start = std::chrono::steady_clock::now();
  auto last = start;
  while (true) {
    bool finished = done.load() >= total;
    if (finished || pool.empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    auto now = std::chrono::steady_clock::now();
    if (progress && now - last > std::chrono::seconds(5)) {
      last = now;
      double s = std::chrono::duration<double>(now - start).count();
      std::fprintf(progress, "data check: %.1f%% of %lld tokens read (%.0f s, %.0fM tokens/s)\n",
                   100.0 * static_cast<double>(done.load()) / static_cast<double>(total),
                   static_cast<long long>(total), s, static_cast<double>(done.load()) / s / 1e6);
      std::fflush(progress);
    }
  }
  for (auto& t : pool) t.join();
  if (bad_file < files.size()) {
    std::ostringstream os;
    if (bad_id < 0)
      os << files[bad_file].path() << ": token " << bad_index << " (id " << bad_id << ") is negative; token ids are "
         << "0 .. model.vocab_size-1 (is this Megatron dataset's dtype right?)";
    else
      os << files[bad_file].path() << ": token " << bad_index << " (id " << bad_id << ") is not below model.vocab_size = "
         << vocab_size << "; was this file made with another tokenizer, or is model.vocab_size too small?";
    throw std::runtime_error(os.str());
  }
  return total;
}

}  // namespace carry
