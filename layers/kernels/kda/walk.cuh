// KDA's state walks (layers/kda/kernel_form.h states them), private to walk.cu and to their CPU run
// through the warp emulation (tests/emulation/kda_walk_emu.cpp). CARRY_LA_EMU: the includer provides
// threadIdx, blockIdx, SMEM_DECL and __syncthreads (tests/emulation/warp_emulation.h).
//
// One block of 256 threads owns a tile of BV columns of one head's state [DK, DV] and walks the chunks
// (C = 64 tokens) in order, the tile in fp32 shared memory the whole way; grid (DV/BV, H, B). The
// columns are independent: a chunk's products mix rows (d) and tokens (c) only. Layouts: W, K_out, Q_s
// [B,H,N,C,DK], U, V_new, dO, dV [B,H,N,C,DV], decay [B,H,N,DK], states [B,H,N,DK,DV], S0, S_final
// [B,H,DK,DV], all fp32 and contiguous.
//
// Forward, per chunk: store S (the state entering it), V_new = U − W·S (thread (c, j): a row of W read
// by the warp at once, the state's column j), then S ← Diag(decay)·S + K_outᵀ·V_new (thread (d, j)).
// Reverse, per chunk from the last: store dS (the gradient of the state leaving it), dV = dV_pre +
// K_out·dS, then dS ← Diag(decay)·dS + Q_sᵀ·dO − Wᵀ·dV. Sums run over d or c in ascending order, so a
// walk cut at a chunk boundary and continued from the state there gives the whole walk's bits.
// Per chunk a block does 2·C·DK·BV multiply-adds forward (3· reverse) and reads the chunk's DK-wide rows
// (2·C·DK·4 bytes forward, 3·C·DK·4 reverse) from L2.
#pragma once

#ifndef CARRY_LA_EMU
#define SMEM_DECL extern __shared__ __align__(128) unsigned char smem[]
#endif

namespace carry::kernels::kda::walk {

constexpr int kChunk = 64;
constexpr int kThreads = 256;

template <int DK, int BV>
constexpr size_t fwd_smem() {
  return sizeof(float) * (DK * BV + 2 * kChunk * DK + 2 * kChunk * BV + DK);
}
template <int DK, int BV>
constexpr size_t bwd_smem() {
  return sizeof(float) * (DK * BV + 3 * kChunk * DK + 2 * kChunk * BV + DK);
}

// Rows [rows, width] of a row-major source with row stride `stride` (floats) from column `col` into a
// dense [rows, width] tile; every thread of the block takes part.
__device__ __forceinline__ void load_tile(float* dst, const float* src, int rows, int width, long stride, long col) {
  for (int i = threadIdx.x; i < rows * width; i += kThreads) dst[i] = src[(long)(i / width) * stride + col + i % width];
}
__device__ __forceinline__ void store_tile(float* dst, const float* src, int rows, int width, long stride, long col) {
  for (int i = threadIdx.x; i < rows * width; i += kThreads) dst[(long)(i / width) * stride + col + i % width] = src[i];
}

template <int DK, int BV>
__global__ void __launch_bounds__(kThreads) fwd_kernel(const float* __restrict__ W, const float* __restrict__ U,
                                                        const float* __restrict__ K_out,
                                                        const float* __restrict__ decay, const float* __restrict__ S0,
                                                        float* __restrict__ states, float* __restrict__ V_new,
                                                        float* __restrict__ S_final, int H, int N, int DV) {
  SMEM_DECL;
  float* S = reinterpret_cast<float*>(smem);  // [DK][BV]
  float* Ws = S + DK * BV;                     // [C][DK]
  float* Ks = Ws + kChunk * DK;                // [C][DK]
  float* Us = Ks + kChunk * DK;                // [C][BV]: U, then V_new
  float* Vs = Us + kChunk * BV;                // [C][BV]
  float* dec = Vs + kChunk * BV;               // [DK]
  const long bh = (long)blockIdx.z * H + blockIdx.y;
  const long j0 = (long)blockIdx.x * BV;
  const int j = threadIdx.x % BV, grp = threadIdx.x / BV;
  constexpr int kGroups = kThreads / BV;
  load_tile(S, S0 + bh * DK * DV, DK, BV, DV, j0);
  for (int n = 0; n < N; ++n) {
    const long chunk = bh * N + n;
    load_tile(Ws, W + chunk * kChunk * DK, 1, kChunk * DK, 0, 0);
    load_tile(Ks, K_out + chunk * kChunk * DK, 1, kChunk * DK, 0, 0);
    load_tile(Us, U + chunk * kChunk * DV, kChunk, BV, DV, j0);
    for (int d = threadIdx.x; d < DK; d += kThreads) dec[d] = decay[chunk * DK + d];
    __syncthreads();
    store_tile(states + chunk * DK * DV, S, DK, BV, DV, j0);
    for (int c = grp; c < kChunk; c += kGroups) {
      float acc = 0.f;
      const float* wr = Ws + c * DK;
#pragma unroll 8
      for (int d = 0; d < DK; ++d) acc += wr[d] * S[d * BV + j];
      Vs[c * BV + j] = Us[c * BV + j] - acc;
    }
    __syncthreads();
    store_tile(V_new + chunk * kChunk * DV, Vs, kChunk, BV, DV, j0);
    for (int d = grp; d < DK; d += kGroups) {
      float acc = 0.f;
#pragma unroll 8
      for (int c = 0; c < kChunk; ++c) acc += Ks[c * DK + d] * Vs[c * BV + j];
      S[d * BV + j] = dec[d] * S[d * BV + j] + acc;
    }
    __syncthreads();
  }
  store_tile(S_final + bh * DK * DV, S, DK, BV, DV, j0);
}

template <int DK, int BV>
__global__ void __launch_bounds__(kThreads) bwd_kernel(const float* __restrict__ Q_s, const float* __restrict__ dO,
                                                        const float* __restrict__ W, const float* __restrict__ K_out,
                                                        const float* __restrict__ decay,
                                                        const float* __restrict__ dV_pre,
                                                        const float* __restrict__ dS_final,
                                                        float* __restrict__ out_grads, float* __restrict__ dV,
                                                        float* __restrict__ dS0, int H, int N, int DV) {
  SMEM_DECL;
  float* dS = reinterpret_cast<float*>(smem);  // [DK][BV]
  float* Qs = dS + DK * BV;                     // [C][DK]
  float* Ws = Qs + kChunk * DK;                 // [C][DK]
  float* Ks = Ws + kChunk * DK;                 // [C][DK]
  float* dOs = Ks + kChunk * DK;                // [C][BV]
  float* dVs = dOs + kChunk * BV;               // [C][BV]: dV_pre, then dV
  float* dec = dVs + kChunk * BV;               // [DK]
  const long bh = (long)blockIdx.z * H + blockIdx.y;
  const long j0 = (long)blockIdx.x * BV;
  const int j = threadIdx.x % BV, grp = threadIdx.x / BV;
  constexpr int kGroups = kThreads / BV;
  load_tile(dS, dS_final + bh * DK * DV, DK, BV, DV, j0);
  for (int n = N - 1; n >= 0; --n) {
    const long chunk = bh * N + n;
    load_tile(Qs, Q_s + chunk * kChunk * DK, 1, kChunk * DK, 0, 0);
    load_tile(Ws, W + chunk * kChunk * DK, 1, kChunk * DK, 0, 0);
    load_tile(Ks, K_out + chunk * kChunk * DK, 1, kChunk * DK, 0, 0);
    load_tile(dOs, dO + chunk * kChunk * DV, kChunk, BV, DV, j0);
    load_tile(dVs, dV_pre + chunk * kChunk * DV, kChunk, BV, DV, j0);
    for (int d = threadIdx.x; d < DK; d += kThreads) dec[d] = decay[chunk * DK + d];
    __syncthreads();
    store_tile(out_grads + chunk * DK * DV, dS, DK, BV, DV, j0);
    for (int c = grp; c < kChunk; c += kGroups) {  // each thread its own (c, j): in place
      float acc = 0.f;
      const float* kr = Ks + c * DK;
#pragma unroll 8
      for (int d = 0; d < DK; ++d) acc += kr[d] * dS[d * BV + j];
      dVs[c * BV + j] += acc;
    }
    __syncthreads();
    store_tile(dV + chunk * kChunk * DV, dVs, kChunk, BV, DV, j0);
    for (int d = grp; d < DK; d += kGroups) {
      float acc = 0.f;
#pragma unroll 8
      for (int c = 0; c < kChunk; ++c) acc += Qs[c * DK + d] * dOs[c * BV + j] - Ws[c * DK + d] * dVs[c * BV + j];
      dS[d * BV + j] = dec[d] * dS[d * BV + j] + acc;
    }
    __syncthreads();
  }
  store_tile(dS0 + bh * DK * DV, dS, DK, BV, DV, j0);
}

}  // namespace carry::kernels::kda::walk
