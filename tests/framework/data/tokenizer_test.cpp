// Tests for framework/data/pretokenize.h, framework/data/tokenizer.h and `carry tokenize`:
// - the GPT-2 and cl100k/Llama 3 pre-tokenizers and a byte-level BPE tokenizer.json against pieces and
//   ids that Hugging Face's tokenizers library (0.23.3) gave for the same tokenizer.json and texts
//   (written by this test; the golden values were printed by that library, not by carry);
// - decode(encode(x)) == x for random bytes (byte-level BPE loses nothing);
// - a tiktoken rank file (merges implied by the ranks);
// - SentencePiece: a model trained through the library, files tokenized in parallel, each document
//   decoded back; the same token file whatever the thread count and the piece size;
// - the errors: unknown tokenizers, a normalizer, a missing end-of-document id.
#include "framework/data/pretokenize.h"
#include "framework/data/token_file.h"
#include "framework/data/tokenizer.h"
#include "framework/cli/tokenize_command.h"
#include "tests/helpers/temp_dir.h"

#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <random>

#include <unistd.h>

namespace carry {
namespace {

using testing::make_temp_dir;
using testing::remove_tree;

struct Golden {
  std::string text;
  std::vector<std::string> gpt2_pieces, cl100k_pieces;
  std::vector<uint32_t> ids;  // the same for both patterns with this tiny vocabulary
};

const std::vector<Golden>& golden() {
  static const std::vector<Golden> g = {
      {"the world and the wind",
       {"the", " world", " and", " the", " wind"},
       {"the", " world", " and", " the", " wind"},
       {116, 257, 268, 263, 258, 265, 259, 100}},
      {"Hello world's  123 !!\n\n  x",
       {"Hello", " world", "'s", " ", " 123", " !!", "\n\n ", " x"},
       {"Hello", " world", "'s", " ", " ", "123", " !!\n\n", " ", " x"},
       {72, 101, 108, 108, 111, 268, 39, 115, 32, 32, 271, 51, 32, 33, 33, 270, 32, 32, 120}},
      {"I'M here: they'll've, O'Neil's\r\n\r\ndone.",
       {"I", "'", "M", " here", ":", " they", "'ll", "'ve", ",", " O", "'", "Neil", "'s", "\r\n\r", "\n", "done", "."},
       {"I", "'M", " here", ":", " they", "'ll", "'ve", ",", " O", "'Neil", "'s", "\r\n\r\n", "done", "."},
       {73, 39, 77, 32, 257, 114, 101, 58, 258, 121, 39, 108, 108, 39, 118, 101, 44, 32,
        79, 39, 78, 101, 105, 108, 39, 115, 13, 10, 13, 10, 100, 111, 110, 101, 46}},
      {"caf\xc3\xa9 12345 \xc2\xbd \xd9\xa3\xd9\xa4 \xe6\xbc\xa2\xe5\xad\x97\xe3\x83\x86\xe3\x82\xb9\xe3\x83\x88",
       {"caf\xc3\xa9", " 12345", " \xc2\xbd", " \xd9\xa3\xd9\xa4",
        " \xe6\xbc\xa2\xe5\xad\x97\xe3\x83\x86\xe3\x82\xb9\xe3\x83\x88"},
       {"caf\xc3\xa9", " ", "123", "45", " ", "\xc2\xbd", " ", "\xd9\xa3\xd9\xa4",
        " \xe6\xbc\xa2\xe5\xad\x97\xe3\x83\x86\xe3\x82\xb9\xe3\x83\x88"},
       {99, 97, 102, 269, 32, 271, 51, 52, 53, 32, 194, 189, 32, 217, 163, 217, 164,
        32, 230, 188, 162, 229, 173, 151, 227, 131, 134, 227, 130, 185, 227, 131, 136}},
      {" \t leading and trailing  ",
       {" \t", " leading", " and", " trailing", "  "},
       {" \t", " leading", " and", " trailing", "  "},
       {32, 9, 32, 108, 101, 97, 100, 259, 103, 263, 256, 114, 97, 105, 108, 259, 103, 272}},
      {"tab\there\n\n\nand then",
       {"tab", "\t", "here", "\n\n", "\n", "and", " then"},
       {"tab", "\there", "\n\n\n", "and", " then"},
       {116, 97, 98, 9, 257, 114, 101, 270, 10, 97, 110, 100, 258, 110}},
      {"a1b2 c33d 9999 the  the",
       {"a", "1", "b", "2", " c", "33", "d", " 9999", " the", " ", " the"},
       {"a", "1", "b", "2", " c", "33", "d", " ", "999", "9", " the", " ", " the"},
       {97, 49, 98, 50, 32, 99, 51, 51, 100, 32, 57, 57, 57, 57, 258, 32, 258}},
  };
  return g;
}

std::vector<std::string> pieces_of(const std::string& text, SplitPattern p) {
  std::vector<std::string_view> v;
  pretokenize(text, p, &v);
  return {v.begin(), v.end()};
}

TEST(Pretokenize, MatchesTheRegexesPieces) {
  for (auto& g : golden()) {
    EXPECT_EQ(pieces_of(g.text, SplitPattern::gpt2), g.gpt2_pieces) << g.text;
    EXPECT_EQ(pieces_of(g.text, SplitPattern::cl100k), g.cl100k_pieces) << g.text;
  }
  EXPECT_TRUE(is_unicode_letter(U'\u00e9'));
  EXPECT_TRUE(is_unicode_letter(U'\u6f22'));
  EXPECT_TRUE(is_unicode_number(U'\u0663'));  // ARABIC-INDIC DIGIT THREE
  EXPECT_TRUE(is_unicode_number(U'\u00bd'));  // VULGAR FRACTION ONE HALF (No)
  EXPECT_FALSE(is_unicode_letter(U'\u2026'));
  EXPECT_TRUE(is_unicode_whitespace(U'\u3000'));
  // Pieces always cover the text, invalid UTF-8 included.
  std::mt19937 gen(5);
  for (int r = 0; r < 200; ++r) {
    std::string s(gen() % 40, ' ');
    for (auto& c : s) c = static_cast<char>(gen() % 256);
    for (auto p : {SplitPattern::gpt2, SplitPattern::cl100k}) {
      std::string joined;
      for (auto& piece : pieces_of(s, p)) joined += piece;
      ASSERT_EQ(joined, s);
    }
  }
}

// The tiny byte-level BPE: ids 0..255 the bytes in GPT-2's characters, then these merges in order,
// then <|endoftext|>.
std::string tiny_tokenizer_json(bool cl100k, const std::string& extra = "") {
  auto byte_char = [](int b) {
    std::vector<int> printable;
    int next = 256;
    for (int x = 0; x < 256; ++x) {
      bool p = (x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF);
      if (x == b) {
        int c = p ? x : next;
        std::string s;
        if (c < 0x80) s += static_cast<char>(c);
        else s += static_cast<char>(0xC0 | (c >> 6)), s += static_cast<char>(0x80 | (c & 0x3F));
        return s;
      }
      if (!p) ++next;
    }
    return std::string();
  };
  auto esc = [](const std::string& s) {
    std::string o;
    for (unsigned char c : s) {
      if (c == '"' || c == '\\') o += '\\', o += static_cast<char>(c);
      else if (c < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", c);
        o += buf;
      } else o += static_cast<char>(c);
    }
    return o;
  };
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"\xc4\xa0", "t"}, {"h", "e"}, {"\xc4\xa0t", "he"}, {"i", "n"}, {"\xc4\xa0", "a"}, {"e", "r"},
      {"\xc4\xa0" "a", "n"}, {"\xc4\xa0" "an", "d"}, {"o", "r"}, {"\xc4\xa0", "w"}, {"\xc4\xa0w", "or"},
      {"l", "d"}, {"\xc4\xa0wor", "ld"}, {"\xc3\x83", "\xc2\xa9"}, {"\xc4\x8a", "\xc4\x8a"}, {"1", "2"},
      {"\xc4\xa0", "\xc4\xa0"}};
  std::string vocab, merge_list;
  int id = 0;
  for (int b = 0; b < 256; ++b) vocab += (b ? "," : "") + std::string("\"") + esc(byte_char(b)) + "\":" + std::to_string(id++);
  for (auto& [a, b] : merges) {
    vocab += ",\"" + esc(a + b) + "\":" + std::to_string(id++);
    merge_list += std::string(merge_list.empty() ? "" : ",") + "\"" + esc(a) + " " + esc(b) + "\"";
  }
  const std::string pre =
      cl100k ? "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":\"" +
                   esc(split_pattern_regex(SplitPattern::cl100k)) +
                   "\"},\"behavior\":\"Isolated\",\"invert\":false},{\"type\":\"ByteLevel\",\"add_prefix_space\":false,"
                   "\"use_regex\":false}]}"
             : "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,\"use_regex\":true}";
  return "{\"version\":\"1.0\",\"added_tokens\":[{\"id\":" + std::to_string(id) +
         ",\"content\":\"<|endoftext|>\",\"special\":true}],\"normalizer\":null,\"pre_tokenizer\":" + pre + extra +
         ",\"model\":{\"type\":\"BPE\",\"vocab\":{" + vocab + "},\"merges\":[" + merge_list + "]}}";
}

class TokenizerFiles : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = make_temp_dir("carry_tokenizer_test"); }
  void TearDown() override { remove_tree(dir_); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(dir_ + "/" + name, std::ios::binary) << text;
    return dir_ + "/" + name;
  }
  static std::string read(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  static int tokenize(std::vector<std::string> args) {
    args.insert(args.begin(), "tokenize");
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    return run_tokenize_command(static_cast<int>(argv.size()), argv.data());
  }
  static std::vector<uint32_t> tokens_of(const std::string& path) {
    TokenFile f(path);
    std::vector<uint32_t> t;
    for (int64_t i = 0; i < f.size(); ++i) t.push_back(f.at(i));
    return t;
  }
  static std::string error_of(const std::string& spec, int64_t eod = -1) {
    try {
      load_tokenizer(spec, eod);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "(no error)";
  }
  std::string dir_;
};

TEST_F(TokenizerFiles, ByteLevelBpeMatchesHuggingFace) {
  for (bool cl100k : {false, true}) {
    auto t = load_tokenizer("bpe:" + write("tokenizer.json", tiny_tokenizer_json(cl100k)));
    EXPECT_EQ(t->vocab_size(), 256 + 17 + 1);
    EXPECT_EQ(t->end_of_document(), 273u);
    for (auto& g : golden()) {
      std::vector<uint32_t> ids;
      t->encode(g.text, &ids);
      EXPECT_EQ(ids, g.ids) << (cl100k ? "cl100k: " : "gpt2: ") << g.text;
      EXPECT_EQ(t->decode(ids), g.text);
    }
    // Nothing is lost, whatever the bytes.
    std::mt19937 gen(11);
    for (int r = 0; r < 100; ++r) {
      std::string s(gen() % 300, ' ');
      for (auto& c : s) c = static_cast<char>(gen() % 4 == 0 ? gen() % 256 : "the world and\n 12"[gen() % 17]);
      std::vector<uint32_t> ids;
      t->encode(s, &ids);
      ASSERT_EQ(t->decode(ids), s);
    }
  }
}

// The byte tokenizer as a Hugging Face tokenizer.json: read back by `bpe:` it encodes every string as the byte
// tokenizer does (ids = bytes, end of document 256); a bpe: tokenizer comes back as its own file with its
// end-of-document token's text; SentencePiece and tiktoken are refused with what is written.
TEST_F(TokenizerFiles, HuggingFaceFilesOfTheByteAndBpeTokenizers) {
  HfTokenizer h = hf_tokenizer("byte");
  EXPECT_EQ(h.eos_id, 256);
  EXPECT_EQ(h.eos_token, "<|endoftext|>");
  auto back = load_tokenizer("bpe:" + write("byte.json", h.tokenizer_json));
  auto bytes = load_tokenizer("byte");
  EXPECT_EQ(back->end_of_document(), 256u);
  EXPECT_EQ(back->vocab_size(), 257);
  std::mt19937 gen(5);
  for (int r = 0; r < 50; ++r) {
    std::string s(gen() % 200, ' ');
    for (auto& c : s) c = static_cast<char>(gen() % 3 == 0 ? gen() % 256 : "héllo wörld 12\n"[gen() % 15]);
    std::vector<uint32_t> a, b;
    back->encode(s, &a);
    bytes->encode(s, &b);
    ASSERT_EQ(a, b);
    ASSERT_EQ(back->decode(a), s);
  }
  const std::string json = tiny_tokenizer_json(false);
  HfTokenizer bpe = hf_tokenizer("bpe:" + write("tiny.json", json));
  EXPECT_EQ(bpe.tokenizer_json, json);
  EXPECT_EQ(bpe.eos_id, 273);
  EXPECT_EQ(bpe.eos_token, "<|endoftext|>");
  try {
    hf_tokenizer("tiktoken:ranks.tiktoken");
    ADD_FAILURE() << "tiktoken accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("only byte, bpe:FILE and sentencepiece:FILE tokenizers are written as"),
              std::string::npos)
        << e.what();
  }
  // A file that is not a SentencePiece model (a field that runs past its end), named with what is wrong.
  const std::string bad = write("bad.model", std::string("\x0a\xff\x01xy", 5));
  try {
    hf_tokenizer("sentencepiece:" + bad);
    ADD_FAILURE() << "a broken model accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(bad + ": not a SentencePiece model file (a field of 255 bytes runs past the end"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(TokenizerFiles, TiktokenRanksImplyTheMerges) {
  // Ranks: the 256 bytes, then "th" (256), "the" (257), " the" (258), "he" (259, after "th": so
  // "the" goes t+h first).
  std::string text;
  auto b64 = [](const std::string& s) {
    static const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string o;
    size_t i = 0;
    for (; i + 2 < s.size(); i += 3) {
      uint32_t v = (uint8_t(s[i]) << 16) | (uint8_t(s[i + 1]) << 8) | uint8_t(s[i + 2]);
      o += a[v >> 18], o += a[(v >> 12) & 63], o += a[(v >> 6) & 63], o += a[v & 63];
    }
    if (s.size() - i == 1) {
      uint32_t v = uint8_t(s[i]) << 16;
      o += a[v >> 18], o += a[(v >> 12) & 63], o += "==";
    } else if (s.size() - i == 2) {
      uint32_t v = (uint8_t(s[i]) << 16) | (uint8_t(s[i + 1]) << 8);
      o += a[v >> 18], o += a[(v >> 12) & 63], o += a[(v >> 6) & 63], o += "=";
    }
    return o;
  };
  for (int b = 0; b < 256; ++b) text += b64(std::string(1, static_cast<char>(b))) + " " + std::to_string(b) + "\n";
  int rank = 256;
  for (const char* t : {"th", "the", " the", "he"}) text += b64(t) + " " + std::to_string(rank++) + "\n";
  auto path = write("tiny.tiktoken", text);
  EXPECT_NE(error_of("tiktoken:" + path).find("give the end-of-document id with --eod-id"), std::string::npos);
  auto t = load_tokenizer("tiktoken:" + path, 300);
  EXPECT_EQ(t->vocab_size(), 301);
  std::vector<uint32_t> ids;
  t->encode("the then he", &ids);
  // "the" -> t,h -> th (256) + e -> the (257); " then" -> " " t h e n: th, the, " the" (258), n; " he" -> " ", he.
  EXPECT_EQ(ids, (std::vector<uint32_t>{257, 258, 'n', ' ', 259}));
  EXPECT_EQ(t->decode(ids), "the then he");
}

TEST_F(TokenizerFiles, ErrorsSayWhatIsSupported) {
  EXPECT_NE(error_of("wordpiece:x").find("unknown tokenizer kind 'wordpiece'"), std::string::npos);
  EXPECT_NE(error_of("bpe:" + dir_ + "/missing.json").find("missing.json: cannot open"), std::string::npos);
  std::string json = tiny_tokenizer_json(false);
  json.replace(json.find("\"normalizer\":null"), 17, "\"normalizer\":{\"type\":\"NFD\"}");
  auto msg = error_of("bpe:" + write("nfd.json", json));
  EXPECT_NE(msg.find("has a normalizer (NFD), which carry does not apply; supported: none, NFC, NFKC"), std::string::npos)
      << msg;
  json = tiny_tokenizer_json(false);
  json.replace(json.find("<|endoftext|>"), 13, "<|other|>");
  msg = error_of("bpe:" + write("noeod.json", json));
  EXPECT_NE(msg.find("no end-of-document token"), std::string::npos) << msg;
  EXPECT_EQ(load_tokenizer("bpe:" + dir_ + "/noeod.json", 5)->end_of_document(), 5u);
  json = tiny_tokenizer_json(false);
  json.replace(json.find("\"use_regex\":true"), 16, "\"use_regex\":false");
  msg = error_of("bpe:" + write("noregex.json", json));
  EXPECT_NE(msg.find("pre_tokenizer: ByteLevel without its regex"), std::string::npos) << msg;
  // A garbage tiktoken file: its line is quoted with control bytes escaped, on one line.
  msg = error_of("tiktoken:" + write("garbage.tiktoken", std::string("\x1b[31m\x07" "bad\rline 3\n")), 5);
  EXPECT_NE(msg.find("garbage.tiktoken:1: expected \"<base64 bytes> <rank>\", got '"), std::string::npos) << msg;
  for (char c : msg) EXPECT_TRUE(c >= 0x20 || c == '\n') << "a control byte " << int(c) << " in: " << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  // An --eod-id past the BPE's tokens widens its vocabulary to hold it, and the token file to 4 bytes.
  EXPECT_EQ(load_tokenizer("bpe:" + dir_ + "/noeod.json", 70000)->vocab_size(), 70001);
  ASSERT_EQ(tokenize({"--tokenizer", "bpe:" + dir_ + "/noeod.json", "--eod-id", "70000", "--input",
                      write("doc.txt", "hello world\n"), "--output", dir_ + "/wide.tok"}),
            0);
  TokenFile wide(dir_ + "/wide.tok");
  EXPECT_EQ(wide.width(), 4);
  ASSERT_GT(wide.size(), 1);
  EXPECT_EQ(wide.at(0), 70000u);
}

// Many files of repeated lines, tokenized with 1 thread and whole pieces, and with 3 threads and
// 1000-byte pieces: the same tokens, an end-of-document before each file, each file decoding back.
TEST_F(TokenizerFiles, ParallelPiecesGiveTheSameTokens) {
  auto json = write("tokenizer.json", tiny_tokenizer_json(true));
  std::vector<std::string> files, texts;
  std::mt19937 gen(3);
  const char* words[] = {"the", "world", "and", "wind", "Hello", "12", "caf\xc3\xa9", "!!", "'s"};
  for (int f = 0; f < 9; ++f) {
    std::string text;
    for (int line = 0; line < 40 + 30 * f; ++line) {
      for (int w = 0; w < 8; ++w) text += std::string(w ? " " : "") + words[gen() % 9];
      text += line % 7 == 3 ? "\n\n" : "\n";
    }
    texts.push_back(text);
    files.push_back(write("doc" + std::to_string(f) + ".txt", text));
  }
  auto run = [&](const std::string& out, std::vector<std::string> extra) {
    std::vector<std::string> args{"--tokenizer", "bpe:" + json, "--output", out, "--input"};
    args.insert(args.end(), files.begin(), files.end());
    args.insert(args.end(), extra.begin(), extra.end());
    EXPECT_EQ(tokenize(args), 0);
    return tokens_of(out);
  };
  auto one = run(dir_ + "/one.tok", {"--threads", "1"});
  auto many = run(dir_ + "/many.tok", {"--threads", "3", "--piece-bytes", "1000"});
  EXPECT_EQ(one, many);
  auto t = load_tokenizer("bpe:" + json);
  std::vector<uint32_t> expected;
  for (auto& text : texts) {
    expected.push_back(t->end_of_document());
    t->encode(text, &expected);
  }
  EXPECT_EQ(one, expected);
}

TEST_F(TokenizerFiles, SentencePieceTrainsAndTokenizes) {
  if (!sentencepiece_available()) GTEST_SKIP() << "this build has no SentencePiece (libsentencepiece-dev)";
  std::string corpus;
  std::mt19937 gen(8);
  const char* words[] = {"alpha", "beta", "gamma", "delta", "carry", "state", "scan", "token", "file", "rank"};
  for (int line = 0; line < 2000; ++line) {
    for (int w = 0; w < 6; ++w) corpus += std::string(w ? " " : "") + words[gen() % 10];
    corpus += "\n";
  }
  auto input = write("corpus.txt", corpus);
  // A link where the library would write PREFIX.model is refused before training; its target keeps its bytes.
  auto victim = write("victim", "precious\n");
  ASSERT_EQ(::symlink(victim.c_str(), (dir_ + "/linked.model").c_str()), 0);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(tokenize({"--train-sentencepiece", dir_ + "/linked", "--vocab-size", "40", "--input", input}), 1);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("carry tokenize: --train-sentencepiece: " + dir_ + "/linked.model is a symbolic link; carry "
                     "writes no file through a link"), std::string::npos) << err;
  EXPECT_EQ(read(victim), "precious\n");
  ASSERT_EQ(tokenize({"--train-sentencepiece", dir_ + "/spm", "--vocab-size", "40", "--input", input}), 0);
  auto a = write("a.txt", "alpha beta gamma\n"), b = write("b.txt", "carry state scan token\nfile rank\n");
  ASSERT_EQ(tokenize({"--tokenizer", "sentencepiece:" + dir_ + "/spm.model", "--input", a, b, a, "--output",
                      dir_ + "/out.tok", "--threads", "2"}),
            0);
  auto t = load_tokenizer("sentencepiece:" + dir_ + "/spm.model");
  EXPECT_EQ(t->vocab_size(), 40);
  EXPECT_EQ(t->end_of_document(), 2u);  // </s>
  auto tokens = tokens_of(dir_ + "/out.tok");
  // Three documents, each after an end-of-document token, each decoding to its text (SentencePiece
  // keeps the words; line breaks are whitespace to it).
  std::vector<std::vector<uint32_t>> docs;
  for (auto id : tokens) {
    if (id == 2) docs.emplace_back();
    else docs.back().push_back(id);
  }
  ASSERT_EQ(docs.size(), 3u);
  EXPECT_EQ(t->decode(docs[0]), "alpha beta gamma");
  EXPECT_EQ(t->decode(docs[1]), "carry state scan token file rank");
  EXPECT_EQ(docs[2], docs[0]);
  EXPECT_LT(docs[0].size(), 17u) << "subword tokens, not bytes";
  auto msg = error_of("sentencepiece:" + dir_ + "/missing.model");
  EXPECT_NE(msg.find("missing.model: cannot load the SentencePiece model: No such file or directory"), std::string::npos)
      << msg;
  // A garbage model and a vocabulary too large for the text: the reason, without the library's source
  // location ("Internal: ./src/....cc(N) [...]").
  auto garbage = write("garbage.model", std::string("\x01\x02not a model\xff\n"));
  msg = error_of("sentencepiece:" + garbage);
  EXPECT_NE(msg.find("garbage.model: cannot load the SentencePiece model: not a SentencePiece model file"),
            std::string::npos) << msg;
  EXPECT_EQ(msg.find(".cc("), std::string::npos) << msg;
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(tokenize({"--train-sentencepiece", dir_ + "/big", "--vocab-size", "5000", "--input", input}), 1);
  msg = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(msg.find("carry tokenize: SentencePiece training failed: Vocabulary size too high (5000)"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("(give a smaller --vocab-size, or more text)"), std::string::npos) << msg;
  EXPECT_EQ(msg.find(".cc("), std::string::npos) << msg;
}

}  // namespace
}  // namespace carry
