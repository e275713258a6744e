// Tests for framework/data/token_file.h and `carry tokenize`: round trips in both widths, the errors for
// truncated, padded, bad-magic, bad-version and bad-width files (each naming the path), llm.c .bin
// files (GPT-2 uint16 and Llama 3 uint32), Megatron .bin/.idx datasets (written here byte for byte as
// Megatron-LM's IndexedDatasetBuilder writes them) and raw uint16/uint32 arrays, read back token for
// token, with their errors; atomic writing through no planted link, a FIFO refused, and the byte-level
// tokenizer.
#include "framework/data/token_file.h"
#include "framework/data/token_dataset.h"
#include "framework/cli/tokenize_command.h"

#include "tests/helpers/temp_dir.h"

#include <gtest/gtest.h>
#include <dirent.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <random>

namespace carry {
namespace {

using testing::exists;
using testing::make_dirs;
using testing::make_temp_dir;
using testing::remove_tree;

int64_t file_size(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

int count_entries(const std::string& dir) {
  int n = 0;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (auto* e = ::readdir(d)) n += std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..");
    ::closedir(d);
  }
  return n;
}

class TokenFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = make_temp_dir("carry_token_test");
  }
  void TearDown() override { remove_tree(dir_); }
  std::string path(const std::string& name) { return dir_ + "/" + name; }

  static std::string bytes_of(const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  static void write_bytes(const std::string& p, const std::string& b) {
    std::ofstream(p, std::ios::binary) << b;
  }
  // The message of the error that opening `p` throws.
  static std::string open_error(const std::string& p) {
    try {
      TokenFile f(p);
    } catch (const std::runtime_error& e) {
      return e.what();
    }
    ADD_FAILURE() << "opening " << p << " did not throw";
    return "";
  }

  std::string dir_;
};

std::vector<uint32_t> random_tokens(size_t n, uint32_t bound, unsigned seed) {
  std::mt19937 gen(seed);
  std::vector<uint32_t> t(n);
  for (auto& x : t) x = gen() % bound;
  return t;
}

TEST_F(TokenFileTest, RoundTripBothWidths) {
  for (int width : {2, 4}) {
    auto tokens = random_tokens(1001, width == 2 ? 65536u : 4000000000u, width);
    tokens[0] = width == 2 ? 65535u : 4294967295u;  // the largest id of the width
    auto p = path("w" + std::to_string(width) + ".tok");
    write_token_file(p, tokens);  // width chosen automatically
    EXPECT_EQ(file_size(p), static_cast<int64_t>(24 + tokens.size() * width));
    TokenFile f(p);
    EXPECT_EQ(f.format(), TokenFileFormat::carry);
    EXPECT_EQ(f.width(), width);
    ASSERT_EQ(f.size(), static_cast<int64_t>(tokens.size()));
    for (size_t i = 0; i < tokens.size(); ++i) ASSERT_EQ(f.at(i), tokens[i]) << i;
    std::vector<int64_t> out(100);
    f.read(900, 100, out.data());
    for (int i = 0; i < 100; ++i) EXPECT_EQ(out[i], static_cast<int64_t>(tokens[900 + i]));
    auto t = f.read_tensor(5, 3);
    EXPECT_EQ(t.scalar_type(), at::kLong);
    EXPECT_EQ(t[2].item<int64_t>(), static_cast<int64_t>(tokens[7]));
    EXPECT_THROW(f.at(1001), std::runtime_error);
    EXPECT_THROW(f.read(1000, 2, out.data()), std::runtime_error);
    // Moving keeps the mapping alive.
    TokenFile g = std::move(f);
    EXPECT_EQ(g.at(1000), tokens[1000]);
  }
  // An explicit 4-byte width for small ids, and an empty file.
  write_token_file(path("small4.tok"), {1, 2, 3}, 4);
  EXPECT_EQ(TokenFile(path("small4.tok")).width(), 4);
  write_token_file(path("empty.tok"), {});
  EXPECT_EQ(TokenFile(path("empty.tok")).size(), 0);
}

TEST_F(TokenFileTest, HeaderLayoutIsAsDocumented) {
  write_token_file(path("a.tok"), {0x0102, 0x0304});
  auto b = bytes_of(path("a.tok"));
  ASSERT_EQ(b.size(), 28u);
  EXPECT_EQ(b.substr(0, 8), "CARRYTOK");
  EXPECT_EQ(b.substr(8, 4), std::string("\x01\0\0\0", 4));
  EXPECT_EQ(b.substr(12, 4), std::string("\x02\0\0\0", 4));
  EXPECT_EQ(b.substr(16, 8), std::string("\x02\0\0\0\0\0\0\0", 8));
  EXPECT_EQ(b.substr(24), std::string("\x02\x01\x04\x03", 4));
}

TEST_F(TokenFileTest, ErrorsNameThePath) {
  auto p = path("t.tok");
  write_token_file(p, {1, 2, 3, 4, 5});
  auto good = bytes_of(p);

  write_bytes(p, good.substr(0, good.size() - 1));
  EXPECT_EQ(open_error(p), p + ": truncated: the CARRYTOK header announces 5 tokens of 2 bytes (34 bytes with the "
                               "header), but the file has 33 bytes");
  write_bytes(p, good + "xy");
  EXPECT_EQ(open_error(p), p + ": the CARRYTOK header announces 5 tokens of 2 bytes (34 bytes with the header), but "
                               "the file has 36 bytes (2 extra)");
  write_bytes(p, good.substr(0, 20));
  EXPECT_EQ(open_error(p), p + ": truncated: 20 bytes, shorter than the CARRYTOK header (24 bytes)");

  auto bad = good;
  bad[0] = 'X';
  write_bytes(p, bad);
  EXPECT_EQ(open_error(p), p + ": not a token file: it starts with bytes 58 41 52 52 59 54 4f 4b, expected the magic "
                               "\"CARRYTOK\", an llm.c .bin header (int32 20240520 or 20240801) or a Megatron .bin "
                               "with its .idx beside it; a raw token array is named \"uint16:" + p + "\" or \"uint32:" +
                               p + "\"");
  bad = good;
  bad[8] = 2;
  write_bytes(p, bad);
  EXPECT_EQ(open_error(p), p + ": unsupported CARRYTOK version 2 (this build reads version 1)");
  bad = good;
  bad[12] = 3;
  write_bytes(p, bad);
  EXPECT_EQ(open_error(p), p + ": unsupported token width 3 bytes (expected 2 or 4)");

  write_bytes(p, "");
  EXPECT_NE(open_error(p).find(p + ": not a token file: 0 bytes"), std::string::npos);
  auto missing = path("missing.tok");
  EXPECT_EQ(open_error(missing), missing + ": cannot open token file: No such file or directory");

  try {
    write_token_file(p, {1, 70000}, 2);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), p + ": token 70000 (at index 1) does not fit a 2-byte token file");
  }
}

TEST_F(TokenFileTest, WriterIsAtomic) {
  auto p = path("atomic.tok");
  {
    TokenFileWriter w(p, 2);
    w.append(7);
    EXPECT_FALSE(exists(p));  // only the temporary exists until commit
  }
  EXPECT_FALSE(exists(p));
  EXPECT_TRUE(count_entries(dir_) == 0);  // the temporary was removed
  TokenFileWriter w(p, 2);
  std::vector<uint32_t> t = {3, 1, 4, 1, 5};
  w.append(t.data(), t.size());
  w.commit();
  EXPECT_EQ(TokenFile(p).size(), 5);
  EXPECT_EQ(count_entries(dir_), 1);
}

// A symbolic link planted at the writer's temporary name (its pid is easy to guess) is removed, not
// followed: the link's target keeps its bytes. A FIFO named as a token file is refused at once.
TEST_F(TokenFileTest, WriterFollowsNoLinkAndReaderWaitsOnNoFifo) {
  const std::string p = path("out.tok"), victim = path("victim");
  write_bytes(victim, "precious\n");
  ASSERT_EQ(::symlink(victim.c_str(), (p + ".tmp." + std::to_string(::getpid())).c_str()), 0);
  std::vector<uint32_t> t = {3, 1, 4};
  write_token_file(p, t, 2);
  EXPECT_EQ(bytes_of(victim), "precious\n");
  EXPECT_EQ(TokenFile(p).size(), 3);
  EXPECT_EQ(count_entries(dir_), 2);  // out.tok and the victim: the link went with the temporary
  const std::string fifo = path("fifo.tok");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  EXPECT_EQ(open_error(fifo), fifo + ": is not a regular file (a token file is read by offset)");
}

// llm.c's data_common.write_datafile: 256 int32 header [magic, version, count, 0...], then tokens.
std::string llmc_file(int32_t magic, int32_t version, int32_t count, const std::vector<uint32_t>& tokens, int width) {
  std::vector<int32_t> header(256, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = count;
  std::string b(reinterpret_cast<const char*>(header.data()), 1024);
  for (auto t : tokens) {
    if (width == 2) {
      auto v = static_cast<uint16_t>(t);
      b.append(reinterpret_cast<const char*>(&v), 2);
    } else {
      b.append(reinterpret_cast<const char*>(&t), 4);
    }
  }
  return b;
}

TEST_F(TokenFileTest, ReadsLlmcBinFiles) {
  auto gpt2 = random_tokens(777, 50257, 1);
  auto p = path("gpt2.bin");
  write_bytes(p, llmc_file(20240520, 1, 777, gpt2, 2));
  TokenFile f(p);
  EXPECT_EQ(f.format(), TokenFileFormat::llmc);
  EXPECT_EQ(f.width(), 2);
  ASSERT_EQ(f.size(), 777);
  for (int i = 0; i < 777; ++i) ASSERT_EQ(f.at(i), gpt2[i]);

  auto llama = random_tokens(333, 128256, 2);
  auto q = path("llama3.bin");
  write_bytes(q, llmc_file(20240801, 7, 333, llama, 4));
  TokenFile g(q);
  EXPECT_EQ(g.width(), 4);
  ASSERT_EQ(g.size(), 333);
  for (int i = 0; i < 333; ++i) ASSERT_EQ(g.at(i), llama[i]);

  write_bytes(p, llmc_file(20240520, 2, 777, gpt2, 2));
  EXPECT_EQ(open_error(p), p + ": unsupported llm.c version 2 for magic 20240520 (expected 1: GPT-2, uint16 tokens)");
  write_bytes(p, llmc_file(20240520, 1, 778, gpt2, 2));
  EXPECT_EQ(open_error(p), p + ": truncated: the llm.c header announces 778 tokens of 2 bytes (2580 bytes with the "
                               "header), but the file has 2578 bytes");
  write_bytes(p, llmc_file(20240520, 1, 0, {}, 2).substr(0, 512));
  EXPECT_EQ(open_error(p), p + ": truncated: 512 bytes, shorter than the llm.c header (1024 bytes)");
}

int tokenize(std::vector<std::string> args) {
  args.insert(args.begin(), "tokenize");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return run_tokenize_command(static_cast<int>(argv.size()), argv.data());
}

TEST_F(TokenFileTest, TokenizeRoundTrip) {
  std::string a = "hello\n\xff\x00 world", b = "second document \xc3\xa9";
  a.push_back('\0');
  write_bytes(path("a.txt"), a);
  write_bytes(path("b.txt"), b);
  write_bytes(path("c.txt"), "");
  auto out = path("out.tok");
  ASSERT_EQ(tokenize({"--input", path("a.txt"), path("b.txt"), path("c.txt"), "--output", out}), 0);
  TokenFile f(out);
  EXPECT_EQ(f.width(), 2);
  std::vector<uint32_t> expected;
  expected.push_back(kByteEndOfDocument);  // before every document
  for (unsigned char c : a) expected.push_back(c);
  expected.push_back(kByteEndOfDocument);
  for (unsigned char c : b) expected.push_back(c);
  expected.push_back(kByteEndOfDocument);  // the empty third file
  ASSERT_EQ(f.size(), static_cast<int64_t>(expected.size()));
  for (size_t i = 0; i < expected.size(); ++i) ASSERT_EQ(f.at(i), expected[i]) << i;

  // Decoding gives the files back.
  std::string decoded;
  for (int64_t i = 0; i < f.size(); ++i)
    decoded += f.at(i) == kByteEndOfDocument ? std::string("<EOD>") : std::string(1, static_cast<char>(f.at(i)));
  EXPECT_EQ(decoded, "<EOD>" + a + "<EOD>" + b + "<EOD>");

  // A large file goes through the streaming buffer in several pieces.
  std::string big(3 * (1 << 20) + 17, 'x');
  for (size_t i = 0; i < big.size(); i += 4099) big[i] = static_cast<char>(i % 251);
  write_bytes(path("big.txt"), big);
  ASSERT_EQ(tokenize({"--input", path("big.txt"), "--output", out}), 0);
  TokenFile g(out);
  ASSERT_EQ(g.size(), static_cast<int64_t>(big.size()) + 1);
  EXPECT_EQ(g.at(0), kByteEndOfDocument);
  for (size_t i = 0; i < big.size(); i += 4099) ASSERT_EQ(g.at(i + 1), static_cast<unsigned char>(big[i]));
  EXPECT_EQ(g.at(g.size() - 1), static_cast<uint32_t>('x'));
}

TEST_F(TokenFileTest, TokenizeErrors) {
  auto out = path("out.tok");
  EXPECT_EQ(tokenize({"--output", out}), 2);
  EXPECT_EQ(tokenize({"--input", path("a.txt")}), 2);
  EXPECT_EQ(tokenize({"--input", path("a.txt"), "--output", out, "--bogus"}), 2);
  EXPECT_EQ(tokenize({"--input", path("missing.txt"), "--output", out}), 1);
  EXPECT_FALSE(exists(out));
  EXPECT_TRUE(count_entries(dir_) == 0);  // no temporary left behind
}

// A Megatron indexed dataset at `prefix` (.bin and .idx) as megatron/core/datasets/indexed_dataset.py's
// IndexedDatasetBuilder writes it: add_item() per sequence (tokens to the .bin in the dtype), end_document()
// after each document's sequences (doc_idx starts at [0] and gets len(sizes)), then the index.
void write_megatron(const std::string& prefix, const std::vector<std::vector<std::vector<int64_t>>>& documents,
                    uint8_t code, int width) {
  std::string bin, idx;
  std::vector<int32_t> sizes;
  std::vector<int64_t> pointers, doc_idx{0};
  for (auto& doc : documents) {
    for (auto& seq : doc) {
      pointers.push_back(static_cast<int64_t>(bin.size()));
      sizes.push_back(static_cast<int32_t>(seq.size()));
      for (int64_t t : seq) bin.append(reinterpret_cast<const char*>(&t), width);  // little-endian: the low bytes
    }
    doc_idx.push_back(static_cast<int64_t>(sizes.size()));
  }
  auto put = [&](const void* p, size_t n) { idx.append(static_cast<const char*>(p), n); };
  put("MMIDIDX\0\0", 9);
  const uint64_t version = 1, S = sizes.size(), D = doc_idx.size();
  put(&version, 8);
  put(&code, 1);
  put(&S, 8);
  put(&D, 8);
  put(sizes.data(), 4 * S);
  put(pointers.data(), 8 * S);
  put(doc_idx.data(), 8 * D);
  std::ofstream(prefix + ".bin", std::ios::binary) << bin;
  std::ofstream(prefix + ".idx", std::ios::binary) << idx;
}

TEST_F(TokenFileTest, ReadsMegatronDatasets) {
  // Three documents, the second of two sequences; uint16 (code 8), int32 (code 4), uint8 (1), int64 (5).
  for (auto [code, width] : {std::pair<uint8_t, int>{8, 2}, {4, 4}, {1, 1}, {5, 8}}) {
    const uint32_t bound = width == 1 ? 256 : width == 2 ? 65536 : 200000;
    auto a = random_tokens(300, bound, code), b = random_tokens(50, bound, code + 1), c = random_tokens(7, bound, code + 2);
    auto as64 = [](const std::vector<uint32_t>& v) { return std::vector<int64_t>(v.begin(), v.end()); };
    const std::string prefix = path("corpus_" + std::to_string(code) + "_text_document");
    write_megatron(prefix, {{as64(a)}, {as64(b), as64(c)}, {as64(c)}}, code, width);
    std::vector<uint32_t> all = a;
    all.insert(all.end(), b.begin(), b.end());
    all.insert(all.end(), c.begin(), c.end());
    all.insert(all.end(), c.begin(), c.end());
    for (const std::string& name : {prefix, prefix + ".bin", prefix + ".idx"}) {
      TokenFile f(name);
      EXPECT_EQ(f.format(), TokenFileFormat::megatron);
      EXPECT_EQ(f.width(), width);
      EXPECT_EQ(f.documents(), 3);
      EXPECT_EQ(f.data_path(), prefix + ".bin");
      ASSERT_EQ(f.size(), static_cast<int64_t>(all.size()));
      std::vector<int64_t> out(all.size());
      f.read(0, f.size(), out.data());
      for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(out[i], static_cast<int64_t>(all[i])) << code << " " << i;
      EXPECT_EQ(f.at(351), all[351]);
    }
    // As a run reads it: a stream over two datasets, and the vocabulary check.
    TokenStream stream({prefix, prefix});
    ASSERT_EQ(stream.size(), 2 * static_cast<int64_t>(all.size()));
    std::vector<int64_t> across(4);
    stream.read(static_cast<int64_t>(all.size()) - 2, 4, across.data());
    EXPECT_EQ(across, (std::vector<int64_t>{all[all.size() - 2], all.back(), all[0], all[1]}));
    EXPECT_EQ(check_token_files({prefix}, bound, nullptr), static_cast<int64_t>(all.size()));
  }
  // A negative id of a signed dtype is named by the check.
  const std::string neg = path("neg");
  write_megatron(neg, {{{5, -3, 7}}}, 4, 4);
  try {
    check_token_files({neg}, 100, nullptr);
    ADD_FAILURE() << "a negative id passed the check";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), neg + ": token 1 (id -3) is negative; token ids are 0 .. model.vocab_size-1 (is "
                                           "this Megatron dataset's dtype right?)");
  }
}

TEST_F(TokenFileTest, MegatronErrorsNameTheFile) {
  const std::string p = path("ds");
  write_megatron(p, {{{1, 2, 3}}, {{4, 5}}}, 8, 2);
  const std::string idx = bytes_of(p + ".idx"), bin = bytes_of(p + ".bin");
  // The .bin shorter than the index says, and longer.
  write_bytes(p + ".bin", bin.substr(0, 8));
  EXPECT_EQ(open_error(p), p + ".bin: truncated: its index " + p + ".idx announces 5 tokens of 2 bytes (10 bytes), but "
                                                                    "the file has 8 bytes");
  write_bytes(p + ".bin", bin + "zz");
  EXPECT_EQ(open_error(p), p + ".bin: its index " + p + ".idx announces 5 tokens of 2 bytes (10 bytes), but the file has "
                                                         "12 bytes");
  write_bytes(p + ".bin", bin);
  // A truncated index, a bad magic, a float dtype, a gap between sequences, a bad document index.
  write_bytes(p + ".idx", idx.substr(0, idx.size() - 3));
  EXPECT_EQ(open_error(p), p + ".idx: truncated: the Megatron index header announces 2 sequences and 3 documents (82 "
                               "bytes of index, or 84 with sequence modes), but the file has 79 bytes");
  std::string bad = idx;
  bad[2] = 'X';
  write_bytes(p + ".idx", bad);
  EXPECT_EQ(open_error(p + ".idx"), p + ".idx: not a Megatron index: it starts with bytes 4d 4d 58 44 49 44 58 00 00, "
                                        "expected \"MMIDIDX\\0\\0\" (4d 4d 49 44 49 44 58 00 00)");
  bad = idx;
  bad[17] = 7;
  write_bytes(p + ".idx", bad);
  EXPECT_EQ(open_error(p), p + ".idx: the Megatron index's dtype code 7 is not an integer token type (expected 1 uint8, "
                               "2 int8, 3 int16, 4 int32, 5 int64 or 8 uint16; 6 and 7 are floats)");
  bad = idx;
  bad[34 + 8 + 8] = 8;  // the second pointer: 8 instead of 6
  write_bytes(p + ".idx", bad);
  EXPECT_EQ(open_error(p), p + ".idx: sequence 1 starts at byte 8 of " + p + ".bin, but the sequences before it end at "
                               "byte 6 (carry reads datasets whose sequences lie end to end, as Megatron writes them)");
  bad = idx;
  bad[34 + 8 + 16 + 16] = 1;  // the last doc_idx entry: 1 instead of 2
  write_bytes(p + ".idx", bad);
  EXPECT_EQ(open_error(p), p + ".idx: the document index ends at sequence 1, expected the sequence count 2");
  // A .bin without its .idx is not taken for a Megatron dataset.
  ::unlink((p + ".idx").c_str());
  EXPECT_NE(open_error(p + ".bin").find("a raw token array is named \"uint16:" + p + ".bin\""), std::string::npos);
}

TEST_F(TokenFileTest, ReadsRawTokenArrays) {
  auto t16 = random_tokens(1001, 65536, 7), t32 = random_tokens(333, 4000000000u, 8);
  std::string b16, b32;
  for (auto t : t16) {
    auto v = static_cast<uint16_t>(t);
    b16.append(reinterpret_cast<const char*>(&v), 2);
  }
  for (auto t : t32) b32.append(reinterpret_cast<const char*>(&t), 4);
  make_dirs(path("raw"));
  write_bytes(path("raw/a_000.bin"), b16);
  write_bytes(path("raw/a_001.bin"), b16.substr(0, 20));
  write_bytes(path("b.bin"), b32);
  TokenFile f("uint16:" + path("raw/a_000.bin"));
  EXPECT_EQ(f.format(), TokenFileFormat::raw);
  EXPECT_EQ(f.width(), 2);
  ASSERT_EQ(f.size(), 1001);
  for (int i = 0; i < 1001; ++i) ASSERT_EQ(f.at(i), t16[i]);
  TokenFile g("uint32:" + path("b.bin"));
  EXPECT_EQ(g.width(), 4);
  ASSERT_EQ(g.size(), 333);
  for (int i = 0; i < 333; ++i) ASSERT_EQ(g.at(i), t32[i]);
  // A pattern keeps the width on every match.
  auto files = expand_token_paths({"uint16:" + path("raw/a_*.bin")}, "paths");
  EXPECT_EQ(files, (std::vector<std::string>{"uint16:" + path("raw/a_000.bin"), "uint16:" + path("raw/a_001.bin")}));
  EXPECT_EQ(TokenStream(files).size(), 1011);
  // A size that is not a multiple of the width.
  write_bytes(path("odd.bin"), b16.substr(0, 7));
  EXPECT_EQ(open_error("uint16:" + path("odd.bin")),
            path("odd.bin") + ": a raw file of uint16 tokens must have a multiple of 2 bytes, but it has 7 (1 extra): is "
                              "it another width, or truncated?");
  write_bytes(path("odd.bin"), b16.substr(0, 6));
  EXPECT_EQ(open_error("uint32:" + path("odd.bin")),
            path("odd.bin") + ": a raw file of uint32 tokens must have a multiple of 4 bytes, but it has 6 (2 extra): is "
                              "it another width, or truncated?");
  EXPECT_NE(open_error("uint16:" + path("missing.bin")).find(path("missing.bin") + ": cannot open token file"),
            std::string::npos);
}

}  // namespace
}  // namespace carry
