// XXH64, the 64-bit xxHash of Yann Collet, written from its specification (xxHash's
// doc/xxhash_spec.md, "XXH64 Algorithm Description"): the checksum of every tensor of a checkpoint
// and of its manifest (framework/io/checkpoint.h). Four 64-bit accumulators take 32-byte stripes in
// parallel (each lane: acc += lane·P2, acc = rotl(acc, 31), acc *= P1), are merged, take the last
// 0..31 bytes 8, 4 and 1 at a time, and the result is avalanched. Its output equals the reference
// implementation's XXH64(data, size, seed), byte order little-endian as the specification reads input,
// on any host; tests/framework/io/xxh64_test.cpp checks it against the reference's outputs.
#pragma once

#include <cstddef>
#include <cstdint>

namespace carry {

uint64_t xxh64(const void* data, size_t size, uint64_t seed = 0);

}  // namespace carry
