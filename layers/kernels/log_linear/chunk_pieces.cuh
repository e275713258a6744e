// Log-linear Gated DeltaNet's chunk pieces (api.h, chunk_pieces_fwd and chunk_pieces_bwd): device code of
// chunk_pieces.cu, and of tests/emulation (CARRY_LA_EMU: the includer provides the warp emulation).
//
// One block of 256 threads (8 warps) a chunk of 64 tokens of one head. With G the chunk's cumulative log decay,
// Γ[t,s] = e^{G_t − G_s}, T = (I + strictly_lower(diag(β) K Kᵀ ⊙ Γ))⁻¹ and W from the delta rule's chunk
// preparation (layers/kernels/delta_rule: its first kernel), the forward writes
//   A = QKᵀ ⊙ Γ (s ≤ t),  P = e^G ⊙ Q − A·W,  K̃ = e^{G_C − G} ⊙ K,  γ = e^{G_C},
//   o = (A·T·diag(β) ⊙ Λ)·V,  Λ[t,s] = λ_t[bit_width(t xor s)] for s ≤ t (the levels inside a chunk),
// all unscaled. Products are mma.sync on bf16 tiles in shared memory with fp32 sums; every intermediate
// C×C or C×dk tile is a warp's fragments (rows 16·(w%4), column half w/4).
//
// The backward takes the gradients of o, W, U = T·diag(β)·V, K̃, P and γ and writes those of q, k, v, g, β
// and λ (levels 0..6), recomputing A and the mixing A·T·diag(β) from the saved T and W:
//   dMλ = dO·Vᵀ,  dλ_t[l] = Σ_{lev(t,s)=l} dMλ⊙(A·Tβ),  dMx = dMλ ⊙ Λ,  dv = (Mx⊙Λ)ᵀ·dO + β ⊙ Tᵀ·dU,
//   dA = dMx·Tβᵀ − dP·Wᵀ,  dW' = dW − Aᵀ·dP,
//   dT = dTβ·diag(β) + dU·(diag(β)V)ᵀ + dW'·(diag(βe^G)K)ᵀ,  dTβ = Aᵀ·dMx,
//   dL = −Tᵀ·dT·Tᵀ (strictly lower, in fp32 on the CUDA cores), and through L, A, K̃, γ and e^G to q, k, G,
// β; dg is the reverse cumulative sum of dG within the chunk. Row and column sums run in a fixed order (no
// atomics): the same bits every run.
#pragma once

#include "layers/kernels/primitives/tiles.cuh"

#ifndef SMEM_DECL
#define SMEM_DECL extern __shared__ __align__(128) unsigned char smem[]
#endif

namespace carry::kernels::log_linear::pieces {

using carry::kernels::primitives::bf16;
using carry::kernels::primitives::frag_mma;
using carry::kernels::primitives::frag_store_bf16;
using carry::kernels::primitives::frag_store_f32;
using carry::kernels::primitives::gemm;
using carry::kernels::primitives::gemm_rb64;
using carry::kernels::primitives::load_tile_async;
using carry::kernels::primitives::to_f;
using carry::kernels::primitives::warp_cumsum64;

constexpr int C = 64, NT = 256, LC = C + 8, LF = C + 4, kLevels = 7;

constexpr size_t tile_bf16(int ld) { return (size_t)C * ld * 2; }
constexpr size_t tile_f32() { return (size_t)C * LF * 4; }

// bit_width(t xor s): the level of the pair (t, s) inside a chunk (0 for s = t).
__device__ __forceinline__ int pair_level(int t, int s) {
  int x = t ^ s, l = 0;
  while (x) ++l, x >>= 1;
  return l;
}

// f(row, col, x) for each accumulator of a warp's fragments c (rows m0 + lane/4 (+8), NT8 n-tiles from n0).
template <int NT8, class F>
__device__ __forceinline__ void frag_each(float (&c)[NT8][4], int m0, int n0, F&& f) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) f(m0 + g + (e >> 1) * 8, n0 + nt * 8 + 2 * t4 + (e & 1), c[nt][e]);
}

// Σ over the 4 lanes of a row group (lanes 4j..4j+3), in a fixed order.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

// Per-row sums of f(row, col, x) over a warp's fragments, added to part[row] (one writer an entry: the warp
// owning the rows, column half h, writes part + h·C).
template <int NT8, class F>
__device__ __forceinline__ void frag_row_sums(float (&c)[NT8][4], int m0, int n0, float* part, F&& f) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int nt = 0; nt < NT8; ++nt) {
    const int col = n0 + nt * 8 + 2 * t4;
    s0 += f(m0 + g, col, c[nt][0]) + f(m0 + g, col + 1, c[nt][1]);
    s1 += f(m0 + g + 8, col, c[nt][2]) + f(m0 + g + 8, col + 1, c[nt][3]);
  }
  s0 = quad_sum(s0), s1 = quad_sum(s1);
  if (t4 == 0) part[m0 + g] += s0, part[m0 + g + 8] += s1;
}

// Row (or, with COLS, column) sums of f(i, j) over a C×C matrix, i the row: four threads a line (threads
// 4i..4i+3 take 16 entries each), combined in a fixed order; out[line] = (add ? out[line] : 0) + sum.
// Every thread of the block calls it.
template <bool COLS, class F>
__device__ __forceinline__ void line_sums(float* out, bool add, F&& f) {
  const int tid = threadIdx.x, line = tid >> 2, p = tid & 3;
  float s = 0.f;
#pragma unroll 4
  for (int j = p * 16; j < p * 16 + 16; ++j) s += COLS ? f(j, line) : f(line, j);
  s = quad_sum(s);
  if (p == 0) out[line] = (add ? out[line] : 0.f) + s;
}

// ---------------------------------------------------------------------------------------------
// Forward.
template <int DK>
struct FwdSmem {
  static constexpr int LK = DK + 8;
  static constexpr size_t oQ = 0, oK = oQ + tile_bf16(LK), oW = oK + tile_bf16(LK), oT = oW + tile_bf16(LK),
                          oA = oT + tile_bf16(LC), oM = oA + tile_bf16(LC), oV = oM + tile_bf16(LC),
                          oG = oV + 2 * tile_bf16(LC), oB = oG + C * 4, oE = oB + C * 4, oLam = oE + C * 4,
                          bytes = oLam + kLevels * C * 4;
};

// q, k [B,T,H,DK], v [B,T,H,DV] bf16; Gc [B,H,T], beta [B,T,H] fp32; Tm [B,H,N,64,64] and W [B,H,T,DK] bf16 (the
// delta rule's preparation); lam [B,H,7,T] fp32. Writes P, Kt [B,H,T,DK] bf16, gamma [B,H,N] and o [B,H,T,DV]
// fp32. Grid (N, H, B).
template <int DK, int DV>
__global__ void __launch_bounds__(NT) fwd_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                 const bf16* __restrict__ v, const float* __restrict__ Gc,
                                                 const float* __restrict__ beta, const bf16* __restrict__ Tm,
                                                 const bf16* __restrict__ W, const float* __restrict__ lam,
                                                 bf16* __restrict__ P, bf16* __restrict__ Kt, float* __restrict__ gamma,
                                                 float* __restrict__ o, int T_, int H) {
  using L = FwdSmem<DK>;
  constexpr int LK = L::LK, NV = DV / 64, HK = DK / 2, NK8 = DK / 16;
  SMEM_DECL;
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::oQ);
  bf16* sK = reinterpret_cast<bf16*>(smem + L::oK);
  bf16* sW = reinterpret_cast<bf16*>(smem + L::oW);
  bf16* sT = reinterpret_cast<bf16*>(smem + L::oT);
  bf16* sA = reinterpret_cast<bf16*>(smem + L::oA);
  bf16* sM = reinterpret_cast<bf16*>(smem + L::oM);
  bf16* sV = reinterpret_cast<bf16*>(smem + L::oV);
  float* sG = reinterpret_cast<float*>(smem + L::oG);
  float* sB = reinterpret_cast<float*>(smem + L::oB);
  float* sE = reinterpret_cast<float*>(smem + L::oE);
  float* sLam = reinterpret_cast<float*>(smem + L::oLam);

  const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, N = T_ / C;
  const long t0 = (long)c * C, bh = (long)b * H + h, rowk = (long)H * DK, rowv = (long)H * DV;
  const int warp = tid >> 5, m0 = (warp & 3) * 16, half = warp >> 2;
  load_tile_async<bf16, C, DK, NT>(sQ, LK, q + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
  load_tile_async<bf16, C, DK, NT>(sK, LK, k + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
  load_tile_async<bf16, C, DK, NT>(sW, LK, W + (bh * T_ + t0) * DK, DK);
  load_tile_async<bf16, C, C, NT>(sT, LC, Tm + (bh * N + c) * C * C, C);
  carry::kernels::primitives::cp_async_commit();
  auto load_v = [&](int it) {
    load_tile_async<bf16, C, 64, NT>(sV + (it & 1) * C * LC, LC, v + ((long)b * T_ + t0) * rowv + (long)h * DV + it * 64,
                                     rowv);
    carry::kernels::primitives::cp_async_commit();
  };
  load_v(0);
  if (tid < C) {
    sG[tid] = Gc[bh * T_ + t0 + tid];
    sB[tid] = beta[((long)b * T_ + t0 + tid) * H + h];
    sE[tid] = expf(sG[tid]);
  }
  for (int i = tid; i < kLevels * C; i += NT) sLam[i] = lam[(bh * kLevels + i / C) * T_ + t0 + i % C];
  carry::kernels::primitives::cp_async_wait<1>();
  __syncthreads();

  {  // A = QKᵀ ⊙ Γ (s ≤ t) in bf16; T·diag(β) in place; K̃ and γ to global
    float s[4][4] = {};
    frag_mma<4, DK, false, true>(s, sQ, LK, sK, LK, m0, half * 32);
    frag_each(s, m0, half * 32, [&](int r, int col, float& x) { x = col <= r ? x * expf(sG[r] - sG[col]) : 0.f; });
    frag_store_bf16<4>(sA, LC, s, m0, half * 32);
    for (int i = tid; i < C * C; i += NT) {
      const int r = i / C, col = i % C;
      sT[r * LC + col] = __float2bfloat16(to_f(sT[r * LC + col]) * sB[col]);
    }
    const float gl = sG[C - 1];
    bf16* kt = Kt + (bh * T_ + t0) * DK;
    for (int i = tid; i < C * DK / 2; i += NT) {
      const int r = (2 * i) / DK, d = (2 * i) % DK;
      const float f = expf(gl - sG[r]);
      *reinterpret_cast<__nv_bfloat162*>(kt + (long)r * DK + d) =
          __floats2bfloat162_rn(to_f(sK[r * LK + d]) * f, to_f(sK[r * LK + d + 1]) * f);
    }
    if (tid == 0) gamma[bh * N + c] = expf(gl);
  }
  __syncthreads();
  {  // P = e^G ⊙ Q − A·W
    float p[NK8][4] = {};
    frag_mma<NK8, C, false, false>(p, sA, LC, sW, LK, m0, half * HK);
    frag_each(p, m0, half * HK, [&](int r, int col, float& x) { x = sE[r] * to_f(sQ[r * LK + col]) - x; });
    frag_store_bf16<NK8>(P + (bh * T_ + t0) * DK, DK, p, m0, half * HK);
  }
  {  // the weighted mixing (A·T·diag(β)) ⊙ Λ in bf16
    float mx[4][4] = {};
    frag_mma<4, C, false, false>(mx, sA, LC, sT, LC, m0, half * 32);
    frag_each(mx, m0, half * 32,
              [&](int r, int col, float& x) { x = col <= r ? x * sLam[pair_level(r, col) * C + r] : 0.f; });
    frag_store_bf16<4>(sM, LC, mx, m0, half * 32);
  }
  for (int it = 0; it < NV; ++it) {  // o = (Mx ⊙ Λ)·V by 64-column tiles
    if (it + 1 < NV) {
      load_v(it + 1);
      carry::kernels::primitives::cp_async_wait<1>();
    } else {
      carry::kernels::primitives::cp_async_wait<0>();
    }
    __syncthreads();
    float ov[4][4] = {};
    frag_mma<4, C, false, false>(ov, sM, LC, sV + (it & 1) * C * LC, LC, m0, half * 32);
    frag_store_f32<4>(o + (bh * T_ + t0) * DV + it * 64, DV, ov, m0, half * 32);
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------------
// Backward.
template <int DK>
struct BwdSmem {
  static constexpr int LK = DK + 8;
  // Q, K, W (later diag(βe^G)K); a region holding the dv loop's four 64-wide tiles (V, diag(β)V, dO, dU), then
  // dP, dW (later dW'), dK̃; T, T·diag(β), A, and one C×C bf16 scratch (Mx ⊙ Λ, dMx, dA ⊙ Γ, dL's dKK); four fp32 C×C.
  static constexpr size_t oQ = 0, oK = oQ + tile_bf16(LK), oW = oK + tile_bf16(LK), oR = oW + tile_bf16(LK);
  static constexpr size_t rDv = 4 * tile_bf16(LC), rDk = 3 * tile_bf16(LK);
  static constexpr size_t oT = oR + (rDv > rDk ? rDv : rDk), oTb = oT + tile_bf16(LC), oA = oTb + tile_bf16(LC),
                          oX = oA + tile_bf16(LC), oF1 = oX + tile_bf16(LC), oF2 = oF1 + tile_f32(),
                          oF3 = oF2 + tile_f32(), oF4 = oF3 + tile_f32(), oS = oF4 + tile_f32();
  // small arrays of C floats: G, β, e^G, λ (7 rows), then the sums
  enum { kG = 0, kB, kE, kLam, kDG = kLam + kLevels, kDGc, kDBc, kDBl, kPG, kPB = kPG + 2, kPR = kPB + 2,
         kPW = kPR + 2, kCS = kPW + 2, kSmall = kCS + 1 };
  static constexpr size_t bytes = oS + (size_t)kSmall * C * 4;
};

// Inputs as the forward's, with dO [B,H,T,DV] (o's gradient), dW, dKt, dP [B,H,T,DK], dU [B,H,T,DV] bf16 and dgamma
// [B,H,N] fp32. Writes dq, dk [B,T,H,DK], dv [B,T,H,DV], dg, dbeta [B,T,H] and dlam [B,H,7,T], fp32.
template <int DK, int DV>
__global__ void __launch_bounds__(NT) bwd_kernel(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ Gc,
    const float* __restrict__ beta, const bf16* __restrict__ Tm, const bf16* __restrict__ W,
    const float* __restrict__ lam, const bf16* __restrict__ dO, const bf16* __restrict__ dW,
    const bf16* __restrict__ dU, const bf16* __restrict__ dKt, const bf16* __restrict__ dP,
    const float* __restrict__ dgamma, float* __restrict__ dq, float* __restrict__ dk, float* __restrict__ dv,
    float* __restrict__ dg, float* __restrict__ dbeta, float* __restrict__ dlam, int T_, int H) {
  using L = BwdSmem<DK>;
  constexpr int LK = L::LK, NV = DV / 64, HK = DK / 2, NK8 = DK / 16;
  SMEM_DECL;
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::oQ);
  bf16* sK = reinterpret_cast<bf16*>(smem + L::oK);
  bf16* sW = reinterpret_cast<bf16*>(smem + L::oW);
  bf16* sV = reinterpret_cast<bf16*>(smem + L::oR);
  bf16* sVb = sV + C * LC;
  bf16* sdO = sVb + C * LC;
  bf16* sdU = sdO + C * LC;
  bf16* sdP = reinterpret_cast<bf16*>(smem + L::oR);
  bf16* sdW = sdP + C * LK;
  bf16* sdKt = sdW + C * LK;
  bf16* sT = reinterpret_cast<bf16*>(smem + L::oT);
  bf16* sTb = reinterpret_cast<bf16*>(smem + L::oTb);
  bf16* sA = reinterpret_cast<bf16*>(smem + L::oA);
  bf16* sX = reinterpret_cast<bf16*>(smem + L::oX);
  float* F1 = reinterpret_cast<float*>(smem + L::oF1);
  float* F2 = reinterpret_cast<float*>(smem + L::oF2);
  float* F3 = reinterpret_cast<float*>(smem + L::oF3);
  float* F4 = reinterpret_cast<float*>(smem + L::oF4);
  float* sm = reinterpret_cast<float*>(smem + L::oS);
  float *sG = sm + L::kG * C, *sB = sm + L::kB * C, *sE = sm + L::kE * C, *sLam = sm + L::kLam * C;
  float *sDG = sm + L::kDG * C, *sDGc = sm + L::kDGc * C, *sDBc = sm + L::kDBc * C;
  float *sDBl = sm + L::kDBl * C, *sPG = sm + L::kPG * C, *sPB = sm + L::kPB * C, *sPR = sm + L::kPR * C;
  float *sPW = sm + L::kPW * C, *sCS = sm + L::kCS * C;

  const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, N = T_ / C;
  const long t0 = (long)c * C, bh = (long)b * H + h, rowk = (long)H * DK, rowv = (long)H * DV;
  const int warp = tid >> 5, m0 = (warp & 3) * 16, half = warp >> 2;
  const long tok = ((long)b * T_ + t0) * H + h;  // the chunk's first row in [B,T,H]
  namespace pr = carry::kernels::primitives;

  load_tile_async<bf16, C, DK, NT>(sQ, LK, q + tok * DK, rowk);
  load_tile_async<bf16, C, DK, NT>(sK, LK, k + tok * DK, rowk);
  load_tile_async<bf16, C, DK, NT>(sW, LK, W + (bh * T_ + t0) * DK, DK);
  load_tile_async<bf16, C, C, NT>(sT, LC, Tm + (bh * N + c) * C * C, C);
  pr::cp_async_commit();
  auto load_dv = [&](int it) {
    load_tile_async<bf16, C, 64, NT>(sV, LC, v + tok * DV + it * 64, rowv);
    load_tile_async<bf16, C, 64, NT>(sdO, LC, dO + (bh * T_ + t0) * DV + it * 64, DV);
    load_tile_async<bf16, C, 64, NT>(sdU, LC, dU + (bh * T_ + t0) * DV + it * 64, DV);
    pr::cp_async_commit();
  };
  load_dv(0);
  if (tid < C) {
    sG[tid] = Gc[bh * T_ + t0 + tid];
    sB[tid] = beta[tok * 1 + (long)tid * H];
    sE[tid] = expf(sG[tid]);
  }
  for (int i = tid; i < kLevels * C; i += NT) sLam[i] = lam[(bh * kLevels + i / C) * T_ + t0 + i % C];
  for (int i = tid; i < 8 * C; i += NT) sPG[i] = 0.f;  // sPG, sPB, sPR, sPW: two halves each
  pr::cp_async_wait<1>();
  __syncthreads();
  const float gl = sG[C - 1];

  {  // A = QKᵀ ⊙ Γ (s ≤ t): fp32 in F1, bf16 in sA; T·diag(β) in sTb
    float s[4][4] = {};
    frag_mma<4, DK, false, true>(s, sQ, LK, sK, LK, m0, half * 32);
    frag_each(s, m0, half * 32, [&](int r, int col, float& x) {
      x = col <= r ? x * expf(sG[r] - sG[col]) : 0.f;
      F1[r * LF + col] = x;
    });
    frag_store_bf16<4>(sA, LC, s, m0, half * 32);
    for (int i = tid; i < C * C; i += NT) {
      const int r = i / C, col = i % C;
      sTb[r * LC + col] = __float2bfloat16(to_f(sT[r * LC + col]) * sB[col]);
    }
  }
  __syncthreads();
  {  // Mx = A·Tβ in F2; Mx ⊙ Λ in sX
    float mx[4][4] = {};
    frag_mma<4, C, false, false>(mx, sA, LC, sTb, LC, m0, half * 32);
    frag_each(mx, m0, half * 32, [&](int r, int col, float& x) {
      x = col <= r ? x : 0.f;
      F2[r * LF + col] = x;
      x *= sLam[pair_level(r, col) * C + r];
    });
    frag_store_bf16<4>(sX, LC, mx, m0, half * 32);
  }
  // The dv loop: dMλ = dO·Vᵀ (F3) and dU·(diag(β)V)ᵀ (F4) summed over the tiles; dv per tile.
  for (int it = 0; it < NV; ++it) {
    pr::cp_async_wait<0>();
    __syncthreads();
    for (int i = tid; i < C * 64; i += NT) {
      const int r = i / 64, col = i % 64;
      sVb[r * LC + col] = __float2bfloat16(to_f(sV[r * LC + col]) * sB[r]);
    }
    __syncthreads();
    gemm_rb64<64, 64, false, true, 8>(sdO, LC, sV, LC, F3, LF, it > 0);
    gemm_rb64<64, 64, false, true, 8>(sdU, LC, sVb, LC, F4, LF, it > 0);
    float d1[4][4] = {}, d2[4][4] = {};
    frag_mma<4, C, true, false>(d1, sX, LC, sdO, LC, m0, half * 32);  // (Mx ⊙ Λ)ᵀ·dO
    frag_mma<4, C, true, false>(d2, sT, LC, sdU, LC, m0, half * 32);  // Tᵀ·dU
    frag_row_sums(d2, m0, half * 32, sPB + half * C,
                  [&](int r, int col, float x) { return x * to_f(sV[r * LC + col]); });
    {  // dv = (Mx ⊙ Λ)ᵀ·dO + β ⊙ Tᵀ·dU
      const int g = (tid & 31) >> 2;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) d1[nt][e] += sB[m0 + g + (e >> 1) * 8] * d2[nt][e];
    }
    frag_store_f32<4>(dv + tok * DV + it * 64, rowv, d1, m0, half * 32);
    __syncthreads();
    if (it + 1 < NV) load_dv(it + 1);
  }
  // dP, dW, dK̃ into the dv loop's region
  load_tile_async<bf16, C, DK, NT>(sdP, LK, dP + (bh * T_ + t0) * DK, DK);
  load_tile_async<bf16, C, DK, NT>(sdW, LK, dW + (bh * T_ + t0) * DK, DK);
  load_tile_async<bf16, C, DK, NT>(sdKt, LK, dKt + (bh * T_ + t0) * DK, DK);
  pr::cp_async_commit();
  {  // dλ (levels 0..6) and dMx = dMλ ⊙ Λ (s ≤ t) in sX: four threads a row, 16 columns each
    const int r = tid >> 2, p = tid & 3;
    float acc[kLevels] = {};
    for (int col = p * 16; col < p * 16 + 16; ++col) {
      float x = 0.f;
      if (col <= r) {
        const int l = pair_level(r, col);
        const float dm = F3[r * LF + col], e = dm * F2[r * LF + col];
#pragma unroll
        for (int j = 0; j < kLevels; ++j) acc[j] += j == l ? e : 0.f;  // registers, not an indexed array
        x = dm * sLam[l * C + r];
      }
      sX[r * LC + col] = __float2bfloat16(x);
    }
#pragma unroll
    for (int l = 0; l < kLevels; ++l) {
      const float s = quad_sum(acc[l]);
      if (p == 0) dlam[(bh * kLevels + l) * T_ + t0 + r] = s;
    }
  }
  __syncthreads();
  gemm_rb64<64, 64, true, false, 8>(sA, LC, sX, LC, F2, LF, false);   // dTβ = Aᵀ·dMx
  gemm_rb64<64, 64, false, true, 8>(sX, LC, sTb, LC, F3, LF, false);  // dMx·Tβᵀ (the first part of dA)
  __syncthreads();
  // dβ_s += Σ_t dTβ[t,s] T[t,s]; dT += dTβ·diag(β)
  line_sums<true>(sDBc, false, [&](int r, int col) { return F2[r * LF + col] * to_f(sT[r * LC + col]); });
  for (int i = tid; i < C * C; i += NT) {
    const int r = i / C, col = i % C;
    F4[r * LF + col] += F2[r * LF + col] * sB[col];
  }
  pr::cp_async_wait<0>();
  __syncthreads();
  gemm_rb64<64, DK, false, true, 8>(sdP, LK, sW, LK, F2, LF, false);  // dP·Wᵀ
  float accq[NK8][4] = {}, acck[NK8][4] = {};
  {  // dW' = dW − Aᵀ·dP in place; dq += e^G ⊙ dP, dk += e^{G_C − G} ⊙ dK̃, and their terms of dG
    float w[NK8][4] = {};
    frag_mma<NK8, C, true, false>(w, sA, LC, sdP, LK, m0, half * HK);
    frag_each(w, m0, half * HK, [&](int r, int col, float& x) { x = to_f(sdW[r * LK + col]) - x; });
    frag_store_bf16<NK8>(sdW, LK, w, m0, half * HK);
    frag_each(accq, m0, half * HK, [&](int r, int col, float& x) { x = sE[r] * to_f(sdP[r * LK + col]); });
    frag_each(acck, m0, half * HK,
              [&](int r, int col, float& x) { x = expf(gl - sG[r]) * to_f(sdKt[r * LK + col]); });
    frag_row_sums(accq, m0, half * HK, sPG + half * C,
                  [&](int r, int col, float x) { return x * to_f(sQ[r * LK + col]); });  // e^G·<dP, Q>
    frag_row_sums(acck, m0, half * HK, sPR + half * C,
                  [&](int r, int col, float x) { return x * to_f(sK[r * LK + col]); });  // <dK̃, K̃>
  }
  __syncthreads();
  // dA = dMx·Tβᵀ − dP·Wᵀ (s ≤ t): dA ⊙ A in F2 (for dG), dA ⊙ Γ in sX
  for (int i = tid; i < C * C; i += NT) {
    const int r = i / C, col = i % C;
    float e = 0.f, x = 0.f;
    if (col <= r) {
      const float da = F3[r * LF + col] - F2[r * LF + col];
      e = da * F1[r * LF + col];
      x = da * expf(sG[r] - sG[col]);
    }
    F2[r * LF + col] = e;
    sX[r * LC + col] = __float2bfloat16(x);
  }
  __syncthreads();
  line_sums<false>(sDG, false, [&](int r, int col) { return F2[r * LF + col]; });
  line_sums<true>(sDGc, false, [&](int r, int col) { return -F2[r * LF + col]; });
  frag_mma<NK8, C, false, false>(accq, sX, LC, sK, LK, m0, half * HK);  // dq += (dA ⊙ Γ)·K
  frag_mma<NK8, C, true, false>(acck, sX, LC, sQ, LK, m0, half * HK);   // dk += (dA ⊙ Γ)ᵀ·Q
  for (int i = tid; i < C * DK; i += NT) {  // diag(βe^G)K over W (dead), T in fp32 in F1 (A's fp32 is dead)
    const int r = i / DK, col = i % DK;
    sW[r * LK + col] = __float2bfloat16(sB[r] * sE[r] * to_f(sK[r * LK + col]));
  }
  for (int i = tid; i < C * C; i += NT) F1[(i / C) * LF + i % C] = to_f(sT[(i / C) * LC + i % C]);
  __syncthreads();
  gemm_rb64<64, DK, false, true, 8>(sdW, LK, sW, LK, F4, LF, true);  // dT += dW'·(diag(βe^G)K)ᵀ
  {  // dk += βe^G ⊙ Tᵀ·dW'; its row sums <Tᵀ·dW', K> feed dβ (·e^G) and dG (·βe^G)
    float w[NK8][4] = {};
    frag_mma<NK8, C, true, false>(w, sT, LC, sdW, LK, m0, half * HK);
    frag_row_sums(w, m0, half * HK, sPW + half * C,
                  [&](int r, int col, float x) { return x * to_f(sK[r * LK + col]); });
    frag_each(w, m0, half * HK, [&](int r, int col, float& x) { x *= sB[r] * sE[r]; });
#pragma unroll
    for (int nt = 0; nt < NK8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acck[nt][e] += w[nt][e];
  }
  __syncthreads();
  gemm<float, 64, 64, 64, true, false, 8>(F1, LF, F4, LF, F3, LF, false);  // Y = Tᵀ·dT
  __syncthreads();
  gemm<float, 64, 64, 64, false, true, 8>(F3, LF, F1, LF, F2, LF, false);  // Z = Y·Tᵀ; dL = −Z
  gemm_rb64<64, DK, false, true, 8>(sK, LK, sK, LK, F4, LF, false);          // KKᵀ
  __syncthreads();
  // L = diag(β)(KKᵀ ⊙ Γ), strictly lower: dβ_t += Σ_s dL·(KKᵀ ⊙ Γ); dX = β_t dL; dG from dX ⊙ X; dKK = dX ⊙ Γ
  for (int i = tid; i < C * C; i += NT) {
    const int r = i / C, col = i % C;
    float lx = 0.f, e = 0.f, x = 0.f;
    if (col < r) {
      const float gm = expf(sG[r] - sG[col]), X = F4[r * LF + col] * gm, dl = -F2[r * LF + col];
      lx = dl * X;
      e = sB[r] * lx;
      x = sB[r] * dl * gm;
    }
    F2[r * LF + col] = lx;
    F3[r * LF + col] = e;
    sX[r * LC + col] = __float2bfloat16(x);
  }
  __syncthreads();
  line_sums<false>(sDBl, false, [&](int r, int col) { return F2[r * LF + col]; });
  line_sums<false>(sDG, true, [&](int r, int col) { return F3[r * LF + col]; });
  line_sums<true>(sDGc, true, [&](int r, int col) { return -F3[r * LF + col]; });
  frag_mma<NK8, C, false, false>(acck, sX, LC, sK, LK, m0, half * HK);  // dk += dKK·K
  frag_mma<NK8, C, true, false>(acck, sX, LC, sK, LK, m0, half * HK);   // dk += dKKᵀ·K
  frag_store_f32<NK8>(dq + tok * DK, rowk, accq, m0, half * HK);
  frag_store_f32<NK8>(dk + tok * DK, rowk, acck, m0, half * HK);
  __syncthreads();
  if (tid < C) {
    const int t = tid;
    const float pw = sPW[t] + sPW[C + t], pr_ = sPR[t] + sPR[C + t];
    // dβ: from U, from Tβ, from L, from W (e^G·<Tᵀ·dW', K>)
    dbeta[tok + (long)t * H] = (sPB[t] + sPB[C + t]) + sDBc[t] + sDBl[t] + sE[t] * pw;
    // dG: from A and L (rows, columns), e^G·<dP, Q>, βe^G·<Tᵀ·dW', K>, −<dK̃, K̃>
    sCS[t] = sDG[t] + sDGc[t] + (sPG[t] + sPG[C + t]) + sB[t] * sE[t] * pw - pr_;
  }
  __syncthreads();
  if (tid < 32) {  // G_C's terms (K̃'s Σ<dK̃, K̃> and γ's), then dg = the reverse cumulative sum of dG
    float r = sPR[tid] + sPR[C + tid] + sPR[tid + 32] + sPR[C + tid + 32];
    for (int off = 16; off > 0; off >>= 1) r += __shfl_xor_sync(0xffffffffu, r, off);
    if (tid == 0) sCS[C - 1] += r + dgamma[bh * N + c] * expf(gl);
    __syncwarp();
    float* cs = sPG;  // scratch: the inclusive cumulative sum
    cs[2 * tid] = sCS[2 * tid], cs[2 * tid + 1] = sCS[2 * tid + 1];
    __syncwarp();
    warp_cumsum64(cs);
    __syncwarp();
    const float tot = cs[C - 1];
    for (int t = tid; t < C; t += 32) dg[tok + (long)t * H] = tot - cs[t] + sCS[t];
  }
}

}  // namespace carry::kernels::log_linear::pieces
