// Running CUDA kernels on the CPU to check their indexing without a GPU: each GPU thread a host thread,
// __syncthreads a barrier of the block's threads, and the warp-collective instructions the kernels use
// (ldmatrix.x4 with and without .trans, mma.sync m16n8k16 bf16 → fp32, __shfl_xor_sync of a float;
// atomicAdd on a float as an atomic host add) emulated per warp with the
// fragment layouts PTX documents, cp.async as plain copies. Kernels written for it (the
// CARRY_LA_EMU path of layers/kernels/decay/fused.cuh) take these in place of the GPU's. The
// numbers, not the speed: a block of 256 threads runs its warps' collectives through barriers.
// The names are those of layers/kernels/primitives/tiles.cuh's helpers. Include before the kernels' header.
// C++20 (std::barrier).
#pragma once

#define CARRY_LA_EMU 1

#include <cuda_bf16.h>

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#undef __global__
#undef __device__
#undef __forceinline__
#undef __launch_bounds__
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)

namespace carry_emu {
struct Dim {
  int x = 0, y = 0, z = 0;
};
struct Warp {
  const unsigned char* addr[32];
  unsigned regs[32][6];
};
inline thread_local Dim tid, bid, bdim;
inline thread_local unsigned char* smem;
inline thread_local std::barrier<>* block_bar;
inline thread_local std::barrier<>* warp_bar;
inline thread_local Warp* warp;
}  // namespace carry_emu

#define threadIdx carry_emu::tid
#define blockIdx carry_emu::bid
#define blockDim carry_emu::bdim
#define SMEM_DECL unsigned char* smem = carry_emu::smem
inline void __syncthreads() { carry_emu::block_bar->arrive_and_wait(); }

// ldmatrix.x4 (.trans): lane 8m + i gives the address of row i of matrix m; a lane receives, of each
// matrix m, the two elements (row lane/4, columns 2(lane%4), +1) of M, or with trans those of Mᵀ:
// M[2(lane%4)][lane/4], M[2(lane%4)+1][lane/4]; the first in the low half.
inline void ldsm_emu(unsigned (&r)[4], const void* p, bool trans) {
  const int lane = carry_emu::tid.x & 31, g = lane >> 2, t4 = lane & 3;
  carry_emu::warp->addr[lane] = static_cast<const unsigned char*>(p);
  carry_emu::warp_bar->arrive_and_wait();
  for (int m = 0; m < 4; ++m) {
    const unsigned char* const* rows = carry_emu::warp->addr + 8 * m;
    uint16_t lo, hi;
    if (!trans) {
      std::memcpy(&lo, rows[g] + 4 * t4, 2);
      std::memcpy(&hi, rows[g] + 4 * t4 + 2, 2);
    } else {
      std::memcpy(&lo, rows[2 * t4] + 2 * g, 2);
      std::memcpy(&hi, rows[2 * t4 + 1] + 2 * g, 2);
    }
    r[m] = lo | (unsigned)hi << 16;
  }
  carry_emu::warp_bar->arrive_and_wait();
}
inline void ldsm_x4(unsigned (&r)[4], const void* p) { ldsm_emu(r, p, false); }
inline void ldsm_x4_t(unsigned (&r)[4], const void* p) { ldsm_emu(r, p, true); }
inline float emu_bf(uint16_t x) { return __bfloat162float(__ushort_as_bfloat16(x)); }
// mma.sync.m16n8k16.row.col, fp32 accumulators: lane (g, t) = (lane/4, lane%4) holds A (g, 2t..2t+1),
// (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..), B (2t..2t+1, g), (2t+8..2t+9, g), and C (g, 2t..2t+1),
// (g+8, 2t..2t+1); the lower index in the low half. Sums in fp32, k ascending.
inline void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  const int lane = carry_emu::tid.x & 31, g = lane >> 2, t4 = lane & 3;
  unsigned* mine = carry_emu::warp->regs[lane];
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b0;
  mine[5] = b1;
  carry_emu::warp_bar->arrive_and_wait();
  float A[16][16], B[16][8];
  for (int L = 0; L < 32; ++L) {
    const int gg = L >> 2, tt = L & 3;
    const unsigned* x = carry_emu::warp->regs[L];
    const int rr[4] = {gg, gg + 8, gg, gg + 8}, cc[4] = {2 * tt, 2 * tt, 2 * tt + 8, 2 * tt + 8};
    for (int i = 0; i < 4; ++i) {
      A[rr[i]][cc[i]] = emu_bf((uint16_t)(x[i] & 0xFFFF));
      A[rr[i]][cc[i] + 1] = emu_bf((uint16_t)(x[i] >> 16));
    }
    B[2 * tt][gg] = emu_bf((uint16_t)(x[4] & 0xFFFF));
    B[2 * tt + 1][gg] = emu_bf((uint16_t)(x[4] >> 16));
    B[2 * tt + 8][gg] = emu_bf((uint16_t)(x[5] & 0xFFFF));
    B[2 * tt + 9][gg] = emu_bf((uint16_t)(x[5] >> 16));
  }
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e >> 1), col = 2 * t4 + (e & 1);
    float acc = d[e];
    for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
    d[e] = acc;
  }
  carry_emu::warp_bar->arrive_and_wait();
}
// __shfl_xor_sync of a float over the whole warp (every lane takes part).
inline float __shfl_xor_sync(unsigned, float x, int m) {
  const int lane = carry_emu::tid.x & 31;
  std::memcpy(carry_emu::warp->regs[lane], &x, 4);
  carry_emu::warp_bar->arrive_and_wait();
  float y;
  std::memcpy(&y, carry_emu::warp->regs[lane ^ m], 4);
  carry_emu::warp_bar->arrive_and_wait();
  return y;
}
// __shfl_up_sync of a float: lane i takes lane i − d's value (its own below d).
inline float __shfl_up_sync(unsigned, float x, int d) {
  const int lane = carry_emu::tid.x & 31;
  std::memcpy(carry_emu::warp->regs[lane], &x, 4);
  carry_emu::warp_bar->arrive_and_wait();
  float y = x;
  if (lane >= d) std::memcpy(&y, carry_emu::warp->regs[lane - d], 4);
  carry_emu::warp_bar->arrive_and_wait();
  return y;
}
inline void __syncwarp(unsigned = 0xffffffffu) { carry_emu::warp_bar->arrive_and_wait(); }
inline float __expf(float x) { return std::exp(x); }
inline float atomicAdd(float* p, float x) { return std::atomic_ref<float>(*p).fetch_add(x); }
inline void cp_async16(void* dst, const void* src) { std::memcpy(dst, src, 16); }
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}
inline float2 unpack_bf16(unsigned u) {
  const unsigned lo = u << 16, hi = u & 0xFFFF0000u;
  float2 f;
  std::memcpy(&f.x, &lo, 4);
  std::memcpy(&f.y, &hi, 4);
  return f;
}
inline unsigned pack_bf16(float x, float y) {
  __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  unsigned u;
  std::memcpy(&u, &v, 4);
  return u;
}

namespace carry_emu {
// kernel() as a grid of blocks, one block after another, each block's threads as host threads sharing
// smem_bytes of "shared memory" (128-byte aligned).
template <class K>
void launch(int gx, int gy, int gz, int threads, size_t smem_bytes, K&& kernel) {
  std::vector<unsigned char> sm(smem_bytes + 256);
  unsigned char* base = sm.data() + (128 - reinterpret_cast<uintptr_t>(sm.data()) % 128) % 128;
  for (int z = 0; z < gz; ++z)
    for (int y = 0; y < gy; ++y)
      for (int x = 0; x < gx; ++x) {
        std::barrier<> block(threads);
        const int nw = (threads + 31) / 32;
        std::vector<std::unique_ptr<std::barrier<>>> wb;
        for (int w = 0; w < nw; ++w) wb.push_back(std::make_unique<std::barrier<>>(std::min(32, threads - 32 * w)));
        std::vector<Warp> ws(nw);
        std::vector<std::thread> th;
        for (int t = 0; t < threads; ++t)
          th.emplace_back([&, t] {
            tid = {t, 0, 0};
            bid = {x, y, z};
            bdim = {threads, 1, 1};
            smem = base;
            block_bar = &block;
            warp_bar = wb[t / 32].get();
            warp = &ws[t / 32];
            kernel();
          });
        for (auto& t : th) t.join();
      }
}
}  // namespace carry_emu
