// XXH64 (see xxh64.h), step for step as the specification lays it out.
#include "framework/io/xxh64.h"

#include <cstring>

namespace carry {

namespace {

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t kP3 = 0x165667B19E3779F9ULL;
constexpr uint64_t kP4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t kP5 = 0x27D4EB2F165667C5ULL;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// Little-endian reads, whatever the host's byte order.
inline uint64_t read64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  return v;
}

inline uint32_t read32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap32(v);
#endif
  return v;
}

inline uint64_t lane_round(uint64_t acc, uint64_t lane) {
  acc += lane * kP2;
  acc = rotl(acc, 31);
  return acc * kP1;
}

inline uint64_t merge(uint64_t acc, uint64_t lane_acc) {
  acc ^= lane_round(0, lane_acc);
  return acc * kP1 + kP4;
}

}  // namespace

uint64_t xxh64(const void* data, size_t size, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  const unsigned char* const end = p + size;
  uint64_t acc;
  // Step 1-3: the four accumulators over 32-byte stripes, then their convergence.
  if (size >= 32) {
    uint64_t v1 = seed + kP1 + kP2, v2 = seed + kP2, v3 = seed, v4 = seed - kP1;
    const unsigned char* const last_stripe = end - 32;
    do {
      v1 = lane_round(v1, read64(p));
      v2 = lane_round(v2, read64(p + 8));
      v3 = lane_round(v3, read64(p + 16));
      v4 = lane_round(v4, read64(p + 24));
      p += 32;
    } while (p <= last_stripe);
    acc = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    acc = merge(acc, v1);
    acc = merge(acc, v2);
    acc = merge(acc, v3);
    acc = merge(acc, v4);
  } else {
    acc = seed + kP5;
  }
  // Step 4: the input length.
  acc += static_cast<uint64_t>(size);
  // Step 5: the remaining 0..31 bytes.
  for (; p + 8 <= end; p += 8) {
    acc ^= lane_round(0, read64(p));
    acc = rotl(acc, 27) * kP1 + kP4;
  }
  if (p + 4 <= end) {
    acc ^= static_cast<uint64_t>(read32(p)) * kP1;
    acc = rotl(acc, 23) * kP2 + kP3;
    p += 4;
  }
  for (; p < end; ++p) {
    acc ^= static_cast<uint64_t>(*p) * kP5;
    acc = rotl(acc, 11) * kP1;
  }
  // Step 6: the avalanche.
  acc ^= acc >> 33;
  acc *= kP2;
  acc ^= acc >> 29;
  acc *= kP3;
  acc ^= acc >> 32;
  return acc;
}

}  // namespace carry
