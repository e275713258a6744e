// Tests of framework/data/regex_split.*: Oniguruma runs GPT-2's and cl100k's regexes (as tokenizer.json files
// write them) to the same pieces as the hand-written scanners of pretokenize.h, on random text of letters,
// digits, punctuation, spaces, newlines, multi-byte characters and invalid bytes (the fast paths checked
// against the general one); Split's Isolated behavior keeps the stretches between matches; NFC composes,
// NFKC folds compatibility characters, invalid bytes pass through; a regex that does not compile names
// itself. Skipped in builds without Oniguruma and utf8proc.
#include "framework/data/pretokenize.h"
#include "framework/data/regex_split.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace carry {
namespace {

std::vector<std::string> pieces_of(const RegexSplitter& r, const std::string& text) {
  std::vector<std::string_view> v;
  r.split(text, &v);
  return std::vector<std::string>(v.begin(), v.end());
}

std::string random_text(std::mt19937& gen, bool invalid) {
  static const std::vector<std::string> parts = {"a", "Z", "é", "ß", "Ω", "中", "文", "😀", "1", "23", "٣", " ", "  ",
                                                 "\n", "\r\n", "\t", "'s", "'LL", "'t", ".", ",", "!?", "-", "$", "__",
                                                 " the", "World", "\u00a0", "\u3000"};
  std::string s;
  const int n = gen() % 60;
  for (int i = 0; i < n; ++i) {
    if (invalid && gen() % 17 == 0) s += static_cast<char>(0x80 + gen() % 0x40);  // a stray continuation byte
    else s += parts[gen() % parts.size()];
  }
  return s;
}

TEST(RegexSplit, HandWrittenScannersEqualOniguruma) {
  if (!regex_split_available()) GTEST_SKIP() << "built without Oniguruma and utf8proc";
  for (auto p : {SplitPattern::gpt2, SplitPattern::cl100k}) {
    RegexSplitter general(split_pattern_regex(p));
    std::mt19937 gen(p == SplitPattern::gpt2 ? 3 : 4);
    for (int r = 0; r < 2000; ++r) {
      const std::string text = random_text(gen, false);
      std::vector<std::string_view> fast;
      pretokenize(text, p, &fast);
      ASSERT_EQ(std::vector<std::string>(fast.begin(), fast.end()), pieces_of(general, text))
          << (p == SplitPattern::gpt2 ? "gpt2" : "cl100k") << " on '" << text << "'";
    }
  }
}

TEST(RegexSplit, IsolatedKeepsEveryByte) {
  if (!regex_split_available()) GTEST_SKIP() << "built without Oniguruma and utf8proc";
  RegexSplitter digits("\\p{N}");
  EXPECT_EQ(pieces_of(digits, "ab12c3"), (std::vector<std::string>{"ab", "1", "2", "c", "3"}));
  RegexSplitter empty("x*");  // matches the empty string between the x's: no empty pieces
  EXPECT_EQ(pieces_of(empty, "axxb"), (std::vector<std::string>{"a", "xx", "b"}));
  std::mt19937 gen(9);
  RegexSplitter qwen("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
                     "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+");
  for (int r = 0; r < 500; ++r) {
    const std::string text = random_text(gen, true);
    std::string joined;
    for (auto& p : pieces_of(qwen, text)) {
      EXPECT_FALSE(p.empty());
      joined += p;
    }
    ASSERT_EQ(joined, text);
  }
  try {
    RegexSplitter bad("(unclosed");
    ADD_FAILURE() << "a bad regex compiled";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("the regex (unclosed does not compile"), std::string::npos) << e.what();
  }
}

TEST(RegexSplit, Normalizations) {
  if (!regex_split_available()) GTEST_SKIP() << "built without Oniguruma and utf8proc";
  EXPECT_EQ(normalize_text("e\xcc\x81t\xc3\xa9", Normalization::nfc), "\xc3\xa9t\xc3\xa9");  // e + U+0301 -> é
  EXPECT_EQ(normalize_text("\xef\xac\x81", Normalization::nfc), "\xef\xac\x81");             // ﬁ stays under NFC
  EXPECT_EQ(normalize_text("\xef\xac\x81", Normalization::nfkc), "fi");                        // and folds under NFKC
  EXPECT_EQ(normalize_text(std::string("a\xff" "e\xcc\x81", 5), Normalization::nfc), std::string("a\xff\xc3\xa9", 4));
  EXPECT_EQ(normalize_text(std::string("a\0b", 3), Normalization::nfc), std::string("a\0b", 3));
  EXPECT_EQ(normalize_text("", Normalization::nfkc), "");
}

}  // namespace
}  // namespace carry
