// XXH64 (framework/io/xxh64.h) against the reference implementation's outputs: every length class
// of the algorithm (no stripe, a tail of 8-, 4- and 1-byte pieces, one and several 32-byte stripes)
// under three seeds, a few texts, and the same hash wherever the bytes sit in memory (unaligned).
//
// The expected values were produced once with the reference implementation, libxxhash 0.8.1
// (Debian's libxxhash0, the library xxhsum uses), through Python's ctypes:
//   lib = ctypes.CDLL("libxxhash.so.0"); lib.XXH64.restype = ctypes.c_uint64
//   lib.XXH64.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]
//   lib.XXH64(bytes((i * 131 + 7) & 0xFF for i in range(n)), n, seed)
// XXH64 of the empty input with seed 0, ef46db3751d8e999, is also the value xxHash's documentation
// publishes.
#include "framework/io/xxh64.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace carry {
namespace {

std::vector<unsigned char> pattern(size_t n) {
  std::vector<unsigned char> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<unsigned char>((i * 131 + 7) & 0xFF);
  return out;
}

TEST(Xxh64, MatchesTheReferenceForEveryLengthClassAndSeed) {
  struct Case {
    uint64_t seed;
    size_t size;
    uint64_t hash;
  };
  const Case cases[] = {
    {0, 0, 0xef46db3751d8e999ULL},
    {0, 1, 0xa96c7f0ce858bbb7ULL},
    {0, 3, 0xbed43740ee6332bbULL},
    {0, 4, 0xfa212ae44b3bb23dULL},
    {0, 5, 0xd339dcc9ac8e6776ULL},
    {0, 7, 0x2744460dd675d2c0ULL},
    {0, 8, 0x994b676b71ce94ddULL},
    {0, 9, 0x572b84c18b983af8ULL},
    {0, 15, 0x09e6451ed2ff8b1dULL},
    {0, 16, 0x94ad0095e72b24d5ULL},
    {0, 17, 0x1464f2eff23b5fe1ULL},
    {0, 31, 0x6711d55e306b5d8fULL},
    {0, 32, 0x07f7b8e3bc5d6e25ULL},
    {0, 33, 0x09f85eeb4e1cbe9fULL},
    {0, 63, 0xb7c9968c066cb6a5ULL},
    {0, 64, 0x50d4159a0411632eULL},
    {0, 65, 0xd277176bff863efcULL},
    {0, 100, 0x9ddada11d3dc2d8fULL},
    {0, 1000, 0x0bf0bdbcc82eb373ULL},
    {0, 4101, 0xda04d26da79591c6ULL},
    {1, 0, 0xd5afba1336a3be4bULL},
    {1, 1, 0x0766883a0a47a96aULL},
    {1, 3, 0x95ba63f005e6e6caULL},
    {1, 4, 0x319607b5ca9d59d4ULL},
    {1, 5, 0xe07f25fb3a8e5de9ULL},
    {1, 7, 0x0047cdce49d4bc99ULL},
    {1, 8, 0xc14d78e582fe5026ULL},
    {1, 9, 0xdb001655fe3a4b7aULL},
    {1, 15, 0x40a4206cc723cce4ULL},
    {1, 16, 0x0c9b8f12f2ae6c76ULL},
    {1, 17, 0x418df2ecde29d078ULL},
    {1, 31, 0xe811d10b03941e82ULL},
    {1, 32, 0xdf4f0f6ea84ebbcaULL},
    {1, 33, 0x489f1772049e476cULL},
    {1, 63, 0xbe65bc64322f219bULL},
    {1, 64, 0x8ea281ce694f574dULL},
    {1, 65, 0x1b26ddaa63626478ULL},
    {1, 100, 0xe6a0d25e6e0a7f2aULL},
    {1, 1000, 0x82f34486d530be54ULL},
    {1, 4101, 0xa3517c0a762f168dULL},
    {0x9E3779B97F4A7C15ULL, 0, 0xc4349fc93c010000ULL},
    {0x9E3779B97F4A7C15ULL, 1, 0x585882422a6165e7ULL},
    {0x9E3779B97F4A7C15ULL, 3, 0x45fa1406538fa168ULL},
    {0x9E3779B97F4A7C15ULL, 4, 0xa65107f22943365aULL},
    {0x9E3779B97F4A7C15ULL, 5, 0xf51eda3a20de9b88ULL},
    {0x9E3779B97F4A7C15ULL, 7, 0xc9b637e2c4599de2ULL},
    {0x9E3779B97F4A7C15ULL, 8, 0xce592d5f53e192ecULL},
    {0x9E3779B97F4A7C15ULL, 9, 0x5495aa796de8ab73ULL},
    {0x9E3779B97F4A7C15ULL, 15, 0x47a857d1f90c35e1ULL},
    {0x9E3779B97F4A7C15ULL, 16, 0x3f8fea7c86a04013ULL},
    {0x9E3779B97F4A7C15ULL, 17, 0xe5044d205f3d2f74ULL},
    {0x9E3779B97F4A7C15ULL, 31, 0x24c4e99ab0404b5eULL},
    {0x9E3779B97F4A7C15ULL, 32, 0x046e99bbda1a814bULL},
    {0x9E3779B97F4A7C15ULL, 33, 0xd7fe2bfee6e4cdedULL},
    {0x9E3779B97F4A7C15ULL, 63, 0xbd457f9ea47180c8ULL},
    {0x9E3779B97F4A7C15ULL, 64, 0xa768f350a8e4fcf6ULL},
    {0x9E3779B97F4A7C15ULL, 65, 0xfe99ab21e40d4b0cULL},
    {0x9E3779B97F4A7C15ULL, 100, 0x35546bd9a4779ae4ULL},
    {0x9E3779B97F4A7C15ULL, 1000, 0x3ecb5d7b5e7c64cfULL},
    {0x9E3779B97F4A7C15ULL, 4101, 0xaf5b89dbdd4fdbe1ULL},
  };
  for (const auto& c : cases) {
    auto bytes = pattern(c.size);
    EXPECT_EQ(xxh64(bytes.data(), bytes.size(), c.seed), c.hash) << "size " << c.size << ", seed " << c.seed;
  }
}

TEST(Xxh64, MatchesTheReferenceOnTexts) {
  struct Case {
    const char* text;
    uint64_t hash;
  };
  const Case cases[] = {
    {"", 0xef46db3751d8e999ULL},
    {"a", 0xd24ec4f1a98c6e5bULL},
    {"abc", 0x44bc2cf5ad770999ULL},
    {"xxhash", 0x32dd38952c4bc720ULL},
    {"The quick brown fox jumps over the lazy dog", 0x0b242d361fda71bcULL},
  };
  for (const auto& c : cases) EXPECT_EQ(xxh64(c.text, std::strlen(c.text)), c.hash) << c.text;
}

TEST(Xxh64, UnalignedBytesHashTheSame) {
  auto bytes = pattern(1000);
  const uint64_t want = xxh64(bytes.data(), bytes.size());
  std::vector<unsigned char> shifted(bytes.size() + 8);
  for (size_t offset = 1; offset < 8; ++offset) {
    std::memcpy(shifted.data() + offset, bytes.data(), bytes.size());
    EXPECT_EQ(xxh64(shifted.data() + offset, bytes.size()), want) << "offset " << offset;
  }
  bytes[500] ^= 1;  // one flipped bit changes the hash
  EXPECT_NE(xxh64(bytes.data(), bytes.size()), want);
}

}  // namespace
}  // namespace carry
