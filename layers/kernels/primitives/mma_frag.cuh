// Device pieces shared by the delta rule's register-fragment kernels (fwd.cu, bwd.cu).
#pragma once

#include "layers/kernels/primitives/tiles.cuh"

namespace carry::kernels::primitives {

// P = scale·(QKᵀ ⊙ Γ), causal (Γ_rs = e^{G_r − G_s} for s ≤ r, else 0), written to shared bf16 Pb.
// Eight warps: warp w computes rows 16·(w%4) and columns 32·(w/4) of the C×C matrix.
template <int DK>
__device__ __forceinline__ void causal_p_bf16(const carry::kernels::primitives::bf16* sQ, const carry::kernels::primitives::bf16* sK, int LK,
                                              const float* sG, float scale, carry::kernels::primitives::bf16* sPb, int LPb) {
  using namespace carry::kernels::primitives;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int m0 = (warp & 3) * 16, n0 = (warp >> 2) * 32;
  float p[4][4] = {};
  frag_mma<4, DK, false, true>(p, sQ, LK, sK, LK, m0, n0);
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = m0 + g + hf * 8, s = n0 + nt * 8 + 2 * t4;
      const float x0 = s <= r ? scale * p[nt][2 * hf] * __expf(sG[r] - sG[s]) : 0.f;
      const float x1 = s + 1 <= r ? scale * p[nt][2 * hf + 1] * __expf(sG[r] - sG[s + 1]) : 0.f;
      *reinterpret_cast<unsigned*>(sPb + r * LPb + s) = tc::pack_bf16(x0, x1);
    }
  }
}

// v = A·B for this warp's 16 rows at m0 and 16 columns at n0 (two n8-tiles), over K = DK: A row-major
// [m][k] (bf16, lda), B row-major [k][n] (bf16, ldb). The k-steps alternate between two accumulator sets
// (two chains of DK/32 dependent mma each) summed at the end: the state walks' per-chunk products,
// W·S (forward) and K·dS (reverse), whose chains set the walks' pace.
template <int DK>
__device__ __forceinline__ void frag_mma_2chain(float (&v)[2][4], const carry::kernels::primitives::bf16* A, int lda,
                                                const carry::kernels::primitives::bf16* B, int ldb, int m0, int n0) {
  using namespace carry::kernels::primitives;
  float w2[2][4] = {};
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) v[nt][e] = 0.f;
#pragma unroll
  for (int k0 = 0; k0 < DK; k0 += 32) {
    unsigned a[4], bb[4], a2[4], bb2[4];
    tc::load_a(a, A, lda, m0, k0);
    tc::load_b2_t(bb, B, ldb, k0, n0);
    tc::load_a(a2, A, lda, m0, k0 + 16);
    tc::load_b2_t(bb2, B, ldb, k0 + 16, n0);
    tc::mma16816(v[0], a, bb[0], bb[1]);
    tc::mma16816(v[1], a, bb[2], bb[3]);
    tc::mma16816(w2[0], a2, bb2[0], bb2[1]);
    tc::mma16816(w2[1], a2, bb2[2], bb2[3]);
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) v[nt][e] += w2[nt][e];
}

// The start shared by the output and intra-chunk dV kernels (the delta rule's and the decay class's
// output): Q and K of the chunk (one cp.async group), the first two of the dv loop's `ntile` 64-wide
// tiles (load_tile(v0, buffer) issues and commits one group), the chunk's G (gc[t·gstride]; zeros
// without a gate, gc null); then, once Q and K have landed, P (causal_p_bf16). The caller's loop waits
// for its tiles.
template <int DK, int NT, typename LoadTile>
__device__ __forceinline__ void load_qk_and_p(carry::kernels::primitives::bf16* sQ, carry::kernels::primitives::bf16* sK, int LK,
                                              const carry::kernels::primitives::bf16* qc, const carry::kernels::primitives::bf16* kc, long rowk,
                                              LoadTile&& load_tile, int ntile, float* sG, const float* gc,
                                              long gstride, float scale, carry::kernels::primitives::bf16* sPb, int LPb) {
  using namespace carry::kernels::primitives;
  constexpr int C = kChunk;
  const float gv = threadIdx.x < C && gc ? gc[threadIdx.x * gstride] : 0.f;  // read before the copies
  load_tile_async<bf16, C, DK, NT>(sQ, LK, qc, rowk);
  load_tile_async<bf16, C, DK, NT>(sK, LK, kc, rowk);
  cp_async_commit();
  load_tile(0, 0);
  if (ntile > 1) load_tile(64, 1);
  if (threadIdx.x < C) sG[threadIdx.x] = gv;
  if (ntile > 1) cp_async_wait<2>();
  else cp_async_wait<1>();
  __syncthreads();
  causal_p_bf16<DK>(sQ, sK, LK, sG, scale, sPb, LPb);
}

// Warp 0 of a chunk-gradient kernel (call with threadIdx.x < 32): dG at the chunk's last token gets
// Σ kd + e^{G_C}·<dH', H> (sRed: the NW warps' partials of <dH', H>), then dg = the reverse cumulative
// sum of dG within the chunk, written to out[r·stride].
template <int NW>
__device__ __forceinline__ void finish_dg(float* sDG, const float* sKD, float* sCS, const float* sRed, float gl,
                                          float* out, long stride) {
  constexpr int C = carry::kernels::primitives::kChunk;
  const int tid = threadIdx.x;
  float kd = sKD[2 * tid] + sKD[2 * tid + 1];
  for (int off = 16; off > 0; off >>= 1) kd += __shfl_xor_sync(0xffffffffu, kd, off);
  float hsum = 0.f;
  for (int w = 0; w < NW; ++w) hsum += sRed[w];
  if (tid == 0) sDG[C - 1] += kd + expf(gl) * hsum;
  __syncwarp();
  sCS[2 * tid] = sDG[2 * tid];
  sCS[2 * tid + 1] = sDG[2 * tid + 1];
  __syncwarp();
  carry::kernels::primitives::warp_cumsum64(sCS);
  __syncwarp();
  const float tot = sCS[C - 1];
  for (int r = tid; r < C; r += 32) out[(long)r * stride] = tot - sCS[r] + sDG[r];
}

}  // namespace carry::kernels::primitives
