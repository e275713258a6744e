// Stage 1 of the delta rule's backward (bwd.cu): the intra-chunk part of dV_new, Pᵀ·dO with
// P = scale·(QKᵀ ⊙ Γ ⊙ causal): bwd_dv_local_kernel (shared tiles, fp32 and bf16) and
// bwd_dv_local_reg_kernel (bf16, the products in mma.sync registers, optionally leaving Q̃ for the
// warpgroup reverse walk). Device code of bwd.cu's translation unit: included by bwd.cu alone, after
// its constants (al128, kBwdStateStages).
#pragma once

namespace carry::kernels::delta_rule {
namespace {

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

}  // namespace
}  // namespace carry::kernels::delta_rule
