// Pre-tokenization of byte-level BPE tokenizers: the regular expressions that cut text into pieces
// before BPE merges bytes within each piece, written as hand-made scanners that give the pieces the
// regex would find (its leftmost alternative that matches at each position, as regex engines do):
//   gpt2    GPT-2 (and RoBERTa, GPT-J, ...: HF's ByteLevel pre-tokenizer with use_regex):
//           's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//   cl100k  tiktoken's cl100k_base, which Llama 3 uses too:
//           (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//           \s*[\r\n]+|\s+(?!\S)|\s+
// \p{L} and \p{N} are the Unicode letter and number categories (tables generated from the Unicode
// database: unicode_classes_gen.py), \s Unicode's White_Space. Text is UTF-8; a byte that does not
// start a valid UTF-8 sequence counts as one character of no class (like punctuation).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace carry {

enum class SplitPattern { gpt2, cl100k };

// The regex's text, as tokenizer.json files write it (to recognize a Split pre-tokenizer).
const std::string& split_pattern_regex(SplitPattern p);
// "gpt2" / "cl100k" (also "llama3") -> the pattern; throws std::invalid_argument listing them.
SplitPattern split_pattern_by_name(const std::string& name);

bool is_unicode_letter(char32_t c);
bool is_unicode_number(char32_t c);
bool is_unicode_whitespace(char32_t c);

// The pieces of `text` in order; they concatenate to `text`.
void pretokenize(std::string_view text, SplitPattern pattern, std::vector<std::string_view>* pieces);

}  // namespace carry
