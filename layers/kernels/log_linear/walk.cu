// Log-linear Gated DeltaNet's levels above the chunk in one walk over the chunks (api.h, level_walk_fwd and
// level_walk_bwd; the math in layers/log_linear/level_walk.h).
//
// Every level above the chunk walks the same chunks with the same operands (W, K̃, P and U of the chunk), so
// one thread block walks all the levels of a group at once: grid (dv/16, B·H, groups), one or two warpgroups
// (four levels each), warp w the state of level j0 + w for the block's 16 columns of dv. The state is held
// transposed, Sᵀ [16 × dk] fp32 a warp, so a warpgroup's four levels are the 64 rows of one wgmma
// accumulator (m64, the rows of warp w its level's): Vᵀ = Uᵀ − Sᵀ·Wᵀ, Rᵀ = Sᵀ·Pᵀ and Sᵀ ← γ Sᵀ + Vᵀ·K̃ are
// wgmma products with A from registers (bf16 roundings of Sᵀ and Vᵀ, as the delta rule's walks round H and
// V_new) and B from the chunk's tiles in shared memory, which the tensor cores read once a warpgroup for its
// four levels. The tiles ([64][dk] bf16, 128-byte swizzled) come by cp.async, double-buffered, once a chunk for
// the block. Per chunk and level: 3·2·16·64·dk FLOPs (the read product is formed at every level, used where the
// level reads); per chunk and block: 3·64·dk·2 + 64·16·2 bytes read from HBM for all its levels.
// Forward: the read-outs λ_t[ℓ]·Rᵀ of the block's levels go to shared slots, summed in level order into o (one
// o a group, summed by the host when several): no atomics, the same bits every run. With keep_states the
// state entering each chunk is stored bf16, transposed ([BH,N,J,dv,dk]: a warp's rows of 4-byte pairs).
// Reverse: dSᵀ per warp, dVᵀ = dSᵀ·K̃ᵀ, dSᵀ ← γ dSᵀ − dVᵀ·W + dRᵀ·P with dRᵀ = (λ[ℓ] ⊙ dO)ᵀ built from the
// chunk's dO tile; the gradient of the state leaving each chunk is stored bf16, transposed.
// Warps past the group's last level hold zero states and take part in the products alone (a wgmma is the
// warpgroup's); a warp whose level does not read at a chunk takes part in the read products too (forward: its
// Rᵀ left unused; reverse: with dRᵀ = 0), since a product skipped for some chunks would serialize the
// warpgroup's products.
#include "layers/kernels/log_linear/api.h"

#include "layers/kernels/primitives/host.h"
#include "layers/kernels/primitives/hopper.cuh"
#include "layers/kernels/primitives/tiles.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

namespace carry::kernels::log_linear {
namespace {

using carry::kernels::primitives::bf16;
namespace pr = carry::kernels::primitives;
namespace tc = carry::kernels::primitives::tc;
namespace hw = carry::kernels::primitives::hopper;

constexpr int kC = 64, kBV = 16, kLevelsWG = 4, kMaxWG = 2;

constexpr size_t al128(size_t x) { return (x + 127) & ~size_t(127); }

// Shared memory of the walks (from a 1024-byte boundary): two buffers of the chunk's tiles (three [64][dk] bf16
// tiles as dk/64 128-byte-swizzled halves of 8192 bytes, a [64][16] bf16 tile of U or dO, the group's λ rows),
// then (forward) two sets of the warps' read-out slots ([64 tokens][16] fp32 a warp), one a chunk in turn.
template <int DK, int NWG>
struct WalkSmem {
  static constexpr int LU = kBV + 8, LR = kBV + 4, warps = kLevelsWG * NWG;
  static constexpr size_t tile = size_t(kC) * DK * 2;
  static constexpr size_t oA = 0, oB = tile, oP = 2 * tile, oU = 3 * tile, oL = al128(oU + size_t(kC) * LU * 2);
  static constexpr size_t buf = hw::al1k(int(oL + size_t(warps) * kC * 4));
  static constexpr size_t oSlots = 2 * buf, slots = size_t(warps) * kC * LR;  // floats a set
  static constexpr size_t fwd_bytes = oSlots + 2 * slots * 4 + 1024;
  static constexpr size_t bwd_bytes = 2 * buf + 1024;
};

// The walk's place: level `level`'s flags at chunk start pos, and the group's levels that read there (bit w:
// level first + w, w < nlev).
__device__ __forceinline__ bool starts_at(long pos, int level) { return (pos & ((1L << level) - 1)) == 0; }
__device__ __forceinline__ unsigned reading(long pos, int first, int nlev) {
  return (unsigned)(pos >> (first - 1)) & ((1u << nlev) - 1);
}

// This thread's share of a chunk's loads, the same every chunk: rows r0 + k·RS of the three [64][dk] tiles
// at 16-byte piece c (RS = threads / pieces a row, a multiple of 8, so every row's swizzle is r0's), a piece
// of the U/dO tile (threads below 128) and of the λ rows (threads below 16·nlev).
template <int DK, int NWG>
struct ChunkLoads {
  static constexpr int PR = DK / 8, NT = 128 * NWG, RS = NT / PR, K = kC / RS;
  static_assert(RS % 8 == 0 && kC % RS == 0, "each thread's rows share one swizzle");
  int soff, goff, uoff_s, uoff_g, loff_s, loff_g;
  __device__ __forceinline__ ChunkLoads(int DV, int col0, int T, int nlev) {
    using S = WalkSmem<DK, NWG>;
    const int tid = threadIdx.x, r0 = tid / PR, c = tid % PR;
    soff = (c >> 3) * 8192 + hw::sw128_off(r0, c & 7);
    goff = r0 * DK + c * 8;
    uoff_s = tid < 128 ? (int)S::oU + ((tid >> 1) * S::LU + (tid & 1) * 8) * 2 : -1;
    uoff_g = (tid >> 1) * DV + col0 + (tid & 1) * 8;
    loff_s = tid < nlev * (kC / 4) ? (int)S::oL + ((tid >> 4) * kC + (tid & 15) * 4) * 4 : -1;
    loff_g = (tid >> 4) * T + (tid & 15) * 4;
  }
  // Chunk n's tiles into buffer sb: a, b, p [64][dk] (rows of [BH,T,dk] tensors), u's 16 columns from col0
  // ([BH,T,dv]) and the λ rows of the group's levels (lam [BH,J,T] from row j0).
  __device__ __forceinline__ void issue(unsigned char* sb, const bf16* a, const bf16* b, const bf16* p, const bf16* u,
                                        const float* lam, int bh, int n, int T, int DV, int J, int j0) const {
    using S = WalkSmem<DK, NWG>;
    const long row0 = (long)bh * T + (long)n * kC;
    const bf16 *ga = a + row0 * DK + goff, *gb = b + row0 * DK + goff, *gp = p + row0 * DK + goff;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      pr::cp_async16(sb + S::oA + soff + k * RS * 128, ga + k * RS * DK);
      pr::cp_async16(sb + S::oB + soff + k * RS * 128, gb + k * RS * DK);
      pr::cp_async16(sb + S::oP + soff + k * RS * 128, gp + k * RS * DK);
    }
    if (uoff_s >= 0) pr::cp_async16(sb + uoff_s, u + row0 * DV + uoff_g);
    if (loff_s >= 0) pr::cp_async16(sb + loff_s, lam + ((long)bh * J + j0) * T + (long)n * kC + loff_g);
    pr::cp_async_commit();
  }
};
// The chunk's tiles landed and visible to the block and to the tensor cores.
__device__ __forceinline__ void chunk_landed() {
  pr::cp_async_wait<0>();
  hw::fence_async();
  __syncthreads();
}

// A operand fragments (16 × 16 k-steps) from this warp's accumulators x [2·KS][4] (rows = m, columns = k).
template <int KS>
__device__ __forceinline__ void to_a(tc::u32 (&a)[KS][4], const float (&x)[2 * KS][4], float sign = 1.f) {
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    a[kk][0] = tc::pack_bf16(sign * x[2 * kk][0], sign * x[2 * kk][1]);
    a[kk][1] = tc::pack_bf16(sign * x[2 * kk][2], sign * x[2 * kk][3]);
    a[kk][2] = tc::pack_bf16(sign * x[2 * kk + 1][0], sign * x[2 * kk + 1][1]);
    a[kk][3] = tc::pack_bf16(sign * x[2 * kk + 1][2], sign * x[2 * kk + 1][3]);
  }
}

// The warpgroup's c [64 × 64] (this warp's 16 rows, [8][4]) = A·Bᵀ over k = dk: A from fragments a [dk/16][4],
// B [64 tokens][dk] a swizzled tile (K-major).
template <int KS>
__device__ __forceinline__ void times_tile_t(float (&c)[8][4], const tc::u32 (&a)[KS][4], const unsigned char* t) {
  const hw::Desc d = hw::desc_sw128(t);
  hw::mma_rs64<0, 0>(&c[0][0], a[0], d);
#pragma unroll
  for (int ks = 1; ks < KS; ++ks) hw::mma_rs64<0>(&c[0][0], a[ks], d.at((ks >> 2) * 8192 + (ks & 3) * 32));
}
// The warpgroup's c [64 × dk] (this warp's 16 rows, [dk/8][4]) += A·B over the chunk's 64 tokens: A from
// fragments a [4][4], B [64 tokens][dk] a swizzled tile (MN-major), one m64n64 product a 64-column half.
template <int NS>
__device__ __forceinline__ void times_tile(float (&c)[NS][4], const tc::u32 (&a)[4][4], const unsigned char* t) {
  const hw::Desc d = hw::desc_sw128(t);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int hh = 0; hh < NS / 8; ++hh) hw::mma_rs64<1>(&c[8 * hh][0], a[ks], d.at(hh * 8192 + ks * 2048));
}

template <int NT8>
__device__ __forceinline__ void zero(float (&c)[NT8][4]) {
#pragma unroll
  for (int i = 0; i < NT8; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
}
template <int KS>
__device__ __forceinline__ void zero_a(tc::u32 (&a)[KS][4]) {
#pragma unroll
  for (int i = 0; i < KS; ++i) a[i][0] = a[i][1] = a[i][2] = a[i][3] = 0u;
}

// A state tile Sᵀ [16 × dk] (this warp's accumulators) to or from a [.., dk, dv] fp32 matrix at `m` (columns
// col0..col0+15), and bf16 to a transposed [.., dv, dk] matrix at `t`.
template <int DK>
__device__ __forceinline__ void load_state(float (&s)[DK / 8][4], const float* m, int DV, int col0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] = m[(long)(nt * 8 + 2 * t4 + (e & 1)) * DV + col0 + g + (e >> 1) * 8];
}
template <int DK>
__device__ __forceinline__ void store_state(float* m, const float (&s)[DK / 8][4], int DV, int col0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int nt = 0; nt < DK / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) m[(long)(nt * 8 + 2 * t4 + (e & 1)) * DV + col0 + g + (e >> 1) * 8] = s[nt][e];
}
template <int DK>
__device__ __forceinline__ void store_state_t(bf16* t, const float (&s)[DK / 8][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int nt = 0; nt < DK / 8; ++nt) {
    *reinterpret_cast<unsigned*>(t + (long)g * DK + nt * 8 + 2 * t4) = tc::pack_bf16(s[nt][0], s[nt][1]);
    *reinterpret_cast<unsigned*>(t + (long)(g + 8) * DK + nt * 8 + 2 * t4) = tc::pack_bf16(s[nt][2], s[nt][3]);
  }
}

// A chunk's read-outs from its slot set (the reading levels' bits in rmask), summed in level order into o's
// rows of the chunk (orow: row 0, column col0), four columns a thread and step.
template <int NWG>
__device__ __forceinline__ void read_out(float* orow, const float* slots, unsigned rmask, int DV) {
  constexpr int LR = kBV + 4;
  for (int i = threadIdx.x; i < kC * kBV / 4; i += 128 * NWG) {
    const int t = i >> 2, q = (i & 3) * 4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kLevelsWG * NWG; ++w)
      if ((rmask >> w) & 1) {
        const float4 x = *reinterpret_cast<const float4*>(slots + (w * kC + t) * LR + q);
        acc.x += x.x;
        acc.y += x.y;
        acc.z += x.z;
        acc.w += x.w;
      }
    *reinterpret_cast<float4*>(orow + (long)t * DV + q) = acc;
  }
}

template <int DK, int NWG>
__global__ void __launch_bounds__(128 * NWG, 1)
    walk_fwd_kernel(const bf16* __restrict__ W, const bf16* __restrict__ U, const bf16* __restrict__ Kt,
                    const bf16* __restrict__ P, const float* __restrict__ gamma, const float* __restrict__ lam,
                    const float* __restrict__ X0, float* __restrict__ o, float* __restrict__ finals,
                    bf16* __restrict__ states, int BH, int T, int DV, int J, int lpg, long offset, int first_level) {
  using S = WalkSmem<DK, NWG>;
  constexpr int NS = DK / 8, KS = DK / 16;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = hw::smem_1k(smem_raw);
  const int col0 = blockIdx.x * kBV, bh = blockIdx.y, grp = blockIdx.z, N = T / kC;
  const int j0 = grp * lpg, nlev = min(lpg, J - j0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const bool active = warp < nlev;
  const int j = j0 + warp, level = first_level + j;
  float* slots = reinterpret_cast<float*>(smem + S::oSlots);
  o += (long)grp * BH * T * DV + (long)bh * T * DV + col0;
  const ChunkLoads<DK, NWG> ld(DV, col0, T, nlev);

  float s[NS][4];
  if (active && X0) load_state<DK>(s, X0 + ((long)j * BH + bh) * DK * DV, DV, col0);
  else zero(s);

  ld.issue(smem, W, Kt, P, U, lam, bh, 0, T, DV, J, j0);
  float gm = gamma[(long)bh * N];
  unsigned prev_mask = 0;
  chunk_landed();
  for (int n = 0; n < N; ++n) {
    unsigned char* sb = smem + (n & 1) * S::buf;
    if (n + 1 < N) ld.issue(smem + ((n + 1) & 1) * S::buf, W, Kt, P, U, lam, bh, n + 1, T, DV, J, j0);
    const float gm_next = n + 1 < N ? gamma[(long)bh * N + n + 1] : 0.f;
    const long pos = offset + (long)n * kC;
    const unsigned rmask = reading(pos, first_level + j0, nlev);
    const bool read = (rmask >> warp) & 1;
    const bf16* sU = reinterpret_cast<const bf16*>(sb + S::oU);
    const float* sL = reinterpret_cast<const float*>(sb + S::oL) + warp * kC;
    float* slot = slots + (n & 1) * S::slots + warp * kC * S::LR;
    if (n > 0 && starts_at(pos, level)) zero(s);
    if (active && states) store_state_t<DK>(states + (((long)bh * N + n) * J + j) * DV * DK + (long)col0 * DK, s);
    tc::u32 sa[KS][4];
    to_a<KS>(sa, s);
    float r[8][4], v[8][4];
    hw::pin(sa);
    hw::wg_fence();
    times_tile_t<KS>(v, sa, sb + S::oA);  // Sᵀ·Wᵀ
    hw::wg_commit();
    times_tile_t<KS>(r, sa, sb + S::oP);  // Rᵀ = Sᵀ·Pᵀ
    hw::wg_commit();
    // The previous chunk's read-outs, while the products run (its slots written before the last barrier).
    if (n > 0) read_out<NWG>(o + (long)(n - 1) * kC * DV, slots + ((n - 1) & 1) * S::slots, prev_mask, DV);
    prev_mask = rmask;
    hw::wg_wait<1>();  // Sᵀ·Wᵀ done (Rᵀ may still run)
    hw::pin(v);
    tc::u32 va[4][4];
    if (active) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = nt * 8 + 2 * t4 + (e & 1), rr = g + (e >> 1) * 8;
          const float u = read ? 0.f : __bfloat162float(sU[t * S::LU + rr]);
          v[nt][e] = u - v[nt][e];
        }
      to_a<4>(va, v);
    } else {
      zero_a(va);
    }
#pragma unroll
    for (int nt = 0; nt < NS; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= gm;
    hw::pin(va);
    hw::pin(s);
    hw::wg_fence();
    times_tile<NS>(s, va, sb + S::oB);  // Sᵀ += Vᵀ·K̃
    hw::wg_commit();
    hw::wg_wait<1>();  // Rᵀ done (the update may still run)
    hw::pin(r);
    if (read) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const float2 l = *reinterpret_cast<const float2*>(sL + nt * 8 + 2 * t4);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = nt * 8 + 2 * t4 + (e & 1), rr = g + (e >> 1) * 8;
          slot[t * S::LR + rr] = r[nt][e] * ((e & 1) ? l.y : l.x);
        }
      }
    }
    hw::wg_wait<0>();
    hw::pin(s);
    gm = gm_next;
    chunk_landed();
  }
  read_out<NWG>(o + (long)(N - 1) * kC * DV, slots + ((N - 1) & 1) * S::slots, prev_mask, DV);
  if (active) store_state<DK>(finals + ((long)j * BH + bh) * DK * DV, s, DV, col0);
}

template <int DK, int NWG>
__global__ void __launch_bounds__(128 * NWG, 1)
    walk_bwd_kernel(const bf16* __restrict__ W, const bf16* __restrict__ Kt, const bf16* __restrict__ P,
                    const float* __restrict__ gamma, const float* __restrict__ lam, const bf16* __restrict__ dO,
                    const float* __restrict__ dF, bf16* __restrict__ dstates, float* __restrict__ dX0, int BH, int T,
                    int DV, int J, int lpg, long offset, int first_level) {
  using S = WalkSmem<DK, NWG>;
  constexpr int NS = DK / 8, KS = DK / 16;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = hw::smem_1k(smem_raw);
  const int col0 = blockIdx.x * kBV, bh = blockIdx.y, grp = blockIdx.z, N = T / kC;
  const int j0 = grp * lpg, nlev = min(lpg, J - j0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const bool active = warp < nlev;
  const int j = j0 + warp, level = first_level + j;
  const ChunkLoads<DK, NWG> ld(DV, col0, T, nlev);

  float ds[NS][4];
  if (active && dF) load_state<DK>(ds, dF + ((long)j * BH + bh) * DK * DV, DV, col0);
  else zero(ds);

  ld.issue(smem + ((N - 1) & 1) * S::buf, W, Kt, P, dO, lam, bh, N - 1, T, DV, J, j0);
  float gm = gamma[(long)bh * N + N - 1];
  chunk_landed();
  for (int n = N - 1; n >= 0; --n) {
    unsigned char* sb = smem + (n & 1) * S::buf;
    if (n > 0) ld.issue(smem + ((n - 1) & 1) * S::buf, W, Kt, P, dO, lam, bh, n - 1, T, DV, J, j0);
    const float gm_next = n > 0 ? gamma[(long)bh * N + n - 1] : 0.f;
    const long pos = offset + (long)n * kC;
    const bool read = (reading(pos, first_level + j0, nlev) >> warp) & 1;
    const bf16* sD = reinterpret_cast<const bf16*>(sb + S::oU);
    const float* sL = reinterpret_cast<const float*>(sb + S::oL) + warp * kC;
    if (n + 1 < N && starts_at(pos + kC, level)) zero(ds);
    if (active) store_state_t<DK>(dstates + (((long)bh * N + n) * J + j) * DV * DK + (long)col0 * DK, ds);
    tc::u32 da[KS][4];
    to_a<KS>(da, ds);
    float dv[8][4];
    hw::pin(da);
    hw::wg_fence();
    times_tile_t<KS>(dv, da, sb + S::oB);  // dVᵀ = dSᵀ·K̃ᵀ
    hw::wg_commit();
    tc::u32 ra[4][4];  // dRᵀ = (λ ⊙ dO)ᵀ: rows dv, columns the chunk's tokens
    if (read) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const int t = kk * 16 + 2 * t4;
        auto x = [&](int tt, int rr) { return sL[tt] * __bfloat162float(sD[tt * S::LU + rr]); };
        ra[kk][0] = tc::pack_bf16(x(t, g), x(t + 1, g));
        ra[kk][1] = tc::pack_bf16(x(t, g + 8), x(t + 1, g + 8));
        ra[kk][2] = tc::pack_bf16(x(t + 8, g), x(t + 9, g));
        ra[kk][3] = tc::pack_bf16(x(t + 8, g + 8), x(t + 9, g + 8));
      }
    } else {
      zero_a(ra);
    }
#pragma unroll
    for (int nt = 0; nt < NS; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) ds[nt][e] *= gm;
    hw::wg_wait<0>();
    hw::pin(dv);
    tc::u32 na[4][4];
    to_a<4>(na, dv, -1.f);
    hw::pin(na);
    hw::pin(ra);
    hw::pin(ds);
    hw::wg_fence();
    times_tile<NS>(ds, na, sb + S::oA);  // dSᵀ −= dVᵀ·W
    times_tile<NS>(ds, ra, sb + S::oP);  // dSᵀ += dRᵀ·P
    hw::wg_commit();
    hw::wg_wait<0>();
    hw::pin(ds);
    gm = gm_next;
    chunk_landed();
  }
  if (active && dX0) store_state<DK>(dX0 + ((long)j * BH + bh) * DK * DV, ds, DV, col0);
}

struct Dims {
  int BH, T, DK, DV, N, J;
};

Dims check(const char* who, const at::Tensor& W, const at::Tensor& Kt, const at::Tensor& P, const at::Tensor& gamma,
           const at::Tensor& lam, int64_t dv, int64_t offset, int64_t first_level) {
  TORCH_CHECK(W.is_cuda() && W.dim() == 3 && W.scalar_type() == at::kBFloat16, who,
              ": W must be a bf16 CUDA tensor [BH,T,dk], got ", W.sizes(), " ", W.scalar_type());
  TORCH_CHECK(Kt.sizes() == W.sizes() && Kt.scalar_type() == at::kBFloat16 &&
                  P.defined() && P.sizes() == W.sizes() && P.scalar_type() == at::kBFloat16,
              who, ": K̃ and P must be bf16 of W's shape ", W.sizes());
  Dims d{(int)W.size(0), (int)W.size(1), (int)W.size(2), (int)dv, (int)(W.size(1) / kC), (int)lam.size(1)};
  TORCH_CHECK(d.DK == 64 || d.DK == 128, who, ": dk must be 64 or 128, got ", d.DK);
  TORCH_CHECK(d.DV == 64 || d.DV == 128 || d.DV == 256, who, ": dv must be 64, 128 or 256, got ", d.DV);
  TORCH_CHECK(d.T % kC == 0 && d.T > 0 && offset % kC == 0 && offset >= 0, who,
              ": T and the offset must be multiples of 64, got ", d.T, " and ", offset);
  TORCH_CHECK(first_level >= 7 && first_level + d.J <= 62, who, ": levels from 7 below 62, got ", first_level,
              " and ", d.J, " levels");
  TORCH_CHECK(gamma.sizes() == at::IntArrayRef({d.BH, d.N}) && gamma.scalar_type() == at::kFloat, who,
              ": gamma must be fp32 [", d.BH, ",", d.N, "], got ", gamma.sizes());
  TORCH_CHECK(lam.dim() == 3 && lam.size(0) == d.BH && lam.size(2) == d.T && lam.scalar_type() == at::kFloat && d.J >= 1,
              who, ": lam must be fp32 [", d.BH, ",J,", d.T, "], got ", lam.sizes());
  return d;
}

// Level groups: as many as the blocks leave SMs for (each group its own blocks and read-out), at most one
// a level, at least enough for 8 levels (two warpgroups) a block.
int levels_per_group(const Dims& d) {
  constexpr int most = kLevelsWG * kMaxWG;
  const int tiles = (d.DV / kBV) * d.BH;
  int groups = std::max((d.J + most - 1) / most, std::min(d.J, std::max(1, pr::sm_count() / tiles)));
  return (d.J + groups - 1) / groups;
}


const float* ptr_or_null(const at::Tensor& t, const char* who, const char* name, at::IntArrayRef sizes) {
  if (!t.defined()) return nullptr;
  TORCH_CHECK(t.sizes() == sizes && t.scalar_type() == at::kFloat && t.is_contiguous(), who, ": ", name,
              " must be contiguous fp32 ", sizes, ", got ", t.sizes());
  return t.data_ptr<float>();
}

}  // namespace

std::vector<at::Tensor> level_walk_fwd(const at::Tensor& W_, const at::Tensor& U_, const at::Tensor& Kt_,
                                       const at::Tensor& P_, const at::Tensor& gamma_, const at::Tensor& lam_,
                                       const at::Tensor& X0_, int64_t offset, int64_t first_level, bool keep_states) {
  const char* who = "level_walk_fwd";
  const Dims d = check(who, W_, Kt_, P_, gamma_, lam_, U_.size(-1), offset, first_level);
  TORCH_CHECK(U_.dim() == 3 && U_.size(0) == d.BH && U_.size(1) == d.T && U_.scalar_type() == at::kBFloat16, who,
              ": U must be bf16 [", d.BH, ",", d.T, ",dv], got ", U_.sizes());
  c10::cuda::CUDAGuard guard(W_.device());
  auto W = pr::dense16(W_), U = pr::dense16(U_), Kt = pr::dense16(Kt_), P = pr::dense16(P_);
  auto gamma = gamma_.contiguous(), lam = pr::dense16(lam_);
  auto X0 = X0_.defined() ? X0_.contiguous() : X0_;
  const int lpg = levels_per_group(d), groups = (d.J + lpg - 1) / lpg;
  auto f32 = W.options().dtype(at::kFloat);
  auto o = at::empty({groups, d.BH, d.T, d.DV}, f32);
  auto finals = at::empty({d.J, d.BH, d.DK, d.DV}, f32);
  at::Tensor states = keep_states ? at::empty({d.BH, d.N, d.J, d.DV, d.DK}, W.options()) : at::Tensor();
  const float* x0 = ptr_or_null(X0, who, "X0", {d.J, d.BH, d.DK, d.DV});
  auto stream = at::cuda::getCurrentCUDAStream();
  dim3 grid(d.DV / kBV, d.BH, groups);
  auto launch = [&](auto kernel, int nwg, size_t bytes) {
    pr::allow_smem(kernel, bytes);
    kernel<<<grid, 128 * nwg, bytes, stream>>>(
        reinterpret_cast<const bf16*>(W.data_ptr()), reinterpret_cast<const bf16*>(U.data_ptr()),
        reinterpret_cast<const bf16*>(Kt.data_ptr()), reinterpret_cast<const bf16*>(P.data_ptr()),
        gamma.data_ptr<float>(), lam.data_ptr<float>(), x0, o.data_ptr<float>(), finals.data_ptr<float>(),
        keep_states ? reinterpret_cast<bf16*>(states.data_ptr()) : nullptr, d.BH, d.T, d.DV, d.J, lpg, (long)offset,
        (int)first_level);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const bool two = lpg > kLevelsWG;
  if (d.DK == 64 && !two) launch(walk_fwd_kernel<64, 1>, 1, WalkSmem<64, 1>::fwd_bytes);
  else if (d.DK == 64) launch(walk_fwd_kernel<64, 2>, 2, WalkSmem<64, 2>::fwd_bytes);
  else if (!two) launch(walk_fwd_kernel<128, 1>, 1, WalkSmem<128, 1>::fwd_bytes);
  else launch(walk_fwd_kernel<128, 2>, 2, WalkSmem<128, 2>::fwd_bytes);
  // The groups' read-outs summed in group order, by elementwise adds (at::sum over the outer dimension read them
  // at a fraction of the copy rate).
  at::Tensor sum = o.select(0, 0);
  if (groups > 1) {
    sum = o.select(0, 0) + o.select(0, 1);
    for (int i = 2; i < groups; ++i) sum.add_(o.select(0, i));
  }
  return {sum, finals, states};
}

std::vector<at::Tensor> level_walk_bwd(const at::Tensor& W_, const at::Tensor& Kt_, const at::Tensor& P_,
                                       const at::Tensor& gamma_, const at::Tensor& lam_, const at::Tensor& dO_,
                                       const at::Tensor& dF_, int64_t offset, int64_t first_level, int64_t dv) {
  const char* who = "level_walk_bwd";
  const Dims d = check(who, W_, Kt_, P_, gamma_, lam_, dv, offset, first_level);
  TORCH_CHECK(dO_.sizes() == at::IntArrayRef({d.BH, d.T, d.DV}) && dO_.scalar_type() == at::kBFloat16, who,
              ": dO must be bf16 [", d.BH, ",", d.T, ",", d.DV, "], got ", dO_.sizes());
  c10::cuda::CUDAGuard guard(W_.device());
  auto W = pr::dense16(W_), Kt = pr::dense16(Kt_), P = pr::dense16(P_), dO = pr::dense16(dO_);
  auto gamma = gamma_.contiguous(), lam = pr::dense16(lam_);
  auto dF = dF_.defined() ? dF_.to(at::kFloat).contiguous() : dF_;
  const int lpg = levels_per_group(d), groups = (d.J + lpg - 1) / lpg;
  auto f32 = W.options().dtype(at::kFloat);
  auto dstates = at::empty({d.BH, d.N, d.J, d.DV, d.DK}, W.options());
  auto dX0 = at::empty({d.J, d.BH, d.DK, d.DV}, f32);
  const float* df = ptr_or_null(dF, who, "dF", {d.J, d.BH, d.DK, d.DV});
  auto stream = at::cuda::getCurrentCUDAStream();
  dim3 grid(d.DV / kBV, d.BH, groups);
  auto launch = [&](auto kernel, int nwg, size_t bytes) {
    pr::allow_smem(kernel, bytes);
    kernel<<<grid, 128 * nwg, bytes, stream>>>(
        reinterpret_cast<const bf16*>(W.data_ptr()), reinterpret_cast<const bf16*>(Kt.data_ptr()),
        reinterpret_cast<const bf16*>(P.data_ptr()), gamma.data_ptr<float>(), lam.data_ptr<float>(),
        reinterpret_cast<const bf16*>(dO.data_ptr()), df, reinterpret_cast<bf16*>(dstates.data_ptr()),
        dX0.data_ptr<float>(), d.BH, d.T, d.DV, d.J, lpg, (long)offset, (int)first_level);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const bool two = lpg > kLevelsWG;
  if (d.DK == 64 && !two) launch(walk_bwd_kernel<64, 1>, 1, WalkSmem<64, 1>::bwd_bytes);
  else if (d.DK == 64) launch(walk_bwd_kernel<64, 2>, 2, WalkSmem<64, 2>::bwd_bytes);
  else if (!two) launch(walk_bwd_kernel<128, 1>, 1, WalkSmem<128, 1>::bwd_bytes);
  else launch(walk_bwd_kernel<128, 2>, 2, WalkSmem<128, 2>::bwd_bytes);
  return {dstates, dX0};
}

}  // namespace carry::kernels::log_linear
