// The delta rule's bf16 state walks on one warpgroup (sm_90a): wgmma products, TMA loads.
//
// One warpgroup (128 threads) owns a 32-column tile of one head's dk × dv state (dk = 128), held in fp32
// registers as two m64n32 wgmma accumulators (rows 64·half + 16·warp + lane/4 (+8), columns 8j +
// 2·(lane%4) (+1)); a block holds one warpgroup or two (NWG: 64 columns, the chunk's K, Q, W and G
// tiles loaded once for both, each warpgroup's own tiles and stores apart; the same operations, so
// the same bits). A chunk's tiles arrive by TMA, issued by one thread S − 1 chunks ahead (S buffers,
// an mbarrier each), so the warps spend no instructions on loads:
//  - K, Q̃, W [64 tokens][128] bf16 as two 64-column halves, 128-byte swizzled (TMA SWIZZLE_128B): the
//    wgmma A operand straight from shared memory, K-major (W·S, K·dS) or MN-major (Kᵀ·Ṽ, Q̃ᵀ·dO, Wᵀ·dV);
//  - U [64][32] bf16 dense rows, dV_local [64][32] fp32 128-byte swizzled, G [64] fp32 (not for
//    DeltaNet: GATE = false), dO [64][32] in 8 × 8 core matrices (the B operand of Q̃ᵀ·dO).
// The state and V_new (dH_c, dV_new) go to shared memory once, by stmatrix, in TMA's 64-byte swizzle: the
// tiles the bulk tensor stores send out (a warpgroup's first thread issues and waits for its own) are the
// products' B operands too. One block barrier and one warpgroup barrier a chunk. A warp spends about 265
// instructions on a chunk forward and 320 in reverse (ncu at H=16, 16384 tokens: a piece of 64 chunks
// 75 µs forward, 94 µs reverse): Q̃ comes from the intra-chunk dV kernel, the tiles are not copied twice,
// DeltaNet does no gate work, and each descriptor is one add from a base (Desc). What a chunk
// does is fwd_state_mma_kernel's (fwd.cu) and bwd_state_mma_kernel's (bwd_state.cuh), the walks at
// dk = 64, with the same roundings to bf16; the products' fp32 sums run in the tensor cores' order, so
// the bits differ from those kernels'.
//
// Floor and cost (one H200, H=16, dk=dv=128, 131072 tokens, ncu, 12 pieces a walk): forward 2.19 ms and
// reverse 2.97 ms with bulk stores (2.34 and 3.20 with the threads' own global stores), against 3.65 and
// 5.16 ms for the mma.sync walk and 2.06 and 2.70 ms for FLA's. The 128-byte TMA boxes are what makes it fast.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cudaTypedefs.h>

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "layers/kernels/primitives/hopper.cuh"

namespace carry::kernels::delta_rule {
namespace wg {

using bf16 = __nv_bfloat16;
constexpr int kC = 64, kDK = 128, kBV = 32, kWalkStages = 3;

// The Hopper primitives (wgmma descriptors and fences, mbarriers, TMA, stmatrix).
using namespace carry::kernels::primitives::hopper;
// A warp's 16 rows at row0 of an m64n32 fragment set (x[hf][j]: the bf16 pair of row g + 8·hf, column
// 8j + 2·t4) into a [rows][32] sw64 tile: two stmatrix.x4, matrix i of the pair jp = (j = 2·jp + i/2,
// hf = i%2).
__device__ __forceinline__ void frag_to_sw64(const unsigned (&x)[2][4], int row0, unsigned char* t) {
  const int lane = threadIdx.x & 31, i = lane >> 3, rr = lane & 7;
#pragma unroll
  for (int jp = 0; jp < 2; ++jp) {
    const unsigned r[4] = {x[0][2 * jp], x[1][2 * jp], x[0][2 * jp + 1], x[1][2 * jp + 1]};
    stsm_x4(t + sw64_off(row0 + 8 * (i & 1) + rr, 8 * (2 * jp + (i >> 1))), r);
  }
}
// The state (bf16) into a [128][32] sw64 tile (H_c or dH_c for a bulk store, and the B operand of W·S
// or K·dS).
__device__ __forceinline__ void state_to_sw64(const float (&s)[2][16], unsigned char* t) {
  const int warp = (threadIdx.x >> 5) & 3;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    unsigned x[2][4];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int j = 0; j < 4; ++j) x[hf][j] = pk(s[hh][4 * j + 2 * hf], s[hh][4 * j + 2 * hf + 1]);
    frag_to_sw64(x, 64 * hh + 16 * warp, t);
  }
}


// The state (two m64n32 accumulators) to or from fp32 [dk][DV] memory at column v0.
template <bool STORE>
__device__ __forceinline__ void state_io(float (&s)[2][16], float* p, long ld, int v0) {
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const long off = (long)(64 * hh + 16 * warp + g + 8 * hf) * ld + v0 + 8 * j + 2 * t4;
        if constexpr (STORE) {
          *reinterpret_cast<float2*>(p + off) = make_float2(s[hh][4 * j + 2 * hf], s[hh][4 * j + 2 * hf + 1]);
        } else {
          const float2 x = p ? *reinterpret_cast<const float2*>(p + off) : make_float2(0.f, 0.f);
          s[hh][4 * j + 2 * hf] = x.x;
          s[hh][4 * j + 2 * hf + 1] = x.y;
        }
      }
}

// The thread of a warpgroup that issues and waits for its bulk stores (bulk groups are per thread).
__device__ __forceinline__ bool wg_leader() { return (threadIdx.x & 127) == 0; }
// Each warpgroup's own tiles: H_c's store tile [128][32] (sw64), V_new's [64][32] (sw64), an 8 KB tile no
// walk uses (kPrivSb; it keeps the block's shared memory, hence its blocks an SM, as measured), and the
// forward's Vb = e^{G_C−G} V_new [64][32] (sw64); 1024-byte multiples, so the swizzled tiles stay aligned.
constexpr int kPrivHt = 0, kPrivVt = 8192, kPrivSb = 12288, kPrivVb = 20480, kPrivBytes = 24576;


// ---- pieces of a chunk shared by both walks ----------------------------------------------------
// The stage barriers (one a buffer), initialized by thread 0; the block waits for them.
template <int S>
__device__ __forceinline__ void init_stages(uint64_t* bar) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < S; ++i) mbar_init(bar + i);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
}
// A [64 tokens][128] bf16 tile as two 128-byte-swizzled boxes of 64 columns: from [rows][128] (W) or
// from token-major [B·T][H][128] (q, k).
__device__ __forceinline__ void load_rows(unsigned char* dst, const CUtensorMap* m, int row, uint64_t* bar) {
  tma2(dst, m, 0, row, bar);
  tma2(dst + 8192, m, 64, row, bar);
}
__device__ __forceinline__ void load_tokens(unsigned char* dst, const CUtensorMap* m, int h, int trow, uint64_t* bar) {
  tma3(dst, m, 0, h, trow, bar);
  tma3(dst + 8192, m, 64, h, trow, bar);
}
// A chunk's start: the state into the B operand of the chunk's first product, the sw64 tile its bulk
// store reads (stmatrix); made visible to the tensor cores and TMA; thread 0 of each warpgroup first
// waits until its previous bulk stores have read their tiles; then one block barrier (every warp is past
// the previous chunk: the shared buffers are free).
__device__ __forceinline__ void chunk_start(const float (&s)[2][16], unsigned char* sHt) {
  state_to_sw64(s, sHt);
  fence_async();
  if (wg_leader()) store_wait_read();
  __syncthreads();
}
// The barrier before the state update, over the warpgroup alone (its tiles are its own; a block of two
// warpgroups syncs both only at chunk_start): the V tiles written and visible; thread 0 waits for the
// state's bulk store to have read its tile, then, after the barrier, sends the V tile to row vrow.
// STORE = false (a walk that writes only its final state): no V tile leaves.
template <bool STORE = true>
__device__ __forceinline__ void chunk_middle(const CUtensorMap* tmV, int v0, int vrow, const unsigned char* sVt) {
  fence_async();
  if (STORE && wg_leader()) store_wait_read();
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + (int)(threadIdx.x >> 7)) : "memory");
  if (STORE && wg_leader()) tma_store2(tmV, v0, vrow, sVt);
}
// d (m64n32) = A·S over dk = 128, A [64 tokens][128] in a swizzled tile (W·S, K·dS), S the B operand at
// descriptor db; issued, not waited for.
__device__ __forceinline__ void tokens_times_state(float (&d)[16], const unsigned char* a, Desc db) {
#pragma unroll
  for (int i = 0; i < 16; ++i) d[i] = 0.f;
  const Desc da = desc_sw128(a);
  wg_fence();
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) mma_ss<0, 1>(d, da.at((ks >> 2) * 8192 + (ks & 3) * 32), db.at(ks * 1024));
  wg_commit();
}
// s += SB·Aᵀ·V over the chunk's 64 tokens, A [64 tokens][128] in a swizzled tile (Kᵀ·Ṽ, −Wᵀ·dV), V the
// B operand at descriptor db; then waited for.
template <int SB = 1>
__device__ __forceinline__ void update_state(float (&s)[2][16], const unsigned char* a, Desc db) {
  const Desc da = desc_sw128(a);
  wg_fence();
#pragma unroll
  for (int hh = 0; hh < 2; ++hh)
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) mma_ss<1, 1, SB>(s[hh], da.at(hh * 8192 + ks * 2048), db.at(ks * 1024));
  wg_commit();
  wg_wait<0>();
}
// The end of a walk: thread 0 waits for its bulk stores to land; the state to fp32 memory.
__device__ __forceinline__ void walk_end(float (&s)[2][16], float* out, int dv, int v0) {
  if (wg_leader()) store_wait_all();
  state_io<true>(s, out, dv, v0);
}

// ---- forward walk ----------------------------------------------------------------------------
// NWG warpgroups a block, each its own 32 columns, sharing the chunk's W, K and G tiles (S stages).
template <int NWG, int S>
struct FwdSmem {
  static constexpr int oW = 0, oK = oW + S * 16384, oU = oK + S * 16384, oG = oU + S * 4096 * NWG,
                       oPriv = al1k(oG + S * 256), oBar = oPriv + NWG * kPrivBytes, bytes = oBar + 8 * S + 1024;
  static_assert(oK % 1024 == 0 && oPriv % 1024 == 0, "swizzled tiles sit on 1024-byte boundaries");
};

// grid (DV/(32·NWG), H, B), 128·NWG threads; warpgroup w of block x owns the 32 columns from
// (NWG·x + w)·32. Walks chunks [c_begin, c_end) from S0 (the state entering c_begin; null: zeros),
// writes H_c (bf16 [B,H,N,dk,DV]) and V_new (bf16 [B,H,T,DV]), and the state after
// c_end − 1 to Sfin (fp32). Maps: W [B·H·T][dk], k [B·T][H][dk] (boxes of 64 × 64, swizzled), U
// [B·H·T][DV] (boxes of 32 × 64), G (fp32 [B·H·T/64][64]).
// H_c and V_new leave by bulk tensor stores (tmH: Hs as [B·H·N·dk][DV], tmV: Vn as [B·H·T][DV], boxes of
// 32 columns, 64-byte swizzle) from shared copies; the kernel writes Hs and Vn only through those maps.
// A warpgroup's operations on its columns are the same whatever NWG: the same bits.
// GATE = false (DeltaNet: G is zero): no gate is read and no factor e^0 = 1 applied (the same bits);
// the V_new tile the bulk store reads is then the update's B operand as it is.
// Segments (the segmented walk, fwd.cu): grid z is B·nseg, block z = b·nseg + seg walks chunks
// [c_begin + seg·seg_len, min(c_begin + (seg + 1)·seg_len, c_end)) with its states at slot
// seg·B·H + b·H + h of S0 and Sfin (nseg = 1: the one walk above). MODE 0 writes H_c and V_new; MODE 1
// (a segment's summary) writes only the final state; MODE 2 (a segment's transport, DV = dk) starts from
// the identity with U ≡ 0 (not read), so its final state is the segment's map A in S ↦ A·S + B.
template <int DV, int NWG, int S, bool GATE, int MODE = 0>
__global__ void __launch_bounds__(128 * NWG)
    fwd_walk_wg(const __grid_constant__ CUtensorMap tmW, const __grid_constant__ CUtensorMap tmK,
                const __grid_constant__ CUtensorMap tmU, const __grid_constant__ CUtensorMap tmG,
                const __grid_constant__ CUtensorMap tmH, const __grid_constant__ CUtensorMap tmV,
                const float* __restrict__ S0, bf16* __restrict__ Hs, bf16* __restrict__ Vn, float* __restrict__ Sfin,
                int T_, int H, int c_first, int c_last, int nseg = 1, int seg_len = 0) {
  static_assert(MODE != 2 || DV == kDK, "a transport walk's state is dk × dk");
  constexpr bool STORE = MODE == 0, READ_U = MODE != 2;
  using L = FwdSmem<NWG, S>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* sm = smem_1k(smem_raw);
  // the warpgroup (a constant with one: its private tiles' descriptors then stay in uniform registers)
  const int wgi = NWG == 1 ? 0 : threadIdx.x >> 7, vb = blockIdx.x * NWG * kBV, v0 = vb + wgi * kBV;
  const int h = blockIdx.y, seg = blockIdx.z % nseg, b = blockIdx.z / nseg, tid = threadIdx.x;
  const int warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int N = T_ / kC;
  const int c_begin = nseg == 1 ? c_first : c_first + seg * seg_len;
  const int c_end = nseg == 1 ? c_last : min(c_begin + seg_len, c_last);
  const long bh = (long)b * H + h, slot = (long)seg * (gridDim.z / nseg) * H + bh;
  unsigned char* sW = sm + L::oW;
  unsigned char* sK = sm + L::oK;
  unsigned char* sU = sm + L::oU;
  float* sG = reinterpret_cast<float*>(sm + L::oG);
  unsigned char* priv = sm + L::oPriv + wgi * kPrivBytes;
  unsigned char* sVb = priv + kPrivVb;
  unsigned char* sHt = priv + kPrivHt;
  unsigned char* sVt = priv + kPrivVt;
  uint64_t* bar = reinterpret_cast<uint64_t*>(sm + L::oBar);
  init_stages<S>(bar);
  auto issue = [&](int c, int buf) {  // one thread
    const int row = (int)(bh * T_ + (long)c * kC), trow = b * T_ + c * kC;
    mbar_expect(bar + buf, 2 * 16384 + (READ_U ? NWG * 4096 : 0) + (GATE ? 256 : 0));
    load_rows(sW + buf * 16384, &tmW, row, bar + buf);
    load_tokens(sK + buf * 16384, &tmK, h, trow, bar + buf);
    if constexpr (READ_U) {
#pragma unroll
      for (int w = 0; w < NWG; ++w) tma2(sU + (buf * NWG + w) * 4096, &tmU, vb + w * kBV, row, bar + buf);
    }
    if constexpr (GATE) tma2(sG + buf * 64, &tmG, 0, row / kC, bar + buf);
  };
  float s[2][16];
  if constexpr (MODE == 2) {  // the identity's columns v0.. of this warpgroup
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            s[hh][4 * j + 2 * hf + e] = (64 * hh + 16 * warp + g + 8 * hf == v0 + 8 * j + 2 * t4 + e) ? 1.f : 0.f;
  } else {
    state_io<false>(s, const_cast<float*>(S0 ? S0 + slot * kDK * DV : nullptr), DV, v0);
  }
  if (tid == 0)
    for (int i = 0; i < S - 1 && c_begin + i < c_end; ++i) issue(c_begin + i, i);
  for (int c = c_begin; c < c_end; ++c) {
    const int it = c - c_begin, buf = it % S;
    chunk_start(s, sHt);
    if (tid == 0 && c + S - 1 < c_end) issue(c + S - 1, (it + S - 1) % S);
    if (STORE && wg_leader()) tma_store2(&tmH, v0, (int)((bh * N + c) * kDK), sHt);
    mbar_wait(bar + buf, (it / S) & 1);
    const unsigned char* cW = sW + buf * 16384;
    const unsigned char* cK = sK + buf * 16384;
    const unsigned char* cU = sU + (buf * NWG + wgi) * 4096;
    const float* G = sG + buf * 64;
    // V_new = U − W·S
    float d[16];
    tokens_times_state(d, cW, desc_sw64(sHt));
    const float gl = GATE ? G[kC - 1] : 0.f;
    float e[2] = {1.f, 1.f};
    unsigned uu[2][4];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = 16 * warp + g + 8 * hf;
      if constexpr (GATE) e[hf] = __expf(gl - G[r]);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        uu[hf][j] = READ_U ? *reinterpret_cast<const unsigned*>(cU + r * 64 + (8 * j + 2 * t4) * 2) : 0u;
    }
    wg_wait<0>();
    unsigned x[2][4], xb[2][4];  // V_new and Vb = e^{G_C−G} V_new, bf16 pairs
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 uf = upk(uu[hf][j]);
        x[hf][j] = pk(uf.x - d[4 * j + 2 * hf], uf.y - d[4 * j + 2 * hf + 1]);
        if constexpr (GATE) {
          const float2 xf = upk(x[hf][j]);
          xb[hf][j] = pk(xf.x * e[hf], xf.y * e[hf]);
        } else {
          xb[hf][j] = x[hf][j];
        }
      }
    frag_to_sw64(x, 16 * warp, sVt);
    if constexpr (GATE) frag_to_sw64(xb, 16 * warp, sVb);
    const Desc vdesc = desc_sw64(GATE ? sVb : sVt);  // Vb's B descriptor
    chunk_middle<STORE>(&tmV, v0, (int)(bh * T_ + (long)c * kC), sVt);
    // S ← e^{G_C} S + Kᵀ·(e^{G_C−G} V_new)
    if constexpr (GATE) {
      const float egl = __expf(gl);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int i = 0; i < 16; ++i) s[hh][i] *= egl;
    }
    update_state(s, cK, vdesc);
  }
  walk_end(s, Sfin + slot * kDK * DV, DV, v0);
}

// ---- reverse walk ----------------------------------------------------------------------------
// NWG warpgroups a block share the chunk's Q, K, W and G tiles; dO and dV_local come a box a warpgroup.
template <int NWG, int S>
struct BwdSmem {
  static constexpr int oQ = 0, oK = oQ + S * 16384, oW = oK + S * 16384, odVl = oW + S * 16384,
                       odO = odVl + S * 8192 * NWG, oG = odO + S * 4096 * NWG, oPriv = al1k(oG + S * 256),
                       oBar = oPriv + NWG * kPrivBytes, bytes = oBar + 8 * S + 1024;
  static_assert(oK % 1024 == 0 && oW % 1024 == 0 && odVl % 1024 == 0 && oPriv % 1024 == 0,
                "swizzled tiles sit on 1024-byte boundaries");
};

// grid (DV/(32·NWG), H, B), 128·NWG threads (columns as fwd_walk_wg). Walks chunks c_end − 1 down to
// c_begin from dSfin (the gradient of the state leaving c_end − 1; null: zeros): dH_c = dS (bf16),
// dV_new = e^{G_C−G} ⊙ K·dS + dV_local (bf16), dS ← e^{G_C} dS + Q̃ᵀ dO − Wᵀ dV_new; dS0 gets the
// gradient entering c_begin. Q̃ = scale·e^G ⊙ Q in bf16 comes ready from the intra-chunk dV kernel
// (bwd_dv_local_reg_kernel, bwd.cu: the same products the walk once formed in registers, 250 of
// its 869 instructions a chunk).
// Maps: Q̃, k [B·T][H][dk] and W [B·H·T][dk] (64 × 64, swizzled), dO [B·T][H][DV] (8 × 64 × 4 core
// matrices), dV_local fp32 [B·H·T][DV] (32 × 64, swizzled), G.
// dH_c and dV_new leave by bulk tensor stores (tmH, tmV as in fwd_walk_wg: dHs and dVn are written only
// through them), and their tiles are the products' B operands (dV_new's negated by the product).
// GATE = false: as in fwd_walk_wg. Segments as in fwd_walk_wg (dSfin and dS0 at the segment's slot);
// STORE = false (a segment's summary): only dS0 is written.
template <int DV, int NWG, int S, bool GATE, bool STORE = true>
__global__ void __launch_bounds__(128 * NWG) bwd_walk_wg(
    const __grid_constant__ CUtensorMap tmQ, const __grid_constant__ CUtensorMap tmK,
    const __grid_constant__ CUtensorMap tmW, const __grid_constant__ CUtensorMap tmdO,
    const __grid_constant__ CUtensorMap tmdVl, const __grid_constant__ CUtensorMap tmG,
    const __grid_constant__ CUtensorMap tmH, const __grid_constant__ CUtensorMap tmV, const float* __restrict__ dSfin,
    bf16* __restrict__ dHs, bf16* __restrict__ dVn, float* __restrict__ dS0, int T_, int H, int c_first,
    int c_last, int nseg = 1, int seg_len = 0) {
  using L = BwdSmem<NWG, S>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* sm = smem_1k(smem_raw);
  // the warpgroup (a constant with one: its private tiles' descriptors then stay in uniform registers)
  const int wgi = NWG == 1 ? 0 : threadIdx.x >> 7, vb = blockIdx.x * NWG * kBV, v0 = vb + wgi * kBV;
  const int h = blockIdx.y, seg = blockIdx.z % nseg, b = blockIdx.z / nseg, tid = threadIdx.x;
  const int warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int N = T_ / kC;
  const int c_begin = nseg == 1 ? c_first : c_first + seg * seg_len;
  const int c_end = nseg == 1 ? c_last : min(c_begin + seg_len, c_last);
  const long bh = (long)b * H + h, slot = (long)seg * (gridDim.z / nseg) * H + bh;
  unsigned char* sQ = sm + L::oQ;
  unsigned char* sK = sm + L::oK;
  unsigned char* sW = sm + L::oW;
  unsigned char* sdO = sm + L::odO;
  unsigned char* sdVl = sm + L::odVl;
  float* sG = reinterpret_cast<float*>(sm + L::oG);
  unsigned char* priv = sm + L::oPriv + wgi * kPrivBytes;
  unsigned char* sHt = priv + kPrivHt;
  unsigned char* sVt = priv + kPrivVt;
  uint64_t* bar = reinterpret_cast<uint64_t*>(sm + L::oBar);
  init_stages<S>(bar);
  auto issue = [&](int c, int buf) {  // one thread
    const int row = (int)(bh * T_ + (long)c * kC), trow = b * T_ + c * kC;
    mbar_expect(bar + buf, 3 * 16384 + NWG * (4096 + 8192) + (GATE ? 256 : 0));
    load_tokens(sQ + buf * 16384, &tmQ, h, trow, bar + buf);
    load_tokens(sK + buf * 16384, &tmK, h, trow, bar + buf);
    load_rows(sW + buf * 16384, &tmW, row, bar + buf);
#pragma unroll
    for (int w = 0; w < NWG; ++w) {
      tma4(sdO + (buf * NWG + w) * 4096, &tmdO, 0, trow, (vb + w * kBV) / 8, h, bar + buf);
      tma2(sdVl + (buf * NWG + w) * 8192, &tmdVl, vb + w * kBV, row, bar + buf);
    }
    if constexpr (GATE) tma2(sG + buf * 64, &tmG, 0, row / kC, bar + buf);
  };
  float s[2][16];
  state_io<false>(s, const_cast<float*>(dSfin ? dSfin + slot * kDK * DV : nullptr), DV, v0);
  const int count = c_end - c_begin;
  if (tid == 0)
    for (int i = 0; i < S - 1 && i < count; ++i) issue(c_end - 1 - i, i);
  for (int it = 0; it < count; ++it) {
    const int c = c_end - 1 - it, buf = it % S;
    chunk_start(s, sHt);
    if (tid == 0 && it + S - 1 < count) issue(c - (S - 1), (it + S - 1) % S);
    if (STORE && wg_leader()) tma_store2(&tmH, v0, (int)((bh * N + c) * kDK), sHt);
    mbar_wait(bar + buf, (it / S) & 1);
    const unsigned char* cQ = sQ + buf * 16384;
    const unsigned char* cK = sK + buf * 16384;
    const unsigned char* cW = sW + buf * 16384;
    const unsigned char* cdO = sdO + (buf * NWG + wgi) * 4096;
    const unsigned char* cdVl = sdVl + (buf * NWG + wgi) * 8192;
    const float* G = sG + buf * 64;
    const float gl = GATE ? G[kC - 1] : 0.f;
    if constexpr (GATE) {
      const float egl = __expf(gl);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int i = 0; i < 16; ++i) s[hh][i] *= egl;
    }
    float d[16];
    tokens_times_state(d, cK, desc_sw64(sHt));  // K·dS
    // Q̃ᵀ (rows d = 64·hh.., k = tokens: MN-major from the swizzled tile, as Wᵀ in update_state) times dO
    const Desc dq = desc_sw128(cQ), ddo = desc(cdO, 128, 1024);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) mma_ss<1, 1>(s[hh], dq.at(hh * 8192 + ks * 2048), ddo.at(ks * 256));
    wg_commit();  // e^{G_C} dS + Q̃ᵀ dO
    float e[2] = {1.f, 1.f};
    float2 l[2][4];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = 16 * warp + g + 8 * hf;
      if constexpr (GATE) e[hf] = __expf(gl - G[r]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int col = 8 * j + 2 * t4;
        l[hf][j] = *reinterpret_cast<const float2*>(cdVl + r * 128 + (((col >> 2) ^ (r & 7)) << 4) + (col & 3) * 4);
      }
    }
    wg_wait<1>();
    unsigned x[2][4];  // dV_new, bf16 pairs
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        x[hf][j] = GATE ? pk(d[4 * j + 2 * hf] * e[hf] + l[hf][j].x, d[4 * j + 2 * hf + 1] * e[hf] + l[hf][j].y)
                        : pk(d[4 * j + 2 * hf] + l[hf][j].x, d[4 * j + 2 * hf + 1] + l[hf][j].y);
    frag_to_sw64(x, 16 * warp, sVt);  // dV_new, the bulk store's tile and (negated) the update's B
    wg_wait<0>();
    chunk_middle<STORE>(&tmV, v0, (int)(bh * T_ + (long)c * kC), sVt);
    update_state<-1>(s, cW, desc_sw64(sVt));  // − Wᵀ dV_new
  }
  walk_end(s, dS0 + slot * kDK * DV, DV, v0);
}


// ---- host: the tensor maps -------------------------------------------------------------------
inline PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    TORCH_CHECK(q == cudaDriverEntryPointSuccess && f,
                "delta rule state walk: expected the CUDA driver to provide cuTensorMapEncodeTiled (CUDA 12 or "
                "later), found none");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

template <int R>
CUtensorMap tensor_map(CUtensorMapDataType dt, const void* base, const uint64_t (&dims)[R],
                       const uint64_t (&strides)[R - 1], const uint32_t (&box)[R], CUtensorMapSwizzle sw) {
  CUtensorMap m;
  const uint32_t ones[5] = {1, 1, 1, 1, 1};  // element strides
  const CUresult r = encode_fn()(&m, dt, R, const_cast<void*>(base), dims, strides, box, ones,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, sw, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "delta rule state walk: cuTensorMapEncodeTiled failed (error ", (int)r, ", rank ", R,
              ", base ", base, ")");
  return m;
}
// q, k ([B,T,H,128] bf16): (d, head, b·T + t), boxes of 64 d × 64 tokens, 128-byte swizzle.
inline CUtensorMap map_tokens(const bf16* p, int B, int T, int H) {
  return tensor_map<3>(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, p, {(uint64_t)kDK, (uint64_t)H, (uint64_t)B * T},
                       {(uint64_t)kDK * 2, (uint64_t)H * kDK * 2}, {64, 1, 64}, CU_TENSOR_MAP_SWIZZLE_128B);
}
// W ([B,H,T,128] bf16): (d, bh·T + t), boxes of 64 × 64, 128-byte swizzle.
inline CUtensorMap map_w(const bf16* p, long rows) {
  return tensor_map<2>(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, p, {(uint64_t)kDK, (uint64_t)rows}, {(uint64_t)kDK * 2},
                       {64, 64}, CU_TENSOR_MAP_SWIZZLE_128B);
}
// U ([B,H,T,dv] bf16): boxes of 32 columns × 64 tokens, dense rows.
inline CUtensorMap map_u(const bf16* p, long rows, int dv) {
  return tensor_map<2>(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, p, {(uint64_t)dv, (uint64_t)rows}, {(uint64_t)dv * 2},
                       {kBV, 64}, CU_TENSOR_MAP_SWIZZLE_NONE);
}
// dO ([B,T,H,dv] bf16): (8 columns, b·T + t, column group, head), boxes 8 × 64 × 4 × 1 (core matrices).
inline CUtensorMap map_do(const bf16* p, int B, int T, int H, int dv) {
  return tensor_map<4>(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, p, {8, (uint64_t)B * T, (uint64_t)dv / 8, (uint64_t)H},
                       {(uint64_t)H * dv * 2, 16, (uint64_t)dv * 2}, {8, 64, kBV / 8, 1}, CU_TENSOR_MAP_SWIZZLE_NONE);
}
// dV_local ([B,H,T,dv] fp32): boxes of 32 columns × 64 tokens, 128-byte swizzle.
inline CUtensorMap map_dvl(const float* p, long rows, int dv) {
  return tensor_map<2>(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, p, {(uint64_t)dv, (uint64_t)rows}, {(uint64_t)dv * 4},
                       {kBV, 64}, CU_TENSOR_MAP_SWIZZLE_128B);
}
// G ([B,H,T] fp32) as [B·H·T/64][64]: one chunk a box.
inline CUtensorMap map_g(const float* p, long rows) {
  return tensor_map<2>(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, p, {64, (uint64_t)rows / 64}, {256}, {64, 1},
                       CU_TENSOR_MAP_SWIZZLE_NONE);
}
// H_c or dH_c ([B,H,N,128,dv] bf16) as [B·H·N·128][dv], and V_new or dV_new ([B,H,T,dv]) as
// [B·H·T][dv]: boxes of 32 columns × box_rows rows, 64-byte swizzle (the walks' bulk stores).
inline CUtensorMap map_store(const bf16* p, long rows, int dv, unsigned box_rows) {
  return tensor_map<2>(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, p, {(uint64_t)dv, (uint64_t)rows}, {(uint64_t)dv * 2},
                       {kBV, box_rows}, CU_TENSOR_MAP_SWIZZLE_64B);
}
// The walks address rows and tokens with 32-bit TMA coordinates.
inline void check_coords(long rows) {
  TORCH_CHECK(2 * rows < (1L << 31), "delta rule state walk: expected B·H·T below 2^30 tokens, found ", rows);
}

}  // namespace wg
}  // namespace carry::kernels::delta_rule
