// Log-linear Gated DeltaNet's levels above the chunk in one walk over the chunks (api.h, level_walk_fwd and
// level_walk_bwd; the math in layers/log_linear/level_walk.h).
//
// Every level above the chunk walks the same chunks with the same operands (W, K̃, P and U of the chunk), so
// one thread block walks all the levels of a group at once: grid (dv/16, B·H, groups), 8 warps, warp w the
// state of level j0 + w for the block's 16 columns of dv. The state is held transposed, Sᵀ [16 × dk] fp32,
// in the warp's mma accumulators, whose layout is the A operand's: Vᵀ = Uᵀ − Sᵀ·Wᵀ, Rᵀ = Sᵀ·Pᵀ and
// Sᵀ ← γ Sᵀ + Vᵀ·K̃ are m16n8k16 products with A from registers (bf16 roundings of Sᵀ and Vᵀ, as the delta
// rule's walks round H and V_new) and B from the chunk's tiles in shared memory, loaded once a chunk for the
// block (cp.async, double-buffered). Per chunk and level: 3·2·16·64·dk FLOPs (reading) or 2 (writing);
// per chunk and block: 3·64·dk·2 + 64·16·2 bytes read from HBM for all its levels.
// Forward: the read-outs λ_t[ℓ]·Rᵀ of the block's levels go to shared slots, summed in level order into o (one
// o a group, summed by the host when several): no atomics, the same bits every run. With keep_states the
// state entering each chunk is stored bf16, transposed ([BH,N,J,dv,dk]: a warp's rows of 4-byte pairs).
// Reverse: dSᵀ per warp, dVᵀ = dSᵀ·K̃ᵀ, dSᵀ ← γ dSᵀ − dVᵀ·W + dRᵀ·P with dRᵀ = (λ[ℓ] ⊙ dO)ᵀ built from the
// chunk's dO tile; the gradient of the state leaving each chunk is stored bf16, transposed.
#include "layers/kernels/log_linear/api.h"

#include "layers/kernels/primitives/host.h"
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

constexpr int kC = 64, kWarps = 8, kThreads = kWarps * 32, kBV = 16;

constexpr size_t al128(size_t x) { return (x + 127) & ~size_t(127); }

// Shared memory of the walks: two buffers of the chunk's tiles (three [64][dk] bf16 tiles, a [64][16] bf16 tile
// of U or dO, the group's λ rows), then (forward) the warps' read-out slots.
template <int DK>
struct WalkSmem {
  static constexpr int LD = DK + 8, LU = kBV + 8, LS = kC + 4;
  static constexpr size_t tile = size_t(kC) * LD * 2;
  static constexpr size_t oA = 0, oB = tile, oP = 2 * tile, oU = 3 * tile, oL = al128(oU + size_t(kC) * LU * 2);
  static constexpr size_t buf = al128(oL + size_t(kWarps) * kC * 4);
  static constexpr size_t oSlots = 2 * buf;
  static constexpr size_t fwd_bytes = oSlots + size_t(kWarps) * kBV * LS * 4;
  static constexpr size_t bwd_bytes = 2 * buf;
};

// The walk's place: chunk n's absolute start and level `level`'s flags there.
__device__ __forceinline__ bool reads_at(long pos, int level) { return (pos >> (level - 1)) & 1; }
__device__ __forceinline__ bool starts_at(long pos, int level) { return (pos & ((1L << level) - 1)) == 0; }

// Chunk n's tiles into buffer `sb`: a, b, p [64][dk] (rows of a [BH,T,dk] tensor), the 16-column tile of u
// ([BH,T,dv] from column col0) and the λ rows of the group's nlev levels.
template <int DK>
__device__ __forceinline__ void load_chunk(unsigned char* sb, const bf16* a, const bf16* b, const bf16* p, const bf16* u,
                                           const float* lam, int bh, int n, int T, int DV, int col0, int J, int j0,
                                           int nlev) {
  using S = WalkSmem<DK>;
  constexpr int PR = DK / 8;  // 16-byte pieces a row
  const long row0 = (long)bh * T + (long)n * kC;
  bf16* sa = reinterpret_cast<bf16*>(sb + S::oA);
  bf16* sbb = reinterpret_cast<bf16*>(sb + S::oB);
  bf16* sp = reinterpret_cast<bf16*>(sb + S::oP);
  for (int i = threadIdx.x; i < kC * PR; i += kThreads) {
    const int r = i / PR, c = (i % PR) * 8;
    pr::cp_async16(sa + r * S::LD + c, a + (row0 + r) * DK + c);
    pr::cp_async16(sbb + r * S::LD + c, b + (row0 + r) * DK + c);
    if (p) pr::cp_async16(sp + r * S::LD + c, p + (row0 + r) * DK + c);
  }
  if (u) {
    bf16* su = reinterpret_cast<bf16*>(sb + S::oU);
    for (int i = threadIdx.x; i < kC * 2; i += kThreads) {
      const int r = i / 2, c = (i % 2) * 8;
      pr::cp_async16(su + r * S::LU + c, u + (row0 + r) * DV + col0 + c);
    }
  }
  float* sl = reinterpret_cast<float*>(sb + S::oL);
  for (int i = threadIdx.x; i < nlev * (kC / 4); i += kThreads) {
    const int w = i / (kC / 4), c = (i % (kC / 4)) * 4;
    pr::cp_async16(sl + w * kC + c, lam + ((long)bh * J + j0 + w) * T + (long)n * kC + c);
  }
  pr::cp_async_commit();
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

// c [NT8][4] += A·B, A from fragments a [K/16][4], B (k × n, n from 0) from shared storage: [n][k] (TB) or [k][n].
template <int NT8, int KS, bool TB>
__device__ __forceinline__ void mma_ab(float (&c)[NT8][4], const tc::u32 (&a)[KS][4], const bf16* s, int ld) {
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
    for (int np = 0; np < NT8 / 2; ++np) {
      tc::u32 b[4];
      if constexpr (TB) tc::load_b2(b, s, ld, kk * 16, np * 16);
      else tc::load_b2_t(b, s, ld, kk * 16, np * 16);
      tc::mma16816(c[2 * np], a[kk], b[0], b[1]);
      tc::mma16816(c[2 * np + 1], a[kk], b[2], b[3]);
    }
  }
}

template <int NT8>
__device__ __forceinline__ void zero(float (&c)[NT8][4]) {
#pragma unroll
  for (int i = 0; i < NT8; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
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

template <int DK>
__global__ void __launch_bounds__(kThreads, 1)
    walk_fwd_kernel(const bf16* __restrict__ W, const bf16* __restrict__ U, const bf16* __restrict__ Kt,
                    const bf16* __restrict__ P, const float* __restrict__ gamma, const float* __restrict__ lam,
                    const float* __restrict__ X0, float* __restrict__ o, float* __restrict__ finals,
                    bf16* __restrict__ states, int BH, int T, int DV, int J, int lpg, long offset, int first_level) {
  using S = WalkSmem<DK>;
  constexpr int NS = DK / 8, KS = DK / 16;
  extern __shared__ __align__(128) unsigned char smem[];
  const int col0 = blockIdx.x * kBV, bh = blockIdx.y, grp = blockIdx.z, N = T / kC;
  const int j0 = grp * lpg, nlev = min(lpg, J - j0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const bool active = warp < nlev;
  const int j = j0 + warp, level = first_level + j;
  float* slots = reinterpret_cast<float*>(smem + S::oSlots);
  o += (long)grp * BH * T * DV;

  float s[NS][4];
  if (active && X0) load_state<DK>(s, X0 + ((long)j * BH + bh) * DK * DV, DV, col0);
  else zero(s);

  load_chunk<DK>(smem, W, Kt, P, U, lam, bh, 0, T, DV, col0, J, j0, nlev);
  pr::cp_async_wait<0>();
  __syncthreads();
  for (int n = 0; n < N; ++n) {
    unsigned char* sb = smem + (n & 1) * S::buf;
    if (n + 1 < N) load_chunk<DK>(smem + ((n + 1) & 1) * S::buf, W, Kt, P, U, lam, bh, n + 1, T, DV, col0, J, j0, nlev);
    const long pos = offset + (long)n * kC;
    if (active) {
      const bf16* sW = reinterpret_cast<const bf16*>(sb + S::oA);
      const bf16* sK = reinterpret_cast<const bf16*>(sb + S::oB);
      const bf16* sP = reinterpret_cast<const bf16*>(sb + S::oP);
      const bf16* sU = reinterpret_cast<const bf16*>(sb + S::oU);
      const float* sL = reinterpret_cast<const float*>(sb + S::oL) + warp * kC;
      if (n > 0 && starts_at(pos, level)) zero(s);
      if (states) store_state_t<DK>(states + (((long)bh * N + n) * J + j) * DV * DK + (long)col0 * DK, s);
      const bool read = reads_at(pos, level);
      tc::u32 sa[KS][4];
      to_a<KS>(sa, s);
      float v[8][4];
      if (read) {
        zero(v);
        mma_ab<8, KS, true>(v, sa, sP, S::LD);  // Rᵀ = Sᵀ·Pᵀ
        float* slot = slots + warp * kBV * S::LS;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int t = nt * 8 + 2 * t4 + (e & 1), r = g + (e >> 1) * 8;
            slot[r * S::LS + t] = v[nt][e] * sL[t];
          }
      }
      zero(v);
      mma_ab<8, KS, true>(v, sa, sW, S::LD);  // Sᵀ·Wᵀ
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = nt * 8 + 2 * t4 + (e & 1), r = g + (e >> 1) * 8;
          const float u = read ? 0.f : __bfloat162float(sU[t * S::LU + r]);
          v[nt][e] = u - v[nt][e];
        }
      tc::u32 va[4][4];
      to_a<4>(va, v);
      const float gm = gamma[(long)bh * N + n];
#pragma unroll
      for (int nt = 0; nt < NS; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= gm;
      mma_ab<NS, 4, false>(s, va, sK, S::LD);  // Sᵀ += Vᵀ·K̃
    }
    __syncthreads();
    // The group's read-outs, summed in level order: o rows of chunk n, columns col0..col0+15.
    for (int i = threadIdx.x; i < kC * kBV; i += kThreads) {
      const int t = i / kBV, r = i % kBV;
      float acc = 0.f;
      for (int w = 0; w < nlev; ++w)
        if (reads_at(pos, first_level + j0 + w)) acc += slots[(w * kBV + r) * S::LS + t];
      o[((long)bh * T + (long)n * kC + t) * DV + col0 + r] = acc;
    }
    pr::cp_async_wait<0>();
    __syncthreads();
  }
  if (active) store_state<DK>(finals + ((long)j * BH + bh) * DK * DV, s, DV, col0);
}

template <int DK>
__global__ void __launch_bounds__(kThreads, 1)
    walk_bwd_kernel(const bf16* __restrict__ W, const bf16* __restrict__ Kt, const bf16* __restrict__ P,
                    const float* __restrict__ gamma, const float* __restrict__ lam, const bf16* __restrict__ dO,
                    const float* __restrict__ dF, bf16* __restrict__ dstates, float* __restrict__ dX0, int BH, int T,
                    int DV, int J, int lpg, long offset, int first_level) {
  using S = WalkSmem<DK>;
  constexpr int NS = DK / 8, KS = DK / 16;
  extern __shared__ __align__(128) unsigned char smem[];
  const int col0 = blockIdx.x * kBV, bh = blockIdx.y, grp = blockIdx.z, N = T / kC;
  const int j0 = grp * lpg, nlev = min(lpg, J - j0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const bool active = warp < nlev;
  const int j = j0 + warp, level = first_level + j;

  float ds[NS][4];
  if (active && dF) load_state<DK>(ds, dF + ((long)j * BH + bh) * DK * DV, DV, col0);
  else zero(ds);

  load_chunk<DK>(smem + ((N - 1) & 1) * S::buf, W, Kt, P, dO, lam, bh, N - 1, T, DV, col0, J, j0, nlev);
  pr::cp_async_wait<0>();
  __syncthreads();
  for (int n = N - 1; n >= 0; --n) {
    unsigned char* sb = smem + (n & 1) * S::buf;
    if (n > 0) load_chunk<DK>(smem + ((n - 1) & 1) * S::buf, W, Kt, P, dO, lam, bh, n - 1, T, DV, col0, J, j0, nlev);
    const long pos = offset + (long)n * kC;
    if (active) {
      const bf16* sW = reinterpret_cast<const bf16*>(sb + S::oA);
      const bf16* sK = reinterpret_cast<const bf16*>(sb + S::oB);
      const bf16* sP = reinterpret_cast<const bf16*>(sb + S::oP);
      const bf16* sD = reinterpret_cast<const bf16*>(sb + S::oU);
      const float* sL = reinterpret_cast<const float*>(sb + S::oL) + warp * kC;
      if (n + 1 < N && starts_at(pos + kC, level)) zero(ds);
      store_state_t<DK>(dstates + (((long)bh * N + n) * J + j) * DV * DK + (long)col0 * DK, ds);
      tc::u32 da[KS][4];
      to_a<KS>(da, ds);
      float dv[8][4];
      zero(dv);
      mma_ab<8, KS, true>(dv, da, sK, S::LD);  // dVᵀ = dSᵀ·K̃ᵀ
      tc::u32 na[4][4];
      to_a<4>(na, dv, -1.f);
      const float gm = gamma[(long)bh * N + n];
#pragma unroll
      for (int nt = 0; nt < NS; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[nt][e] *= gm;
      mma_ab<NS, 4, false>(ds, na, sW, S::LD);  // dSᵀ −= dVᵀ·W
      if (reads_at(pos, level)) {
        tc::u32 ra[4][4];  // dRᵀ = (λ ⊙ dO)ᵀ: rows dv, columns the chunk's tokens
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const int t = kk * 16 + 2 * t4;
          auto x = [&](int tt, int r) { return sL[tt] * __bfloat162float(sD[tt * S::LU + r]); };
          ra[kk][0] = tc::pack_bf16(x(t, g), x(t + 1, g));
          ra[kk][1] = tc::pack_bf16(x(t, g + 8), x(t + 1, g + 8));
          ra[kk][2] = tc::pack_bf16(x(t + 8, g), x(t + 9, g));
          ra[kk][3] = tc::pack_bf16(x(t + 8, g + 8), x(t + 9, g + 8));
        }
        mma_ab<NS, 4, false>(ds, ra, sP, S::LD);  // dSᵀ += dRᵀ·P
      }
    }
    pr::cp_async_wait<0>();
    __syncthreads();
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
                  (!P.defined() || (P.sizes() == W.sizes() && P.scalar_type() == at::kBFloat16)),
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
// a level, at least enough for 8 levels a block.
int levels_per_group(const Dims& d) {
  const int tiles = (d.DV / kBV) * d.BH;
  int groups = std::max((d.J + kWarps - 1) / kWarps, std::min(d.J, std::max(1, pr::sm_count() / tiles)));
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
  auto launch = [&](auto kernel, size_t bytes) {
    pr::allow_smem(kernel, bytes);
    kernel<<<grid, kThreads, bytes, stream>>>(
        reinterpret_cast<const bf16*>(W.data_ptr()), reinterpret_cast<const bf16*>(U.data_ptr()),
        reinterpret_cast<const bf16*>(Kt.data_ptr()), reinterpret_cast<const bf16*>(P.data_ptr()),
        gamma.data_ptr<float>(), lam.data_ptr<float>(), x0, o.data_ptr<float>(), finals.data_ptr<float>(),
        keep_states ? reinterpret_cast<bf16*>(states.data_ptr()) : nullptr, d.BH, d.T, d.DV, d.J, lpg, (long)offset,
        (int)first_level);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (d.DK == 64) launch(walk_fwd_kernel<64>, WalkSmem<64>::fwd_bytes);
  else launch(walk_fwd_kernel<128>, WalkSmem<128>::fwd_bytes);
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
  auto launch = [&](auto kernel, size_t bytes) {
    pr::allow_smem(kernel, bytes);
    kernel<<<grid, kThreads, bytes, stream>>>(
        reinterpret_cast<const bf16*>(W.data_ptr()), reinterpret_cast<const bf16*>(Kt.data_ptr()),
        reinterpret_cast<const bf16*>(P.data_ptr()), gamma.data_ptr<float>(), lam.data_ptr<float>(),
        reinterpret_cast<const bf16*>(dO.data_ptr()), df, reinterpret_cast<bf16*>(dstates.data_ptr()),
        dX0.data_ptr<float>(), d.BH, d.T, d.DV, d.J, lpg, (long)offset, (int)first_level);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (d.DK == 64) launch(walk_bwd_kernel<64>, WalkSmem<64>::bwd_bytes);
  else launch(walk_bwd_kernel<128>, WalkSmem<128>::bwd_bytes);
  return {dstates, dX0};
}

}  // namespace carry::kernels::log_linear
