// Backward of the delta rule (DeltaNet, Gated DeltaNet), chunk C = 64, from the saved forward
// pieces (G, T = (I+A)⁻¹, W, H_c = state entering chunk c, V_new).
//
//  1. bwd_dv_local_kernel, grid (N, H, B), 256 threads. One block owns one chunk of one head:
//     P = scale·(QKᵀ ⊙ Γ ⊙ causal) in shared memory, then per dv tile of 64 the intra-chunk part of
//     dV_new, Pᵀ·dO, written in fp32 [B,H,T,dv].
//  2. bwd_state_kernel, grid (dv/BV, H, B), 128 threads: the reverse recurrence. One block owns a
//     BV-wide column tile of one head's state gradient dS [dk,BV] (fp32, shared memory) and walks
//     the chunks backwards, streaming Q, K, W [C,dk], dO, dV_local [C,BV] (double-buffered with
//     cp.async for bf16). Per chunk: writes dH_c = dS (gradient of the state leaving chunk c),
//       dV_new = (e^{G_C−G} ⊙ K)·dS + dV_local,
//       dS ← e^{G_C} dS + (scale·e^G ⊙ Q)ᵀ dO − Wᵀ dV_new,
//     and at the end d_initial_state = dS. With few heads the bf16 walk runs in pieces and the
//     chunk-gradient kernel (3.) of each finished piece runs beside the next (bwd_pieces).
//  3. bwd_chunk_reg_kernel (bf16), grid (N, H, B), 512 threads: the chunk-local gradients dq, dk,
//     dv, dg, dbeta from H_c, dH_c, V_new, dV_new, T, every C×dk and C×C intermediate in mma.sync
//     registers (see 3b below; ~197 KB of shared memory at dk = 128, dv tiles double-buffered).
//     bwd_chunk_kernel (fp32), 256 threads: the same formulas on shared fp32 tiles with FMA
//     products; fp32 with dk=128 does not fit: it falls back to chunk_grads (batched ATen).
//  For bf16 the intra-chunk dV is bwd_dv_local_reg_kernel (1b), the same product from registers; where
//  the warpgroup reverse walk (walk_wg.cuh) follows, it also writes Q̃ = scale·e^G ⊙ Q (bf16) into dq's
//  memory for the walk, which 3. overwrites with dq once the walk has passed the chunk.
#include "layers/kernels/delta_rule/api.h"
#include "layers/kernels/primitives/tiles.cuh"
#include "layers/kernels/delta_rule/launch.h"
#include "layers/kernels/primitives/mma_frag.cuh"
#include "layers/kernels/delta_rule/walk_wg.cuh"

#include <ATen/cuda/CUDAEvent.h>

#include <cstdlib>
#include <limits>
#include <type_traits>

namespace carry::kernels::delta_rule {
using namespace carry::kernels::primitives;

namespace {

constexpr size_t al128(size_t x) { return (x + 127) & ~size_t(127); }
// Chunks buffered by the bf16 reverse recurrence (see kStateStages in fwd.cu). It streams
// Q, K and W a chunk: 3 stages at dk = 128, BV = 16 take 191 KB (2 took 129 KB, also one block an
// SM) and ran 3% faster on an H200 (H=4, dk=128, dv=256, T=32768: 1084 vs 1114 µs).
constexpr int kBwdStateStages = 3;


// ---------------------------------------------------------------------------------------------
// 1. intra-chunk dV_new
template <typename T, int DK>
struct DvSmem {
  static constexpr int C = kChunk, P = pad_of<T>();
  static constexpr int LK = DK + P, LA = C + kPadF, LPb = C + P, LV = 64 + P, LO = 64 + kPadF;
  static constexpr size_t oQ = 0;
  static constexpr size_t oK = al128(oQ + C * LK * sizeof(T));
  static constexpr size_t oP = al128(oK + C * LK * sizeof(T));
  static constexpr size_t oPb = al128(oP + C * LA * 4);
  static constexpr size_t oV = al128(oPb + C * LPb * sizeof(T));
  static constexpr size_t oO = al128(oV + C * LV * sizeof(T));
  static constexpr size_t oG = al128(oO + C * LO * 4);
  static constexpr size_t bytes = oG + C * 4;
};

template <typename T, int DK, int DV>
__global__ void __launch_bounds__(256) bwd_dv_local_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                                           const float* __restrict__ Gc, const T* __restrict__ dO,
                                                           float* __restrict__ dVl, float scale, int T_, int H) {
  constexpr int C = kChunk, NT = 256, NW = 8;
  using L = DvSmem<T, DK>;
  extern __shared__ __align__(128) char smem[];
  T* sQ = reinterpret_cast<T*>(smem + L::oQ);
  T* sK = reinterpret_cast<T*>(smem + L::oK);
  float* sP = reinterpret_cast<float*>(smem + L::oP);
  T* sPb = reinterpret_cast<T*>(smem + L::oPb);
  T* sV = reinterpret_cast<T*>(smem + L::oV);
  float* sO = reinterpret_cast<float*>(smem + L::oO);
  float* sG = reinterpret_cast<float*>(smem + L::oG);

  const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const long t0 = (long)c * C, bh = (long)b * H + h, rowk = (long)H * DK, rowv = (long)H * DV;
  load_tile_async<T, C, DK, NT>(sQ, L::LK, q + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
  load_tile_async<T, C, DK, NT>(sK, L::LK, k + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
  cp_async_commit();
  if (tid < C) sG[tid] = Gc[bh * T_ + t0 + tid];
  cp_async_wait<0>();
  __syncthreads();
  gemm<T, C, C, DK, false, true, NW>(sQ, L::LK, sK, L::LK, sP, L::LA, false);
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
    load_tile_async<T, C, 64, NT>(sV, L::LV, dO + ((long)b * T_ + t0) * rowv + (long)h * DV + v0, rowv);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    gemm<T, C, 64, C, true, false, NW>(pP, ldP, sV, L::LV, sO, L::LO, false);  // Pᵀ dO
    __syncthreads();
    store_tile<float, C, 64, NT>(dVl + (bh * T_ + t0) * DV + v0, DV, sO, L::LO);
    __syncthreads();
  }
}

// 1b. bf16 intra-chunk dV_new with the products in mma.sync registers (the plan of fwd_o_reg_kernel):
// P once in bf16 shared memory, then per 64-wide dv tile Pᵀ·dO summed in registers and stored in
// fp32 straight to global; the dO tiles double-buffered, the first loaded with Q and K.
template <int DK>
struct DvRegSmem {
  static constexpr int C = kChunk, LK = DK + 8, LPb = C + 8, LV = 64 + 8;
  static constexpr size_t oQ = 0;
  static constexpr size_t oK = al128(oQ + C * LK * 2);
  static constexpr size_t oPb = al128(oK + C * LK * 2);
  static constexpr size_t oG = al128(oPb + C * LPb * 2);
  static constexpr size_t oBuf = al128(oG + C * 4);
  static constexpr size_t buf = al128(C * LV * 2);
  static constexpr size_t bytes = oBuf + 2 * buf;
};

template <int DK, int DV>
__global__ void __launch_bounds__(256) bwd_dv_local_reg_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                               const float* __restrict__ Gc, const bf16* __restrict__ dO,
                                                               float* __restrict__ dVl, bf16* __restrict__ qs,
                                                               float scale, int T_, int H, int c_begin) {
  constexpr int C = kChunk, NT = 256, NTILE = DV / 64;
  using L = DvRegSmem<DK>;
  extern __shared__ __align__(128) char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::oQ);
  bf16* sK = reinterpret_cast<bf16*>(smem + L::oK);
  bf16* sPb = reinterpret_cast<bf16*>(smem + L::oPb);
  float* sG = reinterpret_cast<float*>(smem + L::oG);
  const int c = c_begin + blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const long t0 = (long)c * C, bh = (long)b * H + h, rowk = (long)H * DK, rowv = (long)H * DV;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int m0 = (warp & 3) * 16, n0 = (warp >> 2) * 32;
  auto load_do = [&](int v0, int bi) {
    load_tile_async<bf16, C, 64, NT>(reinterpret_cast<bf16*>(smem + L::oBuf + bi * L::buf), L::LV,
                                     dO + ((long)b * T_ + t0) * rowv + (long)h * DV + v0, rowv);
    cp_async_commit();
  };
  load_qk_and_p<DK, NT>(sQ, sK, L::LK, q + ((long)b * T_ + t0) * rowk + (long)h * DK,
                        k + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk, load_do, NTILE, sG,
                        Gc + bh * T_ + t0, 1, scale, sPb, L::LPb);
  if (qs) {  // Q̃ = scale·e^{G_t} ⊙ Q in bf16 (q's layout) for the reverse warpgroup walk (walk_wg.cuh)
    for (int i = tid; i < C * DK / 8; i += NT) {
      const int r = i / (DK / 8), c8 = (i % (DK / 8)) * 8;
      const float f = scale * __expf(sG[r]);
      const uint4 u = *reinterpret_cast<const uint4*>(sQ + r * L::LK + c8);
      const unsigned in[4] = {u.x, u.y, u.z, u.w};
      unsigned o[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&in[e]));
        const __nv_bfloat162 y = __floats2bfloat162_rn(x.x * f, x.y * f);
        o[e] = *reinterpret_cast<const unsigned*>(&y);
      }
      *reinterpret_cast<uint4*>(qs + ((long)b * T_ + t0 + r) * rowk + (long)h * DK + c8) = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
  for (int it = 0; it < NTILE; ++it) {
    const bf16* sV = reinterpret_cast<const bf16*>(smem + L::oBuf + (it & 1) * L::buf);
    if (it + 1 < NTILE) cp_async_wait<1>();
    else cp_async_wait<0>();
    __syncthreads();
    float o[4][4] = {};
    frag_mma<4, C, true, false>(o, sPb, L::LPb, sV, L::LV, m0, n0);  // Pᵀ dO
    float* out = dVl + (bh * T_ + t0) * DV + it * 64;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int col = n0 + nt * 8 + 2 * t4;
      *reinterpret_cast<float2*>(out + (long)(m0 + g) * DV + col) = make_float2(o[nt][0], o[nt][1]);
      *reinterpret_cast<float2*>(out + (long)(m0 + g + 8) * DV + col) = make_float2(o[nt][2], o[nt][3]);
    }
    if (it + 2 < NTILE) {
      __syncthreads();
      load_do((it + 2) * 64, it & 1);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 2. reverse state recurrence
template <typename T, int DK, int BV, int NBUF>
struct BwdStateSmem {
  static constexpr int C = kChunk, P = pad_of<T>();
  static constexpr int LK = DK + P, LS = BV + kPadF, LSb = BV + P;
  static constexpr size_t oS = 0;
  static constexpr size_t oSb = al128(oS + DK * LS * 4);
  static constexpr size_t oQ = al128(oSb + DK * LSb * sizeof(T));
  static constexpr size_t oK = al128(oQ + NBUF * C * LK * sizeof(T));
  static constexpr size_t oW = al128(oK + NBUF * C * LK * sizeof(T));
  static constexpr size_t odO = al128(oW + NBUF * C * LK * sizeof(T));
  static constexpr size_t odVl = al128(odO + NBUF * C * LSb * sizeof(T));
  static constexpr size_t oG = al128(odVl + NBUF * C * LS * 4);
  static constexpr size_t odVn = al128(oG + NBUF * C * 4);
  static constexpr size_t odVnb = al128(odVn + C * LS * 4);
  static constexpr size_t bytes = odVnb + C * LSb * sizeof(T);
};

template <typename T, int DK, int DV, int BV, int NBUF, int NW>
__global__ void __launch_bounds__(NW * 32) bwd_state_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                                        const T* __restrict__ W, const float* __restrict__ Gc,
                                                        const T* __restrict__ dO, const float* __restrict__ dVl,
                                                        const float* __restrict__ dSfin, T* __restrict__ dHs,
                                                        T* __restrict__ dVn, float* __restrict__ dS0, float scale,
                                                        int T_, int H) {
  constexpr int C = kChunk, NT = NW * 32;
  using L = BwdStateSmem<T, DK, BV, NBUF>;
  extern __shared__ __align__(128) char smem[];
  float* sdS = reinterpret_cast<float*>(smem + L::oS);
  T* sdSb = reinterpret_cast<T*>(smem + L::oSb);
  T* sQ = reinterpret_cast<T*>(smem + L::oQ);
  T* sK = reinterpret_cast<T*>(smem + L::oK);
  T* sW = reinterpret_cast<T*>(smem + L::oW);
  T* sdO = reinterpret_cast<T*>(smem + L::odO);
  float* sdVl = reinterpret_cast<float*>(smem + L::odVl);
  float* sG = reinterpret_cast<float*>(smem + L::oG);
  float* sdVn = reinterpret_cast<float*>(smem + L::odVn);
  T* sdVnb = reinterpret_cast<T*>(smem + L::odVnb);

  const int v0 = blockIdx.x * BV, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int N = T_ / C;
  const long bh = (long)b * H + h, rowk = (long)H * DK, rowv = (long)H * DV;

  auto issue = [&](int c, int buf) {
    const long t0 = (long)c * C;
    load_tile_async<T, C, DK, NT>(sQ + buf * C * L::LK, L::LK, q + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
    load_tile_async<T, C, DK, NT>(sK + buf * C * L::LK, L::LK, k + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
    load_tile_async<T, C, DK, NT>(sW + buf * C * L::LK, L::LK, W + (bh * T_ + t0) * DK, DK);
    load_tile_async<T, C, BV, NT>(sdO + buf * C * L::LSb, L::LSb, dO + ((long)b * T_ + t0) * rowv + (long)h * DV + v0,
                                  rowv);
    load_tile_async<float, C, BV, NT>(sdVl + buf * C * L::LS, L::LS, dVl + (bh * T_ + t0) * DV + v0, DV);
    if (tid < C / 4) cp_async16(sG + buf * C + tid * 4, Gc + bh * T_ + t0 + tid * 4);
  };

  for (int i = tid; i < DK * BV; i += NT) {
    const int r = i / BV, j = i % BV;
    sdS[r * L::LS + j] = dSfin ? dSfin[(bh * DK + r) * DV + v0 + j] : 0.f;
  }
  if constexpr (NBUF == 2) {
    issue(N - 1, 0);
    cp_async_commit();
  }
  __syncthreads();

  for (int it = 0; it < N; ++it) {
    const int c = N - 1 - it;
    const int buf = NBUF == 2 ? (it & 1) : 0;
    T* dh = dHs + (bh * N + c) * DK * DV + v0;
    for (int i = tid; i < DK * BV; i += NT) {
      const int r = i / BV, j = i % BV;
      const T x = from_f<T>(sdS[r * L::LS + j]);
      sdSb[r * L::LSb + j] = x;
      dh[(long)r * DV + j] = x;
    }
    if constexpr (NBUF == 2) {
      if (c > 0) issue(c - 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      issue(c, 0);
      cp_async_commit();
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* cQ = sQ + buf * C * L::LK;
    const T* cK = sK + buf * C * L::LK;
    const T* cW = sW + buf * C * L::LK;
    T* cdO = sdO + buf * C * L::LSb;
    const float* cdVl = sdVl + buf * C * L::LS;
    const float* G = sG + buf * C;

    gemm<T, C, BV, DK, false, false, NW>(cK, L::LK, sdSb, L::LSb, sdVn, L::LS, false);  // K·dS
    __syncthreads();
    const float gl = G[C - 1], egl = expf(gl);
    T* dvn = dVn + (bh * T_ + (long)c * C) * DV + v0;
    for (int i = tid; i < C * BV; i += NT) {
      const int r = i / BV, j = i % BV;
      const T x = from_f<T>(sdVn[r * L::LS + j] * expf(gl - G[r]) + cdVl[r * L::LS + j]);
      dvn[(long)r * DV + j] = x;
      sdVnb[r * L::LSb + j] = from_f<T>(-to_f(x));
      cdO[r * L::LSb + j] = from_f<T>(to_f(cdO[r * L::LSb + j]) * scale * expf(G[r]));
    }
    for (int i = tid; i < DK * BV; i += NT) {
      const int r = i / BV, j = i % BV;
      sdS[r * L::LS + j] *= egl;
    }
    __syncthreads();
    gemm<T, DK, BV, C, true, false, NW>(cQ, L::LK, cdO, L::LSb, sdS, L::LS, true);    // += (scale e^G Q)ᵀ dO
    gemm<T, DK, BV, C, true, false, NW>(cW, L::LK, sdVnb, L::LSb, sdS, L::LS, true);  // −= Wᵀ dV_new
    __syncthreads();
  }
  for (int i = tid; i < DK * BV; i += NT) {
    const int r = i / BV, j = i % BV;
    dS0[(bh * DK + r) * DV + v0 + j] = sdS[r * L::LS + j];
  }
}

// 2b. bf16 reverse recurrence on raw tensor cores (the plan of bwd_state_kernel, with dS in
// registers as mma accumulators; unit ownership as in fwd_state_mma_kernel).
template <int DK, int BV, int NBUF>
struct BwdStateMmaSmem {
  static constexpr int C = kChunk, LK = DK + 8, LB = BV + 8, LF = BV + kPadF;
  static constexpr size_t oSb = 0;
  static constexpr size_t oQ = al128(oSb + DK * LB * 2);
  static constexpr size_t oK = al128(oQ + NBUF * C * LK * 2);
  static constexpr size_t oW = al128(oK + NBUF * C * LK * 2);
  static constexpr size_t odO = al128(oW + NBUF * C * LK * 2);
  static constexpr size_t odVl = al128(odO + NBUF * C * LB * 2);
  static constexpr size_t oG = al128(odVl + NBUF * C * LF * 4);
  static constexpr size_t oVb = al128(oG + NBUF * C * 4);
  static constexpr size_t bytes = oVb + C * LB * 2;
  static_assert(bytes <= 227 * 1024, "state kernel shared memory");
};

template <int DK, int DV, int BV, int NW, int NBUF>
__global__ void __launch_bounds__(NW * 32) bwd_state_mma_kernel(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ W, const float* __restrict__ Gc,
    const bf16* __restrict__ dO, const float* __restrict__ dVl, const float* __restrict__ dSfin,
    bf16* __restrict__ dHs, bf16* __restrict__ dVn, float* __restrict__ dS0, float scale, int T_, int H,
    int c_begin, int c_end) {
  constexpr int C = kChunk, NT = NW * 32, NP = BV / 16;
  constexpr int U2 = (DK / 16) * NP, U2W = U2 / NW, U1 = (C / 16) * NP;
  static_assert(U2 % NW == 0, "state units must split evenly over warps");
  static_assert(NBUF >= 2, "at least one chunk in flight");
  using L = BwdStateMmaSmem<DK, BV, NBUF>;
  constexpr int LK = L::LK, LB = L::LB, LF = L::LF;
  extern __shared__ __align__(128) char smem[];
  bf16* sSb = reinterpret_cast<bf16*>(smem + L::oSb);
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::oQ);
  bf16* sK = reinterpret_cast<bf16*>(smem + L::oK);
  bf16* sW = reinterpret_cast<bf16*>(smem + L::oW);
  bf16* sdO = reinterpret_cast<bf16*>(smem + L::odO);
  float* sdVl = reinterpret_cast<float*>(smem + L::odVl);
  float* sG = reinterpret_cast<float*>(smem + L::oG);
  bf16* sVb = reinterpret_cast<bf16*>(smem + L::oVb);

  const int v0 = blockIdx.x * BV, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const int N = T_ / C;
  const long bh = (long)b * H + h, rowk = (long)H * DK, rowv = (long)H * DV;

  auto issue = [&](int c, int buf) {
    const long t0 = (long)c * C;
    load_tile_async<bf16, C, DK, NT>(sQ + buf * C * LK, LK, q + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
    load_tile_async<bf16, C, DK, NT>(sK + buf * C * LK, LK, k + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
    load_tile_async<bf16, C, DK, NT>(sW + buf * C * LK, LK, W + (bh * T_ + t0) * DK, DK);
    load_tile_async<bf16, C, BV, NT>(sdO + buf * C * LB, LB, dO + ((long)b * T_ + t0) * rowv + (long)h * DV + v0, rowv);
    load_tile_async<float, C, BV, NT>(sdVl + buf * C * LF, LF, dVl + (bh * T_ + t0) * DV + v0, DV);
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
        acc[i][nt][2 * hf] = dSfin ? dSfin[(bh * DK + row) * DV + col] : 0.f;
        acc[i][nt][2 * hf + 1] = dSfin ? dSfin[(bh * DK + row) * DV + col + 1] : 0.f;
      }
    }
  }
  // NBUF − 1 chunks in flight, walking backwards (as in fwd_state_mma_kernel) over the chunks
  // [c_begin, c_end): dSfin is the state gradient leaving chunk c_end − 1, dS0 gets the one entering
  // c_begin (a piece of the walk; pieces chained through fp32 memory give the whole walk's bits).
  const int count = c_end - c_begin;
#pragma unroll
  for (int it = 0; it < NBUF - 1; ++it) {
    if (it < count) issue(c_end - 1 - it, it);
    cp_async_commit();
  }

  for (int it = 0; it < count; ++it) {
    const int c = c_end - 1 - it, buf = it % NBUF;
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
    if (it + NBUF - 1 < count) issue(c - (NBUF - 1), (it + NBUF - 1) % NBUF);
    cp_async_commit();
    cp_async_wait<NBUF - 1>();
    __syncthreads();
    const bf16* cQ = sQ + buf * C * LK;
    const bf16* cK = sK + buf * C * LK;
    const bf16* cW = sW + buf * C * LK;
    bf16* cdO = sdO + buf * C * LB;
    const float* cdVl = sdVl + buf * C * LF;
    const float* G = sG + buf * C;
    {  // dH_c = dS (16-byte copies)
      bf16* dh = dHs + (bh * N + c) * DK * DV + v0;
      constexpr int VR = BV / 8;
      static_assert(NT % VR == 0 && (DK * VR) % NT == 0, "whole rows a pass");
      const int r0 = tid / VR, cv = (tid % VR) * 8;
#pragma unroll
      for (int j = 0; j < DK * VR / NT; ++j) {
        const int r = r0 + j * (NT / VR);
        *reinterpret_cast<uint4*>(dh + (long)r * DV + cv) = *reinterpret_cast<const uint4*>(sSb + r * LB + cv);
      }
    }
    const float gl = G[C - 1];
    // aq = Qᵀ·(scale e^G ⊙ dO), which does not depend on dS: issued before the dV_new product so it
    // runs beside it, and added to the decayed dS after the barrier (the update's chain is then the
    // Wᵀ·Vb product alone, 4 k-steps deep instead of 8). The factor scale·e^{G_t} scales Qᵀ's
    // fragments in registers (A columns = tokens k0 + 2·t4 + {0, 1, 8, 9}) instead of a pass over dO.
    float aq[U2W][2][4];
    {
      float sq[C / 16][4];
#pragma unroll
      for (int ks = 0; ks < C / 16; ++ks) {
        const int t = 16 * ks + 2 * t4;
        sq[ks][0] = scale * __expf(G[t]);
        sq[ks][1] = scale * __expf(G[t + 1]);
        sq[ks][2] = scale * __expf(G[t + 8]);
        sq[ks][3] = scale * __expf(G[t + 9]);
      }
#pragma unroll
      for (int i = 0; i < U2W; ++i) {
        const int u = warp + i * NW, n0 = (u % NP) * 16, m0 = (u / NP) * 16;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) aq[i][nt][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < C / 16; ++ks) {
          unsigned a[4], bb[4];
          tc::load_a_t(a, cQ, LK, m0, 16 * ks);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 x = tc::unpack_bf16(a[e]);
            const int p = (e >> 1) * 2;
            a[e] = tc::pack_bf16(x.x * sq[ks][p], x.y * sq[ks][p + 1]);
          }
          tc::load_b2_t(bb, cdO, LB, 16 * ks, n0);
          tc::mma16816(aq[i][0], a, bb[0], bb[1]);
          tc::mma16816(aq[i][1], a, bb[2], bb[3]);
        }
      }
    }
    // dV_new = e^{G_C−G} ⊙ K·dS + dV_local; Vb = −dV_new
    for (int u1 = warp; u1 < U1; u1 += NW) {
      const int m0 = (u1 / NP) * 16, n0 = (u1 % NP) * 16;
      float v[2][4];
      frag_mma_2chain<DK>(v, cK, LK, sSb, LB, m0, n0);
      bf16* dvn = dVn + (bh * T_ + (long)c * C) * DV + v0;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = m0 + g + hf * 8;
        const float e = __expf(gl - G[r]);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int col = n0 + nt * 8 + 2 * t4;
          const float2 l = *reinterpret_cast<const float2*>(cdVl + r * LF + col);
          const unsigned x = tc::pack_bf16(v[nt][2 * hf] * e + l.x, v[nt][2 * hf + 1] * e + l.y);
          *reinterpret_cast<unsigned*>(dvn + (long)r * DV + col) = x;
          const float2 xf = tc::unpack_bf16(x);
          *reinterpret_cast<unsigned*>(sVb + r * LB + col) = tc::pack_bf16(-xf.x, -xf.y);
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
        for (int e = 0; e < 4; ++e) acc[i][nt][e] = acc[i][nt][e] * egl + aq[i][nt][e];
#pragma unroll
      for (int k0 = 0; k0 < C; k0 += 16) {
        unsigned a[4], bb[4];
        tc::load_a_t(a, cW, LK, m0, k0);
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
        *reinterpret_cast<float2*>(dS0 + (bh * DK + row) * DV + col) =
            make_float2(acc[i][nt][2 * hf], acc[i][nt][2 * hf + 1]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 3. chunk-local gradients, one block per (chunk, head, batch), 256 threads.
// Phase 1 walks dv in tiles of BVt and accumulates in fp32 shared memory
//   F1 = dO Hᵀ, F2 = V_new dH'ᵀ, F3 = dV_new Hᵀ  [C,dk];  M1 = dO V_newᵀ, M2 = dV_new Vᵀ  [C,C]
// and finishes dv = β ⊙ Tᵀ dV_new per tile. Phase 2 turns them into dq, dk, dg, dbeta with a
// handful of C×C×dk and C×C×C products (see chunk_grads for the formulas, same order).
// The fp32 kernel (bf16 runs bwd_chunk_reg_kernel below).
template <typename T, int DK, int BVt>
struct ChunkSmem {
  static constexpr int C = kChunk, P = pad_of<T>();
  static constexpr int LF = DK + kPadF, LM = C + kPadF, LTb = C + P, LT = BVt + P, LY = BVt + kPadF, LK = DK + P;
  static constexpr size_t oF1 = 0;
  static constexpr size_t oF2 = al128(oF1 + C * LF * 4);
  static constexpr size_t oF3 = al128(oF2 + C * LF * 4);
  static constexpr size_t oM1 = al128(oF3 + C * LF * 4);
  static constexpr size_t oM2 = al128(oM1 + C * LM * 4);
  static constexpr size_t oTb = al128(oM2 + C * LM * 4);
  static constexpr size_t oSmall = al128(oTb + C * LTb * sizeof(T));  // G, B, DG, DB, KD, CS [C] + red[32]
  static constexpr size_t oR = al128(oSmall + (6 * C + 32) * 4);
  // phase 1 (in R)
  static constexpr size_t odO = oR;
  static constexpr size_t oVn = al128(odO + C * LT * sizeof(T));
  static constexpr size_t odVn = al128(oVn + C * LT * sizeof(T));
  static constexpr size_t oV = al128(odVn + C * LT * sizeof(T));
  static constexpr size_t oH = al128(oV + C * LT * sizeof(T));
  static constexpr size_t odH = al128(oH + DK * LT * sizeof(T));
  static constexpr size_t oY = al128(odH + DK * LT * sizeof(T));
  static constexpr size_t end1 = oY + C * LY * 4;
  // phase 2 (in R)
  static constexpr size_t oQ = oR;
  static constexpr size_t oK = al128(oQ + C * LK * sizeof(T));
  static constexpr size_t oXb = al128(oK + C * LK * sizeof(T));
  static constexpr size_t oMb1 = al128(oXb + C * LK * sizeof(T));
  static constexpr size_t oMb2 = al128(oMb1 + C * LTb * sizeof(T));
  static constexpr size_t end2 = oMb2 + C * LTb * sizeof(T);
  static constexpr size_t bytes = end1 > end2 ? end1 : end2;
};
constexpr size_t kMaxSmem = 232448;

// Sum of 4 consecutive lanes (a row group), result valid in all 4.
template <int RG>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int off = 1; off < RG; off <<= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

template <typename T, int DK, int DV, int BVt, int NW>
__global__ void __launch_bounds__(NW * 32) bwd_chunk_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const float* __restrict__ Gc,
    const float* __restrict__ beta, const float* __restrict__ Tm, const T* __restrict__ Hs,
    const T* __restrict__ dHs, const T* __restrict__ Vn, const T* __restrict__ dVn, const T* __restrict__ dO,
    T* __restrict__ dq, T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dg, float* __restrict__ dbeta,
    float scale, int T_, int H, int stop) {
  constexpr int C = kChunk, NT = NW * 32, RG = NT / C;  // RG threads per row in row passes
  using L = ChunkSmem<T, DK, BVt>;
  extern __shared__ __align__(128) char smem[];
  float* F1 = reinterpret_cast<float*>(smem + L::oF1);
  float* F2 = reinterpret_cast<float*>(smem + L::oF2);
  float* F3 = reinterpret_cast<float*>(smem + L::oF3);
  float* M1 = reinterpret_cast<float*>(smem + L::oM1);
  float* M2 = reinterpret_cast<float*>(smem + L::oM2);
  T* Tb = reinterpret_cast<T*>(smem + L::oTb);
  float* sG = reinterpret_cast<float*>(smem + L::oSmall);
  float* sB = sG + C;
  float* sDG = sB + C;
  float* sDB = sDG + C;
  float* sKD = sDB + C;
  float* sCS = sKD + C;
  float* sRed = sCS + C;
  T* tdO = reinterpret_cast<T*>(smem + L::odO);
  T* tVn = reinterpret_cast<T*>(smem + L::oVn);
  T* tdVn = reinterpret_cast<T*>(smem + L::odVn);
  T* tV = reinterpret_cast<T*>(smem + L::oV);
  T* tH = reinterpret_cast<T*>(smem + L::oH);
  T* tdH = reinterpret_cast<T*>(smem + L::odH);
  float* tY = reinterpret_cast<float*>(smem + L::oY);
  T* sQ = reinterpret_cast<T*>(smem + L::oQ);
  T* sK = reinterpret_cast<T*>(smem + L::oK);
  T* sXb = reinterpret_cast<T*>(smem + L::oXb);
  T* Mb1 = reinterpret_cast<T*>(smem + L::oMb1);
  T* Mb2 = reinterpret_cast<T*>(smem + L::oMb2);

  const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int N = T_ / C;
  const long t0 = (long)c * C, bh = (long)b * H + h, rowk = (long)H * DK, rowv = (long)H * DV;
  const int rq = tid / RG, part = tid % RG;  // row-group mapping for row reductions (64 rows x RG threads)

  {
    const float* tm = Tm + (bh * N + c) * C * C;
    for (int i = tid; i < C * C; i += NT) Tb[(i / C) * L::LTb + i % C] = from_f<T>(tm[i]);
    if (tid < C) {
      sG[tid] = Gc[bh * T_ + t0 + tid];
      sB[tid] = beta[((long)b * T_ + t0 + tid) * H + h];
      sDG[tid] = 0.f;
      sDB[tid] = 0.f;
    }
  }
  float hs = 0.f;  // thread-private part of <dH', H>
  {
  for (int v0 = 0; v0 < DV; v0 += BVt) {
    load_tile_async<T, C, BVt, NT>(tdO, L::LT, dO + ((long)b * T_ + t0) * rowv + (long)h * DV + v0, rowv);
    load_tile_async<T, C, BVt, NT>(tV, L::LT, v + ((long)b * T_ + t0) * rowv + (long)h * DV + v0, rowv);
    load_tile_async<T, C, BVt, NT>(tVn, L::LT, Vn + (bh * T_ + t0) * DV + v0, DV);
    load_tile_async<T, C, BVt, NT>(tdVn, L::LT, dVn + (bh * T_ + t0) * DV + v0, DV);
    load_tile_async<T, DK, BVt, NT>(tH, L::LT, Hs + (bh * N + c) * DK * DV + v0, DV);
    load_tile_async<T, DK, BVt, NT>(tdH, L::LT, dHs + (bh * N + c) * DK * DV + v0, DV);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    const bool acc = v0 > 0;
    gemm<T, C, DK, BVt, false, true, NW>(tdO, L::LT, tH, L::LT, F1, L::LF, acc);    // dO Hᵀ
    gemm<T, C, DK, BVt, false, true, NW>(tVn, L::LT, tdH, L::LT, F2, L::LF, acc);   // V_new dH'ᵀ
    gemm<T, C, DK, BVt, false, true, NW>(tdVn, L::LT, tH, L::LT, F3, L::LF, acc);   // dV_new Hᵀ
    gemm<T, C, C, BVt, false, true, NW>(tdO, L::LT, tVn, L::LT, M1, L::LM, acc);    // dO V_newᵀ
    gemm<T, C, C, BVt, false, true, NW>(tdVn, L::LT, tV, L::LT, M2, L::LM, acc);    // dV_new Vᵀ
    gemm<T, C, BVt, C, true, false, NW>(Tb, L::LTb, tdVn, L::LT, tY, L::LY, false);  // Tᵀ dV_new
    for (int i = tid; i < DK * BVt; i += NT) {
      const int r = i / BVt, j = i % BVt;
      hs += to_f(tH[r * L::LT + j]) * to_f(tdH[r * L::LT + j]);
    }
    __syncthreads();
    {
      constexpr int W4 = BVt / RG;
      float s = 0.f;
      const float br = sB[rq];
      T* dvr = dv + ((long)b * T_ + t0 + rq) * rowv + (long)h * DV + v0;
      for (int j = part * W4; j < (part + 1) * W4; ++j) {
        const float y = tY[rq * L::LY + j];
        s += to_f(tV[rq * L::LT + j]) * y;
        dvr[j] = from_f<T>(br * y);
      }
      s = group_sum<RG>(s);
      if (part == 0) sDB[rq] += s;
    }
    __syncthreads();
  }
  }
  // <dH', H> over the block
  {
    float x = hs;
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    if (tid % 32 == 0) sRed[tid / 32] = x;
  }
  load_tile_async<T, C, DK, NT>(sQ, L::LK, q + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
  load_tile_async<T, C, DK, NT>(sK, L::LK, k + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  const float gl = sG[C - 1];
  // (a) dQi = scale e^G ⊙ F1, dKs = e^{G_C−G} ⊙ F2, dW = −F3 (as T); dG += Σ Q⊙dQi − Σ K⊙dKs
  {
    constexpr int W4 = DK / RG;
    const float s1 = scale * expf(sG[rq]), s2 = expf(gl - sG[rq]);
    float a1 = 0.f, a2 = 0.f;
    for (int j = part * W4; j < (part + 1) * W4; ++j) {
      const float x1 = F1[rq * L::LF + j] * s1, x2 = F2[rq * L::LF + j] * s2;
      F1[rq * L::LF + j] = x1;
      F2[rq * L::LF + j] = x2;
      a1 += to_f(sQ[rq * L::LK + j]) * x1;
      a2 += to_f(sK[rq * L::LK + j]) * x2;
      sXb[rq * L::LK + j] = from_f<T>(-F3[rq * L::LF + j]);
    }
    a1 = group_sum<RG>(a1);
    a2 = group_sum<RG>(a2);
    if (part == 0) {
      sDG[rq] += a1 - a2;
      sKD[rq] = a2;
    }
  }
  __syncthreads();
  if (stop == 1) return;  // timing experiments (CARRY_GDN_CHUNK_STOP)
  // (b) F3 <- Q Kᵀ (scratch C×C)
  gemm<T, C, C, DK, false, true, NW>(sQ, L::LK, sK, L::LK, F3, L::LF, false);
  __syncthreads();
  // (c) P = scale QKᵀ⊙Γ (causal); dP = M1 (causal); F3 <- dP⊙P; Mb1 <- dP⊙Γ·scale; dG_r += Σ_s dP⊙P
  {
    constexpr int W4 = C / RG;
    const float gr = sG[rq];
    float a = 0.f;
    for (int s = part * W4; s < (part + 1) * W4; ++s) {
      const bool in = s <= rq;
      const float gam = in ? expf(gr - sG[s]) : 0.f;
      const float p = scale * F3[rq * L::LF + s] * gam;
      const float dp = in ? M1[rq * L::LM + s] : 0.f;
      const float x = dp * p;
      F3[rq * L::LF + s] = x;
      a += x;
      Mb1[rq * L::LTb + s] = from_f<T>(dp * gam * scale);
    }
    a = group_sum<RG>(a);
    if (part == 0) sDG[rq] += a;
  }
  __syncthreads();
  // (d) column sums of dP⊙P; dq = dQi + dPs K; dk = dKs + dPsᵀ Q
  {
    constexpr int W4 = C / RG;
    float a = 0.f;
    for (int r = part * W4; r < (part + 1) * W4; ++r) a += F3[r * L::LF + rq];
    a = group_sum<RG>(a);
    if (part == 0) sDG[rq] -= a;
  }
  gemm<T, C, DK, C, false, false, NW>(Mb1, L::LTb, sK, L::LK, F1, L::LF, true);
  gemm<T, C, DK, C, true, false, NW>(Mb1, L::LTb, sQ, L::LK, F2, L::LF, true);
  __syncthreads();
  if (stop == 2) return;  // timing experiments (CARRY_GDN_CHUNK_STOP)
  // (e) write dq; F3 <- X = Tᵀ dW; F1 <- dW Kᵀ (scratch C×C)
  store_tile<T, C, DK, NT>(dq + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk, F1, L::LF);
  __syncthreads();
  gemm<T, C, DK, C, true, false, NW>(Tb, L::LTb, sXb, L::LK, F3, L::LF, false);
  gemm<T, C, C, DK, false, true, NW>(sXb, L::LK, sK, L::LK, F1, L::LF, false);
  __syncthreads();
  // (f) dT = β_s (M2 + e^{G_s} dW Kᵀ) -> Mb1; dk += β e^G X; dβ += e^G Σ K⊙X; dG += β e^G Σ K⊙X
  for (int i = tid; i < C * C; i += NT) {
    const int r = i / C, s = i % C;
    Mb1[r * L::LTb + s] = from_f<T>(sB[s] * (M2[r * L::LM + s] + expf(sG[s]) * F1[r * L::LF + s]));
  }
  {
    constexpr int W4 = DK / RG;
    const float eg = expf(sG[rq]), be = sB[rq] * eg;
    float a = 0.f;
    for (int j = part * W4; j < (part + 1) * W4; ++j) {
      const float x = F3[rq * L::LF + j];
      F2[rq * L::LF + j] += be * x;
      a += to_f(sK[rq * L::LK + j]) * x;
    }
    a = group_sum<RG>(a);
    if (part == 0) {
      sDB[rq] += eg * a;
      sDG[rq] += be * a;
    }
  }
  __syncthreads();
  if (stop == 3) return;  // timing experiments (CARRY_GDN_CHUNK_STOP)
  // (g) Z = Tᵀ dT; dA = −Z Tᵀ (strictly lower); KK = K Kᵀ
  gemm<T, C, C, C, true, false, NW>(Tb, L::LTb, Mb1, L::LTb, F1, L::LF, false);
  __syncthreads();
  for (int i = tid; i < C * C; i += NT) Mb2[(i / C) * L::LTb + i % C] = from_f<T>(F1[(i / C) * L::LF + i % C]);
  __syncthreads();
  gemm<T, C, C, C, false, true, NW>(Mb2, L::LTb, Tb, L::LTb, M1, L::LM, false);
  gemm<T, C, C, DK, false, true, NW>(sK, L::LK, sK, L::LK, F1, L::LF, false);
  __syncthreads();
  // (h) D = dA⊙Γ; dβ += Σ_s D⊙KK; dAA = dA⊙A (A = β KK⊙Γ) -> M1, row sums to dG; Mb1 <- β D
  {
    constexpr int W4 = C / RG;
    const float gr = sG[rq], br = sB[rq];
    float ab = 0.f, ag = 0.f;
    for (int s = part * W4; s < (part + 1) * W4; ++s) {
      const bool in = s < rq;
      const float gam = in ? expf(gr - sG[s]) : 0.f;
      const float da = in ? -M1[rq * L::LM + s] : 0.f;
      const float kk = F1[rq * L::LF + s];
      const float d = da * gam;
      ab += d * kk;
      const float x = da * br * kk * gam;
      ag += x;
      M1[rq * L::LM + s] = x;
      Mb1[rq * L::LTb + s] = from_f<T>(br * d);
    }
    ab = group_sum<RG>(ab);
    ag = group_sum<RG>(ag);
    if (part == 0) {
      sDB[rq] += ab;
      sDG[rq] += ag;
    }
  }
  __syncthreads();
  // (i) column sums of dA⊙A; dk += (βD) K + (βD)ᵀ K
  {
    constexpr int W4 = C / RG;
    float a = 0.f;
    for (int r = part * W4; r < (part + 1) * W4; ++r) a += M1[r * L::LM + rq];
    a = group_sum<RG>(a);
    if (part == 0) sDG[rq] -= a;
  }
  gemm<T, C, DK, C, false, false, NW>(Mb1, L::LTb, sK, L::LK, F2, L::LF, true);
  gemm<T, C, DK, C, true, false, NW>(Mb1, L::LTb, sK, L::LK, F2, L::LF, true);
  __syncthreads();
  if (stop == 4) return;  // timing experiments (CARRY_GDN_CHUNK_STOP)
  // (j) write dk, dβ; dG at the chunk's last token gets Σ kd + e^{G_C}<dH', H>; dg = reverse cumsum
  store_tile<T, C, DK, NT>(dk + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk, F2, L::LF);
  if (tid < C) dbeta[((long)b * T_ + t0 + tid) * H + h] = sDB[tid];
  if (dg) {
    if (tid < 32) {
      finish_dg<NW>(sDG, sKD, sCS, sRed, gl, dg + ((long)b * T_ + t0) * H + h, H);
    }
  }
}

// 3b. bf16: the chunk-local gradients with every C×dk and C×C intermediate in mma.sync registers.
// Sixteen warps; warp w owns rows m0 = 16·(w%4) of every product, columns (w/4)·dk/4 .. of the
// C×dk ones (F1 = dO Hᵀ → dq, F2 = V_new dH'ᵀ → dk, F3 = dV_new Hᵀ = −dW, X = Tᵀ dW) and
// (w/4)·16 .. of the C×C ones (M1 = dO V_newᵀ, M2 = dV_new Vᵀ, QKᵀ, dW Kᵀ, Tᵀ dT, dA, KKᵀ), the
// layout of gemm_rb64, so a product's fragments meet the ones they combine with in the same
// registers. Shared memory holds only the bf16 operands (Q, K, T, −F3 and two C×C matrices) and the
// phase-1 tiles, which are double-buffered so the next dv tile loads while this one multiplies; Q
// and K load with the first tile. Row and column sums go through small per-warp partial arrays and
// are added in a fixed order (same bits run to run and wherever the sequence is cut). The earlier
// version kept F1..F3, M1, M2 in fp32 shared memory (220 KB) with a block barrier around each of
// about 20 passes over them. Without a gate (DeltaNet) the sums only dG needs are skipped, and with
// them QKᵀ (P enters dG alone; dq and dk take dP⊙Γ).
template <int DK, int BVt>
struct ChunkRegSmem {
  static constexpr int C = kChunk, P = 8;
  static constexpr int LTb = C + P, LT = BVt + P, LK = DK + P;
  static constexpr int kRowSlots = 7, kColSlots = 2;  // see RowSlot
  static constexpr size_t oTb = 0;
  static constexpr size_t oSmall = al128(oTb + C * LTb * 2);  // G, B, red[32], rowp, colp
  static constexpr size_t oQ = al128(oSmall + (2 * C + 32 + (kRowSlots + kColSlots) * 4 * C) * 4);
  static constexpr size_t oK = al128(oQ + C * LK * 2);
  static constexpr size_t oR = al128(oK + C * LK * 2);
  // phase 1: two buffers of dO, V, V_new, dV_new [C][BVt] and H, dH' [DK][BVt]
  static constexpr size_t oDO = 0, oV = al128(C * LT * 2), oVn = 2 * oV, odVn = 3 * oV, oH = 4 * oV;
  static constexpr size_t odH = al128(oH + DK * LT * 2);
  static constexpr size_t buf = al128(odH + DK * LT * 2);
  // phase 2 (over the phase-1 buffers): −F3 as bf16 [C][DK], Mb1, Mb2 [C][C]
  static constexpr size_t oXb = oR;
  static constexpr size_t oMb1 = al128(oXb + C * LK * 2);
  static constexpr size_t oMb2 = al128(oMb1 + C * LTb * 2);
  static constexpr size_t end2 = oMb2 + C * LTb * 2;
  static constexpr size_t end1 = oR + 2 * buf;
  static constexpr size_t bytes = end1 > end2 ? end1 : end2;
};
enum RowSlot { kRowDB1, kRowA1, kRowA2, kRowC, kRowF, kRowH1, kRowH2 };

template <int DK, int DV>
__global__ void __launch_bounds__(512) bwd_chunk_reg_kernel(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ Gc,
    const float* __restrict__ beta, const bf16* __restrict__ Tm, const bf16* __restrict__ Hs,
    const bf16* __restrict__ dHs, const bf16* __restrict__ Vn, const bf16* __restrict__ dVn,
    const bf16* __restrict__ dO, bf16* __restrict__ dq, bf16* __restrict__ dk, bf16* __restrict__ dv,
    float* __restrict__ dg, float* __restrict__ dbeta, float scale, int T_, int H, int c_off) {
  constexpr int C = kChunk, NW = 16, NT = NW * 32, BVt = 64, NTILE = DV / BVt;
  constexpr int FN = DK / 32, MN = 2;  // n8-tiles a warp owns: C×dk products, C×C products
  static_assert(DV % BVt == 0 && FN % 2 == 0, "chunk kernel tiling");
  using L = ChunkRegSmem<DK, BVt>;
  extern __shared__ __align__(128) char smem[];
  bf16* Tb = reinterpret_cast<bf16*>(smem + L::oTb);
  float* sG = reinterpret_cast<float*>(smem + L::oSmall);
  float* sB = sG + C;
  float* sRed = sB + C;
  float* rowp = sRed + 32;                       // [kRowSlots][4 column groups][C]
  float* colp = rowp + L::kRowSlots * 4 * C;     // [kColSlots][4 row groups][C]
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::oQ);
  bf16* sK = reinterpret_cast<bf16*>(smem + L::oK);
  bf16* sXb = reinterpret_cast<bf16*>(smem + L::oXb);
  bf16* Mb1 = reinterpret_cast<bf16*>(smem + L::oMb1);
  bf16* Mb2 = reinterpret_cast<bf16*>(smem + L::oMb2);

  const int c = c_off + blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const bool gated = dg != nullptr;  // Gated DeltaNet: dG and the row and column sums only it needs
  const int N = T_ / C;
  const long t0 = (long)c * C, bh = (long)b * H + h, rowk = (long)H * DK, rowv = (long)H * DV;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int rg = warp & 3, cg = warp >> 2, m0 = rg * 16, fh = cg * (DK / 4), mh = cg * 16;
  const int r0 = m0 + g, r1 = r0 + 8;

  auto load_tiles = [&](int v0, int bi) {
    char* base = smem + L::oR + bi * L::buf;
    load_tile_async<bf16, C, BVt, NT>(reinterpret_cast<bf16*>(base + L::oDO), L::LT,
                                      dO + ((long)b * T_ + t0) * rowv + (long)h * DV + v0, rowv);
    load_tile_async<bf16, C, BVt, NT>(reinterpret_cast<bf16*>(base + L::oV), L::LT,
                                      v + ((long)b * T_ + t0) * rowv + (long)h * DV + v0, rowv);
    load_tile_async<bf16, C, BVt, NT>(reinterpret_cast<bf16*>(base + L::oVn), L::LT, Vn + (bh * T_ + t0) * DV + v0, DV);
    load_tile_async<bf16, C, BVt, NT>(reinterpret_cast<bf16*>(base + L::odVn), L::LT, dVn + (bh * T_ + t0) * DV + v0,
                                      DV);
    load_tile_async<bf16, DK, BVt, NT>(reinterpret_cast<bf16*>(base + L::oH), L::LT,
                                       Hs + (bh * N + c) * DK * DV + v0, DV);
    load_tile_async<bf16, DK, BVt, NT>(reinterpret_cast<bf16*>(base + L::odH), L::LT,
                                       dHs + (bh * N + c) * DK * DV + v0, DV);
    cp_async_commit();
  };
  // G and β are read into registers first and stored after the tiles' copies are issued: one memory
  // latency for all of them. T comes saved in bf16 (the forward's rounding of its fp32 inverse, the
  // operand this kernel multiplies by) and loads with Q and K. (Saved in fp32 and converted here, T's
  // waits took 11% of this kernel's warp-stall samples at H=16, 131072 tokens on an H200 while it was
  // read a float4 at a time after the copies.)
  float gv = 0.f, bv = 0.f;
  if (tid < C) {
    gv = Gc[bh * T_ + t0 + tid];
    bv = beta[((long)b * T_ + t0 + tid) * H + h];
  }
  load_tile_async<bf16, C, C, NT>(Tb, L::LTb, Tm + (bh * N + c) * C * C, C);
  load_tile_async<bf16, C, DK, NT>(sQ, L::LK, q + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
  load_tile_async<bf16, C, DK, NT>(sK, L::LK, k + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
  cp_async_commit();
  load_tiles(0, 0);
  if (NTILE > 1) load_tiles(BVt, 1);
  if (tid < C) {
    sG[tid] = gv;
    sB[tid] = bv;
  }
  // This warp's partial of a per-row sum (its rows r0, r1, over its columns) into rowp[slot][cg].
  auto row_put = [&](int slot, float x0, float x1) {
    x0 = quad_sum(x0);
    x1 = quad_sum(x1);
    if (t4 == 0) {
      rowp[(slot * 4 + cg) * C + r0] = x0;
      rowp[(slot * 4 + cg) * C + r1] = x1;
    }
  };
  auto row_get = [&](int slot, int r) {
    const float* p = rowp + slot * 4 * C + r;
    return ((p[0] + p[C]) + p[2 * C]) + p[3 * C];
  };
  // This warp's partial of the column sums of a C×C fragment (its 16 rows) into colp[slot][rg].
  auto col_put = [&](int slot, const float (&x)[MN][4]) {
#pragma unroll
    for (int nt = 0; nt < MN; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float s = x[nt][j] + x[nt][2 + j];
        s += __shfl_xor_sync(0xffffffffu, s, 4);
        s += __shfl_xor_sync(0xffffffffu, s, 8);
        s += __shfl_xor_sync(0xffffffffu, s, 16);
        if (g == 0) colp[(slot * 4 + rg) * C + mh + nt * 8 + 2 * t4 + j] = s;
      }
    }
  };
  auto col_get = [&](int slot, int s) {
    const float* p = colp + slot * 4 * C + s;
    return ((p[0] + p[C]) + p[2 * C]) + p[3 * C];
  };
  // A C×C fragment's n8-tile nt into Mb1 in bf16, two columns a 32-bit store (16-bit stores, one an
  // element, were twice the shared-memory store instructions).
  auto mb1_put = [&](int nt, const float (&x)[4]) {
    const int col = mh + nt * 8 + 2 * t4;
    *reinterpret_cast<unsigned*>(Mb1 + r0 * L::LTb + col) = tc::pack_bf16(x[0], x[1]);
    *reinterpret_cast<unsigned*>(Mb1 + r1 * L::LTb + col) = tc::pack_bf16(x[2], x[3]);
  };

  // Phase 1: F1..F3, M1, M2 over the dv tiles; dv = β ⊙ Tᵀ dV_new per tile.
  float f1[FN][4] = {}, f2[FN][4] = {}, f3[FN][4] = {}, m1[MN][4] = {}, m2[MN][4] = {};
  float db[2] = {0.f, 0.f}, hs = 0.f;
  for (int it = 0; it < NTILE; ++it) {
    const int v0 = it * BVt;
    const char* base = smem + L::oR + (it & 1) * L::buf;
    const bf16* tdO = reinterpret_cast<const bf16*>(base + L::oDO);
    const bf16* tV = reinterpret_cast<const bf16*>(base + L::oV);
    const bf16* tVn = reinterpret_cast<const bf16*>(base + L::oVn);
    const bf16* tdVn = reinterpret_cast<const bf16*>(base + L::odVn);
    const bf16* tH = reinterpret_cast<const bf16*>(base + L::oH);
    const bf16* tdH = reinterpret_cast<const bf16*>(base + L::odH);
    if (it + 1 < NTILE) cp_async_wait<1>();
    else cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int k0 = 0; k0 < BVt; k0 += 16) {
      tc::u32 aO[4], aVn[4], adVn[4];
      tc::load_a(aO, tdO, L::LT, m0, k0);
      tc::load_a(aVn, tVn, L::LT, m0, k0);
      tc::load_a(adVn, tdVn, L::LT, m0, k0);
#pragma unroll
      for (int np = 0; np < FN / 2; ++np) {
        tc::u32 bH[4], bdH[4];
        tc::load_b2(bH, tH, L::LT, k0, fh + np * 16);
        tc::load_b2(bdH, tdH, L::LT, k0, fh + np * 16);
        tc::mma16816(f1[2 * np], aO, bH[0], bH[1]);
        tc::mma16816(f1[2 * np + 1], aO, bH[2], bH[3]);
        tc::mma16816(f3[2 * np], adVn, bH[0], bH[1]);
        tc::mma16816(f3[2 * np + 1], adVn, bH[2], bH[3]);
        tc::mma16816(f2[2 * np], aVn, bdH[0], bdH[1]);
        tc::mma16816(f2[2 * np + 1], aVn, bdH[2], bdH[3]);
      }
      tc::u32 bVn[4], bV[4];
      tc::load_b2(bVn, tVn, L::LT, k0, mh);
      tc::load_b2(bV, tV, L::LT, k0, mh);
      tc::mma16816(m1[0], aO, bVn[0], bVn[1]);
      tc::mma16816(m1[1], aO, bVn[2], bVn[3]);
      tc::mma16816(m2[0], adVn, bV[0], bV[1]);
      tc::mma16816(m2[1], adVn, bV[2], bV[3]);
    }
    {  // Y = Tᵀ dV_new on 16 of the tile's columns; dv = β ⊙ Y; dβ += Σ V⊙Y
      float y[2][4] = {};
      frag_mma<2, C, true, false>(y, Tb, L::LTb, tdVn, L::LT, m0, mh);
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = hf ? r1 : r0;
        const float br = sB[r];
        float sacc = 0.f;
        bf16* dvr = dv + ((long)b * T_ + t0 + r) * rowv + (long)h * DV + v0;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int col = mh + nt * 8 + 2 * t4;
          const float2 vv = tc::unpack_bf16(*reinterpret_cast<const unsigned*>(tV + r * L::LT + col));
          const float y0 = y[nt][2 * hf], y1 = y[nt][2 * hf + 1];
          sacc += vv.x * y0 + vv.y * y1;
          *reinterpret_cast<unsigned*>(dvr + col) = tc::pack_bf16(br * y0, br * y1);
        }
        db[hf] += sacc;
      }
    }
#pragma unroll
    for (int i = tid; i < (gated ? DK * BVt / 2 : 0); i += NT) {  // <dH', H>
      const int r = (2 * i) / BVt, j = (2 * i) % BVt;
      const float2 a = tc::unpack_bf16(*reinterpret_cast<const unsigned*>(tH + r * L::LT + j));
      const float2 d = tc::unpack_bf16(*reinterpret_cast<const unsigned*>(tdH + r * L::LT + j));
      hs += a.x * d.x + a.y * d.y;
    }
    __syncthreads();
    if (it + 2 < NTILE) load_tiles(v0 + 2 * BVt, it & 1);
  }
  row_put(kRowDB1, db[0], db[1]);
  if (gated) {
    float x = hs;
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    if (lane == 0) sRed[warp] = x;
  }
  // The phase-1 buffers are free (the loop ended on a barrier): −F3 goes to Xb.
  const float gl = sG[C - 1];
  // (a) dQi = scale e^G ⊙ F1, dKs = e^{G_C−G} ⊙ F2; row sums Σ Q⊙dQi, Σ K⊙dKs; Xb = dW = −F3
  {
    float a1[2] = {0.f, 0.f}, a2[2] = {0.f, 0.f};
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = hf ? r1 : r0;
      const float s1 = scale * __expf(sG[r]), s2 = __expf(gl - sG[r]);
#pragma unroll
      for (int nt = 0; nt < FN; ++nt) {
        const int col = fh + nt * 8 + 2 * t4;
        const float x0 = f1[nt][2 * hf] * s1, x1 = f1[nt][2 * hf + 1] * s1;
        const float y0 = f2[nt][2 * hf] * s2, y1 = f2[nt][2 * hf + 1] * s2;
        f1[nt][2 * hf] = x0;
        f1[nt][2 * hf + 1] = x1;
        f2[nt][2 * hf] = y0;
        f2[nt][2 * hf + 1] = y1;
        if (gated) {
          const float2 qq = tc::unpack_bf16(*reinterpret_cast<const unsigned*>(sQ + r * L::LK + col));
          const float2 kk = tc::unpack_bf16(*reinterpret_cast<const unsigned*>(sK + r * L::LK + col));
          a1[hf] += qq.x * x0 + qq.y * x1;
          a2[hf] += kk.x * y0 + kk.y * y1;
        }
        *reinterpret_cast<unsigned*>(sXb + r * L::LK + col) = tc::pack_bf16(-f3[nt][2 * hf], -f3[nt][2 * hf + 1]);
      }
    }
    if (gated) {
      row_put(kRowA1, a1[0], a1[1]);
      row_put(kRowA2, a2[0], a2[1]);
    }
  }
  // (b, c) P = scale QKᵀ⊙Γ (causal), dP = M1 (causal): Mb1 = dP⊙Γ·scale; sums of dP⊙P by row and column
  {
    float p[MN][4] = {};
    if (gated) frag_mma<MN, DK, false, true>(p, sQ, L::LK, sK, L::LK, m0, mh);
    float ra[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < MN; ++nt) {
      float mv[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e < 2 ? r0 : r1, s = mh + nt * 8 + 2 * t4 + (e & 1);
        const bool in = s <= r;
        const float gam = in ? __expf(sG[r] - sG[s]) : 0.f;
        const float dp = in ? m1[nt][e] : 0.f;
        const float x = dp * (scale * p[nt][e] * gam);
        p[nt][e] = x;
        ra[e >> 1] += x;
        mv[e] = dp * gam * scale;
      }
      mb1_put(nt, mv);
    }
    if (gated) {
      row_put(kRowC, ra[0], ra[1]);
      col_put(0, p);
    }
  }
  __syncthreads();
  // (d) dq = dQi + (dP⊙Γ·scale) K, written; dk = dKs + (dP⊙Γ·scale)ᵀ Q
  frag_mma<FN, C, false, false>(f1, Mb1, L::LTb, sK, L::LK, m0, fh);
  frag_mma<FN, C, true, false>(f2, Mb1, L::LTb, sQ, L::LK, m0, fh);
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    bf16* dqr = dq + ((long)b * T_ + t0 + (hf ? r1 : r0)) * rowk + (long)h * DK;
#pragma unroll
    for (int nt = 0; nt < FN; ++nt)
      *reinterpret_cast<unsigned*>(dqr + fh + nt * 8 + 2 * t4) = tc::pack_bf16(f1[nt][2 * hf], f1[nt][2 * hf + 1]);
  }
  // (e) X = Tᵀ dW, dW Kᵀ
  float x[FN][4] = {}, w[MN][4] = {};
  frag_mma<FN, C, true, false>(x, Tb, L::LTb, sXb, L::LK, m0, fh);
  frag_mma<MN, DK, false, true>(w, sXb, L::LK, sK, L::LK, m0, mh);
  __syncthreads();  // every warp is done reading Mb1
  // (f) dT = β_s (M2 + e^{G_s} dW Kᵀ) -> Mb1; dk += β e^G X; Σ K⊙X by row (dβ, dG)
  {
#pragma unroll
    for (int nt = 0; nt < MN; ++nt) {
      float mv[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int s = mh + nt * 8 + 2 * t4 + (e & 1);
        mv[e] = sB[s] * (m2[nt][e] + __expf(sG[s]) * w[nt][e]);
      }
      mb1_put(nt, mv);
    }
    float a[2] = {0.f, 0.f};
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = hf ? r1 : r0;
      const float be = sB[r] * __expf(sG[r]);
#pragma unroll
      for (int nt = 0; nt < FN; ++nt) {
        const int col = fh + nt * 8 + 2 * t4;
        const float2 kk = tc::unpack_bf16(*reinterpret_cast<const unsigned*>(sK + r * L::LK + col));
        const float x0 = x[nt][2 * hf], x1 = x[nt][2 * hf + 1];
        f2[nt][2 * hf] += be * x0;
        f2[nt][2 * hf + 1] += be * x1;
        a[hf] += kk.x * x0 + kk.y * x1;
      }
    }
    row_put(kRowF, a[0], a[1]);
  }
  __syncthreads();
  // (g) Z = Tᵀ dT -> Mb2; dA = −Z Tᵀ (strictly lower); KK = K Kᵀ
  {
    float z[MN][4] = {};
    frag_mma<MN, C, true, false>(z, Tb, L::LTb, Mb1, L::LTb, m0, mh);
#pragma unroll
    for (int nt = 0; nt < MN; ++nt) {
      const int col = mh + nt * 8 + 2 * t4;
      *reinterpret_cast<unsigned*>(Mb2 + r0 * L::LTb + col) = tc::pack_bf16(z[nt][0], z[nt][1]);
      *reinterpret_cast<unsigned*>(Mb2 + r1 * L::LTb + col) = tc::pack_bf16(z[nt][2], z[nt][3]);
    }
  }
  float kk[MN][4] = {};
  frag_mma<MN, DK, false, true>(kk, sK, L::LK, sK, L::LK, m0, mh);
  __syncthreads();  // Mb2 written, Mb1 read
  // (h) D = dA⊙Γ; dβ += Σ_s D⊙KK; dAA = dA⊙A (A = β KK⊙Γ): sums by row and column; Mb1 <- β D
  {
    float za[MN][4] = {};
    frag_mma<MN, C, false, true>(za, Mb2, L::LTb, Tb, L::LTb, m0, mh);
    float ab[2] = {0.f, 0.f}, ag[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < MN; ++nt) {
      float mv[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e < 2 ? r0 : r1, s = mh + nt * 8 + 2 * t4 + (e & 1);
        const bool in = s < r;
        const float br = sB[r];
        const float gam = in ? __expf(sG[r] - sG[s]) : 0.f;
        const float da = in ? -za[nt][e] : 0.f;
        const float d = da * gam;
        ab[e >> 1] += d * kk[nt][e];
        const float xa = da * br * kk[nt][e] * gam;
        ag[e >> 1] += xa;
        za[nt][e] = xa;
        mv[e] = br * d;
      }
      mb1_put(nt, mv);
    }
    row_put(kRowH1, ab[0], ab[1]);
    if (gated) {
      row_put(kRowH2, ag[0], ag[1]);
      col_put(1, za);
    }
  }
  __syncthreads();
  // (i) dk += (βD) K + (βD)ᵀ K, written
  frag_mma<FN, C, false, false>(f2, Mb1, L::LTb, sK, L::LK, m0, fh);
  frag_mma<FN, C, true, false>(f2, Mb1, L::LTb, sK, L::LK, m0, fh);
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    bf16* dkr = dk + ((long)b * T_ + t0 + (hf ? r1 : r0)) * rowk + (long)h * DK;
#pragma unroll
    for (int nt = 0; nt < FN; ++nt)
      *reinterpret_cast<unsigned*>(dkr + fh + nt * 8 + 2 * t4) = tc::pack_bf16(f2[nt][2 * hf], f2[nt][2 * hf + 1]);
  }
  // (j) dβ; dG per token, the chunk's last token gets Σ kd + e^{G_C}<dH', H>; dg = reverse cumsum
  float* sDG = reinterpret_cast<float*>(Mb2);  // Mb2 is read by no one after (h)
  float* sKD = sDG + C;
  if (tid < C) {
    const int r = tid;
    const float eg = __expf(sG[r]);
    dbeta[((long)b * T_ + t0 + r) * H + h] = (row_get(kRowDB1, r) + eg * row_get(kRowF, r)) + row_get(kRowH1, r);
    if (gated) {
      const float a2 = row_get(kRowA2, r);
      float x = row_get(kRowA1, r) - a2;
      x += row_get(kRowC, r);
      x -= col_get(0, r);
      x += sB[r] * eg * row_get(kRowF, r);
      x += row_get(kRowH2, r);
      x -= col_get(1, r);
      sDG[r] = x;
      sKD[r] = a2;
    }
  }
  if (!gated) return;
  __syncthreads();
  if (tid < 32) {
    float* sCS = sKD + C;
    finish_dg<NW>(sDG, sKD, sCS, sRed, gl, dg + ((long)b * T_ + t0) * H + h, H);
  }
}

// The chunk-gradient kernel's phase count to run, 0 = all of them (a nonzero value ends it early, for
// timing one phase in a profiling build; gradients are then wrong). Not read from the environment.
int chunk_stop() { return 0; }

struct BwdArgs {
  Dims d;
  at::Tensor q, k, v, beta, W, Gc, Tm, Hs, Vn, dO;
  float scale;
  const float* dSfin;
  at::Tensor dVl, dHs, dVn, dS0;        // recurrence outputs
  at::Tensor dq, dk, dv, dg, dbeta;     // chunk-kernel outputs (dg undefined: DeltaNet)
  // MixerOptions::on_initial_state_grad: called with dS0 once the reverse walk is enqueued.
  std::function<void(const at::Tensor&)> on_s0_grad;
};

// The bf16 intra-chunk dV (bwd_dv_local_reg_kernel) of chunks [c0, c1) on stream st; scaled_q: it also
// leaves Q̃ = scale·e^G ⊙ Q in dq's memory for the warpgroup reverse walk (the chunk-gradient kernel,
// which writes dq, runs on a chunk only after the walk has passed it).
template <int DK, int DV>
void dv_local_reg(const BwdArgs& a, cudaStream_t st, int c0, int c1, bool scaled_q) {
  auto kern = bwd_dv_local_reg_kernel<DK, DV>;
  constexpr size_t sm = DvRegSmem<DK>::bytes;
  carry::kernels::primitives::allow_smem(kern, sm);
  auto P = [](const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); };
  kern<<<dim3(c1 - c0, a.d.H, a.d.B), 256, sm, st>>>(P(a.q), P(a.k), a.Gc.data_ptr<float>(), P(a.dO),
                                                      a.dVl.data_ptr<float>(),
                                                      scaled_q ? reinterpret_cast<bf16*>(a.dq.data_ptr()) : nullptr,
                                                      a.scale, a.d.T, a.d.H, c0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// bf16: the reverse recurrence (bwd_state_mma_kernel, BV = 16 and 4 warps, or 32 and 8 where
// wide_state_tiles says so) and the chunk-gradient
// kernel. When the recurrence's tiles leave at least half the SMs idle (few heads), it walks the
// chunks in pieces (consecutive launches on one stream, the state gradient handed on through fp32
// memory: the same operations and bits as one walk), and the chunk-gradient kernel of each finished
// piece runs on a second stream on the SMs the recurrence leaves idle while the next piece walks; the
// caller's stream then waits for the last one. Otherwise one walk, then the chunk-gradient kernel
// over every chunk. (The timeline of a run: CARRY_GDN_TIMELINE=1, launch.h.)
// own_dv: the intra-chunk dV is not computed yet, bwd_pieces runs it too: piece by piece on a stream
// of its own in the walk's order when the walk is in pieces with wide state tiles or ramped pieces
// (the first piece's alone, the others beside the walk, whose first piece would otherwise leave the
// SMs it does not use idle; with narrow tiles two pieces ahead of the walk), else before the walk.
// WG: the walk is wg::bwd_walk_wg (walk_wg.cuh; dk = 128, 32 columns, one warpgroup) instead of
// bwd_state_mma_kernel<BV, NW>.
template <int DK, int DV, int BV = 16, int NW = 4, bool WG = false>
bool bwd_pieces(BwdArgs& a, bool own_dv = false) {
  static_assert(!WG || (DK == wg::kDK && BV == wg::kBV), "the warpgroup walk takes dk = 128 in 32-column tiles");
  auto stream = at::cuda::getCurrentCUDAStream();
  const Dims& d = a.d;
  auto P = [](const at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); };
  // two warpgroups a block buffer two chunks (three would not fit in shared memory)
  const int nwg = WG ? walk_warpgroups(d, true) : 1;
  const size_t ssm = !WG ? BwdStateMmaSmem<DK, BV, kBwdStateStages>::bytes
                     : nwg == 2 ? size_t(wg::BwdSmem<2, 2>::bytes)
                                : size_t(wg::BwdSmem<1, wg::kWalkStages>::bytes);
  CUtensorMap tmQ{}, tmK{}, tmW{}, tmdO{}, tmdVl{}, tmG{}, tmH{}, tmV{};
  const bool bulk = walk_bulk_stores();
  // DeltaNet (no gate, dg undefined) walks without the gate's reads and unit factors (the same bits)
  constexpr int S = wg::kWalkStages;
  const bool gate = a.dg.defined();
  auto wkern = nwg == 2 ? (gate ? wg::bwd_walk_wg<DV, true, 2, 2, true> : wg::bwd_walk_wg<DV, true, 2, 2, false>)
               : bulk   ? (gate ? wg::bwd_walk_wg<DV, true, 1, S, true> : wg::bwd_walk_wg<DV, true, 1, S, false>)
                        : wg::bwd_walk_wg<DV, false>;
  if constexpr (WG) {
    const long rows = (long)d.B * d.H * d.T;
    wg::check_coords(rows);
    tmQ = wg::map_tokens(P(a.dq), d.B, d.T, d.H);  // Q̃, which the intra-chunk dV kernel left in dq
    tmK = wg::map_tokens(P(a.k), d.B, d.T, d.H);
    tmW = wg::map_w(P(a.W), rows);
    tmdO = wg::map_do(P(a.dO), d.B, d.T, d.H, DV);
    tmdVl = wg::map_dvl(a.dVl.data_ptr<float>(), rows, DV);
    tmG = wg::map_g(a.Gc.data_ptr<float>(), rows);
    tmH = wg::map_store(P(a.dHs), (long)d.B * d.H * d.N * DK, DV, DK);
    tmV = wg::map_store(P(a.dVn), rows, DV, wg::kC);
    carry::kernels::primitives::allow_smem(wkern, ssm);
  } else {
    carry::kernels::primitives::allow_smem(bwd_state_mma_kernel<DK, DV, BV, NW, kBwdStateStages>, ssm);
  }
  auto ckern = bwd_chunk_reg_kernel<DK, DV>;
  constexpr size_t csm = ChunkRegSmem<DK, 64>::bytes;
  static_assert(csm <= kMaxSmem, "bf16 chunk kernel must fit");
  carry::kernels::primitives::allow_smem(ckern, csm);
  at::cuda::CUDAStream wst = stream;  // the walk's stream
  auto walk = [&](int c0, int c1, const float* from, float* to) {
    if constexpr (WG) {
      wkern<<<dim3(DV / (BV * nwg), d.H, d.B), 128 * nwg, ssm, wst>>>(
          tmQ, tmK, tmW, tmdO, tmdVl, tmG, tmH, tmV, from, P(a.dHs), P(a.dVn), to, d.T, d.H, c0, c1);
    } else
      bwd_state_mma_kernel<DK, DV, BV, NW, kBwdStateStages><<<dim3(DV / BV, d.H, d.B), NW * 32, ssm, wst>>>(
          P(a.q), P(a.k), P(a.W), a.Gc.data_ptr<float>(), P(a.dO), a.dVl.data_ptr<float>(), from, P(a.dHs),
          P(a.dVn), to, a.scale, d.T, d.H, c0, c1);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  auto chunks = [&](cudaStream_t st, int c0, int c1) {
    ckern<<<dim3(c1 - c0, d.H, d.B), 512, csm, st>>>(
        P(a.q), P(a.k), P(a.v), a.Gc.data_ptr<float>(), a.beta.data_ptr<float>(), P(a.Tm), P(a.Hs),
        P(a.dHs), P(a.Vn), P(a.dVn), P(a.dO), P(a.dq), P(a.dk), P(a.dv),
        a.dg.defined() ? a.dg.data_ptr<float>() : nullptr, a.dbeta.data_ptr<float>(), a.scale, d.T, d.H, c0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const Pieces pc = plan_pieces(d, (DV / (BV * nwg)) * d.H * d.B);
  // Narrow state tiles (H=4, dv=256) take the intra-chunk dV beside the walk only where the pieces ramp
  // (from 1216 chunks): at 32768 tokens beside it Gated DeltaNet ran 1.987 / 1.921 ms against 1.868 /
  // 1.829 before the walk (one H200), where the walk's pieces are too short to hide it.
  if (own_dv && !wide_state_tiles(d) && !pc.ramped) {
    dv_local_reg<DK, DV>(a, stream, 0, d.N, WG);
    own_dv = false;
  }
  if (pc.n == 1) {
    if (own_dv) dv_local_reg<DK, DV>(a, stream, 0, d.N, WG);
    walk(0, d.N, a.dSfin, a.dS0.data_ptr<float>());
    if (a.on_s0_grad) a.on_s0_grad(a.dS0);  // before the chunk kernels: a send runs beside them
    chunks(stream, 0, d.N);
    return true;
  }
  at::Tensor tmp = at::empty({2, d.B, d.H, d.DK, d.DV}, a.dS0.options());
  auto side = at::cuda::getStreamFromPool(false, a.q.device().index());
  Timeline tl("bwd", stream);
  std::vector<at::cuda::CUDAEvent> dv_done(own_dv ? pc.n : 0), reached(pc.n);
  at::cuda::CUDAStream dvs = stream;  // the intra-chunk dV's stream (own_dv)
  auto dv_piece = [&](int p) {
    tl.span("dv", p, dvs, [&] { dv_local_reg<DK, DV>(a, dvs, pc.c0(p, true), pc.c1(p, true), WG); });
    dv_done[p].record(dvs);
  };
  // Narrow tiles: the dV of piece p + 2 waits until the walk's stream has reached piece p (reached[p]:
  // its dV done, the piece before walked), so the dV blocks do not take the SMs before the walk's (one
  // piece ahead the next walk could wait for its dV). Wide tiles: every piece's dV queued at once (it
  // then held the first piece's walk back 90 µs at H=16, 16384 tokens, but throttled two ahead the
  // layer ran no faster: 9.179 / 9.214 → 9.300 / 9.264 ms at 131072 tokens, with the ramp).
  // CARRY_GDN_DV_AHEAD=n: n pieces ahead on every shape (A/B; read once; 64: all at once).
  static const int dv_ahead = static_cast<int>(env_int(
      "CARRY_GDN_DV_AHEAD", 0, 64, "the pieces from 1 to 64 the intra-chunk dV runs ahead of the reverse walk"));
  const int kDvAhead = dv_ahead > 0 ? dv_ahead : wide_state_tiles(d) ? pc.n : 2;
  if (own_dv) {
    // the walk on a high-priority stream: it then takes the SMs ahead of the pieces' dV blocks
    wst = walk_stream(stream);
    dvs = at::cuda::getStreamFromPool(false, a.q.device().index());
    join(stream, wst);
    join(stream, dvs);  // the caller's stream has produced the inputs
    for (int p = 0; p < std::min(kDvAhead, pc.n); ++p) dv_piece(p);
  }
  const float* from = a.dSfin;
  for (int p = 0; p < pc.n; ++p) {
    const int c0 = pc.c0(p, true), c1 = pc.c1(p, true);
    float* to = c0 == 0 ? a.dS0.data_ptr<float>() : tmp[p % 2].data_ptr<float>();
    if (own_dv) {
      dv_done[p].block(wst);
      reached[p].record(wst);
    }
    tl.span("walk", p, wst, [&] { walk(c0, c1, from, to); });
    from = to;
    if (c0 == 0) {  // the reverse walk's last piece: the caller's stream gets dS0
      join(wst, stream);
      if (a.on_s0_grad) a.on_s0_grad(a.dS0);
    }
    if (own_dv && p + kDvAhead < pc.n) {
      reached[p].block(dvs);
      dv_piece(p + kDvAhead);
    }
    join(wst, side);
    tl.span("chunks", p, side, [&] { chunks(side, c0, c1); });
  }
  join(side, stream);
  join(dvs, stream);
  return true;
}

// Runs the dv-local and reverse-recurrence kernels, then the chunk-gradient kernel where its
// shared memory fits (returns false otherwise: the caller uses chunk_grads in ATen).
template <typename T, int DK, int DV>
bool bwd_impl(BwdArgs& a) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const Dims& d = a.d;
  auto P = [](const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); };
  if constexpr (std::is_same<T, bf16>::value) {
    // The intra-chunk dV in pieces beside the walk (bwd_pieces' own_dv; CARRY_GDN_DV_PIECES=0: before
    // it, for A/B): the warpgroup walks with wide state tiles (wide_state_tiles, launch.h) or
    // ramped pieces (bwd_pieces decides: at H=4, dv=256 the dV kernel, 0.11 ms at 32768 tokens, ran
    // ahead of the whole walk); the mma.sync walks in 32-column tiles (wide_state_tiles). Measured
    // on an H200: see README, "Kernel forms". At H=4, dv=256 with the mma.sync walks (16-column tiles)
    // pieces gave 7.74-8.63 ms at 131072 tokens, in a build that also held a reverse-walk change
    // reverted after, against 7.40-7.47 without either.
    static const bool dv_pieces = switch_on("CARRY_GDN_DV_PIECES");
    if constexpr (DK == wg::kDK) {
      if (warpgroup_walk()) {
        if (dv_pieces) return bwd_pieces<DK, DV, wg::kBV, 4, true>(a, true);
        dv_local_reg<DK, DV>(a, stream, 0, d.N, true);
        return bwd_pieces<DK, DV, wg::kBV, 4, true>(a);
      }
    }
    if (wide_state_tiles(a.d) && dv_pieces) return bwd_pieces<DK, DV, 32, 8>(a, true);
    dv_local_reg<DK, DV>(a, stream, 0, d.N, false);
  } else {
    auto kern = bwd_dv_local_kernel<T, DK, DV>;
    size_t sm = DvSmem<T, DK>::bytes;
    carry::kernels::primitives::allow_smem(kern, sm);
    kern<<<dim3(d.N, d.H, d.B), 256, sm, stream>>>(P(a.q), P(a.k), a.Gc.data_ptr<float>(), P(a.dO),
                                                    a.dVl.data_ptr<float>(), a.scale, d.T, d.H);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  {
    auto launch = [&](auto bv, auto nw) {
      constexpr int BV = decltype(bv)::value, NW = decltype(nw)::value;
      constexpr int NBUF = sizeof(T) == 2 ? 2 : 1;
      auto kern = bwd_state_kernel<T, DK, DV, BV, NBUF, NW>;
      size_t sm = BwdStateSmem<T, DK, BV, NBUF>::bytes;
      carry::kernels::primitives::allow_smem(kern, sm);
      kern<<<dim3(DV / BV, d.H, d.B), NW * 32, sm, stream>>>(P(a.q), P(a.k), P(a.W), a.Gc.data_ptr<float>(), P(a.dO),
                                                            a.dVl.data_ptr<float>(), a.dSfin, P(a.dHs), P(a.dVn),
                                                            a.dS0.data_ptr<float>(), a.scale, d.T, d.H);
    };
    if constexpr (std::is_same<T, bf16>::value) {
      // bf16 always walks in pieces: 16-column state tiles, or 32-column tiles and 8 warps where they are
      // wide (launch.h, wide_state_tiles).
      if (!wide_state_tiles(a.d)) return bwd_pieces<DK, DV>(a);
      return bwd_pieces<DK, DV, 32, 8>(a);
    }
    using I16 = std::integral_constant<int, 16>;
    using I4 = std::integral_constant<int, 4>;
    launch(I16{}, I4{});  // fp32: the generic state kernel, 16-column tiles, 4 warps
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (a.on_s0_grad) a.on_s0_grad(a.dS0);  // before the chunk kernels: a send runs beside them
  if constexpr (std::is_same<T, bf16>::value) {
    auto kern = bwd_chunk_reg_kernel<DK, DV>;
    constexpr size_t sm = ChunkRegSmem<DK, 64>::bytes;
    static_assert(sm <= kMaxSmem, "bf16 chunk kernel must fit");
    carry::kernels::primitives::allow_smem(kern, sm);
    kern<<<dim3(d.N, d.H, d.B), 512, sm, stream>>>(
        P(a.q), P(a.k), P(a.v), a.Gc.data_ptr<float>(), a.beta.data_ptr<float>(), P(a.Tm), P(a.Hs),
        P(a.dHs), P(a.Vn), P(a.dVn), P(a.dO), P(a.dq), P(a.dk), P(a.dv),
        a.dg.defined() ? a.dg.data_ptr<float>() : nullptr, a.dbeta.data_ptr<float>(), a.scale, d.T, d.H, 0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
  } else {
    constexpr int BVt = 16, NWC = 8;  // fp32: FMA products on shared tiles
    if constexpr (ChunkSmem<T, DK, BVt>::bytes <= kMaxSmem) {
      auto kern = bwd_chunk_kernel<T, DK, DV, BVt, NWC>;
      size_t sm = ChunkSmem<T, DK, BVt>::bytes;
      carry::kernels::primitives::allow_smem(kern, sm);
      kern<<<dim3(d.N, d.H, d.B), NWC * 32, sm, stream>>>(
          P(a.q), P(a.k), P(a.v), a.Gc.data_ptr<float>(), a.beta.data_ptr<float>(), P(a.Tm), P(a.Hs),
          P(a.dHs), P(a.Vn), P(a.dVn), P(a.dO), P(a.dq), P(a.dk), P(a.dv),
          a.dg.defined() ? a.dg.data_ptr<float>() : nullptr, a.dbeta.data_ptr<float>(), a.scale, d.T, d.H,
          chunk_stop());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return true;
    } else {
      return false;
    }
  }
}

template <typename T, typename... A>
bool bwd_dispatch(int DK, int DV, A&&... a) {
#define CARRY_GDN_CASE(dk, dv) \
  if (DK == dk && DV == dv) return bwd_impl<T, dk, dv>(std::forward<A>(a)...);
  CARRY_GDN_CASE(64, 64) CARRY_GDN_CASE(64, 128) CARRY_GDN_CASE(64, 256)
  CARRY_GDN_CASE(128, 64) CARRY_GDN_CASE(128, 128) CARRY_GDN_CASE(128, 256)
#undef CARRY_GDN_CASE
  TORCH_CHECK(false, "gdn_bwd: unsupported dk=", DK, " dv=", DV);
  return false;
}

// ---------------------------------------------------------------------------------------------
// 3. chunk-local gradients, batched ATen over [B,H,N,C,·] in fp32. With P = scale·(QKᵀ⊙Γ),
// A = diag(β)(KKᵀ)⊙Γ strictly lower, T = (I+A)⁻¹, Kb = β e^G K, Vb = β V:
//   dQ = scale e^G ⊙ dO Hᵀ + (dP⊙Γ·scale) K,  dP = dO V_newᵀ (causal)
//   dK = (dP⊙Γ·scale)ᵀ Q + e^{G_C−G} ⊙ V_new dH'ᵀ + β e^G ⊙ Tᵀ dW + (βD + (βD)ᵀ) K,
//        dW = −dV_new Hᵀ, dT = dV_new Vbᵀ + dW Kbᵀ, dA = −Tᵀ dT Tᵀ (strictly lower), D = dA ⊙ Γ
//   dV = β ⊙ Tᵀ dV_new;  dβ = Σ V⊙TᵀdV_new + Σ e^G K⊙TᵀdW + Σ_s D⊙KKᵀ
//   dG: every e^{±G} factor's share, then dg = reverse cumsum within the chunk.
std::vector<at::Tensor> chunk_grads(const Dims& d, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    bool gated, const at::Tensor& beta, double scale, const at::Tensor& Gc,
                                    const at::Tensor& Tm, const at::Tensor& Hs_, const at::Tensor& Vn_,
                                    const at::Tensor& dO, const at::Tensor& dHs_, const at::Tensor& dVn_) {
  using at::Tensor;
  const int64_t B = d.B, H = d.H, N = d.N, C = kChunk, DK = d.DK, DV = d.DV;
  auto f32 = at::kFloat;
  auto bhn = [&](const Tensor& x, int64_t D) { return x.view({B, N, C, H, D}).permute({0, 3, 1, 2, 4}).to(f32); };
  Tensor q5 = bhn(q, DK), k5 = bhn(k, DK), v5 = bhn(v, DV), do5 = bhn(dO, DV);
  Tensor G = Gc.view({B, H, N, C});
  Tensor b4 = beta.view({B, N, C, H}).permute({0, 3, 1, 2}).to(f32);
  Tensor Hs = Hs_.to(f32), dHs = dHs_.to(f32);
  Tensor Vn = Vn_.view({B, H, N, C, DV}).to(f32), dVn = dVn_.view({B, H, N, C, DV}).to(f32);
  auto bopt = q.options().dtype(at::kBool);
  Tensor causal = at::ones({C, C}, bopt).tril(), strict = at::ones({C, C}, bopt).tril(-1);
  const double ninf = -std::numeric_limits<double>::infinity();
  Tensor Gd = G.unsqueeze(-1) - G.unsqueeze(-2);
  Tensor Gam = Gd.masked_fill(causal.logical_not(), ninf).exp();
  Tensor Gs = Gd.masked_fill(strict.logical_not(), ninf).exp();
  Tensor eG = G.exp().unsqueeze(-1);
  Tensor Glast = G.select(-1, C - 1);
  Tensor eout = (Glast.unsqueeze(-1) - G).exp().unsqueeze(-1);
  Tensor bcol = b4.unsqueeze(-1);

  Tensor dQi = at::matmul(do5, Hs.transpose(-1, -2)) * eG * scale;
  Tensor P = at::matmul(q5, k5.transpose(-1, -2)) * Gam * scale;
  Tensor dP = at::matmul(do5, Vn.transpose(-1, -2)).masked_fill(causal.logical_not(), 0);
  Tensor dPs = dP * Gam * scale;
  Tensor dq = dQi + at::matmul(dPs, k5);
  Tensor dk = at::matmul(dPs.transpose(-1, -2), q5);
  Tensor dKs = at::matmul(Vn, dHs.transpose(-1, -2)) * eout;
  dk += dKs;
  Tensor dW = -at::matmul(dVn, Hs.transpose(-1, -2));
  Tensor Kb = k5 * bcol * eG, Vb = v5 * bcol;
  Tensor dT = at::matmul(dVn, Vb.transpose(-1, -2)) + at::matmul(dW, Kb.transpose(-1, -2));
  Tensor TmT = Tm.to(f32).transpose(-1, -2);
  Tensor X = at::matmul(TmT, dW), Y = at::matmul(TmT, dVn);
  Tensor dv = Y * bcol;
  Tensor dbeta = (v5 * Y).sum(-1) + (k5 * X * eG).sum(-1);
  dk += X * bcol * eG;
  Tensor dA = -at::matmul(at::matmul(TmT, dT), TmT).masked_fill(strict.logical_not(), 0);
  Tensor KK = at::matmul(k5, k5.transpose(-1, -2));
  Tensor D = dA * Gs;
  dbeta += (D * KK).sum(-1);
  Tensor bD = D * bcol;
  dk += at::matmul(bD, k5) + at::matmul(bD.transpose(-1, -2), k5);

  auto back = [&](const Tensor& x, const at::Tensor& like) {  // [B,H,N,C,D] -> [B,T,H,D]
    return x.permute({0, 2, 3, 1, 4}).reshape({B, N * C, H, x.size(-1)}).to(like.scalar_type());
  };
  auto back3 = [&](const Tensor& x, at::ScalarType st) {  // [B,H,N,C] -> [B,T,H]
    return x.permute({0, 2, 3, 1}).reshape({B, N * C, H}).to(st);
  };
  Tensor dg;
  if (gated) {
    Tensor dG = (Kb * X).sum(-1);
    Tensor A = KK * Gs * bcol;
    Tensor dAA = dA * A;
    dG += dAA.sum(-1) - dAA.sum(-2);
    Tensor dPP = dP * P;
    dG += dPP.sum(-1) - dPP.sum(-2);
    dG += (q5 * dQi).sum(-1);
    Tensor kd = (k5 * dKs).sum(-1);
    dG -= kd;
    Tensor last = kd.sum(-1) + Glast.exp() * (dHs * Hs).sum({-1, -2});
    dG.select(-1, C - 1).add_(last);
    dg = dG.flip(-1).cumsum(-1).flip(-1);
    dg = back3(dg, f32);
  }
  return {back(dq, q), back(dk, k), back(dv, v), dg, back3(dbeta, f32)};
}

}  // namespace

std::vector<at::Tensor> gdn_bwd(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                const at::Tensor& g_, const at::Tensor& beta_, double scale,
                                const at::Tensor& S0_, const std::vector<at::Tensor>& saved,
                                const at::Tensor& d_o, const at::Tensor& dSfin_, int64_t chunk_size,
                                const std::function<void(const at::Tensor&)>& on_initial_state_grad) {
  const Dims d = check_inputs("gdn_bwd", q_, k_, v_, g_, beta_, chunk_size);
  TORCH_CHECK(saved.size() == 5, "gdn_bwd: saved must be the 5 tensors gdn_fwd returned after o and final_state");
  TORCH_CHECK(d_o.sizes() == v_.sizes(), "gdn_bwd: d_o must have v's shape ", v_.sizes(), ", got ", d_o.sizes());
  c10::cuda::CUDAGuard guard(q_.device());
  auto q = dense(q_), k = dense(k_), v = dense(v_);
  auto dO = dense(d_o.to(q.scalar_type()));
  auto beta = beta_.to(at::kFloat).contiguous();
  const at::Tensor &Gc = saved[0], &Tm = saved[1], &W = saved[2], &Hs = saved[3], &Vn = saved[4];
  at::Tensor dSfin;
  if (dSfin_.defined()) {
    TORCH_CHECK(dSfin_.sizes() == at::IntArrayRef({d.B, d.H, d.DK, d.DV}), "gdn_bwd: d_final_state must be [B,H,dk,dv]");
    dSfin = dSfin_.to(at::kFloat).contiguous();
  }
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dVl = alloc({d.B, d.H, d.T, d.DV}, f32);
  at::Tensor dHs = alloc({d.B, d.H, d.N, d.DK, d.DV}, q.options());
  at::Tensor dVn = alloc({d.B, d.H, d.T, d.DV}, q.options());
  at::Tensor dS0 = alloc({d.B, d.H, d.DK, d.DV}, f32);
  BwdArgs a{d, q, k, v, beta, W, Gc, Tm, Hs, Vn, dO, (float)scale,
            dSfin.defined() ? dSfin.data_ptr<float>() : nullptr, dVl, dHs, dVn, dS0};
  a.dq = alloc({d.B, d.T, d.H, d.DK}, q.options());
  a.dk = alloc({d.B, d.T, d.H, d.DK}, q.options());
  a.dv = alloc({d.B, d.T, d.H, d.DV}, q.options());
  if (g_.defined()) a.dg = alloc({d.B, d.T, d.H}, f32);
  a.dbeta = alloc({d.B, d.T, d.H}, f32);
  a.on_s0_grad = on_initial_state_grad;
  const bool fused = q.scalar_type() == at::kBFloat16 ? bwd_dispatch<bf16>(d.DK, d.DV, a)
                                                      : bwd_dispatch<float>(d.DK, d.DV, a);
  std::vector<at::Tensor> gr;
  if (fused) gr = {a.dq, a.dk, a.dv, a.dg, a.dbeta};
  else gr = chunk_grads(d, q, k, v, g_.defined(), beta, scale, Gc, Tm, Hs, Vn, dO, dHs, dVn);
  at::Tensor dg = gr[3];
  if (dg.defined()) dg = dg.to(g_.scalar_type());
  return {gr[0], gr[1], gr[2], dg, gr[4].to(beta_.scalar_type()), dS0};
}

}  // namespace carry::kernels::delta_rule
