// Hopper (sm_90a) primitives shared by kernels that use the asynchronous units: shared-memory
// addresses and bf16 packing, wgmma shared-memory descriptors (one 32-bit add a step inside a tile) and
// the wgmma fence / commit / wait, mbarriers, TMA tile loads (2-, 3- and 4-D boxes) and bulk stores,
// TMA's 64-byte swizzle, and stmatrix. Device-only: included by .cu files (through their own .cuh).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

namespace carry::kernels::primitives::hopper {
__device__ __forceinline__ unsigned saddr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ unsigned pk(float x, float y) {
  __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<unsigned*>(&v);
}
__device__ __forceinline__ float2 upk(unsigned u) { return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u)); }

// wgmma shared-memory descriptor as its two words: lo the start address (16-byte units, bits 0-13) and
// the leading byte offset, hi the stride byte offset and the swizzle mode (bits 62-63 of the whole).
// A step within a tile adds to lo alone (shared addresses stay below 2^18: the address field never
// carries), so a chunk computes each tile's base once and every product's descriptor is one 32-bit add
// from it (with the 64-bit descriptor rebuilt a product, the reverse walk spent about 200 of its 290
// instructions a chunk on descriptors).
struct Desc {
  uint32_t lo, hi;
  __device__ __forceinline__ Desc at(int bytes) const { return {lo + (uint32_t)(bytes >> 4), hi}; }
  __device__ __forceinline__ uint64_t u64() const { return (uint64_t)hi << 32 | lo; }
};
__device__ __forceinline__ Desc desc(const void* p, int lbo, int sbo, unsigned swizzle = 0) {
  return {((saddr(p) & 0x3FFFFu) >> 4) | ((uint32_t)(lbo >> 4) & 0x3FFFu) << 16,
          ((uint32_t)(sbo >> 4) & 0x3FFFu) | swizzle << 30};
}
// A 64-row operand in a 128-byte-swizzled half tile: 8-row groups 1024 bytes apart (the other offset
// is unused: 64 elements, one swizzle atom, along the contiguous dimension).
__device__ __forceinline__ Desc desc_sw128(const void* p) { return desc(p, 1024, 1024, 1); }
// A B operand [k][32 n] MN-major in TMA's 64-byte swizzle (sw64_off: 64-byte rows, 8-row groups 512 bytes
// apart): the tiles the bulk stores read (H_c, V_new) serve as the products' B operands too. 32 columns
// are one swizzle atom wide, so only the K-direction offset (512) is read; it is given for both offsets,
// whichever of them the layout names the K stride.
// (Both B layouts advance 1024 bytes, 16 rows, a k16-step.)
__device__ __forceinline__ Desc desc_sw64(const void* p) { return desc(p, 512, 512, 2); }

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Shared-memory writes of the threads made visible to the tensor cores' (async proxy) reads.
__device__ __forceinline__ void fence_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d (m64n32, fp32) += A·B, A and B from shared memory (TA, TB: 1 = MN-major; SB = −1: B negated, an
// exact sign change of every product).
template <int TA, int TB, int SB = 1>
__device__ __forceinline__ void mma_ss(float (&d)[16], Desc a, Desc b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, 1, 1, %18, %19, %20;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a.u64()), "l"(b.u64()), "n"(SB), "n"(TA), "n"(TB));
}
// d (m64n64, fp32: d[4j + e] is row 16·warp + lane/4 + 8·(e/2), column 8j + 2·(lane%4) + e%2 of the
// warpgroup's tile) += A·B, A from each warp's registers (its 16 rows of the m64k16 operand, mma.sync's A
// fragment layout), B [16][64] from shared memory (TB: 1 = MN-major).
// ACC = 0: d = A·B (d's values not read).
template <int TB, int ACC = 1>
__device__ __forceinline__ void mma_rs64(float* d, const unsigned (&a)[4], Desc b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,"
      "%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, %38, 1, 1, %37;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b.u64()), "n"(TB), "n"(ACC));
}
// Registers pinned at this point of the program: their values computed before it and not moved past it by
// the compiler (accumulators and fragments around wgmma.fence and wgmma.wait; values moved across them make
// the assembler serialize the products).
template <int N, int M>
__device__ __forceinline__ void pin(float (&x)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < M; ++j) asm volatile("" : "+f"(x[i][j])::"memory");
}
template <int N, int M>
__device__ __forceinline__ void pin(unsigned (&x)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < M; ++j) asm volatile("" : "+r"(x[i][j])::"memory");
}
// The byte offset of 16-byte piece c (0..7) of row r in a 128-byte-swizzled tile of 128-byte rows (TMA's
// SWIZZLE_128B, the layout desc_sw128 describes): the piece XORed with the row's place in its 8-row group.
__device__ __forceinline__ int sw128_off(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }
// The block's dynamic shared memory, rounded up to 1024 bytes (the swizzle atoms' alignment; the
// launchers ask for 1024 bytes more).
__device__ __forceinline__ unsigned char* smem_1k(unsigned char* p) {
  const unsigned a = saddr(p);
  return p + (((a + 1023u) & ~1023u) - a);
}
// Shared-memory offsets rounded up to the swizzle atoms' 1024 bytes (TMA swizzles by absolute address bits).
constexpr int al1k(int x) { return (x + 1023) & ~1023; }

__device__ __forceinline__ void mbar_init(uint64_t* b) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(saddr(b)) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint64_t* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(saddr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, unsigned parity) {
  asm volatile(
      "{\n.reg .pred P1;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE_%=;\nbra WAIT_%=;\nDONE_%=:\n}\n" ::"r"(saddr(b)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void tma2(void* dst, const CUtensorMap* m, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          saddr(dst)),
      "l"(m), "r"(c0), "r"(c1), "r"(saddr(bar))
      : "memory");
}
__device__ __forceinline__ void tma3(void* dst, const CUtensorMap* m, int c0, int c1, int c2, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(saddr(dst)),
      "l"(m), "r"(c0), "r"(c1), "r"(c2), "r"(saddr(bar))
      : "memory");
}
__device__ __forceinline__ void tma4(void* dst, const CUtensorMap* m, int c0, int c1, int c2, int c3, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6];\n" ::"r"(saddr(dst)),
      "l"(m), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(saddr(bar))
      : "memory");
}
// Bulk tensor store of a shared tile (one thread); the tile may be rewritten after store_wait_read.
__device__ __forceinline__ void tma_store2(const CUtensorMap* m, int c0, int c1, const void* src) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(m), "r"(c0),
               "r"(c1), "r"(saddr(src))
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void store_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// [rows][32] bf16 with 64-byte rows in TMA's 64-byte swizzle: the 16-byte chunk of a row XORed with
// bits 1-2 of the row.
__device__ __forceinline__ int sw64_off(int r, int n) { return r * 64 + ((((n >> 3) ^ (r >> 1)) & 3) << 4) + (n & 7) * 2; }
// Four 8 × 8 bf16 matrices from the warp's mma fragments into shared memory (row r of matrix i at the
// address lane 8i + r gives; a thread's register i holds its pair of matrix i, as in an accumulator).
__device__ __forceinline__ void stsm_x4(void* p, const unsigned (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(saddr(p)), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

}  // namespace carry::kernels::primitives::hopper
