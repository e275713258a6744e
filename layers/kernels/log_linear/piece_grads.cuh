// Log-linear Gated DeltaNet's walk-piece gradients that read every level's state (api.h, level_read_grads and
// level_write_sum; layers/log_linear/level_walk.h states the math): device code of piece_grads.cu and of
// tests/emulation (CARRY_LA_EMU).
//
// read_grads_kernel: one block of 8 warps a chunk of one head. For each level ℓ read at the chunk it forms
// Z = dO·S^ℓᵀ [64 × dk] (mma over dv in 64-row tiles of the stored Sᵀ, double-buffered), then
// dλ_t[ℓ] = <P_t, Z_t> and dP += λ[ℓ] ⊙ Z, in registers: the states are read once, and nothing of a level's
// size is written. Levels not read at the chunk give dλ = 0.
// write_sum_kernel: D = Σ over the levels written at the chunk of dS^ℓ, summed in level order in fp32.
#pragma once

#include "layers/kernels/primitives/tiles.cuh"

#ifndef SMEM_DECL
#define SMEM_DECL extern __shared__ __align__(128) unsigned char smem[]
#endif

namespace carry::kernels::log_linear::grads {

using carry::kernels::primitives::bf16;
using carry::kernels::primitives::frag_mma;
using carry::kernels::primitives::frag_store_f32;
using carry::kernels::primitives::load_tile_async;
using carry::kernels::primitives::to_f;

constexpr int C = 64, NT = 256;

// Whether level first_level + j is read (second half of its block) by the chunk starting at absolute position pos.
__device__ __forceinline__ bool reads(long pos, int level) { return (pos >> (level - 1)) & 1; }

template <int DK, int DV>
struct ReadSmem {
  static constexpr int LK = DK + 8, LO = DV + 8;
  static constexpr size_t oO = 0, oP = oO + (size_t)C * LO * 2, oS = oP + (size_t)C * LK * 2,
                          oR = oS + 2 * (size_t)64 * LK * 2, oL = oR + 2 * C * 4, bytes = oL + C * 4;
};

// St [BH,N,J,DV,DK] bf16 (Sᵀ of each level entering each chunk), dO [BH,T,DV] bf16, P [BH,T,DK] bf16, lam [BH,J,T]
// fp32 → dP [BH,T,DK] fp32, dlam [BH,J,T] fp32. Grid (N, BH).
template <int DK, int DV>
__global__ void __launch_bounds__(NT) read_grads_kernel(const bf16* __restrict__ St, const bf16* __restrict__ dO,
                                                        const bf16* __restrict__ P, const float* __restrict__ lam,
                                                        float* __restrict__ dP, float* __restrict__ dlam, int T_, int J,
                                                        long offset, int first_level) {
  using L = ReadSmem<DK, DV>;
  constexpr int LK = L::LK, LO = L::LO, NV = DV / 64, HK = DK / 2, NK8 = DK / 16;
  namespace pr = carry::kernels::primitives;
  SMEM_DECL;
  bf16* sO = reinterpret_cast<bf16*>(smem + L::oO);
  bf16* sP = reinterpret_cast<bf16*>(smem + L::oP);
  bf16* sS = reinterpret_cast<bf16*>(smem + L::oS);
  float* sR = reinterpret_cast<float*>(smem + L::oR);  // the row sums' two column halves
  float* sL = reinterpret_cast<float*>(smem + L::oL);  // λ[ℓ] of the chunk's tokens
  const int n = blockIdx.x, tid = threadIdx.x, N = T_ / C;
  const long bh = blockIdx.y, t0 = (long)n * C, pos = offset + t0;
  const int warp = tid >> 5, m0 = (warp & 3) * 16, half = warp >> 2;
  load_tile_async<bf16, C, DV, NT>(sO, LO, dO + (bh * T_ + t0) * DV, DV);
  load_tile_async<bf16, C, DK, NT>(sP, LK, P + (bh * T_ + t0) * DK, DK);
  pr::cp_async_commit();
  // The (level, dv tile) steps of the levels read here, in order; tile i of the list into buffer i % 2.
  auto load_step = [&](int j, int it, int buf) {
    load_tile_async<bf16, 64, DK, NT>(sS + buf * 64 * LK, LK, St + (((bh * N + n) * J + j) * DV + it * 64) * (long)DK, DK);
    pr::cp_async_commit();
  };
  auto next_read = [&](int j) {
    while (j < J && !reads(pos, first_level + j)) ++j;
    return j;
  };
  float acc[NK8][4] = {};
  int j = next_read(0), step = 0;
  if (j < J) load_step(j, 0, 0);
  for (int jj = 0; jj < J; ++jj)
    if (!reads(pos, first_level + jj) && tid < C) dlam[(bh * J + jj) * T_ + t0 + tid] = 0.f;
  while (j < J) {
    float z[NK8][4] = {};
    for (int it = 0; it < NV; ++it, ++step) {
      // the next step's tile: the next dv tile of this level, or the first of the next level read
      const int nj = it + 1 < NV ? j : next_read(j + 1), nit = it + 1 < NV ? it + 1 : 0;
      if (nj < J) {
        load_step(nj, nit, (step + 1) & 1);
        pr::cp_async_wait<1>();
      } else {
        pr::cp_async_wait<0>();
      }
      __syncthreads();
      frag_mma<NK8, 64, false, false>(z, sO + it * 64, LO, sS + (step & 1) * 64 * LK, LK, m0, half * HK);
      __syncthreads();
    }
    if (tid < C) sL[tid] = lam[(bh * J + j) * T_ + t0 + tid];
    {  // dλ_t = <P_t, Z_t>: the lane's columns, its row group, then the two column halves in order
      const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int nt = 0; nt < NK8; ++nt) {
        const int col = half * HK + nt * 8 + 2 * t4;
        s0 += z[nt][0] * to_f(sP[(m0 + g) * LK + col]) + z[nt][1] * to_f(sP[(m0 + g) * LK + col + 1]);
        s1 += z[nt][2] * to_f(sP[(m0 + g + 8) * LK + col]) + z[nt][3] * to_f(sP[(m0 + g + 8) * LK + col + 1]);
      }
      s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
      s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
      s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
      s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
      if (t4 == 0) sR[half * C + m0 + g] = s0, sR[half * C + m0 + g + 8] = s1;
    }
    __syncthreads();
    if (tid < C) dlam[(bh * J + j) * T_ + t0 + tid] = sR[tid] + sR[C + tid];
    {
      const int g = (tid & 31) >> 2;
#pragma unroll
      for (int nt = 0; nt < NK8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] += sL[m0 + g + (e >> 1) * 8] * z[nt][e];
    }
    __syncthreads();
    j = next_read(j + 1);
  }
  frag_store_f32<NK8>(dP + (bh * T_ + t0) * DK, DK, acc, m0, half * HK);
  pr::cp_async_wait<0>();
}

// dSt [BH,N,J,E] bf16 (E = dv·dk) → D [BH,N,E] bf16: D = Σ_{levels written at chunk n} dSt[·,n,j], in level order.
// One thread 8 consecutive elements; grid (E / (8·NT), N, BH).
__global__ void __launch_bounds__(NT) write_sum_kernel(const bf16* __restrict__ dSt, bf16* __restrict__ D, int N, int J,
                                                       long E, long offset, int first_level) {
  const long bh = blockIdx.z, n = blockIdx.y, i = ((long)blockIdx.x * NT + threadIdx.x) * 8;
  if (i >= E) return;
  const long pos = offset + n * C;
  float s[8] = {};
  for (int j = 0; j < J; ++j) {
    if (reads(pos, first_level + j)) continue;
    const uint4 u = *reinterpret_cast<const uint4*>(dSt + ((bh * N + n) * J + j) * E + i);
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = carry::kernels::primitives::tc::unpack_bf16(w[k]);
      s[2 * k] += f.x, s[2 * k + 1] += f.y;
    }
  }
  uint4 o;
  o.x = carry::kernels::primitives::tc::pack_bf16(s[0], s[1]);
  o.y = carry::kernels::primitives::tc::pack_bf16(s[2], s[3]);
  o.z = carry::kernels::primitives::tc::pack_bf16(s[4], s[5]);
  o.w = carry::kernels::primitives::tc::pack_bf16(s[6], s[7]);
  *reinterpret_cast<uint4*>(D + (bh * N + n) * E + i) = o;
}

}  // namespace carry::kernels::log_linear::grads
