// Forward kernels of the delta rule (DeltaNet, Gated DeltaNet), chunk C = 64, WY/UT form.
//
// Three kernels; only the second is sequential (over chunks):
//  1. prep_kernel, grid (N chunks, H, B), 256 threads. One block owns one chunk of one head.
//     Reads k [C,dk], v [C,dv], g, beta. In shared memory: K, A = strictly_lower(diag(β)KKᵀ ⊙ Γ)
//     and its inverse T = (I+A)⁻¹ (fp32, 16x16 diagonal blocks by substitution, then the
//     off-diagonal blocks by distance), V tiles of 64. Writes G (gate cumsum, fp32), and in the
//     input dtype T (saved for backward: the bf16 backward multiplies by T's bf16 rounding, so
//     saving that rounding gives its bits in half the bytes), W = T·(β e^G K) and U = T·(β V).
//     HBM floor per token and head: read 2(dk+dv) bytes, write 2(dk+dv) + 2·64 + 4 bytes (bf16).
//     FLOPs per chunk: 2·C²·dk (KKᵀ) + 2·C²·(dk+dv) (W, U), on tensor cores for bf16.
//     For bf16 the launcher uses prep_reg_kernel (1b: products in mma.sync registers, β and e^G
//     folded into T's columns) and, for 3., fwd_o_reg_kernel (3b).
//  2. fwd_state_kernel, grid (dv/BV, H, B), 128 threads. One block owns one BV-wide column tile
//     of one head's state and walks the chunks in order. The state tile S [dk,BV] stays in shared
//     memory in fp32 for the whole sequence; per chunk it streams in W, K [C,dk] and U [C,BV]
//     (double-buffered with cp.async for bf16) and streams out H_c = S (input dtype, saved) and
//     V_new = U − W·S; then S ← e^{G_C} S + Kᵀ (e^{G_C−G} ⊙ V_new).
//     Per chunk: 2·C·dk·BV·2 FLOPs; HBM reads 2C(2dk+BV), writes 2(dk·BV + C·BV) bytes (bf16).
//     For bf16 the launcher uses, at dk = 128, the warpgroup walk (walk_wg.cuh: wgmma, TMA loads, bulk
//     stores, 32-column tiles), at dk = 64 fwd_state_mma_kernel (2b: state in mma registers, BV = 16 and
//     4 warps, or 32 and 8 at many heads: wide_state_tiles); fwd_state_kernel (wmma on shared tiles)
//     serves fp32.
//     With few heads (the walk's tiles on at most half the SMs) the bf16 walk runs in pieces of
//     chunks, the state handed on in fp32 memory (one walk's bits), and 1. and 3. of other pieces
//     run beside it on a second stream (fwd_pieces).
//  3. fwd_o_kernel, grid (N, H, B), 256 threads. One block owns one chunk of one head (all of dv,
//     in tiles of 64): P = scale·(QKᵀ ⊙ Γ ⊙ causal) once, then per dv tile
//     O = scale·e^G ⊙ (Q·H_c) + P·V_new. Reads q, k [C,dk], H_c [dk,dv], V_new [C,dv].
#include "layers/kernels/delta_rule/api.h"
#include "layers/kernels/primitives/tiles.cuh"
#include "layers/kernels/delta_rule/launch.h"
#include "layers/kernels/primitives/mma_frag.cuh"
#include "layers/kernels/delta_rule/walk_wg.cuh"

#include <ATen/cuda/CUDAEvent.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <type_traits>

namespace carry::kernels::delta_rule {
using namespace carry::kernels::primitives;

namespace {
std::atomic<bool> g_poison{false};
}
bool poison_enabled() { return g_poison.load(); }
void gdn_set_poison(bool on) { g_poison.store(on); }
namespace {
std::atomic<int> g_walk_warpgroups{0};
}
// Warpgroups a warpgroup walk block (each its own 32 columns; the chunk's W, K, Q tiles loaded once for
// the block). Two take half the SMs a walk holds, each walk a little slower (ncu, H=16, dk=dv=128,
// 131072 tokens, a piece of 12: forward 0.184 → 0.258 ms, reverse 0.265 → 0.395 on an H200), and leave
// the other SMs to the chunk-local kernels running beside the walk in pieces. That pays where those
// kernels set the pace: H=16, dk=dv=128, 64 tiles of 32 columns (DeltaNet 10.82 / 10.70 → 10.46 / 10.38
// ms forward+backward at 131072 tokens), and costs where the walk does: H=4, dv=256, 32 tiles (Gated
// DeltaNet 1.94 / 1.89 → 2.60 / 2.51 ms at 32768). Automatic: two where the 32-column tiles number from
// 3/8 to 1/2 of the SMs (the walk then runs in pieces) and the sequence has more than 256 chunks, else
// one. At 256 chunks (16384 tokens, four pieces of 64) one warpgroup a block both ways ran faster (H=16,
// dk=dv=128, one H200, two runs each, forward+backward ms: DeltaNet 1.326 / 1.324 →
// 1.299 / 1.306, Gated DeltaNet 1.448 / 1.460 → 1.424 / 1.423), at 512 chunks level (DeltaNet 2.485 /
// 2.494 → 2.502 / 2.503) and at 1024 slower (4.672 / 4.675 → 4.787 / 4.784). gdn_set_walk_warpgroups
// forces one or two (tests).
int walk_warpgroups(const Dims& d) {
  const int forced = g_walk_warpgroups.load();
  if (forced) return forced;
  const int tiles = (d.DV / 32) * d.H * d.B, sms = sm_count();
  return d.N > 256 && 8 * tiles >= 3 * sms && 2 * tiles <= sms ? 2 : 1;
}
void gdn_set_walk_warpgroups(int n) {
  TORCH_CHECK(n >= 0 && n <= 2, "gdn_set_walk_warpgroups: expected 0 (automatic), 1 or 2, got ", n);
  g_walk_warpgroups.store(n);
}
namespace {
std::atomic<int> g_pieces{0};
std::atomic<bool> g_ramp_forced{false};
}
// gdn_set_pieces' value, else 0 (automatic).
int forced_pieces() { return g_pieces.load(); }
// Whether the pieces ramp (carry::kernels::primitives::piece_cuts): gdn_set_pieces' ramp for forced pieces;
// the automatic ones may (plan_pieces, launch.h, decides where).
bool ramp_pieces() { return forced_pieces() > 0 ? g_ramp_forced.load() : true; }
void gdn_set_pieces(int n, bool ramp) {
  g_pieces.store(n < 0 ? 0 : n);
  g_ramp_forced.store(ramp);
}
namespace {
std::atomic<int> g_segments{0};
}
int forced_segments() { return g_segments.load(); }
void gdn_set_segments(int n) { g_segments.store(n < 0 ? 0 : n); }

namespace {

constexpr size_t al128(size_t x) { return (x + 127) & ~size_t(127); }
// Chunks buffered by the bf16 state kernel (NBUF − 1 loads in flight while one chunk is used).
// 4 stages ran no faster than 2 on an H200 (H=4, dk=128, dv=256, T=32768: 676 vs 678 µs): the
// chunk's chain of products, not the loads, sets the pace. 2 stages take 86 KB (two blocks an SM).
constexpr int kStateStages = 2;
// Shared memory an SM has for its blocks (H100, H200: 228 KB, 1 KB of it reserved a block).
constexpr size_t kMaxSmemSM = 228 * 1024;

// ---------------------------------------------------------------------------------------------
// 1. chunk preparation
template <typename T, int DK>
struct PrepSmem {
  static constexpr int C = kChunk, P = pad_of<T>();
  static constexpr int LK = DK + P, LA = C + kPadF, LTb = C + P, LO = DK + kPadF, LV = 64 + P;
  static constexpr size_t oK = 0;
  static constexpr size_t oA = al128(oK + C * LK * sizeof(T));
  static constexpr size_t oTm = al128(oA + C * LA * 4);
  static constexpr size_t oTb = al128(oTm + C * LA * 4);
  static constexpr size_t oO = al128(oTb + C * LTb * sizeof(T));
  static constexpr size_t oV = al128(oO + C * LO * 4);
  static constexpr size_t oG = al128(oV + C * LV * sizeof(T));
  static constexpr size_t oB = oG + C * 4;
  static constexpr size_t bytes = oB + C * 4;
};

// s[i][j] += Σ_{k<16} X[i][k]·Y[k][j] for 2 rows of X (x0, x1: 16 contiguous floats each) and 4 columns
// of Y (y: 4 contiguous floats, rows ldy apart), k in order: X's rows and Y's columns load as float4s
// once for the 8 products that share them.
__device__ __forceinline__ void fma_2x4x16(float (&s)[2][4], const float* x0, const float* x1, const float* y,
                                           int ldy) {
#pragma unroll
  for (int k4 = 0; k4 < 16; k4 += 4) {
    const float4 a0 = *reinterpret_cast<const float4*>(x0 + k4);
    const float4 a1 = *reinterpret_cast<const float4*>(x1 + k4);
    const float av[2][4] = {{a0.x, a0.y, a0.z, a0.w}, {a1.x, a1.y, a1.z, a1.w}};
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const float4 t = *reinterpret_cast<const float4*>(y + (k4 + kk) * ldy);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        s[i][0] += av[i][kk] * t.x;
        s[i][1] += av[i][kk] * t.y;
        s[i][2] += av[i][kk] * t.z;
        s[i][3] += av[i][kk] * t.w;
      }
    }
  }
}

// sA holds A (strictly lower, fp32); writes T = (I + A)⁻¹ into sTm. sZ: scratch of 3·256 floats.
template <int NT>
__device__ __forceinline__ void unit_lower_inverse64(const float* sA, float* sTm, int LA, float* sZ) {
  static_assert(NT >= 96, "the inverse's steps take 64 and up to 96 threads");
  const int tid = threadIdx.x;
  // diagonal 16x16 blocks: one thread per (block, column), substitution down the column
  if (tid < 64) {
    const int r0 = (tid / 16) * 16, col = tid % 16;
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      float s = (i == col) ? 1.f : 0.f;
#pragma unroll
      for (int j = 0; j < i; ++j) s -= sA[(r0 + i) * LA + r0 + j] * x[j];
      x[i] = s;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) sTm[(r0 + i) * LA + r0 + col] = x[i];
  }
  __syncthreads();
  // off-diagonal blocks at block distance d: T_IJ = −T_II · Σ_{K=J}^{I−1} A_IK T_KJ. A thread owns 2
  // rows × 4 columns of a block (fma_2x4x16): a tenth of the shared-memory load instructions of one
  // element a thread, which set prep_reg_kernel's pace (ncu, an H200: memory throughput 76% with DRAM
  // at 24%, compute 41%). Every element's sum runs in that version's order (kb, then kk), so T keeps
  // its bits.
  for (int d = 1; d < 4; ++d) {
    const int nb = 4 - d;
    const int J = tid >> 5, I = J + d, r = ((tid >> 2) & 7) * 2, cc = (tid & 3) * 4;
    if (tid < nb * 32) {
      float s[2][4] = {};
      for (int kb = J; kb < I; ++kb)
        fma_2x4x16(s, sA + (I * 16 + r) * LA + kb * 16, sA + (I * 16 + r + 1) * LA + kb * 16,
                   sTm + kb * 16 * LA + J * 16 + cc, LA);
#pragma unroll
      for (int i = 0; i < 2; ++i)
        *reinterpret_cast<float4*>(sZ + J * 256 + (r + i) * 16 + cc) = make_float4(s[i][0], s[i][1], s[i][2], s[i][3]);
    }
    __syncthreads();
    if (tid < nb * 32) {
      float s[2][4] = {};
      fma_2x4x16(s, sTm + (I * 16 + r) * LA + I * 16, sTm + (I * 16 + r + 1) * LA + I * 16, sZ + J * 256 + cc, 16);
#pragma unroll
      for (int i = 0; i < 2; ++i)
        *reinterpret_cast<float4*>(sTm + (I * 16 + r + i) * LA + J * 16 + cc) =
            make_float4(-s[i][0], -s[i][1], -s[i][2], -s[i][3]);
    }
    __syncthreads();
  }
}

template <typename T, int DK, int DV>
__global__ void __launch_bounds__(256) prep_kernel(const T* __restrict__ k, const T* __restrict__ v,
                                                   const float* __restrict__ g, const float* __restrict__ beta,
                                                   float* __restrict__ Gc, T* __restrict__ Tm,
                                                   T* __restrict__ W, T* __restrict__ U, int T_, int H) {
  constexpr int C = kChunk, NT = 256, NW = 8;
  using L = PrepSmem<T, DK>;
  extern __shared__ __align__(128) char smem[];
  T* sK = reinterpret_cast<T*>(smem + L::oK);
  float* sA = reinterpret_cast<float*>(smem + L::oA);
  float* sTm = reinterpret_cast<float*>(smem + L::oTm);
  T* sTb = reinterpret_cast<T*>(smem + L::oTb);
  float* sO = reinterpret_cast<float*>(smem + L::oO);
  T* sV = reinterpret_cast<T*>(smem + L::oV);
  float* sG = reinterpret_cast<float*>(smem + L::oG);
  float* sB = reinterpret_cast<float*>(smem + L::oB);

  const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int N = T_ / C;
  const long t0 = (long)c * C, bh = (long)b * H + h;
  const long rowk = (long)H * DK, rowv = (long)H * DV;

  load_tile_async<T, C, DK, NT>(sK, L::LK, k + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
  cp_async_commit();
  if (tid < C) {
    const long idx = ((long)b * T_ + t0 + tid) * H + h;
    sG[tid] = g ? g[idx] : 0.f;
    sB[tid] = beta[idx];
  }
  __syncthreads();
  if (tid < 32) warp_cumsum64(sG);
  cp_async_wait<0>();
  __syncthreads();
  if (tid < C) Gc[bh * T_ + t0 + tid] = sG[tid];

  gemm<T, C, C, DK, false, true, NW>(sK, L::LK, sK, L::LK, sA, L::LA, false);  // K Kᵀ
  __syncthreads();
  for (int i = tid; i < C * C; i += NT) {
    const int r = i / C, s = i % C;
    const float a = sA[r * L::LA + s];
    sA[r * L::LA + s] = s < r ? sB[r] * a * expf(sG[r] - sG[s]) : 0.f;
    sTm[r * L::LA + s] = 0.f;
  }
  __syncthreads();
  unit_lower_inverse64<NT>(sA, sTm, L::LA, sO);

  T* tm = Tm + (bh * N + c) * C * C;
  for (int i = tid; i < C * C; i += NT) {
    const int r = i / C, s = i % C;
    const float x = sTm[r * L::LA + s];
    tm[i] = from_f<T>(x);
    sTb[r * L::LTb + s] = from_f<T>(x);
  }
  for (int i = tid; i < C * DK; i += NT) {
    const int r = i / DK, j = i % DK;
    sK[r * L::LK + j] = from_f<T>(to_f(sK[r * L::LK + j]) * sB[r] * expf(sG[r]));
  }
  __syncthreads();
  const T* pT;
  int ldT;
  if constexpr (std::is_same<T, float>::value) { pT = sTm; ldT = L::LA; }
  else { pT = sTb; ldT = L::LTb; }

  gemm<T, C, DK, C, false, false, NW>(pT, ldT, sK, L::LK, sO, L::LO, false);  // W = T (β e^G K)
  __syncthreads();
  store_tile<T, C, DK, NT>(W + (bh * T_ + t0) * DK, DK, sO, L::LO);
  for (int v0 = 0; v0 < DV; v0 += 64) {
    __syncthreads();
    load_tile_async<T, C, 64, NT>(sV, L::LV, v + ((long)b * T_ + t0) * rowv + (long)h * DV + v0, rowv);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    for (int i = tid; i < C * 64; i += NT) {
      const int r = i / 64, j = i % 64;
      sV[r * L::LV + j] = from_f<T>(to_f(sV[r * L::LV + j]) * sB[r]);
    }
    __syncthreads();
    gemm<T, C, 64, C, false, false, NW>(pT, ldT, sV, L::LV, sO, L::LO, false);  // U = T (β V)
    __syncthreads();
    store_tile<T, C, 64, NT>(U + (bh * T_ + t0) * DV + v0, DV, sO, L::LO);
  }
}

// 1b. bf16 chunk preparation with the products in mma.sync registers: eight warps, warp w owns rows
// 16·(w%4) and the column half w/4 of KKᵀ (straight into A), of W and of each 64-wide U tile. β and
// e^G fold into T's columns (W = (T·diag(β e^G))·K, U = (T·diag(β))·V, two bf16 copies of T) instead
// of passes that scale K and V in shared memory; W and U go from registers to global; the V tiles
// are double-buffered and the first ones load with K. The two bf16 copies of T take the place of A
// and the inverse's scratch, dead by then: 73 KB of shared memory at dk = 128, three blocks an SM
// (92 KB and two before; the inverse's barriers leave a block's SM idle, ncu: 33% of its warps'
// stall samples at a barrier).
template <int DK>
struct PrepRegSmem {
  static constexpr int C = kChunk, LK = DK + 8, LA = C + kPadF, LTb = C + 8, LV = 64 + 8;
  static constexpr size_t oK = 0;
  static constexpr size_t oA = al128(oK + C * LK * 2);
  static constexpr size_t oZ = oA + C * LA * 4;                      // the inverse's scratch, after A
  static constexpr size_t oTw = oA, oTu = oA + C * LTb * 2;          // over A and Z, after the inverse
  static constexpr size_t oTm = al128(std::max(oZ + 3 * 256 * 4, oTu + C * LTb * 2));
  static constexpr size_t oG = al128(oTm + C * LA * 4);
  static constexpr size_t oB = oG + C * 4;
  static constexpr size_t oBuf = al128(oB + C * 4);
  static constexpr size_t buf = al128(C * LV * 2);
  static constexpr size_t bytes = oBuf + 2 * buf;
  static_assert(oZ % 16 == 0 && oTu % 16 == 0, "float4 and uint2 access");
};

template <int DK, int DV>
__global__ void __launch_bounds__(256) prep_reg_kernel(const bf16* __restrict__ k, const bf16* __restrict__ v,
                                                       const float* __restrict__ g, const float* __restrict__ beta,
                                                       float* __restrict__ Gc, bf16* __restrict__ Tm,
                                                       bf16* __restrict__ W, bf16* __restrict__ U, int T_, int H,
                                                       int c_off) {
  constexpr int C = kChunk, NT = 256, NTILE = DV / 64, WN = DK / 16;  // W: n8-tiles a warp
  using L = PrepRegSmem<DK>;
  extern __shared__ __align__(128) char smem[];
  bf16* sK = reinterpret_cast<bf16*>(smem + L::oK);
  float* sA = reinterpret_cast<float*>(smem + L::oA);
  float* sTm = reinterpret_cast<float*>(smem + L::oTm);
  bf16* sTw = reinterpret_cast<bf16*>(smem + L::oTw);
  bf16* sTu = reinterpret_cast<bf16*>(smem + L::oTu);
  float* sZ = reinterpret_cast<float*>(smem + L::oZ);
  float* sG = reinterpret_cast<float*>(smem + L::oG);
  float* sB = reinterpret_cast<float*>(smem + L::oB);

  const int c = c_off + blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int N = T_ / C;
  const long t0 = (long)c * C, bh = (long)b * H + h;
  const long rowk = (long)H * DK, rowv = (long)H * DV;
  const int warp = tid >> 5, lane = tid & 31, gq = lane >> 2, t4 = lane & 3;
  const int m0 = (warp & 3) * 16, n0 = (warp >> 2) * 32;
  auto load_v = [&](int v0, int bi) {
    load_tile_async<bf16, C, 64, NT>(reinterpret_cast<bf16*>(smem + L::oBuf + bi * L::buf), L::LV,
                                     v + ((long)b * T_ + t0) * rowv + (long)h * DV + v0, rowv);
    cp_async_commit();
  };
  float gv = 0.f, bv = 0.f;  // read before the copies are issued, stored after
  if (tid < C) {
    const long idx = ((long)b * T_ + t0 + tid) * H + h;
    gv = g ? g[idx] : 0.f;
    bv = beta[idx];
  }
  load_tile_async<bf16, C, DK, NT>(sK, L::LK, k + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
  cp_async_commit();
  load_v(0, 0);
  if (NTILE > 1) load_v(64, 1);
  if (tid < C) {
    sG[tid] = gv;
    sB[tid] = bv;
  }
  __syncthreads();
  if (tid < 32) warp_cumsum64(sG);
  if (NTILE > 1) cp_async_wait<2>();
  else cp_async_wait<1>();
  __syncthreads();
  if (tid < C) Gc[bh * T_ + t0 + tid] = sG[tid];
  {  // A = strictly_lower(diag(β) KKᵀ ⊙ Γ) in fp32; T's storage zeroed
    float kk[4][4] = {};
    frag_mma<4, DK, false, true>(kk, sK, L::LK, sK, L::LK, m0, n0);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = m0 + gq + (e >> 1) * 8, s = n0 + nt * 8 + 2 * t4 + (e & 1);
        sA[r * L::LA + s] = s < r ? sB[r] * kk[nt][e] * __expf(sG[r] - sG[s]) : 0.f;
        sTm[r * L::LA + s] = 0.f;
      }
    }
  }
  __syncthreads();
  unit_lower_inverse64<NT>(sA, sTm, L::LA, sZ);
  {  // T to global (bf16, the backward's operand: its bits), T·diag(β e^G) and T·diag(β) in bf16
    bf16* tm = Tm + (bh * N + c) * C * C;
    for (int i = tid; i < C * C / 4; i += NT) {
      const int r = (4 * i) / C, s = (4 * i) % C;
      const float4 x = *reinterpret_cast<const float4*>(sTm + r * L::LA + s);
      uint2 ut;
      ut.x = tc::pack_bf16(x.x, x.y);
      ut.y = tc::pack_bf16(x.z, x.w);
      reinterpret_cast<uint2*>(tm)[i] = ut;
      const float b0 = sB[s], b1 = sB[s + 1], b2 = sB[s + 2], b3 = sB[s + 3];
      uint2 uw, uu;
      uw.x = tc::pack_bf16(x.x * b0 * __expf(sG[s]), x.y * b1 * __expf(sG[s + 1]));
      uw.y = tc::pack_bf16(x.z * b2 * __expf(sG[s + 2]), x.w * b3 * __expf(sG[s + 3]));
      uu.x = tc::pack_bf16(x.x * b0, x.y * b1);
      uu.y = tc::pack_bf16(x.z * b2, x.w * b3);
      *reinterpret_cast<uint2*>(sTw + r * L::LTb + s) = uw;
      *reinterpret_cast<uint2*>(sTu + r * L::LTb + s) = uu;
    }
  }
  __syncthreads();
  {  // W = (T·diag(β e^G))·K
    float w[WN][4] = {};
    frag_mma<WN, C, false, false>(w, sTw, L::LTb, sK, L::LK, m0, (warp >> 2) * (DK / 2));
    frag_store_bf16<WN>(W + (bh * T_ + t0) * DK, DK, w, m0, (warp >> 2) * (DK / 2));
  }
  for (int it = 0; it < NTILE; ++it) {  // U = (T·diag(β))·V, by 64-wide tiles
    const bf16* sV = reinterpret_cast<const bf16*>(smem + L::oBuf + (it & 1) * L::buf);
    if (it + 1 < NTILE) cp_async_wait<1>();
    else cp_async_wait<0>();
    __syncthreads();
    float u[4][4] = {};
    frag_mma<4, C, false, false>(u, sTu, L::LTb, sV, L::LV, m0, n0);
    frag_store_bf16<4>(U + (bh * T_ + t0) * DV + it * 64, DV, u, m0, n0);
    if (it + 2 < NTILE) {
      __syncthreads();
      load_v((it + 2) * 64, it & 1);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 2. state recurrence over chunks
template <typename T, int DK, int BV, int NBUF>
struct StateSmem {
  static constexpr int C = kChunk, P = pad_of<T>();
  static constexpr int LK = DK + P, LS = BV + kPadF, LSb = BV + P, LU = BV + P;
  static constexpr size_t oS = 0;
  static constexpr size_t oSb = al128(oS + DK * LS * 4);
  static constexpr size_t oW = al128(oSb + DK * LSb * sizeof(T));
  static constexpr size_t oK = al128(oW + NBUF * C * LK * sizeof(T));
  static constexpr size_t oU = al128(oK + NBUF * C * LK * sizeof(T));
  static constexpr size_t oG = al128(oU + NBUF * C * LU * sizeof(T));
  static constexpr size_t oVn = al128(oG + NBUF * C * 4);
  static constexpr size_t oVnb = al128(oVn + C * LS * 4);
  static constexpr size_t bytes = oVnb + C * LSb * sizeof(T);
};

template <typename T, int DK, int DV, int BV, int NBUF, int NW>
__global__ void __launch_bounds__(NW * 32) fwd_state_kernel(const T* __restrict__ k, const T* __restrict__ W,
                                                        const T* __restrict__ U, const float* __restrict__ Gc,
                                                        const float* __restrict__ S0, T* __restrict__ Hs,
                                                        T* __restrict__ Vn, float* __restrict__ Sfin,
                                                        int T_, int H) {
  constexpr int C = kChunk, NT = NW * 32;
  using L = StateSmem<T, DK, BV, NBUF>;
  extern __shared__ __align__(128) char smem[];
  float* sS = reinterpret_cast<float*>(smem + L::oS);
  T* sSb = reinterpret_cast<T*>(smem + L::oSb);
  T* sW = reinterpret_cast<T*>(smem + L::oW);
  T* sK = reinterpret_cast<T*>(smem + L::oK);
  T* sU = reinterpret_cast<T*>(smem + L::oU);
  float* sG = reinterpret_cast<float*>(smem + L::oG);
  float* sVn = reinterpret_cast<float*>(smem + L::oVn);
  T* sVnb = reinterpret_cast<T*>(smem + L::oVnb);

  const int v0 = blockIdx.x * BV, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int N = T_ / C;
  const long bh = (long)b * H + h;

  auto issue = [&](int c, int buf) {
    const long t0 = (long)c * C;
    load_tile_async<T, C, DK, NT>(sW + buf * C * L::LK, L::LK, W + (bh * T_ + t0) * DK, DK);
    load_tile_async<T, C, DK, NT>(sK + buf * C * L::LK, L::LK, k + ((long)b * T_ + t0) * H * DK + (long)h * DK,
                                  (long)H * DK);
    load_tile_async<T, C, BV, NT>(sU + buf * C * L::LU, L::LU, U + (bh * T_ + t0) * DV + v0, DV);
    if (tid < C / 4) cp_async16(sG + buf * C + tid * 4, Gc + bh * T_ + t0 + tid * 4);
  };

  for (int i = tid; i < DK * BV; i += NT) {
    const int r = i / BV, j = i % BV;
    sS[r * L::LS + j] = S0 ? S0[(bh * DK + r) * DV + v0 + j] : 0.f;
  }
  if constexpr (NBUF == 2) {
    issue(0, 0);
    cp_async_commit();
  }
  __syncthreads();

  for (int c = 0; c < N; ++c) {
    const int buf = NBUF == 2 ? (c & 1) : 0;
    T* hc = Hs + (bh * N + c) * DK * DV + v0;
    for (int i = tid; i < DK * BV; i += NT) {
      const int r = i / BV, j = i % BV;
      const T x = from_f<T>(sS[r * L::LS + j]);
      sSb[r * L::LSb + j] = x;
      hc[(long)r * DV + j] = x;
    }
    if constexpr (NBUF == 2) {
      if (c + 1 < N) issue(c + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      issue(c, 0);
      cp_async_commit();
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* cW = sW + buf * C * L::LK;
    const T* cK = sK + buf * C * L::LK;
    const T* cU = sU + buf * C * L::LU;
    const float* G = sG + buf * C;

    gemm<T, C, BV, DK, false, false, NW>(cW, L::LK, sSb, L::LSb, sVn, L::LS, false);  // W·S
    __syncthreads();
    const float gl = G[C - 1], egl = expf(gl);
    T* vn = Vn + (bh * T_ + (long)c * C) * DV + v0;
    for (int i = tid; i < C * BV; i += NT) {
      const int r = i / BV, j = i % BV;
      const T x = from_f<T>(to_f(cU[r * L::LU + j]) - sVn[r * L::LS + j]);
      vn[(long)r * DV + j] = x;
      sVnb[r * L::LSb + j] = from_f<T>(to_f(x) * expf(gl - G[r]));
    }
    for (int i = tid; i < DK * BV; i += NT) {
      const int r = i / BV, j = i % BV;
      sS[r * L::LS + j] *= egl;
    }
    __syncthreads();
    gemm<T, DK, BV, C, true, false, NW>(cK, L::LK, sVnb, L::LSb, sS, L::LS, true);  // += Kᵀ(e^{G_C−G} V_new)
    __syncthreads();
  }
  for (int i = tid; i < DK * BV; i += NT) {
    const int r = i / BV, j = i % BV;
    Sfin[(bh * DK + r) * DV + v0 + j] = sS[r * L::LS + j];
  }
}

// 2b. bf16 state recurrence on raw tensor cores. Same plan as fwd_state_kernel, but the fp32
// state tile lives in registers as mma accumulators: warp w owns the 16x16 units
// u = w, w+NW, ... of S [dk,BV] (unit u: rows 16·(u / (BV/16)), columns 16·(u % (BV/16))).
// Per chunk: S -> bf16 shared copy Sb (B operand of W·S, and H_c written from it with 16-byte
// stores); V_new = U − W·Sb by units of 16 rows x 16 columns; S ← e^{G_C} S + Kᵀ·(e^{G_C−G} V_new)
// with Kᵀ read by ldmatrix.trans. Three block barriers per chunk.
template <int DK, int BV, int NBUF>
struct StateMmaSmem {
  static constexpr int C = kChunk, LK = DK + 8, LB = BV + 8;
  static constexpr size_t oSb = 0;
  static constexpr size_t oW = al128(oSb + DK * LB * 2);
  static constexpr size_t oK = al128(oW + NBUF * C * LK * 2);
  static constexpr size_t oU = al128(oK + NBUF * C * LK * 2);
  static constexpr size_t oG = al128(oU + NBUF * C * LB * 2);
  static constexpr size_t oVb = al128(oG + NBUF * C * 4);
  static constexpr size_t bytes = oVb + C * LB * 2;
  static_assert(bytes <= 227 * 1024, "state kernel shared memory");
};

template <int DK, int DV, int BV, int NW, int NBUF>
__global__ void __launch_bounds__(NW * 32) fwd_state_mma_kernel(const bf16* __restrict__ k, const bf16* __restrict__ W,
                                                                const bf16* __restrict__ U, const float* __restrict__ Gc,
                                                                const float* __restrict__ S0, bf16* __restrict__ Hs,
                                                                bf16* __restrict__ Vn, float* __restrict__ Sfin,
                                                                int T_, int H, int c_begin, int c_end) {
  constexpr int C = kChunk, NT = NW * 32, NP = BV / 16;
  constexpr int U2 = (DK / 16) * NP, U2W = U2 / NW, U1 = (C / 16) * NP;
  static_assert(U2 % NW == 0, "state units must split evenly over warps");
  static_assert(NBUF >= 2, "at least one chunk in flight");
  using L = StateMmaSmem<DK, BV, NBUF>;
  constexpr int LK = L::LK, LB = L::LB;
  extern __shared__ __align__(128) char smem[];
  bf16* sSb = reinterpret_cast<bf16*>(smem + L::oSb);
  bf16* sW = reinterpret_cast<bf16*>(smem + L::oW);
  bf16* sK = reinterpret_cast<bf16*>(smem + L::oK);
  bf16* sU = reinterpret_cast<bf16*>(smem + L::oU);
  float* sG = reinterpret_cast<float*>(smem + L::oG);
  bf16* sVb = reinterpret_cast<bf16*>(smem + L::oVb);

  const int v0 = blockIdx.x * BV, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const int N = T_ / C;
  const long bh = (long)b * H + h;

  auto issue = [&](int c, int buf) {
    const long t0 = (long)c * C;
    load_tile_async<bf16, C, DK, NT>(sW + buf * C * LK, LK, W + (bh * T_ + t0) * DK, DK);
    load_tile_async<bf16, C, DK, NT>(sK + buf * C * LK, LK, k + ((long)b * T_ + t0) * H * DK + (long)h * DK,
                                     (long)H * DK);
    load_tile_async<bf16, C, BV, NT>(sU + buf * C * LB, LB, U + (bh * T_ + t0) * DV + v0, DV);
    if (tid < C / 4) cp_async16(sG + buf * C + tid * 4, Gc + bh * T_ + t0 + tid * 4);
  };

  float acc[U2W][2][4];
#pragma unroll
  for (int i = 0; i < U2W; ++i) {
    const int u = warp + i * NW, m0 = (u / NP) * 16, n0 = (u % NP) * 16;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int col = v0 + n0 + nt * 8 + 2 * t4;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = m0 + g + hf * 8;
        acc[i][nt][2 * hf] = S0 ? S0[(bh * DK + row) * DV + col] : 0.f;
        acc[i][nt][2 * hf + 1] = S0 ? S0[(bh * DK + row) * DV + col + 1] : 0.f;
      }
    }
  }
  // NBUF − 1 chunks in flight (kStateStages says what was measured). The block walks the chunks
  // [c_begin, c_end) from S0 (the state entering c_begin) and leaves the state after c_end − 1 in
  // Sfin: a piece of the walk (pieces chained through fp32 memory give the whole walk's bits).
#pragma unroll
  for (int c = 0; c < NBUF - 1; ++c) {
    if (c_begin + c < c_end) issue(c_begin + c, c);
    cp_async_commit();
  }

  for (int c = c_begin; c < c_end; ++c) {
    const int buf = (c - c_begin) % NBUF;
    // S -> Sb (bf16)
#pragma unroll
    for (int i = 0; i < U2W; ++i) {
      const int u = warp + i * NW, m0 = (u / NP) * 16, n0 = (u % NP) * 16;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = n0 + nt * 8 + 2 * t4;
        *reinterpret_cast<unsigned*>(sSb + (m0 + g) * LB + col) = tc::pack_bf16(acc[i][nt][0], acc[i][nt][1]);
        *reinterpret_cast<unsigned*>(sSb + (m0 + g + 8) * LB + col) = tc::pack_bf16(acc[i][nt][2], acc[i][nt][3]);
      }
    }
    // the buffer chunk c − 1 used is free: its last reads came before the previous barrier
    if (c + NBUF - 1 < c_end) issue(c + NBUF - 1, (c + NBUF - 1 - c_begin) % NBUF);
    cp_async_commit();
    cp_async_wait<NBUF - 1>();
    __syncthreads();
    const bf16* cW = sW + buf * C * LK;
    const bf16* cK = sK + buf * C * LK;
    const bf16* cU = sU + buf * C * LB;
    const float* G = sG + buf * C;
    // H_c = S (16-byte copies): read from Sb here, stored after the W·S product is issued, so the
    // shared loads' latency passes under the product (straight-line code: the unit loop below is
    // unrolled).
    constexpr int VR = BV / 8, HCJ = DK * VR / NT;
    static_assert(NT % VR == 0 && (DK * VR) % NT == 0, "whole rows a pass");
    uint4 hcv[HCJ];
#pragma unroll
    for (int j = 0; j < HCJ; ++j)
      hcv[j] = *reinterpret_cast<const uint4*>(sSb + (tid / VR + j * (NT / VR)) * LB + (tid % VR) * 8);
    const float gl = G[C - 1];
    // V_new = U − W·S; Vb = e^{G_C−G} V_new
#pragma unroll
    for (int i1 = 0; i1 < (U1 + NW - 1) / NW; ++i1) {
      const int u1 = warp + i1 * NW;
      const bool unit = U1 % NW == 0 || u1 < U1;  // else this warp has no unit left
      const int m0 = (u1 / NP) * 16, n0 = (u1 % NP) * 16;
      float v[2][4], e[2];
      unsigned uu[2][2];
      if (unit) {  // U and the row factors read before the product, their latency under it
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int r = m0 + g + hf * 8;
          e[hf] = __expf(gl - G[r]);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
            uu[hf][nt] = *reinterpret_cast<const unsigned*>(cU + r * LB + n0 + nt * 8 + 2 * t4);
        }
        frag_mma_2chain<DK>(v, cW, LK, sSb, LB, m0, n0);
      }
      if (i1 == 0) {
        bf16* hc = Hs + (bh * N + c) * DK * DV + v0;
#pragma unroll
        for (int j = 0; j < HCJ; ++j)
          *reinterpret_cast<uint4*>(hc + (long)(tid / VR + j * (NT / VR)) * DV + (tid % VR) * 8) = hcv[j];
      }
      if (!unit) break;
      bf16* vn = Vn + (bh * T_ + (long)c * C) * DV + v0;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = m0 + g + hf * 8;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int col = n0 + nt * 8 + 2 * t4;
          const float2 uf = tc::unpack_bf16(uu[hf][nt]);
          const unsigned x = tc::pack_bf16(uf.x - v[nt][2 * hf], uf.y - v[nt][2 * hf + 1]);
          *reinterpret_cast<unsigned*>(vn + (long)r * DV + col) = x;
          const float2 xf = tc::unpack_bf16(x);
          *reinterpret_cast<unsigned*>(sVb + r * LB + col) = tc::pack_bf16(xf.x * e[hf], xf.y * e[hf]);
        }
      }
    }
    __syncthreads();
    const float egl = __expf(gl);
#pragma unroll
    for (int i = 0; i < U2W; ++i) {
      const int u = warp + i * NW, m0 = (u / NP) * 16, n0 = (u % NP) * 16;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][nt][e] *= egl;
#pragma unroll
      for (int k0 = 0; k0 < C; k0 += 16) {
        unsigned a[4], bb[4];
        tc::load_a_t(a, cK, LK, m0, k0);
        tc::load_b2_t(bb, sVb, LB, k0, n0);
        tc::mma16816(acc[i][0], a, bb[0], bb[1]);
        tc::mma16816(acc[i][1], a, bb[2], bb[3]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < U2W; ++i) {
    const int u = warp + i * NW, m0 = (u / NP) * 16, n0 = (u % NP) * 16;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int col = v0 + n0 + nt * 8 + 2 * t4;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = m0 + g + hf * 8;
        *reinterpret_cast<float2*>(Sfin + (bh * DK + row) * DV + col) =
            make_float2(acc[i][nt][2 * hf], acc[i][nt][2 * hf + 1]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 3. output
template <typename T, int DK>
struct OutSmem {
  static constexpr int C = kChunk, P = pad_of<T>();
  static constexpr int LK = DK + P, LA = C + kPadF, LPb = C + P, LV = 64 + P, LO = 64 + kPadF;
  static constexpr size_t oQ = 0;
  static constexpr size_t oK = al128(oQ + C * LK * sizeof(T));
  static constexpr size_t oP = al128(oK + C * LK * sizeof(T));
  static constexpr size_t oPb = al128(oP + C * LA * 4);
  static constexpr size_t oH = al128(oPb + C * LPb * sizeof(T));
  static constexpr size_t oV = al128(oH + DK * LV * sizeof(T));
  static constexpr size_t oO = al128(oV + C * LV * sizeof(T));
  static constexpr size_t oG = al128(oO + C * LO * 4);
  static constexpr size_t bytes = oG + C * 4;
};

template <typename T, int DK, int DV>
__global__ void __launch_bounds__(256) fwd_o_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                                    const float* __restrict__ Gc, const T* __restrict__ Hs,
                                                    const T* __restrict__ Vn, T* __restrict__ O, float scale,
                                                    int T_, int H) {
  constexpr int C = kChunk, NT = 256, NW = 8;
  using L = OutSmem<T, DK>;
  extern __shared__ __align__(128) char smem[];
  T* sQ = reinterpret_cast<T*>(smem + L::oQ);
  T* sK = reinterpret_cast<T*>(smem + L::oK);
  float* sP = reinterpret_cast<float*>(smem + L::oP);
  T* sPb = reinterpret_cast<T*>(smem + L::oPb);
  T* sH = reinterpret_cast<T*>(smem + L::oH);
  T* sV = reinterpret_cast<T*>(smem + L::oV);
  float* sO = reinterpret_cast<float*>(smem + L::oO);
  float* sG = reinterpret_cast<float*>(smem + L::oG);

  const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int N = T_ / C;
  const long t0 = (long)c * C, bh = (long)b * H + h, rowk = (long)H * DK, rowv = (long)H * DV;
  load_tile_async<T, C, DK, NT>(sQ, L::LK, q + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
  load_tile_async<T, C, DK, NT>(sK, L::LK, k + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
  cp_async_commit();
  if (tid < C) sG[tid] = Gc[bh * T_ + t0 + tid];
  cp_async_wait<0>();
  __syncthreads();
  gemm<T, C, C, DK, false, true, NW>(sQ, L::LK, sK, L::LK, sP, L::LA, false);  // Q Kᵀ
  __syncthreads();
  const T* pP;
  int ldP;
  if constexpr (std::is_same<T, float>::value) { pP = sP; ldP = L::LA; }
  else { pP = sPb; ldP = L::LPb; }
  for (int i = tid; i < C * C; i += NT) {
    const int r = i / C, s = i % C;
    const float x = s <= r ? scale * sP[r * L::LA + s] * expf(sG[r] - sG[s]) : 0.f;
    if constexpr (std::is_same<T, float>::value) sP[r * L::LA + s] = x;
    else sPb[r * L::LPb + s] = from_f<T>(x);
  }
  for (int v0 = 0; v0 < DV; v0 += 64) {
    load_tile_async<T, DK, 64, NT>(sH, L::LV, Hs + ((bh * N + c) * DK) * DV + v0, DV);
    load_tile_async<T, C, 64, NT>(sV, L::LV, Vn + (bh * T_ + t0) * DV + v0, DV);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    gemm<T, C, 64, DK, false, false, NW>(sQ, L::LK, sH, L::LV, sO, L::LO, false);  // Q·H_c
    __syncthreads();
    for (int i = tid; i < C * 64; i += NT) {
      const int r = i / 64, j = i % 64;
      sO[r * L::LO + j] *= scale * expf(sG[r]);
    }
    __syncthreads();
    gemm<T, C, 64, C, false, false, NW>(pP, ldP, sV, L::LV, sO, L::LO, true);  // += P·V_new
    __syncthreads();
    store_tile<T, C, 64, NT>(O + ((long)b * T_ + t0) * rowv + (long)h * DV + v0, rowv, sO, L::LO);
    __syncthreads();
  }
}

// 3b. bf16 output with the products in mma.sync registers: eight warps, warp w owns rows 16·(w%4)
// and the column half w/4 of P = scale·(QKᵀ⊙Γ) [C,C] and of each 64-wide output tile. P goes to
// shared memory once in bf16; each tile's O = scale·e^G ⊙ (Q·H_c) + P·V_new is summed in registers
// and stored straight to global. The H_c and V_new tiles have NB buffers: two (the next tile loads
// while this one multiplies) or one (73 KB, three blocks an SM; out_kernel says where). The
// fp32-staged version above spent two block barriers and an fp32 shared-memory round trip a tile.
template <int DK, int NB>
struct OutRegSmem {
  static constexpr int C = kChunk, LK = DK + 8, LPb = C + 8, LV = 64 + 8;
  static constexpr size_t oQ = 0;
  static constexpr size_t oK = al128(oQ + C * LK * 2);
  static constexpr size_t oPb = al128(oK + C * LK * 2);
  static constexpr size_t oG = al128(oPb + C * LPb * 2);
  static constexpr size_t oBuf = al128(oG + C * 4);
  static constexpr size_t oV = al128(DK * LV * 2);  // within a buffer: H_c tile, then V_new tile
  static constexpr size_t buf = al128(oV + C * LV * 2);
  static constexpr size_t bytes = oBuf + NB * buf;
};

template <int DK, int DV, int NB>
__global__ void __launch_bounds__(256) fwd_o_reg_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                        const float* __restrict__ Gc, const bf16* __restrict__ Hs,
                                                        const bf16* __restrict__ Vn, bf16* __restrict__ O, float scale,
                                                        int T_, int H, int c_off) {
  constexpr int C = kChunk, NT = 256, NTILE = DV / 64;
  using L = OutRegSmem<DK, NB>;
  extern __shared__ __align__(128) char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::oQ);
  bf16* sK = reinterpret_cast<bf16*>(smem + L::oK);
  bf16* sPb = reinterpret_cast<bf16*>(smem + L::oPb);
  float* sG = reinterpret_cast<float*>(smem + L::oG);

  const int c = c_off + blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int N = T_ / C;
  const long t0 = (long)c * C, bh = (long)b * H + h, rowk = (long)H * DK, rowv = (long)H * DV;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int m0 = (warp & 3) * 16, n0 = (warp >> 2) * 32;
  auto load_tiles = [&](int v0, int bi) {
    char* base = smem + L::oBuf + bi * L::buf;
    load_tile_async<bf16, DK, 64, NT>(reinterpret_cast<bf16*>(base), L::LV, Hs + ((bh * N + c) * DK) * DV + v0, DV);
    load_tile_async<bf16, C, 64, NT>(reinterpret_cast<bf16*>(base + L::oV), L::LV, Vn + (bh * T_ + t0) * DV + v0, DV);
    cp_async_commit();
  };
  load_qk_and_p<DK, NT>(sQ, sK, L::LK, q + ((long)b * T_ + t0) * rowk + (long)h * DK,
                        k + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk, load_tiles, NB == 1 ? 1 : NTILE, sG,
                        Gc + bh * T_ + t0, 1, scale, sPb, L::LPb);
  const float e0 = scale * __expf(sG[m0 + g]), e1 = scale * __expf(sG[m0 + g + 8]);
  for (int it = 0; it < NTILE; ++it) {
    const char* base = smem + L::oBuf + (NB == 1 ? 0 : (it & 1)) * L::buf;
    const bf16* sH = reinterpret_cast<const bf16*>(base);
    const bf16* sV = reinterpret_cast<const bf16*>(base + L::oV);
    if (NB == 2 && it + 1 < NTILE) cp_async_wait<1>();
    else cp_async_wait<0>();
    __syncthreads();  // this tile's loads (and, on the first, P) are visible
    float o[4][4] = {};
    frag_mma<4, DK, false, false>(o, sQ, L::LK, sH, L::LV, m0, n0);  // Q·H_c
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      o[nt][0] *= e0;
      o[nt][1] *= e0;
      o[nt][2] *= e1;
      o[nt][3] *= e1;
    }
    frag_mma<4, C, false, false>(o, sPb, L::LPb, sV, L::LV, m0, n0);  // += P·V_new
    frag_store_bf16<4>(O + ((long)b * T_ + t0) * rowv + (long)h * DV + it * 64, rowv, o, m0, n0);
    if (it + NB < NTILE) {
      __syncthreads();  // every warp is done with this buffer
      load_tiles((it + NB) * 64, NB == 1 ? 0 : (it & 1));
    }
  }
}

// The output kernel and its shared memory: one dv-tile buffer where the walk takes 32-column tiles
// (wide_state_tiles: the output kernel then shares the SMs the walk leaves with the preparation, and
// paces the forward with it). Measured on an H200 (forward+backward ms, two buffers → one, twice):
// H=16, dk=dv=128, 131072 tokens, Gated DeltaNet 12.724 / 12.766 → 12.672 / 12.633, DeltaNet 12.674 /
// 12.593 → 12.523 / 12.410 (the output kernel's piece 0.175 → 0.152 ms in the timeline); at H=4,
// dv=256 one buffer ran slower (2.137 / 2.114 → 2.175 / 2.158 ms at 32768), so there two.
template <int DK, int DV>
struct OutKernel {
  decltype(&fwd_o_reg_kernel<DK, DV, 2>) kern;
  size_t smem;
};
template <int DK, int DV>
OutKernel<DK, DV> out_kernel(const Dims& d) {
  if (wide_state_tiles(d)) return {fwd_o_reg_kernel<DK, DV, 1>, OutRegSmem<DK, 1>::bytes};
  return {fwd_o_reg_kernel<DK, DV, 2>, OutRegSmem<DK, 2>::bytes};
}


// bf16: the chunk preparation, the state walk (fwd_state_mma_kernel, BV = 16 and 4 warps, or 32 and 8
// where wide_state_tiles says so) and the output
// kernel. When the walk's tiles leave at least half the SMs idle, it runs in pieces (consecutive
// launches on the caller's stream, the state handed on through fp32 memory: one walk's operations
// and bits), and on a second stream the preparation of the next piece runs ahead of it and the
// output of each finished piece behind it; the walk then asks for enough shared memory that no
// preparation or output block shares its SM (it would slow the walk's chain).
// WG: the walk is wg::fwd_walk_wg (walk_wg.cuh; dk = 128, 32 columns, one warpgroup) instead of
// fwd_state_mma_kernel<BV, NW>.
template <int DK, int DV, int BV = 16, int NW = 4, bool WG = false>
void fwd_pieces(const Dims& d, const bf16* kp, const bf16* vp, const float* g, const float* beta, at::Tensor& Gc,
                at::Tensor& Tm, bf16* Wp, bf16* Up, const float* S0, bf16* Hp, bf16* Vnp, at::Tensor& Sfin,
                const bf16* qp, bf16* Op, float scale, const std::function<void(const at::Tensor&)>& on_final_state,
                int segments, at::Tensor& As) {
  static_assert(!WG || (DK == wg::kDK && BV == wg::kBV), "the warpgroup walk takes dk = 128 in 32-column tiles");
  auto stream = at::cuda::getCurrentCUDAStream();
  const OutKernel<DK, DV> ok = out_kernel<DK, DV>(d);
  const auto okern = ok.kern;
  const size_t osm = ok.smem;
  auto pkern = prep_reg_kernel<DK, DV>;
  constexpr size_t psm = PrepRegSmem<DK>::bytes;
  carry::kernels::primitives::allow_smem(okern, osm);
  carry::kernels::primitives::allow_smem(pkern, psm, /*max_carveout=*/true);  // three blocks of 73 KB an SM need the carve-out
  const int nwg = WG ? walk_warpgroups(d) : 1;  // warpgroups (32-column tiles) a walk block
  const Pieces pc = plan_pieces(d, (DV / (BV * nwg)) * d.H * d.B);
  // one walk: its own size; pieces: also more than an SM has left beside an output or a prep block
  const size_t walk_bytes = !WG ? StateMmaSmem<DK, BV, kStateStages>::bytes
                            : nwg == 2 ? size_t(wg::FwdSmem<2, wg::kWalkStages>::bytes)
                                       : size_t(wg::FwdSmem<1, wg::kWalkStages>::bytes);
  const size_t ssm =
      std::max(walk_bytes, pc.n == 1 || !pc.idle ? size_t(0) : size_t(kMaxSmemSM) - std::min(osm, psm) + 1024);
  CUtensorMap tmW{}, tmK{}, tmU{}, tmG{}, tmH{}, tmV{};
  // DeltaNet (no gate) walks without the gate's reads and unit factors (GATE = false, the same bits)
  constexpr int S = wg::kWalkStages;
  auto wkern = nwg == 2 ? (g ? wg::fwd_walk_wg<DV, 2, S, true> : wg::fwd_walk_wg<DV, 2, S, false>)
                        : (g ? wg::fwd_walk_wg<DV, 1, S, true> : wg::fwd_walk_wg<DV, 1, S, false>);
  if constexpr (WG) {
    const long rows = (long)d.B * d.H * d.T;
    wg::check_coords(rows);
    tmW = wg::map_w(Wp, rows);
    tmK = wg::map_tokens(kp, d.B, d.T, d.H);
    tmU = wg::map_u(Up, rows, DV);
    tmG = wg::map_g(Gc.data_ptr<float>(), rows);
    tmH = wg::map_store(Hp, (long)d.B * d.H * d.N * DK, DV, DK);
    tmV = wg::map_store(Vnp, rows, DV, wg::kC);
    carry::kernels::primitives::allow_smem(wkern, ssm);
  } else {
    carry::kernels::primitives::allow_smem(fwd_state_mma_kernel<DK, DV, BV, NW, kStateStages>, ssm);
  }
  auto prep = [&](cudaStream_t st, int c0, int c1) {
    pkern<<<dim3(c1 - c0, d.H, d.B), 256, psm, st>>>(kp, vp, g, beta, Gc.data_ptr<float>(),
                                                      reinterpret_cast<bf16*>(Tm.data_ptr()), Wp, Up, d.T, d.H, c0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  at::cuda::CUDAStream wst = stream;  // the walk's stream
  auto walk = [&](int c0, int c1, const float* from, float* to) {
    if constexpr (WG) {
      wkern<<<dim3(DV / (BV * nwg), d.H, d.B), 128 * nwg, ssm, wst>>>(tmW, tmK, tmU, tmG, tmH, tmV, from, Hp, Vnp, to,
                                                                      d.T, d.H, c0, c1, 1, 0);
    } else
      fwd_state_mma_kernel<DK, DV, BV, NW, kStateStages><<<dim3(DV / BV, d.H, d.B), NW * 32, ssm, wst>>>(
          kp, Wp, Up, Gc.data_ptr<float>(), from, Hp, Vnp, to, d.T, d.H, c0, c1);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  auto out = [&](cudaStream_t st, int c0, int c1) {
    okern<<<dim3(c1 - c0, d.H, d.B), 256, osm, st>>>(qp, kp, Gc.data_ptr<float>(), Hp, Vnp, Op, scale, d.T, d.H, c0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if constexpr (WG) {
    // The segmented walk: P segments of L chunks. Segments 0..P−2 give their summaries B from zero over
    // the dv columns and (beside it, on a second stream) their maps A from the identity over dk columns
    // (every segment's, saved, where the backward walks the segments too: it reads A of 1..P−1);
    // S_in(0) = S0, S_in(p) = A(p−1)·S_in(p−1) + B(p−1) in fp32 (cuBLAS), in order; then every segment
    // walks at once from its S_in, writing H_c and V_new as the one walk does.
    const int P = plan_segments(d, segments);
    if (P > 1) {
      const int L = d.N / P;
      const auto f32 = Sfin.options();
      constexpr int kNwg = 2;
      const size_t wsm = wg::FwdSmem<kNwg, S>::bytes;
      auto k0 = g ? wg::fwd_walk_wg<DV, kNwg, S, true, 0> : wg::fwd_walk_wg<DV, kNwg, S, false, 0>;
      auto k1 = g ? wg::fwd_walk_wg<DV, kNwg, S, true, 1> : wg::fwd_walk_wg<DV, kNwg, S, false, 1>;
      auto k2 = g ? wg::fwd_walk_wg<DK, kNwg, S, true, 2> : wg::fwd_walk_wg<DK, kNwg, S, false, 2>;
      for (auto kern : {k0, k1}) carry::kernels::primitives::allow_smem(kern, wsm);
      carry::kernels::primitives::allow_smem(k2, wsm);
      at::Tensor Bs = at::empty({P - 1, d.B, d.H, DK, DV}, f32);
      const int NA = segmented_backward(segments) ? P : P - 1;  // the segments whose maps are formed
      at::Tensor A = at::empty({NA, d.B, d.H, DK, DK}, f32);
      at::Tensor Sin = at::empty({P, d.B, d.H, DK, DV}, f32), Sf = at::empty({P, d.B, d.H, DK, DV}, f32);
      prep(stream, 0, d.N);
      auto side = at::cuda::getStreamFromPool(false, Sfin.device().index());
      join(stream, side);
      k2<<<dim3(DK / (BV * kNwg), d.H, d.B * NA), 128 * kNwg, wsm, side>>>(
          tmW, tmK, tmU, tmG, tmH, tmV, nullptr, Hp, Vnp, A.data_ptr<float>(), d.T, d.H, 0, NA * L, NA, L);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      k1<<<dim3(DV / (BV * kNwg), d.H, d.B * (P - 1)), 128 * kNwg, wsm, stream>>>(
          tmW, tmK, tmU, tmG, tmH, tmV, nullptr, Hp, Vnp, Bs.data_ptr<float>(), d.T, d.H, 0, (P - 1) * L, P - 1, L);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      join(side, stream);
      const long bh = (long)d.B * d.H;
      if (S0) Sin[0].view({bh, DK, DV}).copy_(at::from_blob(const_cast<float*>(S0), {bh, DK, DV}, f32));
      else Sin[0].zero_();
      for (int p = 1; p < P; ++p) {
        at::Tensor out_p = Sin[p].view({bh, DK, DV});
        at::baddbmm_out(out_p, Bs[p - 1].view({bh, DK, DV}), A[p - 1].view({bh, DK, DK}), Sin[p - 1].view({bh, DK, DV}));
      }
      k0<<<dim3(DV / (BV * kNwg), d.H, d.B * P), 128 * kNwg, wsm, stream>>>(
          tmW, tmK, tmU, tmG, tmH, tmV, Sin.data_ptr<float>(), Hp, Vnp, Sf.data_ptr<float>(), d.T, d.H, 0, d.N, P, L);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      Sfin.copy_(Sf[P - 1]);
      if (NA == P) As = A;
      if (on_final_state) on_final_state(Sfin);  // before the output kernel: a send runs beside it
      out(stream, 0, d.N);
      return;
    }
  }
  if (pc.n == 1) {
    prep(stream, 0, d.N);
    walk(0, d.N, S0, Sfin.data_ptr<float>());
    if (on_final_state) on_final_state(Sfin);  // before the output kernel: a send runs beside it
    out(stream, 0, d.N);
    return;
  }
  // The second stream: the preparation of piece p + 1 goes ahead of the output of piece p (so it
  // runs while piece p walks), the output of piece p after piece p's walk.
  at::Tensor tmp = at::empty({2, d.B, d.H, d.DK, d.DV}, Sfin.options());
  auto side = at::cuda::getStreamFromPool(false, Sfin.device().index());
  Timeline tl("fwd", stream);
  wst = walk_stream(stream);
  join(stream, side);  // the caller's stream has produced the inputs
  join(stream, wst);
  std::vector<at::cuda::CUDAEvent> prepared(pc.n);
  tl.span("prep", 0, side, [&] { prep(side, pc.c0(0, false), pc.c1(0, false)); });
  prepared[0].record(side);
  const float* from = S0;
  for (int p = 0; p < pc.n; ++p) {
    const int c0 = pc.c0(p, false), c1 = pc.c1(p, false);
    if (p + 1 < pc.n) {
      tl.span("prep", p + 1, side, [&] { prep(side, pc.c0(p + 1, false), pc.c1(p + 1, false)); });
      prepared[p + 1].record(side);
    }
    float* to = c1 == d.N ? Sfin.data_ptr<float>() : tmp[p % 2].data_ptr<float>();
    prepared[p].block(wst);
    tl.span("walk", p, wst, [&] { walk(c0, c1, from, to); });
    from = to;
    if (c1 == d.N) {  // the last piece: the caller's stream gets the final state
      join(wst, stream);
      if (on_final_state) on_final_state(Sfin);
    }
    join(wst, side);
    tl.span("out", p, side, [&] { out(side, c0, c1); });
  }
  join(side, stream);
}

template <typename T, int DK, int DV>
void fwd_impl(const Dims& d, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const float* g,
              const float* beta, float scale, const float* S0, at::Tensor& Gc, at::Tensor& Tm, at::Tensor& W,
              at::Tensor& U, at::Tensor& Hs, at::Tensor& Vn, at::Tensor& Sfin, at::Tensor& O,
              const std::function<void(const at::Tensor&)>& on_final_state, int segments, at::Tensor& As) {
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  T* Wp = reinterpret_cast<T*>(W.data_ptr());
  T* Up = reinterpret_cast<T*>(U.data_ptr());
  T* Hp = reinterpret_cast<T*>(Hs.data_ptr());
  T* Vnp = reinterpret_cast<T*>(Vn.data_ptr());
  T* Op = reinterpret_cast<T*>(O.data_ptr());
  if constexpr (std::is_same<T, bf16>::value) {
    // bf16 always walks in pieces (fwd_pieces; one piece where the walk's tiles fill the GPU): at dk = 128
    // on the warpgroup walks, at dk = 64 on the mma.sync walks in 16-column state tiles and 4 warps, or
    // 32-column tiles and 8 warps where the tiles are wide (wide_state_tiles; measured with these walks
    // at dk = 128, H=16, 131k tokens on an H200: 14.43 ms with 4 warps against 13.86).
    if constexpr (DK == wg::kDK)
      return fwd_pieces<DK, DV, wg::kBV, 4, true>(d, kp, vp, g, beta, Gc, Tm, Wp, Up, S0, Hp, Vnp, Sfin, qp, Op, scale,
                                                  on_final_state, segments, As);
    else if (!wide_state_tiles(d))
      return fwd_pieces<DK, DV>(d, kp, vp, g, beta, Gc, Tm, Wp, Up, S0, Hp, Vnp, Sfin, qp, Op, scale, on_final_state,
                                segments, As);
    else
      return fwd_pieces<DK, DV, 32, 8>(d, kp, vp, g, beta, Gc, Tm, Wp, Up, S0, Hp, Vnp, Sfin, qp, Op, scale,
                                       on_final_state, segments, As);
  } else {
    // fp32: the generic kernels on shared tiles, one walk (16-column tiles, 4 warps).
    auto stream = at::cuda::getCurrentCUDAStream();
    dim3 gc(d.N, d.H, d.B);
    {
      auto kern = prep_kernel<T, DK, DV>;
      size_t sm = PrepSmem<T, DK>::bytes;
      carry::kernels::primitives::allow_smem(kern, sm);
      kern<<<gc, 256, sm, stream>>>(kp, vp, g, beta, Gc.data_ptr<float>(), reinterpret_cast<T*>(Tm.data_ptr()), Wp, Up,
                                    d.T, d.H);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    {
      constexpr int BV = 16, NW = 4, NBUF = 1;
      auto kern = fwd_state_kernel<T, DK, DV, BV, NBUF, NW>;
      size_t sm = StateSmem<T, DK, BV, NBUF>::bytes;
      carry::kernels::primitives::allow_smem(kern, sm);
      kern<<<dim3(DV / BV, d.H, d.B), NW * 32, sm, stream>>>(kp, Wp, Up, Gc.data_ptr<float>(), S0, Hp, Vnp,
                                                            Sfin.data_ptr<float>(), d.T, d.H);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (on_final_state) on_final_state(Sfin);  // before the output kernel: a send runs beside it
    {
      auto kern = fwd_o_kernel<T, DK, DV>;
      size_t sm = OutSmem<T, DK>::bytes;
      carry::kernels::primitives::allow_smem(kern, sm);
      kern<<<gc, 256, sm, stream>>>(qp, kp, Gc.data_ptr<float>(), Hp, Vnp, Op, scale, d.T, d.H);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
}

template <typename T, typename... A>
void fwd_dispatch(int DK, int DV, A&&... a) {
#define CARRY_GDN_CASE(dk, dv) \
  if (DK == dk && DV == dv) return fwd_impl<T, dk, dv>(std::forward<A>(a)...);
  CARRY_GDN_CASE(64, 64) CARRY_GDN_CASE(64, 128) CARRY_GDN_CASE(64, 256)
  CARRY_GDN_CASE(128, 64) CARRY_GDN_CASE(128, 128) CARRY_GDN_CASE(128, 256)
#undef CARRY_GDN_CASE
  TORCH_CHECK(false, "gdn_fwd: unsupported dk=", DK, " dv=", DV);
}

}  // namespace

std::vector<at::Tensor> gdn_prep(const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& g_,
                                 const at::Tensor& beta_) {
  const Dims d = check_inputs("gdn_prep", k_, k_, v_, g_, beta_, 64);
  TORCH_CHECK(k_.scalar_type() == at::kBFloat16, "gdn_prep: k and v must be bf16, got ", k_.scalar_type());
  c10::cuda::CUDAGuard guard(k_.device());
  auto k = dense(k_), v = dense(v_);
  auto g = g_.defined() ? g_.to(at::kFloat).contiguous() : at::Tensor();
  auto beta = beta_.to(at::kFloat).contiguous();
  auto io = k.options();
  at::Tensor Gc = alloc({d.B, d.H, d.T}, io.dtype(at::kFloat)), Tm = alloc({d.B, d.H, d.N, 64, 64}, io);
  at::Tensor W = alloc({d.B, d.H, d.T, d.DK}, io), U = alloc({d.B, d.H, d.T, d.DV}, io);
  auto launch = [&](auto kern, size_t bytes) {
    carry::kernels::primitives::allow_smem(kern, bytes, /*max_carveout=*/true);
    kern<<<dim3(d.N, d.H, d.B), 256, bytes, at::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const bf16*>(k.data_ptr()), reinterpret_cast<const bf16*>(v.data_ptr()),
        g.defined() ? g.data_ptr<float>() : nullptr, beta.data_ptr<float>(), Gc.data_ptr<float>(),
        reinterpret_cast<bf16*>(Tm.data_ptr()), reinterpret_cast<bf16*>(W.data_ptr()),
        reinterpret_cast<bf16*>(U.data_ptr()), d.T, d.H, 0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
#define CARRY_GDN_CASE(dk, dv) \
  if (d.DK == dk && d.DV == dv) launch(prep_reg_kernel<dk, dv>, PrepRegSmem<dk>::bytes);
  CARRY_GDN_CASE(64, 64) CARRY_GDN_CASE(64, 128) CARRY_GDN_CASE(64, 256)
  CARRY_GDN_CASE(128, 64) CARRY_GDN_CASE(128, 128) CARRY_GDN_CASE(128, 256)
#undef CARRY_GDN_CASE
  return {Gc, Tm, W, U};
}

bool gdn_poison_enabled() { return poison_enabled(); }

std::vector<at::Tensor> gdn_fwd(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                const at::Tensor& g_, const at::Tensor& beta_, double scale,
                                const at::Tensor& S0_, int64_t chunk_size,
                                const std::function<void(const at::Tensor&)>& on_final_state, int segments) {
  const Dims d = check_inputs("gdn_fwd", q_, k_, v_, g_, beta_, chunk_size);
  c10::cuda::CUDAGuard guard(q_.device());
  auto q = dense(q_), k = dense(k_), v = dense(v_);
  auto g = g_.defined() ? g_.to(at::kFloat).contiguous() : at::Tensor();
  auto beta = beta_.to(at::kFloat).contiguous();
  at::Tensor S0;
  if (S0_.defined()) {
    TORCH_CHECK(S0_.sizes() == at::IntArrayRef({d.B, d.H, d.DK, d.DV}), "gdn_fwd: initial_state must be [B,H,dk,dv] = [",
                d.B, ",", d.H, ",", d.DK, ",", d.DV, "], got ", S0_.sizes());
    S0 = S0_.to(at::kFloat).contiguous();
  }
  auto f32 = q.options().dtype(at::kFloat);
  auto io = q.options();
  at::Tensor Gc = alloc({d.B, d.H, d.T}, f32), Tm = alloc({d.B, d.H, d.N, 64, 64}, io);
  at::Tensor W = alloc({d.B, d.H, d.T, d.DK}, io), U = alloc({d.B, d.H, d.T, d.DV}, io);
  at::Tensor Hs = alloc({d.B, d.H, d.N, d.DK, d.DV}, io), Vn = alloc({d.B, d.H, d.T, d.DV}, io);
  at::Tensor Sfin = alloc({d.B, d.H, d.DK, d.DV}, f32), O = alloc({d.B, d.T, d.H, d.DV}, io);
  const float* gp = g.defined() ? g.data_ptr<float>() : nullptr;
  const float* S0p = S0.defined() ? S0.data_ptr<float>() : nullptr;
  at::Tensor As = at::empty({0}, f32);  // the segments' maps (the segmented walk), else empty
  if (q.scalar_type() == at::kBFloat16)
    fwd_dispatch<bf16>(d.DK, d.DV, d, q, k, v, gp, beta.data_ptr<float>(), (float)scale, S0p, Gc, Tm, W, U, Hs, Vn,
                       Sfin, O, on_final_state, segments, As);
  else
    fwd_dispatch<float>(d.DK, d.DV, d, q, k, v, gp, beta.data_ptr<float>(), (float)scale, S0p, Gc, Tm, W, U, Hs,
                        Vn, Sfin, O, on_final_state, segments, As);
  return {O, Sfin, Gc, Tm, W, Hs, Vn, As};
}

}  // namespace carry::kernels::delta_rule
