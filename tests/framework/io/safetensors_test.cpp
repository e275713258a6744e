// safetensors reader and writer: every dtype round-trips; a file built byte by byte from the published
// format is read correctly, and the writer produces exactly the reference writer's bytes (order by
// descending dtype then name, compact JSON, header padded with spaces to a multiple of 8); every kind
// of corrupt file is refused with a message naming the file, the tensor and what was expected.
#include "framework/io/safetensors.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <unistd.h>
#include <vector>

namespace carry {
namespace {

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "missing '" << (part) << "' in: " << (text)

std::string temp_path(const std::string& name) {
  auto dir = std::filesystem::path(::testing::TempDir()) /
             ("carry_safetensors_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// The 8-byte little-endian length, built byte by byte.
std::string le_u64(uint64_t n) {
  std::string s;
  for (int i = 0; i < 8; ++i) s += static_cast<char>((n >> (8 * i)) & 0xFF);
  return s;
}

// A file: length, header (padded with spaces to a multiple of 8 when `pad`), buffer.
std::string file_bytes(std::string header, const std::string& buffer, bool pad = true) {
  if (pad) header.append((8 - header.size() % 8) % 8, ' ');
  return le_u64(header.size()) + header + buffer;
}

std::string bytes(std::initializer_list<int> b) {
  std::string s;
  for (int x : b) s += static_cast<char>(x);
  return s;
}

std::string load_error(const std::string& path) {
  try {
    load_safetensors(path);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

TEST(Safetensors, RoundTripsEveryDtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  std::map<std::string, at::Tensor> tensors;
  std::vector<at::ScalarType> types = {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong,
                                       at::kInt,    at::kShort, at::kChar, at::kByte,     at::kBool};
  for (auto type : types) {
    std::string n = c10::toString(type);
    auto make = [&](at::IntArrayRef shape) {
      if (at::isFloatingType(type)) return at::randn(shape, gen, at::kDouble).to(type);
      if (type == at::kBool) return at::randint(0, 2, shape, gen, at::kLong).to(type);
      int64_t lo = type == at::kByte ? 0 : -100;
      return at::randint(lo, 100, shape, gen, at::kLong).to(type);
    };
    tensors[n + ".matrix"] = make({3, 5});
    tensors[n + ".scalar"] = make({});
    tensors[n + ".empty"] = make({0, 4});
    tensors[n + ".transposed"] = make({4, 3}).t();  // non-contiguous: written in C order
  }
  tensors["Long.extreme"] = at::tensor({INT64_MIN, INT64_MAX, int64_t{-1}}, at::kLong);
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "quote \" slash \\ tab \t é"}};
  auto path = temp_path("roundtrip.safetensors");
  save_safetensors(path, tensors, meta);
  std::map<std::string, std::string> meta_back;
  auto back = load_safetensors(path, &meta_back);
  EXPECT_EQ(meta_back, meta);
  ASSERT_EQ(back.size(), tensors.size());
  for (auto& [name, t] : tensors) {
    ASSERT_TRUE(back.count(name)) << name;
    EXPECT_EQ(back[name].scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(back[name].sizes(), t.sizes()) << name;
    EXPECT_TRUE(back[name].is_contiguous()) << name;
    EXPECT_TRUE(at::equal(back[name], t)) << name;
  }
  // No temporary file is left beside the result; writing again replaces the file.
  save_safetensors(path, {{"only", at::ones({2})}});
  EXPECT_EQ(load_safetensors(path).size(), 1u);
  int entries = 0;
  for (auto& e : std::filesystem::directory_iterator(std::filesystem::path(path).parent_path()))
    entries += e.path().filename().string().rfind("roundtrip.safetensors", 0) == 0;
  EXPECT_EQ(entries, 1);
}

// Tensors with known little-endian bytes: F32 [2,2] {1, -2.5, 0.5, 2}, I64 [2] {1, -2}, BF16 [1] {1},
// U8 [3] {7, 8, 9}, BOOL [2] {true, false}.
std::map<std::string, at::Tensor> known_tensors() {
  return {{"w", at::tensor({1.0f, -2.5f, 0.5f, 2.0f}).reshape({2, 2})},
          {"n", at::tensor({int64_t{1}, int64_t{-2}})},
          {"h", at::ones({1}, at::kBFloat16)},
          {"u", at::tensor({7, 8, 9}, at::kByte)},
          {"m", at::tensor({1, 0}, at::kByte).to(at::kBool)}};
}
const std::string kW = bytes({0, 0, 0x80, 0x3F, 0, 0, 0x20, 0xC0, 0, 0, 0, 0x3F, 0, 0, 0, 0x40});
const std::string kN = bytes({1, 0, 0, 0, 0, 0, 0, 0, 0xFE, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF});
const std::string kH = bytes({0x80, 0x3F});
const std::string kU = bytes({7, 8, 9});
const std::string kM = bytes({1, 0});

void expect_known(std::map<std::string, at::Tensor>& t) {
  auto want = known_tensors();
  ASSERT_EQ(t.size(), want.size());
  for (auto& [name, w] : want) {
    ASSERT_TRUE(t.count(name)) << name;
    EXPECT_EQ(t[name].scalar_type(), w.scalar_type()) << name;
    EXPECT_TRUE(at::equal(t[name], w)) << name;
  }
}

TEST(Safetensors, ReadsHandBuiltFile) {
  // Any key order, spaces in the JSON, the buffer in another order than the writer's, metadata last.
  std::string header =
      "{ \"u\": {\"shape\": [3], \"dtype\": \"U8\", \"data_offsets\": [0, 3]},\n"
      "  \"w\": {\"data_offsets\": [3, 19], \"dtype\": \"F32\", \"shape\": [2, 2]},\n"
      "  \"m\": {\"dtype\": \"BOOL\", \"shape\": [2], \"data_offsets\": [19, 21]},\n"
      "  \"n\": {\"dtype\": \"I64\", \"shape\": [2], \"data_offsets\": [21, 37]},\n"
      "  \"h\": {\"dtype\": \"BF16\", \"shape\": [1], \"data_offsets\": [37, 39]},\n"
      "  \"__metadata__\": {\"format\": \"pt\", \"step\": \"12\"} }";
  auto path = temp_path("handbuilt.safetensors");
  write_bytes(path, file_bytes(header, kU + kW + kM + kN + kH));
  std::map<std::string, std::string> meta;
  auto t = load_safetensors(path, &meta);
  expect_known(t);
  EXPECT_EQ(meta, (std::map<std::string, std::string>{{"format", "pt"}, {"step", "12"}}));

  // Unpadded header and no metadata are valid too.
  write_bytes(path, file_bytes("{\"u\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[0,3]}}", kU, false));
  meta = {{"stale", "x"}};
  auto u = load_safetensors(path, &meta);
  EXPECT_TRUE(meta.empty());
  ASSERT_EQ(u.size(), 1u);
  EXPECT_TRUE(at::equal(u["u"], known_tensors()["u"]));
}

TEST(Safetensors, WritesReferenceBytes) {
  // Descending dtype (I64, F32, BF16, U8, BOOL), then name; __metadata__ first; compact; padded.
  std::string header =
      "{\"__metadata__\":{\"format\":\"pt\",\"step\":\"12\"},"
      "\"n\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[0,16]},"
      "\"w\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[16,32]},"
      "\"h\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[32,34]},"
      "\"u\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[34,37]},"
      "\"m\":{\"dtype\":\"BOOL\",\"shape\":[2],\"data_offsets\":[37,39]}}";
  ASSERT_NE(header.size() % 8, 0u) << "the test should exercise the padding";
  std::string want = file_bytes(header, kN + kW + kH + kU + kM);
  auto path = temp_path("written.safetensors");
  save_safetensors(path, known_tensors(), {{"step", "12"}, {"format", "pt"}});
  std::string got = read_bytes(path);
  EXPECT_EQ(got.size(), want.size());
  EXPECT_EQ(got, want);
  // Same name order within one dtype, ties broken by name; an empty file is "{}" and 6 spaces.
  save_safetensors(path, {{"b", at::zeros({1})}, {"a", at::zeros({1})}, {"c", at::zeros({1}, at::kDouble)}});
  EXPECT_EQ(read_bytes(path),
            file_bytes("{\"c\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]},"
                       "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]},"
                       "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[12,16]}}",
                       std::string(16, '\0')));
  save_safetensors(path, {});
  EXPECT_EQ(read_bytes(path), le_u64(8) + "{}      ");
  // Control characters in strings are escaped as JSON requires, and read back.
  save_safetensors(path, {}, {{"k", std::string("a\x01\n\"b")}});
  EXPECT_EQ(read_bytes(path), file_bytes("{\"__metadata__\":{\"k\":\"a\\u0001\\n\\\"b\"}}", ""));
  std::map<std::string, std::string> meta;
  load_safetensors(path, &meta);
  EXPECT_EQ(meta["k"], std::string("a\x01\n\"b"));
}

TEST(Safetensors, RefusesCorruptFiles) {
  auto path = temp_path("corrupt.safetensors");
  const std::string f32x2 = std::string(8, '\0');
  auto entry = [](const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
    return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
           ",\"data_offsets\":" + offsets + "}";
  };
  struct Case {
    std::string what, file;
    std::vector<std::string> message;
  };
  std::vector<Case> cases = {
      {"truncated to 5 bytes", std::string(5, '\0'), {"5 bytes, shorter than the 8-byte header length"}},
      {"header past the end", le_u64(1000) + "{}", {"header length 1000 bytes runs past the end", "(10 bytes"}},
      {"absurd header length", le_u64(uint64_t{1} << 40) + "{}      ", {"header length 1099511627776 bytes is absurd"}},
      {"bad JSON", file_bytes("{\"a\": }", ""), {"header is not valid JSON", "Unexpected token", "Unexpected token (at header byte 6, file byte 14), near '} '"}},
      {"truncated JSON", file_bytes("{\"a\":", "", false), {"header is not valid JSON", "end of the header"}},
      {"junk after the JSON", file_bytes(std::string("{\"a\":1}\0\0", 9), "", false),
       {"header is not valid JSON", "(at header byte 7, file byte 15), near '{\"a\":1}\\x00\\x00'"}},
      {"not an object", file_bytes("[1, 2]", ""), {"must be a JSON object starting with '{', found '['"}},
      {"not UTF-8", file_bytes("{\"a\xff\":1}", ""), {"not valid UTF-8 (at header byte 3)"}},
      {"duplicate name", file_bytes("{" + entry("a", "F32", "[2]", "[0,8]") + "," + entry("a", "F32", "[2]", "[0,8]") + "}", f32x2),
       {"header is not valid JSON", "Repeated map key: 'a'"}},
      {"bad dtype", file_bytes("{" + entry("x", "F128", "[1]", "[0,16]") + "}", std::string(16, '\0')),
       {"tensor 'x'", "unknown dtype \"F128\"", "F64, F32"}},
      {"dtype not a string", file_bytes("{\"x\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", "xxxx"),
       {"tensor 'x'", "\"dtype\" must be a string", "found a number"}},
      {"missing shape", file_bytes("{\"x\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", "xxxx"),
       {"tensor 'x'", "has no \"shape\""}},
      {"negative size", file_bytes("{" + entry("x", "F32", "[-1]", "[0,4]") + "}", "xxxx"),
       {"tensor 'x'", "\"shape\"[0] must be a non-negative integer", "found -1"}},
      {"fractional size", file_bytes("{" + entry("x", "F32", "[1.5]", "[0,4]") + "}", "xxxx"),
       {"tensor 'x'", "\"shape\"[0] must be a non-negative integer", "found 1.5"}},
      {"three offsets", file_bytes("{" + entry("x", "F32", "[1]", "[0,4,8]") + "}", "xxxx"),
       {"tensor 'x'", "\"data_offsets\" must be [begin, end], found 3 numbers"}},
      {"end before begin", file_bytes("{" + entry("x", "F32", "[0]", "[4,0]") + "}", "xxxx"),
       {"tensor 'x'", "[4, 0] end before begin"}},
      {"shape and offsets disagree", file_bytes("{" + entry("x", "F32", "[3]", "[0,8]") + "}", f32x2),
       {"tensor 'x'", "dtype F32 and shape [3] need 12 bytes but data_offsets [0, 8] hold 8"}},
      {"overlapping", file_bytes("{" + entry("a", "F32", "[2]", "[0,8]") + "," + entry("b", "F32", "[2]", "[4,12]") + "}", std::string(12, '\0')),
       {"tensor 'b'", "[4, 12] overlap tensor 'a' [0, 8]"}},
      {"gap", file_bytes("{" + entry("a", "F32", "[2]", "[0,8]") + "," + entry("b", "F32", "[2]", "[12,20]") + "}", std::string(20, '\0')),
       {"bytes [8, 12) of the byte buffer belong to no tensor", "tensor 'b' starts at 12"}},
      {"past the buffer", file_bytes("{" + entry("a", "F32", "[2]", "[0,8]") + "}", "xxxx"),
       {"tensor 'a'", "[0, 8] run past the end of the byte buffer (4 bytes"}},
      {"buffer not covered", file_bytes("{" + entry("a", "F32", "[2]", "[0,8]") + "}", std::string(12, '\0')),
       {"byte buffer has 12 bytes but the tensors cover only 8", "[8, 12) belong to no tensor"}},
      {"metadata not strings", file_bytes("{\"__metadata__\":{\"step\":12}}", ""),
       {"\"__metadata__\" entry \"step\" must be a string, found a number"}},
      {"bool bytes", file_bytes("{" + entry("b", "BOOL", "[2]", "[0,2]") + "}", bytes({1, 2})),
       {"tensor 'b' is BOOL but has bytes other than 0 and 1"}},
  };
  for (auto& c : cases) {
    write_bytes(path, c.file);
    std::string msg = load_error(path);
    SCOPED_TRACE(c.what);
    EXPECT_CONTAINS(msg, path);
    for (auto& part : c.message) EXPECT_CONTAINS(msg, part);
  }
  std::string missing = temp_path("does_not_exist.safetensors");
  EXPECT_CONTAINS(load_error(missing), missing + ": cannot open");
}

// A header nested far deeper than safetensors' two levels is refused by a linear scan before the JSON
// parser sees it (protobuf's parser took 21 s on 30,000 levels and did not end on 100,000); brackets
// inside strings do not count; a header over the format's 100 MB limit is refused by its length.
TEST(Safetensors, RefusesDeepOrHugeHeadersQuickly) {
  auto path = temp_path("deep.safetensors");
  for (int levels : {30000, 100000}) {
    SCOPED_TRACE(levels);
    std::string header = "{\"a\":" + std::string(levels, '[') + std::string(levels, ']') + "}";
    write_bytes(path, file_bytes(header, ""));
    auto start = std::chrono::steady_clock::now();
    std::string msg = load_error(path);
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(seconds, 1.0);
    EXPECT_CONTAINS(msg, path + ": header nests objects and lists more than 8 levels deep (level 9 at header byte 12)");
    EXPECT_CONTAINS(msg, "safetensors headers are 2 levels deep");
  }
  // Nine levels of objects: refused the same way; eight are parsed (and refused for what they hold).
  std::string nine = "{\"a\":{\"b\":{\"c\":{\"d\":{\"e\":{\"f\":{\"g\":{\"h\":{}}}}}}}}}";
  write_bytes(path, file_bytes(nine, ""));
  EXPECT_CONTAINS(load_error(path), "more than 8 levels deep (level 9 at header byte 40)");
  std::string eight = "{\"a\":{\"b\":{\"c\":{\"d\":{\"e\":{\"f\":{\"g\":{}}}}}}}}";
  write_bytes(path, file_bytes(eight, ""));
  EXPECT_CONTAINS(load_error(path), "tensor 'a': header entry has no \"dtype\"");

  // Brackets and escaped quotes inside names are text, not nesting.
  std::string name = "[[[[[[[[[[{{{{{{{{{{\\\"";
  std::string header = "{\"" + name + "\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
  write_bytes(path, file_bytes(header, "x"));
  auto loaded = load_safetensors(path);
  ASSERT_EQ(loaded.size(), 1u);
  EXPECT_EQ(loaded.begin()->first, "[[[[[[[[[[{{{{{{{{{{\"");

  // One byte over the limit: the message names the file, the length found and the limit.
  write_bytes(path, le_u64(100000001) + "{}      ");
  EXPECT_CONTAINS(load_error(path), path + ": header length 100000001 bytes is absurd (the format allows at most "
                                           "100000000 bytes)");
}

TEST(Safetensors, RefusesWhatItCannotWrite) {
  auto path = temp_path("refused.safetensors");
  auto error = [&](const std::map<std::string, at::Tensor>& t) -> std::string {
    try {
      save_safetensors(path, t);
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "(no error)";
  };
  EXPECT_CONTAINS(error({{"z", at::zeros({2}, at::kComplexDouble)}}), "tensor 'z' has dtype ComplexDouble");
  EXPECT_CONTAINS(error({{"__metadata__", at::zeros({2})}}), "'__metadata__' cannot name a tensor");
  EXPECT_CONTAINS(error({{"u", at::Tensor()}}), "tensor 'u' is undefined");
  std::string bad_dir = temp_path("no_such_dir") + "/x.safetensors";
  try {
    save_safetensors(bad_dir, {{"a", at::zeros({1})}});
    ADD_FAILURE() << "writing into a missing directory succeeded";
  } catch (const c10::Error& e) {
    EXPECT_CONTAINS(e.what_without_backtrace(), bad_dir + ": cannot create the temporary file");
  }
}

}  // namespace
}  // namespace carry
