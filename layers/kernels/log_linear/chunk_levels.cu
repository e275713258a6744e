// The levels inside a 64-token chunk of log-linear Mamba-2 (api.h, chunk_levels_fwd/bwd): the chunk's decayed
// causal attention with each pair (t, s) weighted by λ_t at its level bit_width(t xor s).
//
// Forward: one thread block owns one chunk of one head and a 64- or 128-wide tile of v; it copies q, k
//   (64 × dk) and the v tile into shared memory, forms P = QKᵀ ⊙ F (F_ts = e^{G_t − G_s} λ_t[level], s ≤ t) in
//   registers (8 warps, 16 rows × 32 columns each) and stores it bf16 in shared memory, then O = P·V
//   (16 rows × half the tile a warp). HBM: q, k, v and o once; FLOPs 2·64·(dk + tile) a token.
// Backward: one thread block owns one chunk of one head with all of dv; it forms S = QKᵀ and dP = dO·Vᵀ in
//   registers, then P = S ⊙ F and dS = dP ⊙ F (bf16, shared), D = dP ⊙ P and E = dP ⊙ S ⊙ e^{G_t − G_s}
//   (fp32, shared); dQ = dS·K, dK = dSᵀ·Q, dV = Pᵀ·dO on tensor cores; dG_t = Σ_s D_ts − Σ_s D_st (then the
//   reverse cumulative sum within the chunk gives dg), dλ_t[ℓ] = Σ_{s at level ℓ} E_ts. HBM: q, k, v, dO in,
//   dq, dk, dv, dg, dλ out, once.
#include "layers/kernels/log_linear/api.h"

#include "layers/kernels/primitives/host.h"
#include "layers/kernels/primitives/tiles.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace carry::kernels::log_linear {
namespace {

using carry::kernels::primitives::bf16;
namespace pr = carry::kernels::primitives;

constexpr int kLevels = 7;  // levels 0..6 inside a 64-token chunk

__device__ __forceinline__ int level_of(int t, int s) { return 32 - __clz(t ^ s); }

// The chunk's G (inclusive cumulative sum of g) and λ rows 0..6 into shared memory; call with the copies in
// flight, then wait and __syncthreads, then finish_g.
__device__ __forceinline__ void load_g_lam(float* sG, float* sL, const float* g, const float* lam, long row0, int bh,
                                          int n, int T, int L) {
  if (threadIdx.x < 64) sG[threadIdx.x] = g[row0 + threadIdx.x];
  for (int idx = threadIdx.x; idx < kLevels * 64; idx += 256)
    sL[idx] = lam[((long)bh * L + idx / 64) * T + (long)n * 64 + idx % 64];
}

template <int DK, int DYT>
__global__ void __launch_bounds__(256) fwd_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                  const bf16* __restrict__ v, const float* __restrict__ g,
                                                  const float* __restrict__ lam, float* __restrict__ out, int T, int dv,
                                                  int L) {
  constexpr int LK = DK + 8, LV = DYT + 8, LP = 64 + 8, NT8 = DYT / 16;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sK = sQ + 64 * LK;
  bf16* sV = sK + 64 * LK;
  bf16* sP = sV + 64 * LV;
  float* sG = reinterpret_cast<float*>(sP + 64 * LP);
  float* sL = sG + 64;
  const int n = blockIdx.x, bh = blockIdx.y, tile0 = blockIdx.z * DYT, tid = threadIdx.x;
  const long row0 = (long)bh * T + (long)n * 64;
  pr::load_tile_async<bf16, 64, DK, 256>(sQ, LK, q + row0 * DK, DK);
  pr::load_tile_async<bf16, 64, DK, 256>(sK, LK, k + row0 * DK, DK);
  pr::load_tile_async<bf16, 64, DYT, 256>(sV, LV, v + row0 * dv + tile0, dv);
  pr::cp_async_commit();
  load_g_lam(sG, sL, g, lam, row0, bh, n, T, L);
  pr::cp_async_wait<0>();
  __syncthreads();
  if (tid < 32) pr::warp_cumsum64(sG);
  __syncthreads();
  const int warp = tid >> 5, lane = tid & 31, g4 = lane >> 2, t4 = lane & 3;
  const int m0 = (warp & 3) * 16, n0 = (warp >> 2) * 32;
  {
    float p[4][4] = {};
    pr::frag_mma<4, DK, false, true>(p, sQ, LK, sK, LK, m0, n0);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = m0 + g4 + hf * 8, s = n0 + nt * 8 + 2 * t4;
        const float x0 = s <= r ? p[nt][2 * hf] * __expf(sG[r] - sG[s]) * sL[level_of(r, s) * 64 + r] : 0.f;
        const float x1 =
            s + 1 <= r ? p[nt][2 * hf + 1] * __expf(sG[r] - sG[s + 1]) * sL[level_of(r, s + 1) * 64 + r] : 0.f;
        *reinterpret_cast<unsigned*>(sP + r * LP + s) = pr::tc::pack_bf16(x0, x1);
      }
  }
  __syncthreads();
  float acc[NT8][4] = {};
  const int n1 = (warp >> 2) * (DYT / 2);
  pr::frag_mma<NT8, 64, false, false>(acc, sP, LP, sV, LV, m0, n1);
  pr::frag_store_f32<NT8>(out + row0 * dv + tile0, dv, acc, m0, n1);
}

template <int DK, int DV>
__global__ void __launch_bounds__(256) bwd_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                  const bf16* __restrict__ v, const float* __restrict__ g,
                                                  const float* __restrict__ lam, const bf16* __restrict__ d_o,
                                                  float* __restrict__ dq, float* __restrict__ dk, float* __restrict__ dv,
                                                  float* __restrict__ dg, float* __restrict__ dlam, int T, int L) {
  constexpr int LK = DK + 8, LV = DV + 8, LP = 64 + 8, LE = 64 + 1;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sK = sQ + 64 * LK;
  bf16* sV = sK + 64 * LK;
  bf16* sO = sV + 64 * LV;  // dO
  bf16* sP = sO + 64 * LV;
  bf16* sS = sP + 64 * LP;  // dS
  float* sD = reinterpret_cast<float*>(sS + 64 * LP);
  float* sE = sD + 64 * LE;
  float* sG = sE + 64 * LE;
  float* sL = sG + 64;
  float* sDG = sL + kLevels * 64;
  const int n = blockIdx.x, bh = blockIdx.y, tid = threadIdx.x;
  const long row0 = (long)bh * T + (long)n * 64;
  pr::load_tile_async<bf16, 64, DK, 256>(sQ, LK, q + row0 * DK, DK);
  pr::load_tile_async<bf16, 64, DK, 256>(sK, LK, k + row0 * DK, DK);
  pr::load_tile_async<bf16, 64, DV, 256>(sV, LV, v + row0 * DV, DV);
  pr::load_tile_async<bf16, 64, DV, 256>(sO, LV, d_o + row0 * DV, DV);
  pr::cp_async_commit();
  load_g_lam(sG, sL, g, lam, row0, bh, n, T, L);
  pr::cp_async_wait<0>();
  __syncthreads();
  if (tid < 32) pr::warp_cumsum64(sG);
  __syncthreads();
  const int warp = tid >> 5, lane = tid & 31, g4 = lane >> 2, t4 = lane & 3;
  const int m0 = (warp & 3) * 16, n0 = (warp >> 2) * 32;
  {
    float sf[4][4] = {}, dp[4][4] = {};
    pr::frag_mma<4, DK, false, true>(sf, sQ, LK, sK, LK, m0, n0);
    pr::frag_mma<4, DV, false, true>(dp, sO, LV, sV, LV, m0, n0);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = m0 + g4 + hf * 8;
        float P[2], dS[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int s = n0 + nt * 8 + 2 * t4 + j;
          const float S = sf[nt][2 * hf + j], dP = dp[nt][2 * hf + j];
          float pv = 0.f, ds = 0.f, dd = 0.f, ee = 0.f;
          if (s <= r) {
            const float ex = __expf(sG[r] - sG[s]), F = ex * sL[level_of(r, s) * 64 + r];
            pv = S * F, ds = dP * F, dd = dP * pv, ee = dP * S * ex;
          }
          P[j] = pv, dS[j] = ds;
          sD[r * LE + s] = dd;
          sE[r * LE + s] = ee;
        }
        const int s = n0 + nt * 8 + 2 * t4;
        *reinterpret_cast<unsigned*>(sP + r * LP + s) = pr::tc::pack_bf16(P[0], P[1]);
        *reinterpret_cast<unsigned*>(sS + r * LP + s) = pr::tc::pack_bf16(dS[0], dS[1]);
      }
  }
  __syncthreads();
  {  // dQ = dS·K, dK = dSᵀ·Q: 64 × dk, 16 rows × dk/2 columns a warp
    constexpr int NT8 = DK / 16;
    const int c0 = (warp >> 2) * (DK / 2);
    float a[NT8][4] = {};
    pr::frag_mma<NT8, 64, false, false>(a, sS, LP, sK, LK, m0, c0);
    pr::frag_store_f32<NT8>(dq + row0 * DK, DK, a, m0, c0);
    float b[NT8][4] = {};
    pr::frag_mma<NT8, 64, true, false>(b, sS, LP, sQ, LK, m0, c0);
    pr::frag_store_f32<NT8>(dk + row0 * DK, DK, b, m0, c0);
  }
  {  // dV = Pᵀ·dO: 64 × dv
    constexpr int NT8 = DV / 16;
    const int c0 = (warp >> 2) * (DV / 2);
    float a[NT8][4] = {};
    pr::frag_mma<NT8, 64, true, false>(a, sP, LP, sO, LV, m0, c0);
    pr::frag_store_f32<NT8>(dv + row0 * DV, DV, a, m0, c0);
  }
  if (tid < 64) {  // dG_t = Σ_s D_ts − Σ_s D_st
    float rs = 0.f, cs = 0.f;
    for (int s = 0; s < 64; ++s) rs += sD[tid * LE + s], cs += sD[s * LE + tid];
    sDG[tid] = rs - cs;
  } else if (tid < 128) {  // dλ_t[ℓ] = Σ_{s ≤ t at level ℓ} E_ts
    const int r = tid - 64;
    float acc[kLevels] = {};
    for (int s = 0; s <= r; ++s) {
      const float e = sE[r * LE + s];
      const int lv = level_of(r, s);
#pragma unroll
      for (int l = 0; l < kLevels; ++l) acc[l] += l == lv ? e : 0.f;
    }
#pragma unroll
    for (int l = 0; l < kLevels; ++l) dlam[((long)bh * L + l) * T + (long)n * 64 + r] = acc[l];
  }
  __syncthreads();
  if (tid < 32) {  // dg_u = Σ_{t ≥ u} dG_t, in a fixed order
    float* sC = sD;  // free now
    sC[2 * tid] = sDG[2 * tid];
    sC[2 * tid + 1] = sDG[2 * tid + 1];
    __syncwarp();
    pr::warp_cumsum64(sC);
    __syncwarp();
    const float tot = sC[63];
    for (int u = tid; u < 64; u += 32) dg[row0 + u] = tot - sC[u] + sDG[u];
  }
}

void check_in(const char* what, const at::Tensor& t, at::ScalarType dt, int dims) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == dt && t.dim() == dims && t.is_contiguous() &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              "log-linear chunk levels: ", what, " must be a contiguous 16-byte aligned CUDA ", dt, " tensor of ", dims,
              " dimensions, got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}
const bf16* P(const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); }

void check_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& lam) {
  check_in("q", q, at::kBFloat16, 3);
  check_in("k", k, at::kBFloat16, 3);
  check_in("v", v, at::kBFloat16, 3);
  check_in("g", g, at::kFloat, 2);
  check_in("lam", lam, at::kFloat, 3);
  const int64_t BH = q.size(0), T = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(T % 64 == 0 && (dk == 64 || dk == 128) && (dv == 64 || dv == 128 || dv == 256) && k.sizes() == q.sizes() &&
                  v.size(0) == BH && v.size(1) == T && g.size(0) == BH && g.size(1) == T && lam.size(0) == BH &&
                  lam.size(1) >= kLevels && lam.size(2) == T,
              "log-linear chunk levels: q, k [BH,T,64|128], v [BH,T,64|128|256], g [BH,T], lam [BH,L>=7,T] with T a "
              "multiple of 64; got q ", q.sizes(), ", v ", v.sizes(), ", g ", g.sizes(), ", lam ", lam.sizes());
}

template <int DK, int DYT>
void launch_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& lam,
                at::Tensor& out) {
  const int BH = (int)q.size(0), T = (int)q.size(1), dv = (int)v.size(2);
  const int smem = 2 * (2 * 64 * (DK + 8) + 64 * (DYT + 8) + 64 * 72) + 4 * (64 + kLevels * 64);
  pr::allow_smem(fwd_kernel<DK, DYT>, smem);
  fwd_kernel<DK, DYT><<<dim3(T / 64, BH, dv / DYT), 256, smem, at::cuda::getCurrentCUDAStream()>>>(
      P(q), P(k), P(v), g.data_ptr<float>(), lam.data_ptr<float>(), out.data_ptr<float>(), T, dv, (int)lam.size(1));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int DK, int DV>
void launch_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& lam,
                const at::Tensor& d_o, std::vector<at::Tensor>& r) {
  const int BH = (int)q.size(0), T = (int)q.size(1);
  const int smem = 2 * (2 * 64 * (DK + 8) + 2 * 64 * (DV + 8) + 2 * 64 * 72) + 4 * (2 * 64 * 65 + 64 + kLevels * 64 + 64);
  pr::allow_smem(bwd_kernel<DK, DV>, smem);
  bwd_kernel<DK, DV><<<dim3(T / 64, BH), 256, smem, at::cuda::getCurrentCUDAStream()>>>(
      P(q), P(k), P(v), g.data_ptr<float>(), lam.data_ptr<float>(), P(d_o), r[0].data_ptr<float>(),
      r[1].data_ptr<float>(), r[2].data_ptr<float>(), r[3].data_ptr<float>(), r[4].data_ptr<float>(), T,
      (int)lam.size(1));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor chunk_levels_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& lam) {
  check_all(q, k, v, g, lam);
  c10::cuda::CUDAGuard guard(q.device());
  const int64_t dk = q.size(2), dv = v.size(2);
  auto out = at::empty({q.size(0), q.size(1), dv}, g.options());
  if (dk == 64) dv == 64 ? launch_fwd<64, 64>(q, k, v, g, lam, out) : launch_fwd<64, 128>(q, k, v, g, lam, out);
  else dv == 64 ? launch_fwd<128, 64>(q, k, v, g, lam, out) : launch_fwd<128, 128>(q, k, v, g, lam, out);
  return out;
}

std::vector<at::Tensor> chunk_levels_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& g, const at::Tensor& lam, const at::Tensor& d_o) {
  check_all(q, k, v, g, lam);
  check_in("d_o", d_o, at::kBFloat16, 3);
  TORCH_CHECK(d_o.sizes() == v.sizes(), "log-linear chunk levels: d_o must have v's shape ", v.sizes(), ", got ",
              d_o.sizes());
  c10::cuda::CUDAGuard guard(q.device());
  const int64_t dk = q.size(2), dv = v.size(2);
  auto f = g.options();
  std::vector<at::Tensor> r{at::empty(q.sizes(), f), at::empty(k.sizes(), f), at::empty(v.sizes(), f),
                            at::empty(g.sizes(), f), at::zeros(lam.sizes(), f)};
  if (dk == 64) {
    if (dv == 64) launch_bwd<64, 64>(q, k, v, g, lam, d_o, r);
    else if (dv == 128) launch_bwd<64, 128>(q, k, v, g, lam, d_o, r);
    else launch_bwd<64, 256>(q, k, v, g, lam, d_o, r);
  } else {
    if (dv == 64) launch_bwd<128, 64>(q, k, v, g, lam, d_o, r);
    else if (dv == 128) launch_bwd<128, 128>(q, k, v, g, lam, d_o, r);
    else launch_bwd<128, 256>(q, k, v, g, lam, d_o, r);
  }
  return r;
}

}  // namespace carry::kernels::log_linear
