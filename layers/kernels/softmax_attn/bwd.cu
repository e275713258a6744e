// Backward of softmax attention (api.h), FlashAttention-2's formulas without its atomics: with
// P = 2^{S − lse} recomputed from the saved base-2 log-sum-exp (S the scores in base-2 units),
//   dP = dO·Vᵀ,  D = rowsum(dO ⊙ O),  dS = P ⊙ (dP − D),
//   dV = Pᵀ·dO,  dK = scale·dSᵀ·Q,  dQ = scale·dS·K.
// Two kernels, each output element summed by one thread in the schedule's fixed order (no atomics:
// the same bits run to run, and on any suffix with a halo, see common.cuh):
//
//  1. bwd_dq_bf16_kernel, grid (T/64 query blocks, H, B), 128 threads (4 warps), two blocks an SM.
//     One block owns 64 query rows of one head; warp w owns rows 16w..16w+15. First D of its rows
//     (two threads a row, from o and dO in HBM), written to HBM for kernel 2. In registers for the
//     whole run: the warp's Q and dO fragments (16×dk, 16×dv) and dQ (16×dk, fp32). It walks the key
//     blocks in the forward's order with K, V [64,d] double-buffered by cp.async; per half block of 32
//     keys: S = Q·Kᵀ, dP = dO·Vᵀ (mma.sync), dS = P ⊙ (dP − D) in the accumulators, dQ += dS·K with
//     dS as bf16 A fragments. FLOPs: 6·64·64·d per block pair. Shared memory 102 KB at d = 128.
//  2. bwd_dkv_bf16_kernel, grid (T/64 key blocks, H, B), 128 threads, two blocks an SM. One block owns
//     64 key rows; warp w owns key rows 16w..16w+15 with dK (16×dk) and dV (16×dv) in registers, its
//     K and V rows in shared memory for the whole run. It walks the query blocks that reach its keys
//     (diagonal first, then later ones) with Q, dO [64,d], lse and D double-buffered; per half block
//     of 32 queries: Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, Pᵀ and dSᵀ in the accumulators, dV += Pᵀ·dO,
//     dK += dSᵀ·Q. FLOPs: 8·64·64·d per block pair. Shared memory 102 KB at d = 128.
// HBM per block pair: kernel 1 reads k, v blocks, kernel 2 reads q, dO blocks (64·2d·2 bytes); each
// writes its gradients once. Both work on half blocks so that the S and dP accumulators take 16
// registers each beside the 64-register gradient tiles (238 and 246 registers at d = 128, no spills).
//
// bwd_dq_f32_kernel, bwd_dkv_f32_kernel: the fp32 inputs' path, same schedule and order, on
// shared-memory tiles with the FMA gemm of tiles.cuh (256 threads). The dK/dV kernel takes 32 key
// rows a block (two blocks a 64-key block, each with the schedule of its 64-block) so that its eight
// fp32 tiles fit in shared memory. Correct to fp32; not tuned.
#include "layers/kernels/softmax_attn/api.h"
#include "layers/kernels/softmax_attn/common.cuh"

namespace carry::kernels::softmax_attn {
using namespace carry::kernels::primitives;

namespace {

// ---------------------------------------------------------------------------------------------
// 1. dQ (and D), bf16
template <int DK, int DV>
struct DqSmem {
  static constexpr int C = kBlock, LK = DK + 8, LV = DV + 8;
  static constexpr size_t oQ = 0;
  static constexpr size_t odO = al128(oQ + C * LK * 2);
  static constexpr size_t oK = al128(odO + C * LV * 2);
  static constexpr size_t oV = al128(oK + 2 * C * LK * 2);
  static constexpr size_t oStat = al128(oV + 2 * C * LV * 2);  // lse, D of the block's rows: [64] each
  static constexpr size_t bytes = oStat + 2 * C * 4;
};

// Σ over 8 bf16 pairs of 16-byte pieces a and b of a·b, in order.
__device__ __forceinline__ float dot8(uint4 a, uint4 b, float acc) {
  const tc::u32 ua[4] = {a.x, a.y, a.z, a.w}, ub[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 x = tc::unpack_bf16(ua[e]), y = tc::unpack_bf16(ub[e]);
    acc = fmaf(x.x, y.x, acc);
    acc = fmaf(x.y, y.y, acc);
  }
  return acc;
}

template <int DK, int DV>
__global__ void __launch_bounds__(128, 2) bwd_dq_bf16_kernel(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const bf16* __restrict__ o,
    const float* __restrict__ lse, const bf16* __restrict__ dO, bf16* __restrict__ dq, float* __restrict__ Dg,
    float scale_log2, float scale, int T_, int H, int window) {
  constexpr int C = kBlock, NT = 128, KT = DK / 16, VT = DV / 16;
  using L = DqSmem<DK, DV>;
  extern __shared__ __align__(128) char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::oQ);
  bf16* sdO = reinterpret_cast<bf16*>(smem + L::odO);
  bf16* sK = reinterpret_cast<bf16*>(smem + L::oK);
  bf16* sV = reinterpret_cast<bf16*>(smem + L::oV);
  float* sLse = reinterpret_cast<float*>(smem + L::oStat);
  float* sD = sLse + C;

  const int N = T_ / C;
  const int i = N - 1 - (int)blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3, r0 = warp * 16;
  const long rowk = (long)H * DK, rowv = (long)H * DV, bhT = ((long)b * H + h) * T_;
  const long q0 = (long)b * T_ * rowk + (long)h * DK, v0 = (long)b * T_ * rowv + (long)h * DV;
  const int j_last = first_key_block(i, window);

  auto issue = [&](int j, int buf) {
    load_tile_async<bf16, C, DK, NT>(sK + buf * C * L::LK, L::LK, k + q0 + (long)j * C * rowk, rowk);
    load_tile_async<bf16, C, DV, NT>(sV + buf * C * L::LV, L::LV, v + v0 + (long)j * C * rowv, rowv);
  };
  load_tile_async<bf16, C, DK, NT>(sQ, L::LK, q + q0 + (long)i * C * rowk, rowk);
  load_tile_async<bf16, C, DV, NT>(sdO, L::LV, dO + v0 + (long)i * C * rowv, rowv);
  if (tid < C / 4) cp_async16(sLse + tid * 4, lse + bhT + (long)i * C + tid * 4);
  issue(i, 0);
  cp_async_commit();

  {  // D = rowsum(dO ⊙ O): threads 2r and 2r+1 sum the two halves of row r in order, then add them.
    const int r = tid >> 1, half = tid & 1;
    const long off = v0 + ((long)i * C + r) * rowv + half * (DV / 2);
    float acc = 0.f;
#pragma unroll
    for (int c = 0; c < DV / 2; c += 8)
      acc = dot8(*reinterpret_cast<const uint4*>(o + off + c), *reinterpret_cast<const uint4*>(dO + off + c), acc);
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    if (half == 0) {
      sD[r] = acc;
      Dg[bhT + (long)i * C + r] = acc;
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  tc::u32 qa[KT][4], oa[VT][4];  // the warp's Q and dO rows as A fragments
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) tc::load_a(qa[kk], sQ, L::LK, r0, kk * 16);
#pragma unroll
  for (int kk = 0; kk < VT; ++kk) tc::load_a(oa[kk], sdO, L::LV, r0, kk * 16);
  const float lrow[2] = {sLse[r0 + g], sLse[r0 + g + 8]}, drow[2] = {sD[r0 + g], sD[r0 + g + 8]};
  float acc[DK / 8][4];  // dQ, rows r0+g (entries 0, 1) and r0+g+8 (entries 2, 3)
#pragma unroll
  for (int nt = 0; nt < DK / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

  for (int j = i, n = 0; j >= j_last; --j, ++n) {
    const int buf = n & 1;
    if (j > j_last) issue(j - 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const bf16* cK = sK + buf * C * L::LK;
    const bf16* cV = sV + buf * C * L::LV;
    const bool masked = block_masked(i, j, window);
#pragma unroll
    for (int kh = 0; kh < 2; ++kh) {  // keys 32·kh .. 32·kh+31
      float s[4][4], dp[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KT; ++kk)
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          tc::u32 bb[4];
          tc::load_b2(bb, cK, L::LK, kk * 16, kh * 32 + np * 16);
          tc::mma16816(s[2 * np], qa[kk], bb[0], bb[1]);
          tc::mma16816(s[2 * np + 1], qa[kk], bb[2], bb[3]);
        }
#pragma unroll
      for (int kk = 0; kk < VT; ++kk)
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          tc::u32 bb[4];
          tc::load_b2(bb, cV, L::LV, kk * 16, kh * 32 + np * 16);
          tc::mma16816(dp[2 * np], oa[kk], bb[0], bb[1]);
          tc::mma16816(dp[2 * np + 1], oa[kk], bb[2], bb[3]);
        }
      // Entry (nt, e): query row r0+g+8(e>>1), key column 32kh + 8nt + 2t4 + (e&1); t − s below.
      const int dist0 = (i - j) * C + r0 + g - kh * 32 - 2 * t4;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hf = e >> 1;
          float p = exp2f(s[nt][e] * scale_log2 - lrow[hf]);
          if (masked && !visible(dist0 + hf * 8 - nt * 8 - (e & 1), window)) p = 0.f;  // also drops 2^{+big}
          s[nt][e] = p * (dp[nt][e] - drow[hf]);                                         // dS
        }
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {  // dQ += dS·K over keys 32kh+16kk ..
        const tc::u32 da[4] = {tc::pack_bf16(s[2 * kk][0], s[2 * kk][1]), tc::pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                               tc::pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               tc::pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int np = 0; np < DK / 16; ++np) {
          tc::u32 bb[4];
          tc::load_b2_t(bb, cK, L::LK, kh * 32 + kk * 16, np * 16);
          tc::mma16816(acc[2 * np], da, bb[0], bb[1]);
          tc::mma16816(acc[2 * np + 1], da, bb[2], bb[3]);
        }
      }
    }
    __syncthreads();  // the buffer is refilled by the next iteration's issue
  }

  // Stage the warp's dQ rows over its own Q rows (only this warp read them), then 16-byte stores.
#pragma unroll
  for (int nt = 0; nt < DK / 8; ++nt) {
    const int col = nt * 8 + 2 * t4;
    *reinterpret_cast<tc::u32*>(sQ + (r0 + g) * L::LK + col) = tc::pack_bf16(acc[nt][0] * scale, acc[nt][1] * scale);
    *reinterpret_cast<tc::u32*>(sQ + (r0 + g + 8) * L::LK + col) =
        tc::pack_bf16(acc[nt][2] * scale, acc[nt][3] * scale);
  }
  __syncwarp();
  constexpr int PR = DK / 8;
  bf16* out = dq + q0 + ((long)i * C + r0) * rowk;
#pragma unroll
  for (int p = lane; p < 16 * PR; p += 32) {
    const int r = p / PR, c = (p % PR) * 8;
    *reinterpret_cast<uint4*>(out + (long)r * rowk + c) = *reinterpret_cast<const uint4*>(sQ + (r0 + r) * L::LK + c);
  }
}

// ---------------------------------------------------------------------------------------------
// 2. dK, dV, bf16
template <int DK, int DV>
struct DkvSmem {
  static constexpr int C = kBlock, LK = DK + 8, LV = DV + 8;
  static constexpr size_t oK = 0;
  static constexpr size_t oV = al128(oK + C * LK * 2);
  static constexpr size_t oQ = al128(oV + C * LV * 2);
  static constexpr size_t odO = al128(oQ + 2 * C * LK * 2);
  static constexpr size_t oStat = al128(odO + 2 * C * LV * 2);  // per buffer: lse [64], then D [64]
  static constexpr size_t bytes = oStat + 2 * 2 * C * 4;
};

template <int DK, int DV>
__global__ void __launch_bounds__(128, 2) bwd_dkv_bf16_kernel(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ lse,
    const float* __restrict__ Dg, const bf16* __restrict__ dO, bf16* __restrict__ dk, bf16* __restrict__ dv,
    float scale_log2, float scale, int T_, int H, int window) {
  constexpr int C = kBlock, NT = 128, KT = DK / 16, VT = DV / 16;
  using L = DkvSmem<DK, DV>;
  extern __shared__ __align__(128) char smem[];
  bf16* sK = reinterpret_cast<bf16*>(smem + L::oK);
  bf16* sV = reinterpret_cast<bf16*>(smem + L::oV);
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::oQ);
  bf16* sdO = reinterpret_cast<bf16*>(smem + L::odO);
  float* sStat = reinterpret_cast<float*>(smem + L::oStat);

  const int N = T_ / C;
  const int j = blockIdx.x;  // the longest columns first (full causal: key block j meets N − j query blocks)
  const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3, r0 = warp * 16;
  const long rowk = (long)H * DK, rowv = (long)H * DV, bhT = ((long)b * H + h) * T_;
  const long q0 = (long)b * T_ * rowk + (long)h * DK, v0 = (long)b * T_ * rowv + (long)h * DV;
  const int i_last = last_query_block(j, window, N);

  auto issue = [&](int i, int buf) {
    load_tile_async<bf16, C, DK, NT>(sQ + buf * C * L::LK, L::LK, q + q0 + (long)i * C * rowk, rowk);
    load_tile_async<bf16, C, DV, NT>(sdO + buf * C * L::LV, L::LV, dO + v0 + (long)i * C * rowv, rowv);
    if (tid < C / 2) {  // 16 pieces of lse, then 16 of D
      const float* src = tid < C / 4 ? lse + bhT + (long)i * C + tid * 4 : Dg + bhT + (long)i * C + (tid - C / 4) * 4;
      cp_async16(sStat + buf * 2 * C + tid * 4, src);
    }
  };
  load_tile_async<bf16, C, DK, NT>(sK, L::LK, k + q0 + (long)j * C * rowk, rowk);
  load_tile_async<bf16, C, DV, NT>(sV, L::LV, v + v0 + (long)j * C * rowv, rowv);
  issue(j, 0);
  cp_async_commit();

  float ak[DK / 8][4], av[DV / 8][4];  // dK, dV: key rows r0+g (entries 0, 1) and r0+g+8 (entries 2, 3)
#pragma unroll
  for (int nt = 0; nt < DK / 8; ++nt) ak[nt][0] = ak[nt][1] = ak[nt][2] = ak[nt][3] = 0.f;
#pragma unroll
  for (int nt = 0; nt < DV / 8; ++nt) av[nt][0] = av[nt][1] = av[nt][2] = av[nt][3] = 0.f;

  for (int i = j, n = 0; i <= i_last; ++i, ++n) {
    const int buf = n & 1;
    if (i < i_last) issue(i + 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const bf16* cQ = sQ + buf * C * L::LK;
    const bf16* cdO = sdO + buf * C * L::LV;
    const float* cL = sStat + buf * 2 * C;
    const float* cD = cL + C;
    const bool masked = block_masked(i, j, window);
#pragma unroll
    for (int qh = 0; qh < 2; ++qh) {  // queries 32·qh .. 32·qh+31
      float s[4][4], dp[4][4];        // Sᵀ, dPᵀ: key rows × query columns
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KT; ++kk) {
        tc::u32 ka[4];
        tc::load_a(ka, sK, L::LK, r0, kk * 16);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          tc::u32 bb[4];
          tc::load_b2(bb, cQ, L::LK, kk * 16, qh * 32 + np * 16);
          tc::mma16816(s[2 * np], ka, bb[0], bb[1]);
          tc::mma16816(s[2 * np + 1], ka, bb[2], bb[3]);
        }
      }
#pragma unroll
      for (int kk = 0; kk < VT; ++kk) {
        tc::u32 va[4];
        tc::load_a(va, sV, L::LV, r0, kk * 16);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          tc::u32 bb[4];
          tc::load_b2(bb, cdO, L::LV, kk * 16, qh * 32 + np * 16);
          tc::mma16816(dp[2 * np], va, bb[0], bb[1]);
          tc::mma16816(dp[2 * np + 1], va, bb[2], bb[3]);
        }
      }
      // Entry (nt, e): key row r0+g+8(e>>1), query column 32qh + 8nt + 2t4 + (e&1); t − s below.
      const int dist0 = (i - j) * C + qh * 32 + 2 * t4 - r0 - g;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int col = qh * 32 + nt * 8 + 2 * t4;
        const float2 lq = *reinterpret_cast<const float2*>(cL + col), dq2 = *reinterpret_cast<const float2*>(cD + col);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float p = exp2f(s[nt][e] * scale_log2 - ((e & 1) ? lq.y : lq.x));
          if (masked && !visible(dist0 + nt * 8 + (e & 1) - (e >> 1) * 8, window)) p = 0.f;
          dp[nt][e] = p * (dp[nt][e] - ((e & 1) ? dq2.y : dq2.x));  // dSᵀ
          s[nt][e] = p;                                               // Pᵀ
        }
      }
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {  // over queries 32qh+16kk ..
        const tc::u32 pa[4] = {tc::pack_bf16(s[2 * kk][0], s[2 * kk][1]), tc::pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                               tc::pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               tc::pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
        const tc::u32 da[4] = {tc::pack_bf16(dp[2 * kk][0], dp[2 * kk][1]), tc::pack_bf16(dp[2 * kk][2], dp[2 * kk][3]),
                               tc::pack_bf16(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                               tc::pack_bf16(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
        for (int np = 0; np < DV / 16; ++np) {  // dV += Pᵀ·dO
          tc::u32 bb[4];
          tc::load_b2_t(bb, cdO, L::LV, qh * 32 + kk * 16, np * 16);
          tc::mma16816(av[2 * np], pa, bb[0], bb[1]);
          tc::mma16816(av[2 * np + 1], pa, bb[2], bb[3]);
        }
#pragma unroll
        for (int np = 0; np < DK / 16; ++np) {  // dK += dSᵀ·Q
          tc::u32 bb[4];
          tc::load_b2_t(bb, cQ, L::LK, qh * 32 + kk * 16, np * 16);
          tc::mma16816(ak[2 * np], da, bb[0], bb[1]);
          tc::mma16816(ak[2 * np + 1], da, bb[2], bb[3]);
        }
      }
    }
    __syncthreads();  // the buffer is refilled by the next iteration's issue
  }

  // Stage the warp's rows over its own K and V rows (only this warp read them), then 16-byte stores.
#pragma unroll
  for (int nt = 0; nt < DK / 8; ++nt) {
    const int col = nt * 8 + 2 * t4;
    *reinterpret_cast<tc::u32*>(sK + (r0 + g) * L::LK + col) = tc::pack_bf16(ak[nt][0] * scale, ak[nt][1] * scale);
    *reinterpret_cast<tc::u32*>(sK + (r0 + g + 8) * L::LK + col) = tc::pack_bf16(ak[nt][2] * scale, ak[nt][3] * scale);
  }
#pragma unroll
  for (int nt = 0; nt < DV / 8; ++nt) {
    const int col = nt * 8 + 2 * t4;
    *reinterpret_cast<tc::u32*>(sV + (r0 + g) * L::LV + col) = tc::pack_bf16(av[nt][0], av[nt][1]);
    *reinterpret_cast<tc::u32*>(sV + (r0 + g + 8) * L::LV + col) = tc::pack_bf16(av[nt][2], av[nt][3]);
  }
  __syncwarp();
  bf16* outk = dk + q0 + ((long)j * C + r0) * rowk;
  bf16* outv = dv + v0 + ((long)j * C + r0) * rowv;
#pragma unroll
  for (int p = lane; p < 16 * (DK / 8); p += 32) {
    const int r = p / (DK / 8), c = (p % (DK / 8)) * 8;
    *reinterpret_cast<uint4*>(outk + (long)r * rowk + c) = *reinterpret_cast<const uint4*>(sK + (r0 + r) * L::LK + c);
  }
#pragma unroll
  for (int p = lane; p < 16 * (DV / 8); p += 32) {
    const int r = p / (DV / 8), c = (p % (DV / 8)) * 8;
    *reinterpret_cast<uint4*>(outv + (long)r * rowv + c) = *reinterpret_cast<const uint4*>(sV + (r0 + r) * L::LV + c);
  }
}

// ---------------------------------------------------------------------------------------------
// fp32 on shared-memory tiles
template <int DK, int DV>
struct DqF32Smem {
  static constexpr int C = kBlock, LK = DK + kPadF, LV = DV + kPadF, LS = C + kPadF;
  static constexpr size_t oQ = 0;
  static constexpr size_t odO = al128(oQ + C * LK * 4);
  static constexpr size_t oK = al128(odO + C * LV * 4);
  static constexpr size_t oV = al128(oK + C * LK * 4);
  static constexpr size_t oS = al128(oV + C * LV * 4);    // S, then dS
  static constexpr size_t odP = al128(oS + C * LS * 4);
  static constexpr size_t odQ = al128(odP + C * LS * 4);
  static constexpr size_t oStat = al128(odQ + C * LK * 4);  // lse, D: [64] each
  static constexpr size_t bytes = oStat + 2 * C * 4;
};

template <int DK, int DV>
__global__ void __launch_bounds__(256) bwd_dq_f32_kernel(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, const float* __restrict__ o,
    const float* __restrict__ lse, const float* __restrict__ dO, float* __restrict__ dq, float* __restrict__ Dg,
    float scale_log2, float scale, int T_, int H, int window) {
  constexpr int C = kBlock, NW = 8, NT = NW * 32;
  using L = DqF32Smem<DK, DV>;
  extern __shared__ __align__(128) char smem[];
  float* sQ = reinterpret_cast<float*>(smem + L::oQ);
  float* sdO = reinterpret_cast<float*>(smem + L::odO);
  float* sK = reinterpret_cast<float*>(smem + L::oK);
  float* sV = reinterpret_cast<float*>(smem + L::oV);
  float* sS = reinterpret_cast<float*>(smem + L::oS);
  float* sdP = reinterpret_cast<float*>(smem + L::odP);
  float* sdQ = reinterpret_cast<float*>(smem + L::odQ);
  float* sLse = reinterpret_cast<float*>(smem + L::oStat);
  float* sD = sLse + C;

  const int N = T_ / C;
  const int i = N - 1 - (int)blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const long rowk = (long)H * DK, rowv = (long)H * DV, bhT = ((long)b * H + h) * T_;
  const long q0 = (long)b * T_ * rowk + (long)h * DK, v0 = (long)b * T_ * rowv + (long)h * DV;

  load_tile_async<float, C, DK, NT>(sQ, L::LK, q + q0 + (long)i * C * rowk, rowk);
  load_tile_async<float, C, DV, NT>(sdO, L::LV, dO + v0 + (long)i * C * rowv, rowv);
  cp_async_commit();
  for (int x = tid; x < C * DK; x += NT) sdQ[(x / DK) * L::LK + x % DK] = 0.f;
  cp_async_wait<0>();
  __syncthreads();
  if (tid < C) {  // D of row tid, columns in order; the row's lse
    const float* orow = o + v0 + ((long)i * C + tid) * rowv;
    float acc = 0.f;
    for (int c = 0; c < DV; ++c) acc = fmaf(orow[c], sdO[tid * L::LV + c], acc);
    sD[tid] = acc;
    Dg[bhT + (long)i * C + tid] = acc;
    sLse[tid] = lse[bhT + (long)i * C + tid];
  }
  const int j_last = first_key_block(i, window);
  for (int j = i; j >= j_last; --j) {
    load_tile_async<float, C, DK, NT>(sK, L::LK, k + q0 + (long)j * C * rowk, rowk);
    load_tile_async<float, C, DV, NT>(sV, L::LV, v + v0 + (long)j * C * rowv, rowv);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    gemm<float, C, C, DK, false, true, NW>(sQ, L::LK, sK, L::LK, sS, L::LS, false);   // S = Q·Kᵀ
    gemm<float, C, C, DV, false, true, NW>(sdO, L::LV, sV, L::LV, sdP, L::LS, false);  // dP = dO·Vᵀ
    __syncthreads();
    const bool masked = block_masked(i, j, window);
    for (int x = tid; x < C * C; x += NT) {
      const int r = x / C, c = x % C;
      float p = exp2f(sS[r * L::LS + c] * scale_log2 - sLse[r]);
      if (masked && !visible((i - j) * C + r - c, window)) p = 0.f;
      sS[r * L::LS + c] = p * (sdP[r * L::LS + c] - sD[r]);  // dS
    }
    __syncthreads();
    gemm<float, C, DK, C, false, false, NW>(sS, L::LS, sK, L::LK, sdQ, L::LK, true);  // dQ += dS·K
    __syncthreads();
  }
  float* out = dq + q0 + (long)i * C * rowk;
  for (int x = tid; x < C * DK; x += NT) {
    const int r = x / DK, c = x % DK;
    out[(long)r * rowk + c] = sdQ[r * L::LK + c] * scale;
  }
}

template <int DK, int DV>
struct DkvF32Smem {
  static constexpr int C = kBlock, R = kBlock / 2, LK = DK + kPadF, LV = DV + kPadF, LS = C + kPadF;
  static constexpr size_t oK = 0;
  static constexpr size_t oV = al128(oK + R * LK * 4);
  static constexpr size_t oQ = al128(oV + R * LV * 4);
  static constexpr size_t odO = al128(oQ + C * LK * 4);
  static constexpr size_t oS = al128(odO + C * LV * 4);   // Sᵀ, then Pᵀ
  static constexpr size_t odP = al128(oS + R * LS * 4);   // dPᵀ, then dSᵀ
  static constexpr size_t odK = al128(odP + R * LS * 4);
  static constexpr size_t odV = al128(odK + R * LK * 4);
  static constexpr size_t oStat = al128(odV + R * LV * 4);  // lse, D of the query block: [64] each
  static constexpr size_t bytes = oStat + 2 * C * 4;
};

template <int DK, int DV>
__global__ void __launch_bounds__(256) bwd_dkv_f32_kernel(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ lse, const float* __restrict__ Dg, const float* __restrict__ dO, float* __restrict__ dk,
    float* __restrict__ dv, float scale_log2, float scale, int T_, int H, int window) {
  constexpr int C = kBlock, NW = 8, NT = NW * 32;
  using L = DkvF32Smem<DK, DV>;
  constexpr int R = L::R;
  extern __shared__ __align__(128) char smem[];
  float* sK = reinterpret_cast<float*>(smem + L::oK);
  float* sV = reinterpret_cast<float*>(smem + L::oV);
  float* sQ = reinterpret_cast<float*>(smem + L::oQ);
  float* sdO = reinterpret_cast<float*>(smem + L::odO);
  float* sS = reinterpret_cast<float*>(smem + L::oS);
  float* sdP = reinterpret_cast<float*>(smem + L::odP);
  float* sdK = reinterpret_cast<float*>(smem + L::odK);
  float* sdV = reinterpret_cast<float*>(smem + L::odV);
  float* sLse = reinterpret_cast<float*>(smem + L::oStat);
  float* sD = sLse + C;

  const int N = T_ / C;
  const int j = blockIdx.x / 2, kr = (blockIdx.x % 2) * R;  // key block j, its rows kr .. kr+R−1
  const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const long rowk = (long)H * DK, rowv = (long)H * DV, bhT = ((long)b * H + h) * T_;
  const long q0 = (long)b * T_ * rowk + (long)h * DK, v0 = (long)b * T_ * rowv + (long)h * DV;

  load_tile_async<float, R, DK, NT>(sK, L::LK, k + q0 + ((long)j * C + kr) * rowk, rowk);
  load_tile_async<float, R, DV, NT>(sV, L::LV, v + v0 + ((long)j * C + kr) * rowv, rowv);
  for (int x = tid; x < R * DK; x += NT) sdK[(x / DK) * L::LK + x % DK] = 0.f;
  for (int x = tid; x < R * DV; x += NT) sdV[(x / DV) * L::LV + x % DV] = 0.f;
  const int i_last = last_query_block(j, window, N);
  for (int i = j; i <= i_last; ++i) {
    load_tile_async<float, C, DK, NT>(sQ, L::LK, q + q0 + (long)i * C * rowk, rowk);
    load_tile_async<float, C, DV, NT>(sdO, L::LV, dO + v0 + (long)i * C * rowv, rowv);
    cp_async_commit();
    if (tid < C) {
      sLse[tid] = lse[bhT + (long)i * C + tid];
      sD[tid] = Dg[bhT + (long)i * C + tid];
    }
    cp_async_wait<0>();
    __syncthreads();
    gemm<float, R, C, DK, false, true, NW>(sK, L::LK, sQ, L::LK, sS, L::LS, false);    // Sᵀ = K·Qᵀ
    gemm<float, R, C, DV, false, true, NW>(sV, L::LV, sdO, L::LV, sdP, L::LS, false);  // dPᵀ = V·dOᵀ
    __syncthreads();
    const bool masked = block_masked(i, j, window);
    for (int x = tid; x < R * C; x += NT) {
      const int r = x / C, c = x % C;  // key row kr + r of the block, query c
      float p = exp2f(sS[r * L::LS + c] * scale_log2 - sLse[c]);
      if (masked && !visible((i - j) * C + c - kr - r, window)) p = 0.f;
      sS[r * L::LS + c] = p;
      sdP[r * L::LS + c] = p * (sdP[r * L::LS + c] - sD[c]);
    }
    __syncthreads();
    gemm<float, R, DV, C, false, false, NW>(sS, L::LS, sdO, L::LV, sdV, L::LV, true);  // dV += Pᵀ·dO
    gemm<float, R, DK, C, false, false, NW>(sdP, L::LS, sQ, L::LK, sdK, L::LK, true);  // dK += dSᵀ·Q
    __syncthreads();
  }
  float* outk = dk + q0 + ((long)j * C + kr) * rowk;
  float* outv = dv + v0 + ((long)j * C + kr) * rowv;
  for (int x = tid; x < R * DK; x += NT) outk[(long)(x / DK) * rowk + x % DK] = sdK[(x / DK) * L::LK + x % DK] * scale;
  for (int x = tid; x < R * DV; x += NT) outv[(long)(x / DV) * rowv + x % DV] = sdV[(x / DV) * L::LV + x % DV];
}

template <int DK, int DV>
void bwd_impl(const Dims& d, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
              const at::Tensor& lse, const at::Tensor& d_o, float scale_log2, float scale, at::Tensor& dq,
              at::Tensor& dk, at::Tensor& dv, at::Tensor& D) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(d.N, d.H, d.B);
  if (q.scalar_type() == at::kBFloat16) {
    auto p = [](const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); };
    auto w = [](at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); };
    {
      auto kern = bwd_dq_bf16_kernel<DK, DV>;
      const size_t sm = DqSmem<DK, DV>::bytes;
      carry::kernels::primitives::allow_smem(kern, sm);
      kern<<<grid, 128, sm, stream>>>(p(q), p(k), p(v), p(o), lse.data_ptr<float>(), p(d_o), w(dq),
                                      D.data_ptr<float>(), scale_log2, scale, d.T, d.H, d.window);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    {
      auto kern = bwd_dkv_bf16_kernel<DK, DV>;
      const size_t sm = DkvSmem<DK, DV>::bytes;
      carry::kernels::primitives::allow_smem(kern, sm);
      kern<<<grid, 128, sm, stream>>>(p(q), p(k), p(v), lse.data_ptr<float>(), D.data_ptr<float>(), p(d_o), w(dk),
                                      w(dv), scale_log2, scale, d.T, d.H, d.window);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  } else {
    {
      auto kern = bwd_dq_f32_kernel<DK, DV>;
      const size_t sm = DqF32Smem<DK, DV>::bytes;
      carry::kernels::primitives::allow_smem(kern, sm);
      kern<<<grid, 256, sm, stream>>>(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                                      o.data_ptr<float>(), lse.data_ptr<float>(), d_o.data_ptr<float>(),
                                      dq.data_ptr<float>(), D.data_ptr<float>(), scale_log2, scale, d.T, d.H,
                                      d.window);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    {
      auto kern = bwd_dkv_f32_kernel<DK, DV>;
      const size_t sm = DkvF32Smem<DK, DV>::bytes;
      carry::kernels::primitives::allow_smem(kern, sm);
      kern<<<dim3(2 * d.N, d.H, d.B), 256, sm, stream>>>(q.data_ptr<float>(), k.data_ptr<float>(),
                                                          v.data_ptr<float>(), lse.data_ptr<float>(),
                                                          D.data_ptr<float>(), d_o.data_ptr<float>(),
                                                          dk.data_ptr<float>(), dv.data_ptr<float>(), scale_log2,
                                                          scale, d.T, d.H, d.window);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
}

}  // namespace

std::vector<at::Tensor> attn_bwd(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& o_,
                                 const at::Tensor& lse_, const at::Tensor& d_o_, double scale, int64_t window) {
  const Dims d = check_inputs("attn_bwd", q_, k_, v_, window);
  TORCH_CHECK(o_.sizes() == v_.sizes() && o_.scalar_type() == v_.scalar_type() && o_.device() == v_.device(),
              "attn_bwd: o must be like v (", v_.sizes(), " ", v_.scalar_type(), "), got ", o_.sizes(), " ",
              o_.scalar_type(), " on ", o_.device());
  TORCH_CHECK(d_o_.sizes() == v_.sizes() && d_o_.scalar_type() == v_.scalar_type() && d_o_.device() == v_.device(),
              "attn_bwd: d_o must be like v (", v_.sizes(), " ", v_.scalar_type(), "), got ", d_o_.sizes(), " ",
              d_o_.scalar_type(), " on ", d_o_.device());
  TORCH_CHECK(lse_.sizes() == at::IntArrayRef({d.B, d.H, d.T}) && lse_.scalar_type() == at::kFloat &&
                  lse_.device() == q_.device(),
              "attn_bwd: lse must be attn_fwd's fp32 [B,H,T] = [", d.B, ",", d.H, ",", d.T, "], got ", lse_.sizes(),
              " ", lse_.scalar_type());
  c10::cuda::CUDAGuard guard(q_.device());
  auto q = dense16(q_), k = dense16(k_), v = dense16(v_), o = dense16(o_), lse = dense16(lse_), d_o = dense16(d_o_);
  at::Tensor dq = alloc(q.sizes(), q.options()), dk = alloc(k.sizes(), k.options()), dv = alloc(v.sizes(), v.options());
  at::Tensor D = alloc({d.B, d.H, d.T}, q.options().dtype(at::kFloat));
  const float scale_log2 = (float)(scale * kLog2e);
  if (d.DK == 64) bwd_impl<64, 64>(d, q, k, v, o, lse, d_o, scale_log2, (float)scale, dq, dk, dv, D);
  else bwd_impl<128, 128>(d, q, k, v, o, lse, d_o, scale_log2, (float)scale, dq, dk, dv, D);
  return {dq, dk, dv};
}

}  // namespace carry::kernels::softmax_attn
