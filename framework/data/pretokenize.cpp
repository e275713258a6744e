// Pre-tokenization scanners (see pretokenize.h). The text is decoded into code points with their byte
// offsets once; each scanner then walks the alternatives of its regex in order at every position.
#include "framework/data/pretokenize.h"

#include <algorithm>
#include <stdexcept>

namespace carry {

namespace {

struct CodePointRange {
  char32_t first, last;
};

#include "framework/data/unicode_classes.inc"

template <size_t N>
bool in_ranges(const CodePointRange (&ranges)[N], char32_t c) {
  const CodePointRange* end = ranges + N;
  const CodePointRange* it = std::upper_bound(ranges, end, c, [](char32_t v, const CodePointRange& r) { return v < r.first; });
  return it != ranges && c <= (it - 1)->last;
}

constexpr char32_t kNotACharacter = 0xFFFFFFFF;  // an undecodable byte: no class

// UTF-8 -> code points and the byte offset where each starts (plus the end).
void decode_utf8(std::string_view s, std::vector<char32_t>* cps, std::vector<size_t>* offsets) {
  cps->clear();
  offsets->clear();
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    int len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    char32_t c = len == 1 ? b : len == 2 ? (b & 0x1F) : len == 3 ? (b & 0x0F) : (b & 0x07);
    bool ok = len > 0 && i + len <= s.size();
    for (int k = 1; ok && k < len; ++k) {
      const auto cb = static_cast<unsigned char>(s[i + k]);
      ok = (cb >> 6) == 2;
      c = (c << 6) | (cb & 0x3F);
    }
    // Overlong forms, surrogates and values past U+10FFFF are not valid UTF-8 either.
    if (ok && ((len == 2 && c < 0x80) || (len == 3 && c < 0x800) || (len == 4 && (c < 0x10000 || c > 0x10FFFF)) ||
               (c >= 0xD800 && c <= 0xDFFF)))
      ok = false;
    if (!ok) len = 1, c = kNotACharacter;
    cps->push_back(c);
    offsets->push_back(i);
    i += static_cast<size_t>(len);
  }
  offsets->push_back(s.size());
}

enum Class : unsigned char { kOther = 0, kLetter = 1, kNumber = 2, kSpace = 3 };

Class class_of(char32_t c) {
  if (c == kNotACharacter) return kOther;
  if (c < 0x80) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return kLetter;
    if (c >= '0' && c <= '9') return kNumber;
    if (c == ' ' || (c >= 0x09 && c <= 0x0D)) return kSpace;
    return kOther;
  }
  if (is_unicode_whitespace(c)) return kSpace;
  if (is_unicode_letter(c)) return kLetter;
  if (is_unicode_number(c)) return kNumber;
  return kOther;
}

// One scan over the code points: `match(i)` returns the end of the piece starting at i.
struct Scanner {
  const std::vector<char32_t>& cp;
  std::vector<Class> cls;
  size_t n;
  explicit Scanner(const std::vector<char32_t>& c) : cp(c), n(c.size()) {
    cls.reserve(n);
    for (char32_t x : c) cls.push_back(class_of(x));
  }
  bool is(size_t i, Class c) const { return i < n && cls[i] == c; }
  size_t run(size_t i, Class c) const {
    while (i < n && cls[i] == c) ++i;
    return i;
  }
  // 's 't 're 've 'm 'll 'd at i (case-insensitively when asked); 0 when none.
  size_t contraction(size_t i, bool any_case) const {
    if (i >= n || cp[i] != '\'' || i + 1 >= n) return 0;
    auto low = [&](size_t k) -> char32_t {
      if (k >= n) return 0;
      char32_t c = cp[k];
      return any_case && c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c;
    };
    const char32_t a = low(i + 1), b = low(i + 2);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
    return 0;
  }
  // \s+(?!\S) then \s+ at i (a whitespace run [i, k)).
  size_t whitespace(size_t i) const {
    const size_t k = run(i, kSpace);
    if (k == n || k - i >= 2) return k == n ? k : k - 1;  // leave the last space to the next piece
    return k;                                               // a single space before a non-space
  }

  size_t gpt2(size_t i) const {
    if (size_t e = contraction(i, false)) return e;
    const size_t j = cp[i] == ' ' ? i + 1 : i;  // " ?"
    if (is(j, kLetter)) return run(j, kLetter);
    if (is(j, kNumber)) return run(j, kNumber);
    if (is(j, kOther)) return run(j, kOther);
    return whitespace(i);
  }

  size_t cl100k(size_t i) const {
    if (size_t e = contraction(i, true)) return e;
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (cls[i] == kLetter) return run(i, kLetter);
    if (cp[i] != '\r' && cp[i] != '\n' && cls[i] != kNumber && is(i + 1, kLetter)) return run(i + 1, kLetter);
    // \p{N}{1,3}
    if (cls[i] == kNumber) {
      size_t e = i;
      while (e < n && e < i + 3 && cls[e] == kNumber) ++e;
      return e;
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n]*
    const size_t j = cp[i] == ' ' ? i + 1 : i;
    if (is(j, kOther)) {
      size_t e = run(j, kOther);
      while (e < n && (cp[e] == '\r' || cp[e] == '\n')) ++e;
      return e;
    }
    // \s*[\r\n]+ : through the last line break of the whitespace run
    const size_t k = run(i, kSpace);
    for (size_t p = k; p > i; --p)
      if (cp[p - 1] == '\r' || cp[p - 1] == '\n') return p;
    return whitespace(i);
  }
};

}  // namespace

bool is_unicode_letter(char32_t c) { return in_ranges(kLetterRanges, c); }
bool is_unicode_number(char32_t c) { return in_ranges(kNumberRanges, c); }
bool is_unicode_whitespace(char32_t c) {
  // Unicode's White_Space property.
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
         c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

const std::string& split_pattern_regex(SplitPattern p) {
  static const std::string gpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
  static const std::string cl100k =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  return p == SplitPattern::gpt2 ? gpt2 : cl100k;
}

SplitPattern split_pattern_by_name(const std::string& name) {
  if (name == "gpt2") return SplitPattern::gpt2;
  if (name == "cl100k" || name == "llama3") return SplitPattern::cl100k;
  throw std::invalid_argument("unknown pre-tokenizer pattern '" + name + "' (known: gpt2, cl100k = llama3)");
}

void pretokenize(std::string_view text, SplitPattern pattern, std::vector<std::string_view>* pieces) {
  pieces->clear();
  std::vector<char32_t> cps;
  std::vector<size_t> offsets;
  decode_utf8(text, &cps, &offsets);
  Scanner s(cps);
  for (size_t i = 0; i < s.n;) {
    size_t e = pattern == SplitPattern::gpt2 ? s.gpt2(i) : s.cl100k(i);
    if (e <= i) e = i + 1;  // (cannot happen: every class matches an alternative)
    pieces->push_back(text.substr(offsets[i], offsets[e] - offsets[i]));
    i = e;
  }
}

}  // namespace carry
