// Tests for framework/data/token_file.h and `carry tokenize`: round trips in both widths, the errors for
// truncated, padded, bad-magic, bad-version and bad-width files (each naming the path), llm.c .bin
// files (GPT-2 uint16 and Llama 3 uint32), atomic writing, and the byte-level tokenizer.
#include "framework/data/token_file.h"
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
                               "\"CARRYTOK\" or an llm.c .bin header (int32 20240520 or 20240801)");
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

}  // namespace
}  // namespace carry
