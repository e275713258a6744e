// Backward kernels of the scalar/diagonal-decay class (api.h), chunk C = 64. With
// H_n the state entering chunk n and dH_n the gradient of the state leaving it:
//  1. state_kernel in reverse (state_walk.cuh): dH_n for every chunk and the initial
//     state's gradient, dH ← e^{Γ} ⊙ dH + scale·(Q ⊙ e^G)ᵀ dO, chunks from last to first.
//  2. dv_kernel, grid (N, dv/TV, B·H): dV = Pᵀ dO + (K ⊙ e^{Γ−G}) dH_n, with P saved by the forward.
//  3. dqk_kernel, grid (N, dk/TK, B·H), TK = dk for GLA in bf16 with dk 96 or 128 (one block a chunk), else 64
//     (32 for other dk = 96: shared memory), TK/8 warps: for TK key columns, over the dv tiles:
//     dP = dO Vᵀ, dq = scale·e^G ⊙ (dO H_nᵀ), dk = e^{Γ−G} ⊙ (V dH_nᵀ); then the intra-chunk parts
//     dq += (dP ⊙ decay) K, dk += (dP ⊙ decay)ᵀ Q (the diagonal decay rescaled per 16-row block as in
//     the forward, its diagonal blocks exact), and the gate's gradient
//     dG_t = q_t ⊙ dq_t − k_t ⊙ dk_t, plus at the chunk's end Σ_s k_s ⊙ dk^{state}_s + e^{Γ} ⊙ diag(H_n dH_nᵀ),
//     summed from the end of the chunk (dg_t = Σ_{u ≥ t} dG_u); for the scalar decay also over d.
// In bf16 the reverse walk is state_mma_kernel (16 x 32 state pieces in mma.sync registers, four warps
// a block), and the scalar decay and linear attention with dk 64 or 128 take 2. and 3. together from
// grad_frag_kernel (one 8-warp block a chunk, every key column, P recomputed from Q and K: the forward then
// saves no P). Every chunk-local kernel takes a first chunk c0, so with decay_set_pieces the reverse walk
// runs in ranges of chunks (last first) and each finished range's chunk gradients run on a second stream
// beside the next range's walk (walk_in_pieces).
#include "layers/kernels/decay/api.h"
#include "layers/kernels/decay/state_walk.cuh"
#include "layers/kernels/decay/launch.h"
#include "layers/kernels/primitives/mma_frag.cuh"

namespace carry::kernels::decay {
namespace {

// GLA in bf16 at dk = 128: dqk_kernel with every key column in one 16-warp block, so dP = dO Vᵀ and the
// chunk's loads happen once, not once for each of two 64-column blocks (H200, H=16, dk=dv=128,
// forward+backward, two blocks → one: 2.52 → 2.44 ms at 16384 tokens, 19.17 → 18.39 ms at 131072).

// ---- dV -------------------------------------------------------------------------------------
template <typename T, int KIND, int DK, int TV>
struct DvSmem {
  static constexpr int C = kChunk, P = pad_of<T>();
  static constexpr int LK = DK + P, LG = DK + 4, LP = C + P, LH = TV + P, LO = TV + 4;
  static constexpr size_t oK = 0;
  static constexpr size_t oG = al128(oK + C * LK * sizeof(T));
  static constexpr size_t oP = al128(oG + (KIND == kDiag ? C * LG * 4 : KIND == kScalar ? C * 4 : 0));
  static constexpr size_t oDO = al128(oP + C * LP * sizeof(T));
  static constexpr size_t oDH = al128(oDO + C * LH * sizeof(T));
  static constexpr size_t oDV = al128(oDH + DK * LH * sizeof(T));
  static constexpr size_t bytes = al128(oDV + C * LO * 4);
  static_assert(bytes <= 227 * 1024, "dv_kernel shared memory");
};

template <typename T, int KIND, int DK, int TV, int NW>
__global__ void __launch_bounds__(NW * 32) dv_kernel(const T* __restrict__ k, const float* __restrict__ G,
                                                     const T* __restrict__ Psave, const T* __restrict__ dO,
                                                     const T* __restrict__ dHsave, T* __restrict__ dv, int Tn,
                                                     int H, int DV, int c0) {
  using L = DvSmem<T, KIND, DK, TV>;
  constexpr int C = kChunk, NT = NW * 32;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Ks = reinterpret_cast<T*>(smem + L::oK);
  float* Gs = reinterpret_cast<float*>(smem + L::oG);
  T* Ps = reinterpret_cast<T*>(smem + L::oP);
  T* dOs = reinterpret_cast<T*>(smem + L::oDO);
  T* dHs = reinterpret_cast<T*>(smem + L::oDH);
  float* dVs = reinterpret_cast<float*>(smem + L::oDV);

  const int n = c0 + blockIdx.x, iv = blockIdx.y, bh = blockIdx.z, b = bh / H, h = bh % H, N = Tn / C;
  const long tok = (long)b * Tn + (long)n * C, ks = (long)H * DK, vs = (long)H * DV;
  load_tile_async<T, C, DK, NT>(Ks, L::LK, k + tok * ks + (long)h * DK, ks);
  load_tile_async<T, C, C, NT>(Ps, L::LP, Psave + ((long)bh * N + n) * C * C, C);
  load_tile_async<T, C, TV, NT>(dOs, L::LH, dO + tok * vs + (long)h * DV + iv * TV, vs);
  load_tile_async<T, DK, TV, NT>(dHs, L::LH, dHsave + ((long)bh * N + n) * DK * DV + iv * TV, DV);
  if constexpr (KIND == kDiag) load_tile_async<float, C, DK, NT>(Gs, L::LG, G + tok * ks + (long)h * DK, ks);
  cp_async_commit();
  if constexpr (KIND == kScalar) {
    if (threadIdx.x < C) Gs[threadIdx.x] = G[(tok + threadIdx.x) * H + h];
  }
  cp_async_wait<0>();
  __syncthreads();
  if constexpr (KIND != kNone) {
    for (int i = threadIdx.x; i < C * DK; i += NT) {
      const int t = i / DK, d = i % DK;
      const float f = __expf(gate<KIND>(Gs, L::LG, C - 1, d) - gate<KIND>(Gs, L::LG, t, d));
      Ks[t * L::LK + d] = from_f<T>(to_f(Ks[t * L::LK + d]) * f);
    }
    __syncthreads();
  }
  gemm<T, C, TV, C, true, false, NW>(Ps, L::LP, dOs, L::LH, dVs, L::LO, false);
  gemm<T, C, TV, DK, false, false, NW>(Ks, L::LK, dHs, L::LH, dVs, L::LO, true);
  __syncthreads();
  store_tile<T, C, TV, NT>(dv + tok * vs + (long)h * DV + iv * TV, vs, dVs, L::LO);
}

// ---- dq, dk, dg -----------------------------------------------------------------------------
template <typename T, int KIND, int TK_>
struct QkSmem {
  // bf16 GLA with 64 key columns (compact): dv tiles of 32 and the diagonal decay's Pk in pieces of 16
  // rows, so that its region holds the scratch and Ab within 27 KB: 113 KB, two blocks an SM.
  static constexpr bool kCompact = sizeof(T) == 2 && KIND == kDiag && TK_ == 64;
  static constexpr int C = kChunk, TK = TK_, TV = kCompact ? 32 : 64, P = pad_of<T>(), kPkRows = kCompact ? 16 : 48;
  static constexpr int LK = TK + P, LG = TK + 4, LA = C + 4, LAb = C + P, LD = TK + 4, LV = TV + P;
  // The region R holds the dv-tile buffers (V, dO, H, dH) during the dv loop; afterwards the scratch
  // of the diagonal decay's blocks (Qh, Kh, Pq, Pk) and, where it fits after that scratch, the
  // intra-chunk matrix Ab (bf16, written after the loop): without its own 9 KB the scalar decay and
  // linear attention at TK = 64 take 108 KB, two blocks an SM, so one block's loads overlap the
  // other's products.
  static constexpr size_t rV = 0;
  static constexpr size_t rDO = al128(rV + C * LV * sizeof(T));
  static constexpr size_t rH = al128(rDO + C * LV * sizeof(T));
  static constexpr size_t rDH = al128(rH + TK * LV * sizeof(T));
  static constexpr size_t rEnd = al128(rDH + TK * LV * sizeof(T));
  static constexpr size_t rQh = 0;
  static constexpr size_t rKh = al128(rQh + 16 * LK * sizeof(T));
  static constexpr size_t rPq = al128(rKh + 48 * LK * sizeof(T));
  static constexpr size_t rPk = al128(rPq + 16 * LD * 4);
  static constexpr size_t rScrEnd = KIND == kDiag ? al128(rPk + kPkRows * LD * 4) : 0;
  static constexpr size_t kAbBytes = C * LAb * sizeof(T);
  static constexpr bool kAbInR = kCompact || rScrEnd + kAbBytes <= rEnd;
  static constexpr size_t rAbEnd = al128(rScrEnd + kAbBytes);
  static constexpr size_t rSize = kAbInR ? (rEnd > rAbEnd ? rEnd : rAbEnd) : (rEnd > rScrEnd ? rEnd : rScrEnd);
  static constexpr size_t oQ = 0;
  static constexpr size_t oK = al128(oQ + C * LK * sizeof(T));
  static constexpr size_t oG = al128(oK + C * LK * sizeof(T));
  static constexpr size_t oA = al128(oG + (KIND == kDiag ? C * LG * 4 : KIND == kScalar ? C * 4 : 0));
  static constexpr size_t oAbOwn = al128(oA + C * LA * 4);
  static constexpr size_t oDQ = al128(oAbOwn + (kAbInR ? 0 : kAbBytes));
  static constexpr size_t oDK = al128(oDQ + C * LD * 4);
  static constexpr size_t oX = al128(oDK + C * LD * 4);  // gx [TK], ext [TK]
  static constexpr size_t oR = al128(oX + 2 * TK * 4);
  static constexpr size_t oV = oR + rV;
  static constexpr size_t oDO = oR + rDO;
  static constexpr size_t oH = oR + rH;
  static constexpr size_t oDH = oR + rDH;
  static constexpr size_t oQh = oR + rQh;
  static constexpr size_t oKh = oR + rKh;
  static constexpr size_t oPq = oR + rPq;
  static constexpr size_t oPk = oR + rPk;
  static constexpr size_t oAb = kAbInR ? oR + rScrEnd : oAbOwn;
  static constexpr size_t bytes = oR + rSize;
  static_assert(bytes <= 227 * 1024, "dqk_kernel shared memory");
  static_assert(!kCompact || bytes <= 113 * 1024, "compact dqk_kernel: two blocks an SM");
  static_assert(oV < oDO && oDO < oH && oH < oDH && oDH < bytes, "dv-tile buffers inside the region");
  static_assert(oQh < oKh && oKh < oPq && oPq < oPk &&
                    (KIND != kDiag || !kAbInR || oPk + (size_t)kPkRows * LD * 4 <= oAb),
                "the diagonal decay's scratch ends before Ab");
};

// Off-diagonal row block I of the intra-chunk gradient for the diagonal decay (see the forward's
// diag_offdiag_block): with r = G of row 16I−1, Qh = Q_I ⊙ e^{G−r}, Kh = K_{<16I} ⊙ e^{r−G},
// dq_I += e^{G−r} ⊙ (dP_I Kh), dk_{<16I} += e^{r−G} ⊙ (dP_Iᵀ Qh).
template <typename T, int I, int TK_, int NW>
__device__ __forceinline__ void diag_offdiag_grad(const T* Qs, const T* Ks, const float* Gs, const T* Ab, T* Qh,
                                                  T* Kh, float* Pq, float* Pk, float* dq, float* dk) {
  using L = QkSmem<T, kDiag, TK_>;
  constexpr int NT = NW * 32, R = 16 * I, TK = L::TK;
  for (int i = threadIdx.x; i < (16 + R) * TK; i += NT) {
    const int r = i / TK, d = i % TK;
    const float ref = Gs[(R - 1) * L::LG + d];
    if (r < 16) {
      Qh[r * L::LK + d] = from_f<T>(to_f(Qs[(R + r) * L::LK + d]) * __expf(Gs[(R + r) * L::LG + d] - ref));
    } else {
      const int s = r - 16;
      Kh[s * L::LK + d] = from_f<T>(to_f(Ks[s * L::LK + d]) * __expf(ref - Gs[s * L::LG + d]));
    }
  }
  __syncthreads();
  gemm<T, 16, TK, R, false, false, NW>(Ab + R * L::LAb, L::LAb, Kh, L::LK, Pq, L::LD, false);
  if constexpr (L::kPkRows < R) {  // Pk in pieces of kPkRows rows (same products, element by element)
    __syncthreads();
    for (int i = threadIdx.x; i < 16 * TK; i += NT) {
      const int r = i / TK, d = i % TK;
      dq[(R + r) * L::LD + d] += Pq[r * L::LD + d] * __expf(Gs[(R + r) * L::LG + d] - Gs[(R - 1) * L::LG + d]);
    }
    for (int p = 0; p < R; p += L::kPkRows) {
      gemm<T, L::kPkRows, TK, 16, true, false, NW>(Ab + R * L::LAb + p, L::LAb, Qh, L::LK, Pk, L::LD, false);
      __syncthreads();
      for (int i = threadIdx.x; i < L::kPkRows * TK; i += NT) {
        const int r = i / TK, d = i % TK, s = p + r;
        dk[s * L::LD + d] += Pk[r * L::LD + d] * __expf(Gs[(R - 1) * L::LG + d] - Gs[s * L::LG + d]);
      }
      __syncthreads();
    }
  } else {
    gemm<T, R, TK, 16, true, false, NW>(Ab + R * L::LAb, L::LAb, Qh, L::LK, Pk, L::LD, false);
    __syncthreads();
    for (int i = threadIdx.x; i < (16 + R) * TK; i += NT) {
      const int r = i / TK, d = i % TK;
      const float ref = Gs[(R - 1) * L::LG + d];
      if (r < 16) {
        dq[(R + r) * L::LD + d] += Pq[r * L::LD + d] * __expf(Gs[(R + r) * L::LG + d] - ref);
      } else {
        const int s = r - 16;
        dk[s * L::LD + d] += Pk[s * L::LD + d] * __expf(ref - Gs[s * L::LG + d]);
      }
    }
    __syncthreads();
  }
}

template <typename T, int KIND, int TK_, int NW>
__global__ void __launch_bounds__(NW * 32) dqk_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                                      const T* __restrict__ v, const float* __restrict__ G,
                                                      const T* __restrict__ Hsave, const T* __restrict__ dO,
                                                      const T* __restrict__ dHsave, T* __restrict__ dq,
                                                      T* __restrict__ dk, float* __restrict__ dg, int Tn, int H,
                                                      int DK, int DV, float scale, int c0) {
  using L = QkSmem<T, KIND, TK_>;
  constexpr int C = kChunk, NT = NW * 32, TK = L::TK, TV = L::TV, kRG = NT / TK;
  static_assert(kRG == 4, "four threads a key column in the row reductions");
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem + L::oQ);
  T* Ks = reinterpret_cast<T*>(smem + L::oK);
  float* Gs = reinterpret_cast<float*>(smem + L::oG);
  float* dA = reinterpret_cast<float*>(smem + L::oA);
  T* Ab = reinterpret_cast<T*>(smem + L::oAb);
  float* dQs = reinterpret_cast<float*>(smem + L::oDQ);
  float* dKs = reinterpret_cast<float*>(smem + L::oDK);
  float* gx = reinterpret_cast<float*>(smem + L::oX);
  float* ext = gx + TK;
  T* Vs = reinterpret_cast<T*>(smem + L::oV);
  T* dOs = reinterpret_cast<T*>(smem + L::oDO);
  T* Hs = reinterpret_cast<T*>(smem + L::oH);
  T* dHs = reinterpret_cast<T*>(smem + L::oDH);

  const int n = c0 + blockIdx.x, ik = blockIdx.y, bh = blockIdx.z, b = bh / H, h = bh % H, N = Tn / C;
  const int k0 = ik * TK;
  const long tok = (long)b * Tn + (long)n * C, ks = (long)H * DK, vs = (long)H * DV;
  const long hoff = ((long)bh * N + n) * DK * DV + (long)k0 * DV;
  load_tile_async<T, C, TK, NT>(Qs, L::LK, q + tok * ks + (long)h * DK + k0, ks);
  load_tile_async<T, C, TK, NT>(Ks, L::LK, k + tok * ks + (long)h * DK + k0, ks);
  if constexpr (KIND == kDiag) load_tile_async<float, C, TK, NT>(Gs, L::LG, G + tok * ks + (long)h * DK + k0, ks);
  cp_async_commit();
  if constexpr (KIND == kScalar) {
    if (threadIdx.x < C) Gs[threadIdx.x] = G[(tok + threadIdx.x) * H + h];
  }
  if (threadIdx.x < TK) gx[threadIdx.x] = 0.f;

  for (int j = 0; j < DV / TV; ++j) {
    load_tile_async<T, C, TV, NT>(Vs, L::LV, v + tok * vs + (long)h * DV + j * TV, vs);
    load_tile_async<T, C, TV, NT>(dOs, L::LV, dO + tok * vs + (long)h * DV + j * TV, vs);
    load_tile_async<T, TK, TV, NT>(Hs, L::LV, Hsave + hoff + j * TV, DV);
    load_tile_async<T, TK, TV, NT>(dHs, L::LV, dHsave + hoff + j * TV, DV);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    gemm<T, C, C, TV, false, true, NW>(dOs, L::LV, Vs, L::LV, dA, L::LA, j > 0);
    gemm<T, C, TK, TV, false, true, NW>(dOs, L::LV, Hs, L::LV, dQs, L::LD, j > 0);
    gemm<T, C, TK, TV, false, true, NW>(Vs, L::LV, dHs, L::LV, dKs, L::LD, j > 0);
    if constexpr (KIND != kNone) {  // diag(H dHᵀ) for this dv tile: 4 consecutive lanes a row
      const int d = threadIdx.x / kRG, part = threadIdx.x % kRG;
      float s = 0.f;
#pragma unroll 4
      for (int c = part * (TV / kRG); c < (part + 1) * (TV / kRG); ++c)
        s += to_f(Hs[d * L::LV + c]) * to_f(dHs[d * L::LV + c]);
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      if (part == 0) gx[d] += s;
    }
    __syncthreads();
  }
  // Inter-chunk parts: dq = scale·e^G ⊙ (dO Hᵀ), dk = e^{Γ−G} ⊙ (V dHᵀ).
  for (int i = threadIdx.x; i < C * TK; i += NT) {
    const int t = i / TK, d = i % TK;
    const float Gt = gate<KIND>(Gs, L::LG, t, d), Gl = gate<KIND>(Gs, L::LG, C - 1, d);
    dQs[t * L::LD + d] *= scale * __expf(Gt);
    dKs[t * L::LD + d] *= __expf(Gl - Gt);
  }
  __syncthreads();
  if constexpr (KIND != kNone) {  // the chunk-end gate's share from the state terms, 4 lanes a column
    const int d = threadIdx.x / kRG, part = threadIdx.x % kRG;
    float s = 0.f;
#pragma unroll 4
    for (int t = part * (C / kRG); t < (part + 1) * (C / kRG); ++t) s += to_f(Ks[t * L::LK + d]) * dKs[t * L::LD + d];
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if (part == 0) ext[d] = s + __expf(gate<KIND>(Gs, L::LG, C - 1, d)) * gx[d];
  }
  for (int i = threadIdx.x; i < C * C; i += NT) {
    const int t = i / C, s = i % C;
    float a = 0.f;
    if (s <= t) {
      a = dA[t * L::LA + s] * scale;
      if constexpr (KIND == kScalar) a *= __expf(Gs[t] - Gs[s]);
    }
    Ab[t * L::LAb + s] = from_f<T>(a);
  }
  __syncthreads();
  if constexpr (KIND == kDiag) {
    T* Qh = reinterpret_cast<T*>(smem + L::oQh);
    T* Kh = reinterpret_cast<T*>(smem + L::oKh);
    float* Pq = reinterpret_cast<float*>(smem + L::oPq);
    float* Pk = reinterpret_cast<float*>(smem + L::oPk);
    diag_offdiag_grad<T, 1, TK, NW>(Qs, Ks, Gs, Ab, Qh, Kh, Pq, Pk, dQs, dKs);
    diag_offdiag_grad<T, 2, TK, NW>(Qs, Ks, Gs, Ab, Qh, Kh, Pq, Pk, dQs, dKs);
    diag_offdiag_grad<T, 3, TK, NW>(Qs, Ks, Gs, Ab, Qh, Kh, Pq, Pk, dQs, dKs);
    // Diagonal blocks, exact: one thread per (block, key column).
    static_assert(4 * TK == NT, "one thread per diagonal block and column");
    const int blk = threadIdx.x / TK, d = threadIdx.x % TK, base = 16 * blk;
    float aq[16], ak[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) aq[i] = ak[i] = 0.f;
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      const float Gt = Gs[(base + t) * L::LG + d], qt = to_f(Qs[(base + t) * L::LK + d]);
#pragma unroll
      for (int s = 0; s <= t; ++s) {
        const float w = dA[(base + t) * L::LA + base + s] * scale * __expf(Gt - Gs[(base + s) * L::LG + d]);
        aq[t] += w * to_f(Ks[(base + s) * L::LK + d]);
        ak[s] += w * qt;
      }
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      dQs[(base + i) * L::LD + d] += aq[i];
      dKs[(base + i) * L::LD + d] += ak[i];
    }
  } else {
    gemm<T, C, TK, C, false, false, NW>(Ab, L::LAb, Ks, L::LK, dQs, L::LD, true);
    gemm<T, C, TK, C, true, false, NW>(Ab, L::LAb, Qs, L::LK, dKs, L::LD, true);
  }
  __syncthreads();
  store_tile<T, C, TK, NT>(dq + tok * ks + (long)h * DK + k0, ks, dQs, L::LD);
  store_tile<T, C, TK, NT>(dk + tok * ks + (long)h * DK + k0, ks, dKs, L::LD);
  if constexpr (KIND != kNone) {
    // dg_t = Σ_{u ≥ t} (q ⊙ dq − k ⊙ dk)_u + ext, per key column; dA's space holds it.
    float* dgs = dA;
    if (threadIdx.x < TK) {
      const int d = threadIdx.x;
      float acc = ext[d];
      for (int t = C - 1; t >= 0; --t) {
        acc += to_f(Qs[t * L::LK + d]) * dQs[t * L::LD + d] - to_f(Ks[t * L::LK + d]) * dKs[t * L::LD + d];
        if constexpr (KIND == kDiag) dg[(tok + t) * ks + (long)h * DK + k0 + d] = acc;
        else dgs[t * L::LA + d] = acc;
      }
    }
    if constexpr (KIND == kScalar) {
      __syncthreads();
      if (threadIdx.x < C) {
        float s = 0.f;
        for (int d = 0; d < TK; ++d) s += dgs[threadIdx.x * L::LA + d];
        dg[((tok + threadIdx.x) * H + h) * (DK / TK) + ik] = s;  // partial over this block's columns
      }
    }
  }
}

// ---- dV, dq, dk, dg of a chunk in one kernel (bf16, scalar decay and linear attention, dk 64 or 128) ----
// One block of 8 warps a chunk (an item: chunk, head, batch), every key column: Q and K load once, P =
// scale·(QKᵀ ⊙ e^{G_t−G_s}) (causal) is recomputed from them (causal_p_bf16, as the forward's output kernel),
// so the forward saves no P, and V, dO, H_n and dH_n are read once a chunk (the two kernels this one replaced,
// dv_frag_kernel and dqk_frag_kernel, read dO and dH twice, K and V twice, and P from memory). Warp w owns
// rows 16·(w%4) and the column half w/4 of each product: per 64-wide dv tile j (V, dO, H, dH double-buffered)
// dP += dO_j V_jᵀ, dq += dO_j H_jᵀ, dk += V_j dH_jᵀ (fragments held over the loop) and
// dV_j = Pᵀ dO_j + e^{Γ−G_s}·(K dH_j) (stored at once); then the intra-chunk parts (A = scale·dP ⊙
// e^{G_t−G_s}, causal, to shared bf16 once; dq += A K, dk += Aᵀ Q) and the gate's gradient
// dG_t = Σ_d (q ⊙ dq − k ⊙ dk)_t, plus at the chunk's end Σ k ⊙ dk^{state} + e^{Γ}·<H_n, dH_n>, summed from
// the chunk's end. 221 registers a thread, one block an SM (16 warps at 128 registers ran no faster: H100,
// H=16, dk=dv=128, T=131072, ncu 3.35 against 3.52 ms; the two kernels it replaced 1.12 + 2.63 ms).
// A block walks items blockIdx.x, blockIdx.x + gridDim.x, ...: with as many blocks as items each takes one;
// with one block an SM (persistent) the next item's Q, K, G and first two tiles are loaded into the other
// Q/K/G buffer and the freed stages while this item finishes its intra-chunk parts and stores.
template <int DK>
struct GradFragSmem {
  static constexpr int C = kChunk, LK = DK + 8, LD = 64 + 8;
  static constexpr size_t qk = al128((size_t)2 * C * LK * 2);  // Q then K of one item
  static constexpr size_t oQK = 0;                              // two items' Q and K
  static constexpr size_t oG = oQK + 2 * qk;                    // two items' G [2][C]
  static constexpr size_t oP = al128(oG + 2 * C * 4);
  static constexpr size_t oA = al128(oP + C * LD * 2);
  static constexpr size_t oRow = al128(oA + C * LD * 2);        // the column halves' row sums of dG [2][C]
  static constexpr size_t oRed = oRow + 2 * C * 4;              // the warps' shares of the chunk-end terms [2][8]
  static constexpr size_t oBuf = al128(oRed + 16 * 4);
  // a stage: V_j, dO_j [C][LD], H_j, dH_j [DK][LD]
  static constexpr size_t oDO = C * LD * 2, oH = 2 * C * LD * 2, oDH = oH + DK * LD * 2;
  static constexpr size_t stage = al128(oDH + DK * LD * 2);
  static constexpr size_t bytes = oBuf + 2 * stage;
  static_assert(bytes + 1024 <= 228 * 1024, "grad_frag_kernel shared memory");
};

template <int KIND, int DK>
__global__ void __launch_bounds__(256, 1) grad_frag_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                           const bf16* __restrict__ v, const float* __restrict__ G,
                                                           const bf16* __restrict__ Hsave, const bf16* __restrict__ dO,
                                                           const bf16* __restrict__ dHsave, bf16* __restrict__ dq,
                                                           bf16* __restrict__ dk, bf16* __restrict__ dv,
                                                           float* __restrict__ dg, int Tn, int H, int DV, float scale,
                                                           int c0, int nch, int B) {
  static_assert(KIND == kScalar || KIND == kNone, "the diagonal decay keeps dv_kernel and dqk_kernel");
  using S = GradFragSmem<DK>;
  constexpr int C = kChunk, NT = 256, LK = S::LK, LD = S::LD, NQ = DK / 16;  // NQ: n8-tiles of a key half
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* Ps = reinterpret_cast<bf16*>(smem + S::oP);
  bf16* As = reinterpret_cast<bf16*>(smem + S::oA);
  float* sRow = reinterpret_cast<float*>(smem + S::oRow);
  float* sRed = reinterpret_cast<float*>(smem + S::oRed);
  const int N = Tn / C, ntile = DV / 64, items = nch * H * B;
  const long ks = (long)H * DK, vs = (long)H * DV;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int m0 = (warp & 3) * 16, half = warp >> 2, n0 = half * 32, nq = half * (DK / 2);
  const int r0 = m0 + g, r1 = r0 + 8;

  struct Item {
    int n, h;
    long bh, tok;
  };
  auto item_at = [&](int w) {
    Item it;
    it.n = c0 + w % nch;
    it.h = (w / nch) % H;
    const int b = w / (nch * H);
    it.bh = (long)b * H + it.h;
    it.tok = (long)b * Tn + (long)it.n * C;
    return it;
  };
  auto q_of = [&](int buf) { return reinterpret_cast<bf16*>(smem + S::oQK + buf * S::qk); };
  auto k_of = [&](int buf) { return reinterpret_cast<bf16*>(smem + S::oQK + buf * S::qk + C * LK * 2); };
  auto g_of = [&](int buf) { return reinterpret_cast<float*>(smem + S::oG) + buf * C; };
  // V, dO, H, dH of item `it` at dv column v0 into stage bi (one cp.async group)
  auto load_tiles = [&](const Item& it, int v0, int bi) {
    unsigned char* base = smem + S::oBuf + bi * S::stage;
    const long hoff = (it.bh * N + it.n) * DK * DV;
    load_tile_async<bf16, C, 64, NT>(reinterpret_cast<bf16*>(base), LD, v + it.tok * vs + (long)it.h * DV + v0, vs);
    load_tile_async<bf16, C, 64, NT>(reinterpret_cast<bf16*>(base + S::oDO), LD,
                                     dO + it.tok * vs + (long)it.h * DV + v0, vs);
    load_tile_async<bf16, DK, 64, NT>(reinterpret_cast<bf16*>(base + S::oH), LD, Hsave + hoff + v0, DV);
    load_tile_async<bf16, DK, 64, NT>(reinterpret_cast<bf16*>(base + S::oDH), LD, dHsave + hoff + v0, DV);
    cp_async_commit();
  };
  // Q, K, G of item `it` into buffer qb (one group), then its first two tiles (a group each)
  auto load_item = [&](const Item& it, int qb) {
    load_tile_async<bf16, C, DK, NT>(q_of(qb), LK, q + it.tok * ks + (long)it.h * DK, ks);
    load_tile_async<bf16, C, DK, NT>(k_of(qb), LK, k + it.tok * ks + (long)it.h * DK, ks);
    if constexpr (KIND == kScalar) {
      if (threadIdx.x < C) cp_async4(g_of(qb) + threadIdx.x, G + (it.tok + threadIdx.x) * H + it.h);
    }
    cp_async_commit();
    load_tiles(it, 0, 0);
    if (ntile > 1) load_tiles(it, 64, 1);
  };
  if constexpr (KIND == kNone) {  // no gate: G = 0 in both buffers, for good
    if (threadIdx.x < 2 * C) g_of(0)[threadIdx.x] = 0.f;
  }
  if (blockIdx.x < items) load_item(item_at(blockIdx.x), 0);

  for (int w = blockIdx.x, i = 0; w < items; w += gridDim.x, ++i) {
    const Item it = item_at(w);
    const int qb = i & 1;
    const bf16* Qs = q_of(qb);
    const bf16* Ks = k_of(qb);
    const float* Gs = g_of(qb);
    if (ntile > 1) cp_async_wait<2>();
    else cp_async_wait<1>();
    __syncthreads();  // Q, K, G have landed; the previous item is done with P and A
    carry::kernels::primitives::causal_p_bf16<DK>(Qs, Ks, LK, Gs, scale, Ps, LD);

    float dp[4][4] = {}, aq[NQ][4] = {}, ak[NQ][4] = {};
    float hdh = 0.f;  // this thread's share of <H, dH> over the chunk's state
    const float Gl = Gs[C - 1];
    for (int j = 0; j < ntile; ++j) {
      if (j + 1 < ntile) cp_async_wait<1>();
      else cp_async_wait<0>();
      __syncthreads();  // this tile's loads (and, on the first, P) are visible
      const unsigned char* base = smem + S::oBuf + (j & 1) * S::stage;
      const bf16* Vs = reinterpret_cast<const bf16*>(base);
      const bf16* dOs = reinterpret_cast<const bf16*>(base + S::oDO);
      const bf16* Hs = reinterpret_cast<const bf16*>(base + S::oH);
      const bf16* dHs = reinterpret_cast<const bf16*>(base + S::oDH);
      frag_mma<4, 64, false, true>(dp, dOs, LD, Vs, LD, m0, n0);    // dP[t][s] = Σ_c dO[t][c] V[s][c]
      frag_mma<NQ, 64, false, true>(aq, dOs, LD, Hs, LD, m0, nq);   // (dO Hᵀ)[t][d]
      frag_mma<NQ, 64, false, true>(ak, Vs, LD, dHs, LD, m0, nq);   // (V dHᵀ)[s][d]
      {  // dV_j = Pᵀ dO_j + e^{Γ−G_s}·(K dH_j)
        float kd[4][4] = {}, acc[4][4] = {};
        frag_mma<4, DK, false, false>(kd, Ks, LK, dHs, LD, m0, n0);  // (K dH)[s][c]
        frag_mma<4, C, true, false>(acc, Ps, LD, dOs, LD, m0, n0);   // (Pᵀ dO)[s][c]
        const float f0 = __expf(Gl - Gs[r0]), f1 = __expf(Gl - Gs[r1]);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          acc[nt][0] += f0 * kd[nt][0], acc[nt][1] += f0 * kd[nt][1];
          acc[nt][2] += f1 * kd[nt][2], acc[nt][3] += f1 * kd[nt][3];
        }
        frag_store_bf16<4>(dv + it.tok * vs + (long)it.h * DV + j * 64, vs, acc, m0, n0);
      }
      if constexpr (KIND != kNone) {  // DK·64/256 elements of H ⊙ dH a thread, 8 at a time
        constexpr int E = DK * 64 / NT, TPR = 64 / E;  // elements a thread, threads a row
        const int r = threadIdx.x / TPR, c = (threadIdx.x % TPR) * E;
#pragma unroll
        for (int p = 0; p < E / 8; ++p) {
          const uint4 hx = *reinterpret_cast<const uint4*>(Hs + r * LD + c + 8 * p);
          const uint4 dx = *reinterpret_cast<const uint4*>(dHs + r * LD + c + 8 * p);
          const unsigned* hu = reinterpret_cast<const unsigned*>(&hx);
          const unsigned* du = reinterpret_cast<const unsigned*>(&dx);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 a = tc::unpack_bf16(hu[e]), d2 = tc::unpack_bf16(du[e]);
            hdh += a.x * d2.x + a.y * d2.y;
          }
        }
      }
      if (j + 2 < ntile) {
        __syncthreads();  // every warp is done with this stage
        load_tiles(it, (j + 2) * 64, j & 1);
      }
    }
    // Every tile of this item is read: the next item's Q, K, G (other buffer) and first tiles start loading
    // while this one finishes.
    __syncthreads();
    if (w + (int)gridDim.x < items) load_item(item_at(w + gridDim.x), qb ^ 1);

    // Inter-chunk parts: dq = scale·e^{G_t} (dO Hᵀ), dk = e^{Γ−G_s} (V dHᵀ); the chunk-end share Σ k ⊙ dk.
    const float G0 = Gs[r0], G1 = Gs[r1];
    const float eq0 = scale * __expf(G0), eq1 = scale * __expf(G1), ek0 = __expf(Gl - G0), ek1 = __expf(Gl - G1);
    float ext = 0.f;
#pragma unroll
    for (int nt = 0; nt < NQ; ++nt) {
      const int col = nq + nt * 8 + 2 * t4;
      aq[nt][0] *= eq0, aq[nt][1] *= eq0, aq[nt][2] *= eq1, aq[nt][3] *= eq1;
      ak[nt][0] *= ek0, ak[nt][1] *= ek0, ak[nt][2] *= ek1, ak[nt][3] *= ek1;
      if constexpr (KIND != kNone) {
        const float2 ka = tc::unpack_bf16(*reinterpret_cast<const unsigned*>(Ks + r0 * LK + col));
        const float2 kb = tc::unpack_bf16(*reinterpret_cast<const unsigned*>(Ks + r1 * LK + col));
        ext += ka.x * ak[nt][0] + ka.y * ak[nt][1] + kb.x * ak[nt][2] + kb.y * ak[nt][3];
      }
    }
    // A = scale·dP ⊙ e^{G_t − G_s} for s ≤ t (dp's columns are tokens s).
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int t = r0 + 8 * hf, s = n0 + nt * 8 + 2 * t4;
        const float Gt = Gs[t];
        const float x0 = s <= t ? scale * dp[nt][2 * hf] * __expf(Gt - Gs[s]) : 0.f;
        const float x1 = s + 1 <= t ? scale * dp[nt][2 * hf + 1] * __expf(Gt - Gs[s + 1]) : 0.f;
        *reinterpret_cast<unsigned*>(As + t * LD + s) = tc::pack_bf16(x0, x1);
      }
    }
    __syncthreads();
    // Intra-chunk parts: dq += A K, dk += Aᵀ Q (A's storage is [t][s]).
    frag_mma<NQ, 64, false, false>(aq, As, LD, Ks, LK, m0, nq);
    frag_mma<NQ, 64, true, false>(ak, As, LD, Qs, LK, m0, nq);
    frag_store_bf16<NQ>(dq + it.tok * ks + (long)it.h * DK, ks, aq, m0, nq);
    frag_store_bf16<NQ>(dk + it.tok * ks + (long)it.h * DK, ks, ak, m0, nq);
    if constexpr (KIND == kScalar) {
      // dG_t = Σ_d (q ⊙ dq − k ⊙ dk)_t; at the chunk's end also the state terms.
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int nt = 0; nt < NQ; ++nt) {
        const int col = nq + nt * 8 + 2 * t4;
        const float2 qa = tc::unpack_bf16(*reinterpret_cast<const unsigned*>(Qs + r0 * LK + col));
        const float2 qb2 = tc::unpack_bf16(*reinterpret_cast<const unsigned*>(Qs + r1 * LK + col));
        const float2 ka = tc::unpack_bf16(*reinterpret_cast<const unsigned*>(Ks + r0 * LK + col));
        const float2 kb = tc::unpack_bf16(*reinterpret_cast<const unsigned*>(Ks + r1 * LK + col));
        s0 += qa.x * aq[nt][0] + qa.y * aq[nt][1] - ka.x * ak[nt][0] - ka.y * ak[nt][1];
        s1 += qb2.x * aq[nt][2] + qb2.y * aq[nt][3] - kb.x * ak[nt][2] - kb.y * ak[nt][3];
      }
#pragma unroll
      for (int off = 1; off <= 2; off <<= 1) {
        s0 += __shfl_xor_sync(0xffffffffu, s0, off);
        s1 += __shfl_xor_sync(0xffffffffu, s1, off);
      }
      if (t4 == 0) sRow[half * C + r0] = s0, sRow[half * C + r1] = s1;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        ext += __shfl_xor_sync(0xffffffffu, ext, off);
        hdh += __shfl_xor_sync(0xffffffffu, hdh, off);
      }
      if (lane == 0) sRed[warp] = ext, sRed[8 + warp] = hdh;
      __syncthreads();
      if (warp == 0) {
        float e = 0.f, hd = 0.f;
#pragma unroll
        for (int w8 = 0; w8 < 8; ++w8) e += sRed[w8], hd += sRed[8 + w8];
        float a = sRow[2 * lane] + sRow[C + 2 * lane], c = sRow[2 * lane + 1] + sRow[C + 2 * lane + 1];
        if (lane == 31) c += e + __expf(Gl) * hd;
        // dg_t = Σ_{u ≥ t} dG_u: a suffix sum over the lanes' pairs.
        float sfx = a + c;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const float o = __shfl_down_sync(0xffffffffu, sfx, off);
          if (lane + off < 32) sfx += o;
        }
        dg[(it.tok + 2 * lane) * H + it.h] = sfx;
        dg[(it.tok + 2 * lane + 1) * H + it.h] = sfx - a;
      }
    }
  }
}

template <typename T, int KIND>
std::vector<at::Tensor> bwd_impl(const Dims& d, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 double scale, const std::vector<at::Tensor>& saved, const at::Tensor& dO,
                                 const at::Tensor& dfinal, const std::function<void(const at::Tensor&)>& on_s0_grad) {
  const auto f32 = q.options().dtype(at::kFloat);
  const at::Tensor &G = saved[0], &Hsave = saved[1], &P = saved[2];
  auto dH = alloc({d.B, d.H, d.N, d.DK, d.DV}, q.options());
  auto ds0 = alloc({d.B, d.H, d.DK, d.DV}, f32);
  auto dv = alloc(v.sizes(), v.options());
  auto dq = alloc(q.sizes(), q.options());
  auto dk = alloc(k.sizes(), k.options());
  // GLA in bf16 with dk 96 or 128: one block a chunk holds every key column (dP = dO Vᵀ computed once, not once
  // per key tile); otherwise key tiles of 64 (32 for fp32 dk = 96, to fit shared memory).
  // (GLA only: the scalar decay sums its gate gradient over d in a [C, C+4] scratch, so TK ≤ 64 there.)
  constexpr bool kWide = sizeof(T) == 2 && KIND == kDiag;
  const int TKq = kWide && d.DK == 96    ? 96
                  : kWide && d.DK == 128 ? 128
                  : (d.DK % 64 == 0 ? 64 : 32),
            nkt = d.DK / TKq;
  // bf16 scalar decay and linear attention with dk 64 or 128: grad_frag_kernel (P recomputed: the forward
  // saved none)
  const bool frag = frag_path<T, KIND>(d.DK);
  at::Tensor dg;
  if (KIND == kDiag) dg = alloc(q.sizes(), f32);
  else if (KIND == kScalar) dg = alloc({d.B, d.T, d.H, frag ? 1 : nkt}, f32);  // partial sums over the key tiles

  // dV, dq, dk, dg of chunks [c0, c1): each reads only its chunk's saved states and state gradients.
  auto dv_chunks = [&](cudaStream_t st, int c0, int c1) {
    constexpr int TV = 64, NW = 8;
    dim3 grid(c1 - c0, d.DV / TV, d.B * d.H);
    auto run = [&](auto dk_tag) {
      constexpr int DK = decltype(dk_tag)::value;
      using L = DvSmem<T, KIND, DK, TV>;
      auto kern = dv_kernel<T, KIND, DK, TV, NW>;
      carry::kernels::primitives::allow_smem(kern, L::bytes);
      kern<<<grid, NW * 32, L::bytes, st>>>(
          reinterpret_cast<const T*>(k.data_ptr()), KIND == kNone ? nullptr : G.data_ptr<float>(),
          reinterpret_cast<const T*>(P.data_ptr()), reinterpret_cast<const T*>(dO.data_ptr()),
          reinterpret_cast<const T*>(dH.data_ptr()), reinterpret_cast<T*>(dv.data_ptr()), d.T, d.H, d.DV, c0);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (d.DK == 64) run(std::integral_constant<int, 64>());
    else if (d.DK == 96) run(std::integral_constant<int, 96>());
    else run(std::integral_constant<int, 128>());
  };
  auto dqk_chunks = [&](cudaStream_t st, int c0, int c1) {
    auto run_qk = [&](auto tk_tag) {
      constexpr int TK = decltype(tk_tag)::value, NW = TK / 8;  // one thread per diagonal block and column
      using L = QkSmem<T, KIND, TK>;
      auto kern = dqk_kernel<T, KIND, TK, NW>;
      carry::kernels::primitives::allow_smem(kern, L::bytes);
      dim3 grid(c1 - c0, nkt, d.B * d.H);
      kern<<<grid, NW * 32, L::bytes, st>>>(
          reinterpret_cast<const T*>(q.data_ptr()), reinterpret_cast<const T*>(k.data_ptr()),
          reinterpret_cast<const T*>(v.data_ptr()), KIND == kNone ? nullptr : G.data_ptr<float>(),
          reinterpret_cast<const T*>(Hsave.data_ptr()), reinterpret_cast<const T*>(dO.data_ptr()),
          reinterpret_cast<const T*>(dH.data_ptr()), reinterpret_cast<T*>(dq.data_ptr()),
          reinterpret_cast<T*>(dk.data_ptr()), KIND == kNone ? nullptr : dg.data_ptr<float>(), d.T, d.H, d.DK, d.DV,
          (float)scale, c0);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if constexpr (kWide) {
      if (TKq == 128) run_qk(std::integral_constant<int, 128>());
      else if (TKq == 96) run_qk(std::integral_constant<int, 96>());
      else run_qk(std::integral_constant<int, 64>());
    } else {
      if (TKq == 64) run_qk(std::integral_constant<int, 64>());
      else run_qk(std::integral_constant<int, 32>());
    }
  };
  // beside: the next piece's walk runs beside (walk_then_local), so one block an item: a persistent block
  // would hold its SM until every item is done, and the walk's next piece waits for whole SMs.
  auto chunk_grads = [&](cudaStream_t st, int c0, int c1, bool beside) {
    if constexpr (frag_kind<T, KIND>()) {
      if (frag) {
        auto run = [&](auto dk_tag) {
          constexpr int DK = decltype(dk_tag)::value;
          auto kern = grad_frag_kernel<KIND, DK>;
          carry::kernels::primitives::allow_smem(kern, GradFragSmem<DK>::bytes);
          const int items = (c1 - c0) * d.H * d.B;
          const int blocks = beside ? items : std::min(items, sm_count());
          kern<<<blocks, 256, GradFragSmem<DK>::bytes, st>>>(
              reinterpret_cast<const bf16*>(q.data_ptr()), reinterpret_cast<const bf16*>(k.data_ptr()),
              reinterpret_cast<const bf16*>(v.data_ptr()), KIND == kNone ? nullptr : G.data_ptr<float>(),
              reinterpret_cast<const bf16*>(Hsave.data_ptr()), reinterpret_cast<const bf16*>(dO.data_ptr()),
              reinterpret_cast<const bf16*>(dH.data_ptr()), reinterpret_cast<bf16*>(dq.data_ptr()),
              reinterpret_cast<bf16*>(dk.data_ptr()), reinterpret_cast<bf16*>(dv.data_ptr()),
              KIND == kNone ? nullptr : dg.data_ptr<float>(), d.T, d.H, d.DV, (float)scale, c0, c1 - c0, d.B);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        };
        if (d.DK == 64) run(std::integral_constant<int, 64>());
        else run(std::integral_constant<int, 128>());
        return;
      }
    }
    dv_chunks(st, c0, c1);
    dqk_chunks(st, c0, c1);
  };

  // the initial state's gradient to on_s0_grad before the chunk kernels: a send runs beside them
  walk_then_local<T, KIND, true>(d, q, dO, G, dfinal, dH, ds0, (float)scale, on_s0_grad, chunk_grads);
  if (KIND == kScalar) dg = dg.size(-1) == 1 ? dg.squeeze(-1) : dg.sum(-1);
  return {dq, dk, dv, dg, ds0};
}

template <typename T>
std::vector<at::Tensor> bwd_kind(Decay kind, const Dims& d, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, double scale, const std::vector<at::Tensor>& saved,
                                 const at::Tensor& dO, const at::Tensor& dfinal,
                                 const std::function<void(const at::Tensor&)>& on_s0_grad) {
  switch (kind) {
    case Decay::none: return bwd_impl<T, kNone>(d, q, k, v, scale, saved, dO, dfinal, on_s0_grad);
    case Decay::scalar: return bwd_impl<T, kScalar>(d, q, k, v, scale, saved, dO, dfinal, on_s0_grad);
    default: return bwd_impl<T, kDiag>(d, q, k, v, scale, saved, dO, dfinal, on_s0_grad);
  }
}

}  // namespace

std::vector<at::Tensor> decay_bwd(Decay kind, const at::Tensor& q_in, const at::Tensor& k_in,
                                  const at::Tensor& v_in, const at::Tensor& g_in, double scale,
                                  const at::Tensor& initial_state, const std::vector<at::Tensor>& saved,
                                  const at::Tensor& d_o, const at::Tensor& d_final_state, int segments,
                                  const std::function<void(const at::Tensor&)>& on_initial_state_grad) {
  Dims d = check_inputs("decay_bwd", kind, q_in, k_in, v_in, g_in);
  d.segments = segments;
  (void)initial_state;
  TORCH_CHECK(saved.size() == 3, "decay_bwd: expected the 3 tensors saved by decay_fwd, got ", saved.size());
  TORCH_CHECK(d_o.sizes() == v_in.sizes(), "decay_bwd: d_o must have v's shape ", v_in.sizes(), ", got ", d_o.sizes());
  TORCH_CHECK(d_final_state.sizes() == at::IntArrayRef({d.B, d.H, d.DK, d.DV}),
              "decay_bwd: d_final_state must be [B,H,dk,dv], got ", d_final_state.sizes());
  c10::cuda::CUDAGuard guard(q_in.device());
  auto q = dense(q_in), k = dense(k_in), v = dense(v_in);
  auto dO = dense(d_o.to(q.scalar_type()));
  auto dfinal = d_final_state.to(at::kFloat).contiguous();
  if (q.scalar_type() == at::kBFloat16)
    return bwd_kind<bf16>(kind, d, q, k, v, scale, saved, dO, dfinal, on_initial_state_grad);
  return bwd_kind<float>(kind, d, q, k, v, scale, saved, dO, dfinal, on_initial_state_grad);
}

}  // namespace carry::kernels::decay
