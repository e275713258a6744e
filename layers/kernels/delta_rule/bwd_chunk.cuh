// Stage 3 of the delta rule's backward (bwd.cu): the chunk-local gradients dq, dk, dv, dg, dbeta from
// H_c, dH_c, V_new, dV_new and T: bwd_chunk_kernel (fp32, shared tiles, FMA products) and
// bwd_chunk_reg_kernel (bf16, every C×dk and C×C intermediate in mma.sync registers). Device code of
// bwd.cu's translation unit: included by bwd.cu alone, after its constants (al128, kBwdStateStages).
#pragma once

namespace carry::kernels::delta_rule {
namespace {

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
  if (stop == 1) return;  // timing one phase (chunk_stop, bwd.cu: 0, all phases)
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
  if (stop == 2) return;  // timing one phase (chunk_stop, bwd.cu: 0, all phases)
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
  if (stop == 3) return;  // timing one phase (chunk_stop, bwd.cu: 0, all phases)
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
  if (stop == 4) return;  // timing one phase (chunk_stop, bwd.cu: 0, all phases)
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

}  // namespace
}  // namespace carry::kernels::delta_rule
