// Oniguruma splits and utf8proc normalizations for tokenizer.json files (regex_split.h).
#include "framework/data/regex_split.h"

#include <algorithm>
#include <stdexcept>

#ifdef CARRY_WITH_ONIG
#include <oniguruma.h>
#include <utf8proc.h>

#include <cstdlib>
#include <mutex>
#endif

namespace carry {

#ifdef CARRY_WITH_ONIG

bool regex_split_available() { return true; }

struct RegexSplitter::Impl {
  OnigRegex reg = nullptr;
};

RegexSplitter::RegexSplitter(const std::string& pattern) : impl_(std::make_unique<Impl>()) {
  static std::once_flag once;
  std::call_once(once, [] {
    OnigEncoding encodings[] = {ONIG_ENCODING_UTF8};
    onig_initialize(encodings, 1);
  });
  OnigErrorInfo info;
  const auto* p = reinterpret_cast<const OnigUChar*>(pattern.data());
  const int r = onig_new(&impl_->reg, p, p + pattern.size(), ONIG_OPTION_NONE, ONIG_ENCODING_UTF8, ONIG_SYNTAX_DEFAULT,
                         &info);
  if (r != ONIG_NORMAL) {
    OnigUChar msg[ONIG_MAX_ERROR_MESSAGE_LEN];
    onig_error_code_to_str(msg, r, &info);
    throw std::runtime_error("the regex " + pattern + " does not compile: " + reinterpret_cast<char*>(msg));
  }
}

RegexSplitter::~RegexSplitter() {
  if (impl_ && impl_->reg) onig_free(impl_->reg);
}

void RegexSplitter::split(std::string_view text, std::vector<std::string_view>* pieces) const {
  const auto* begin = reinterpret_cast<const OnigUChar*>(text.data());
  const auto* end = begin + text.size();
  OnigRegion* region = onig_region_new();
  size_t prev = 0, at = 0;
  while (at <= text.size()) {
    const int r = onig_search(impl_->reg, begin, end, begin + at, end, region, ONIG_OPTION_NONE);
    if (r == ONIG_MISMATCH) break;
    if (r < 0) {
      onig_region_free(region, 1);
      throw std::runtime_error("regex search failed (Oniguruma code " + std::to_string(r) + ")");
    }
    const size_t s = static_cast<size_t>(region->beg[0]), e = static_cast<size_t>(region->end[0]);
    if (e == s) {  // an empty match: no piece; search again one character on
      if (s >= text.size()) break;
      const unsigned char b = begin[s];
      const size_t len = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 1;  // the character's bytes (1 if invalid)
      at = std::min(text.size(), s + len);
      continue;
    }
    if (s > prev) pieces->push_back(text.substr(prev, s - prev));
    pieces->push_back(text.substr(s, e - s));
    prev = at = e;
  }
  if (prev < text.size()) pieces->push_back(text.substr(prev));
  onig_region_free(region, 1);
}

std::string normalize_text(std::string_view text, Normalization form) {
  if (form == Normalization::none || text.empty()) return std::string(text);
  const auto options = static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE |
                                                      (form == Normalization::nfkc ? UTF8PROC_COMPAT : 0));
  std::string out;
  auto map = [&](size_t a, size_t b) {  // a valid UTF-8 run
    if (b <= a) return;
    utf8proc_uint8_t* dst = nullptr;
    const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data() + a),
                                static_cast<utf8proc_ssize_t>(b - a), &dst, options);
    if (n < 0) {
      out.append(text.substr(a, b - a));
    } else {
      out.append(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
    }
    std::free(dst);
  };
  size_t run = 0, i = 0;
  while (i < text.size()) {
    utf8proc_int32_t c;
    const auto n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(text.data() + i),
                                    static_cast<utf8proc_ssize_t>(text.size() - i), &c);
    if (n > 0 && c != 0) {
      i += static_cast<size_t>(n);
      continue;
    }
    // An invalid byte (or a NUL, which utf8proc's map would end at): kept as it is.
    map(run, i);
    out.push_back(text[i]);
    run = ++i;
  }
  map(run, text.size());
  return out;
}

#else

bool regex_split_available() { return false; }

struct RegexSplitter::Impl {};

RegexSplitter::RegexSplitter(const std::string& pattern) {
  throw std::runtime_error("the regex " + pattern + " needs Oniguruma, which this build lacks (install "
                           "libonig-dev and libutf8proc-dev and rebuild: launcher/setup does)");
}
RegexSplitter::~RegexSplitter() = default;
void RegexSplitter::split(std::string_view, std::vector<std::string_view>*) const {}

std::string normalize_text(std::string_view text, Normalization form) {
  if (form == Normalization::none) return std::string(text);
  throw std::runtime_error("Unicode normalization needs utf8proc, which this build lacks (install libonig-dev and "
                           "libutf8proc-dev and rebuild: launcher/setup does)");
}

#endif

}  // namespace carry
