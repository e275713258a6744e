// The general pieces of a tokenizer.json beyond the two hand-written pre-tokenizers (pretokenize.h):
// a Split pre-tokenizer's regular expression run by Oniguruma (the engine Hugging Face `tokenizers` uses,
// with its default syntax), and the NFC / NFKC normalizers by utf8proc. Both need the build to have found
// libonig-dev and libutf8proc-dev (CARRY_WITH_ONIG); without them the constructors throw saying so.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace carry {

// Whether this build runs general regexes and normalizers.
bool regex_split_available();

// A Split pre-tokenizer with behavior Isolated (invert false): every match is a piece, and so is every
// stretch between matches; the pieces concatenate to the text. A regex that matches the empty string
// there gives no piece (the search moves on one character). Text is UTF-8; bytes that are not valid
// UTF-8 are searched as Oniguruma sees them. Safe to call from several threads at once.
class RegexSplitter {
 public:
  // Throws std::runtime_error with Oniguruma's message when `pattern` does not compile.
  explicit RegexSplitter(const std::string& pattern);
  ~RegexSplitter();
  RegexSplitter(const RegexSplitter&) = delete;
  RegexSplitter& operator=(const RegexSplitter&) = delete;
  void split(std::string_view text, std::vector<std::string_view>* pieces) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

enum class Normalization { none, nfc, nfkc };

// `text` normalized (NFC or NFKC) where it is valid UTF-8; bytes that are not valid UTF-8 stay as they are.
std::string normalize_text(std::string_view text, Normalization form);

}  // namespace carry
