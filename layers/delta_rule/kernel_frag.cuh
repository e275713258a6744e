// Device pieces shared by the delta rule's register-fragment kernels (kernel_fwd.cu, kernel_bwd.cu).
#pragma once

#include "layers/common/kernel_tiles.cuh"

namespace carry_gdn {

// P = scale·(QKᵀ ⊙ Γ), causal (Γ_rs = e^{G_r − G_s} for s ≤ r, else 0), written to shared bf16 Pb.
// Eight warps: warp w computes rows 16·(w%4) and columns 32·(w/4) of the C×C matrix.
template <int DK>
__device__ __forceinline__ void causal_p_bf16(const carry_tiles::bf16* sQ, const carry_tiles::bf16* sK, int LK,
                                              const float* sG, float scale, carry_tiles::bf16* sPb, int LPb) {
  using namespace carry_tiles;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int m0 = (warp & 3) * 16, n0 = (warp >> 2) * 32;
  float p[4][4] = {};
  frag_mma<4, DK, false, true>(p, sQ, LK, sK, LK, m0, n0);
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = m0 + g + hf * 8, s = n0 + nt * 8 + 2 * t4;
      const float x0 = s <= r ? scale * p[nt][2 * hf] * expf(sG[r] - sG[s]) : 0.f;
      const float x1 = s + 1 <= r ? scale * p[nt][2 * hf + 1] * expf(sG[r] - sG[s + 1]) : 0.f;
      *reinterpret_cast<unsigned*>(sPb + r * LPb + s) = tc::pack_bf16(x0, x1);
    }
  }
}

}  // namespace carry_gdn
