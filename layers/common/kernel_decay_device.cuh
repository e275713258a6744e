// Device pieces shared by the forward and backward kernels of the scalar/diagonal-decay class
// (layers/common/kernel_decay.cuh): the state recurrence over chunks (one
// kernel, run forward for the states and in reverse for their gradients), and tile copies.
#pragma once

#include "layers/common/kernel_tiles.cuh"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>

namespace carry_decay {
using namespace carry_tiles;

constexpr int kNone = 0, kScalar = 1, kDiag = 2;

constexpr size_t al128(size_t x) { return (x + 127) & ~size_t(127); }

// Copy a ROWS x COLS tile of T from shared (row stride lds) to global (row stride gs), 16 bytes a step.
template <typename T, int ROWS, int COLS, int NT>
__device__ __forceinline__ void copy_tile_out(T* g, long gs, const T* s, int lds) {
  constexpr int E = 16 / sizeof(T), VPR = COLS / E;
  for (int i = threadIdx.x; i < ROWS * VPR; i += NT) {
    const int r = i / VPR, c = (i % VPR) * E;
    *reinterpret_cast<uint4*>(g + r * gs + c) = *reinterpret_cast<const uint4*>(s + r * lds + c);
  }
}

// The decay G (cumulated in the chunk) of row t and key column d, for the three kinds; Gs holds a
// [64][LG] tile (diag) or 64 values (scalar).
template <int KIND>
__device__ __forceinline__ float gate(const float* Gs, int LG, int t, int d) {
  if constexpr (KIND == kDiag) return Gs[t * LG + d];
  else if constexpr (KIND == kScalar) return Gs[t];
  else return 0.f;
}

// The state recurrence over chunks for one TK x TV tile of one head's state (rows of the state are
// independent under a scalar or diagonal transport, so the grid tiles both dk and dv).
// Forward (REV = false): X = k, Y = v, S starts at the initial state;
//   per chunk n: Hsave[n] = S, then S ← e^{Γ} ⊙ S + (X ⊙ e^{Γ − G})ᵀ Y   (Γ = G at the chunk's end).
// Reverse (REV = true): X = q, Y = dO, S starts at the final state's gradient, chunks from last to first;
//   per chunk n: Hsave[n] = S (the gradient of the state leaving chunk n), then
//   S ← e^{Γ} ⊙ S + scale · (X ⊙ e^{G})ᵀ Y.   Sfinal gets the last S (final state / initial state's gradient).
// Grid ((dk/TK)·(dv/TV), H, B·NS); NW warps. X, Y, G of the next chunk load while this one is used.
// Segments (NS > 1): block z = b·NS + j walks only the L chunks of segment j, from the initial state
// (forward, j = 0; reverse, j = NS−1) or from zero (the others), and leaves its last S in
// Send[b,h,j]; segment_fix_kernel then adds the states carried in from the other segments.
template <typename T, int KIND, bool REV, int TK, int TV, int NW>
__global__ void __launch_bounds__(NW * 32) state_kernel(const T* __restrict__ X, const T* __restrict__ Y,
                                                        const float* __restrict__ G, const float* __restrict__ S0,
                                                        T* __restrict__ Hsave, float* __restrict__ Sfinal, int Tn,
                                                        int H, int DK, int DV, float scale, int NS, int L,
                                                        float* __restrict__ SegG) {
  constexpr int C = kChunk, NT = NW * 32, P = pad_of<T>();
  constexpr int LX = TK + P, LY = TV + P, LG = TK + 4, LS = TV + 4;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Xs = reinterpret_cast<T*>(smem);                                   // [2][C][LX]
  T* Ys = Xs + 2 * C * LX;                                              // [2][C][LY]
  float* Gs = reinterpret_cast<float*>(Ys + 2 * C * LY);                // [2][C][LG] or [2][C]
  float* Ss = Gs + (KIND == kDiag ? 2 * C * LG : 2 * C);                // [TK][LS]
  float* gam = Ss + TK * LS;                                            // [TK]

  const int ntv = DV / TV, ik = blockIdx.x / ntv, iv = blockIdx.x % ntv;
  const int h = blockIdx.y, b = blockIdx.z / NS, seg = blockIdx.z % NS, N = Tn / C;
  const int n_begin = seg * L, n_end = min(N, n_begin + L), count = n_end - n_begin;
  const bool from_given = REV ? seg == NS - 1 : seg == 0;
  const long xs = (long)H * DK, ys = (long)H * DV;
  const long bh = (long)b * H + h;
  const int k0 = ik * TK, v0 = iv * TV;

  auto issue = [&](int n, int buf) {
    const long tok = (long)b * Tn + (long)n * C;
    load_tile_async<T, C, TK, NT>(Xs + buf * C * LX, LX, X + tok * xs + (long)h * DK + k0, xs);
    load_tile_async<T, C, TV, NT>(Ys + buf * C * LY, LY, Y + tok * ys + (long)h * DV + v0, ys);
    if constexpr (KIND == kDiag)
      load_tile_async<float, C, TK, NT>(Gs + buf * C * LG, LG, G + tok * xs + (long)h * DK + k0, xs);
    cp_async_commit();
  };

  for (int i = threadIdx.x; i < TK * TV; i += NT) {
    const int r = i / TV, c = i % TV;
    Ss[r * LS + c] = from_given ? S0[(bh * DK + k0 + r) * DV + v0 + c] : 0.f;
  }
  float seg_gate = 0.f;  // thread d < TK: Σ Γ over this segment's chunks for row k0 + d (walking order)
  issue(REV ? n_end - 1 : n_begin, 0);
  for (int it = 0; it < count; ++it) {
    const int n = REV ? n_end - 1 - it : n_begin + it, buf = it & 1;
    if (it + 1 < count) {
      issue(REV ? n - 1 : n + 1, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    T* Xb = Xs + buf * C * LX;
    const T* Yb = Ys + buf * C * LY;
    float* Gb = Gs + buf * (KIND == kDiag ? C * LG : C);
    if constexpr (KIND == kScalar) {
      if (threadIdx.x < C) Gb[threadIdx.x] = G[((long)b * Tn + (long)n * C + threadIdx.x) * H + h];
    }
    __syncthreads();
    store_tile<T, TK, TV, NT>(Hsave + ((bh * N + n) * DK + k0) * DV + v0, DV, Ss, LS);
    // X ⊙ e^{Γ−G} (forward) or scale · X ⊙ e^{G} (reverse), in place; e^{Γ} per row of the state.
    for (int i = threadIdx.x; i < C * TK; i += NT) {
      const int t = i / TK, d = i % TK;
      const float Gt = gate<KIND>(Gb, LG, t, d), Gl = gate<KIND>(Gb, LG, C - 1, d);
      const float f = REV ? scale * __expf(Gt) : __expf(Gl - Gt);
      Xb[t * LX + d] = from_f<T>(to_f(Xb[t * LX + d]) * f);
    }
    if (threadIdx.x < TK) {
      const float gl = gate<KIND>(Gb, LG, C - 1, threadIdx.x);
      gam[threadIdx.x] = __expf(gl);
      seg_gate += gl;
    }
    __syncthreads();
    if constexpr (KIND != kNone) {
      for (int i = threadIdx.x; i < TK * TV; i += NT) Ss[(i / TV) * LS + i % TV] *= gam[i / TV];
      __syncthreads();
    }
    gemm<T, TK, TV, C, true, false, NW>(Xb, LX, Yb, LY, Ss, LS, true);
    __syncthreads();
  }
  // Several segments: the segment's summed gate per row, for segment_fix_kernel ([B,H,NS,DK]).
  if (NS > 1 && SegG != nullptr && iv == 0 && threadIdx.x < TK) SegG[(bh * NS + seg) * DK + k0 + threadIdx.x] = seg_gate;
  // One segment: the final state; several: this segment's end state, in Send = Sfinal [B,H,NS,DK,DV].
  float* out = Sfinal + ((bh * NS + seg) * DK + k0) * DV + v0;
  for (int i = threadIdx.x; i < TK * TV; i += NT) {
    const int r = i / TV, c = i % TV;
    out[r * DV + c] = Ss[r * LS + c];
  }
}

// Segments joined. For one TK x TV tile of one head and one segment j: the state carried into it
// from the segments before (forward) or after (reverse), X_j = Σ over those segments i of
// (the decay between i's end and j) ⊙ Send_i, is added to every saved state of the segment with the
// decay from the segment's edge to that chunk: forward Hsave[n] += e^{Σ_{m=start_j}^{n−1} Γ_m} ⊙ X_j,
// reverse Hsave[n] += e^{Σ_{m=n+1}^{end_j} Γ_m} ⊙ X_j (Γ_m the gate summed over chunk m). The block of
// the last segment in walking order also writes the final state (forward: e^{Σ_j Γ} ⊙ X + Send;
// reverse: the initial state's gradient). Grid ((dk/TK)·(dv/TV), H, B·NS), 128 threads.
template <typename T, int KIND, bool REV, int TK, int TV>
__global__ void __launch_bounds__(128) segment_fix_kernel(const float* __restrict__ G, const float* __restrict__ Send,
                                                          T* __restrict__ Hsave, float* __restrict__ Sfinal, int Tn,
                                                          int H, int DK, int DV, int NS, int L,
                                                          const float* __restrict__ SegG) {
  constexpr int C = kChunk, NT = 128, PER = TK * TV / NT;
  __shared__ float gam[TK];  // e^{decay} factors per row of the tile
  __shared__ float run[TK];  // a running sum of chunk gates per row (thread d < TK owns row d)
  const int ntv = DV / TV, ik = blockIdx.x / ntv, iv = blockIdx.x % ntv;
  const int h = blockIdx.y, b = blockIdx.z / NS, j = blockIdx.z % NS, N = Tn / C;
  const int k0 = ik * TK, v0 = iv * TV;
  const long bh = (long)b * H + h;
  const int GD = KIND == kDiag ? DK : 1;
  auto chunk_gate = [&](int m, int d) -> float {  // Γ_m for row k0 + d
    if constexpr (KIND == kNone) return 0.f;
    const long tok = (long)b * Tn + (long)m * C + C - 1;
    return G[(tok * H + h) * GD + (KIND == kDiag ? k0 + d : 0)];
  };
  auto seg_sum = [&](int i, int d) {  // Σ Γ over segment i (summed by state_kernel)
    if constexpr (KIND == kNone) return 0.f;
    return SegG[(bh * NS + i) * DK + k0 + d];
  };
  const bool first = REV ? j == NS - 1 : j == 0;  // walked first: nothing carried in
  const bool last = REV ? j == 0 : j == NS - 1;
  if (first && !last) return;
  float X[PER];
#pragma unroll
  for (int e = 0; e < PER; ++e) X[e] = 0.f;
  // X_j, walking the segments between the first one and j in order.
  const int step = REV ? -1 : 1;
  for (int i = REV ? NS - 1 : 0; i != j; i += step) {
    if (threadIdx.x < TK) gam[threadIdx.x] = __expf(seg_sum(i, threadIdx.x));
    __syncthreads();
    const float* Si = Send + ((bh * NS + i) * DK + k0) * DV + v0;
#pragma unroll
    for (int e = 0; e < PER; ++e) {
      const int idx = threadIdx.x + e * NT, r = idx / TV, c = idx % TV;
      X[e] = gam[r] * X[e] + Si[r * DV + c];
    }
    __syncthreads();
  }
  const int n0 = j * L, n1 = min(N, n0 + L);
  if (!first) {
    if (threadIdx.x < TK) run[threadIdx.x] = 0.f;
    for (int it = 0; it < n1 - n0; ++it) {
      const int n = REV ? n1 - 1 - it : n0 + it;
      if (threadIdx.x < TK) {
        gam[threadIdx.x] = __expf(run[threadIdx.x]);
        run[threadIdx.x] += chunk_gate(n, threadIdx.x);
      }
      __syncthreads();
      T* Hn = Hsave + ((bh * N + n) * DK + k0) * DV + v0;
#pragma unroll
      for (int e = 0; e < PER; ++e) {
        const int idx = threadIdx.x + e * NT, r = idx / TV, c = idx % TV;
        Hn[r * DV + c] = from_f<T>(to_f(Hn[r * DV + c]) + gam[r] * X[e]);
      }
      __syncthreads();
    }
  }
  if (last) {
    if (threadIdx.x < TK) gam[threadIdx.x] = first ? 0.f : __expf(seg_sum(j, threadIdx.x));
    __syncthreads();
    const float* Sj = Send + ((bh * NS + j) * DK + k0) * DV + v0;
    float* out = Sfinal + (bh * DK + k0) * DV + v0;
#pragma unroll
    for (int e = 0; e < PER; ++e) {
      const int idx = threadIdx.x + e * NT, r = idx / TV, c = idx % TV;
      out[r * DV + c] = gam[r] * X[e] + Sj[r * DV + c];
    }
  }
}

template <typename T, int KIND, int TK, int TV>
constexpr size_t state_smem() {
  constexpr int C = kChunk, P = pad_of<T>();
  return (size_t)2 * C * (TK + P) * sizeof(T) + (size_t)2 * C * (TV + P) * sizeof(T) +
         (KIND == kDiag ? (size_t)2 * C * (TK + 4) * 4 : (size_t)2 * C * 4) + (size_t)TK * (TV + 4) * 4 + TK * 4;
}

}  // namespace carry_decay

namespace carry_decay {

// Launch the state recurrence (forward or reverse) with 32 x 32 state tiles and 4 warps.
template <typename T, int KIND, bool REV>
void launch_state(const at::Tensor& X, const at::Tensor& Y, const at::Tensor& G, const at::Tensor& S0,
                  at::Tensor& Hsave, at::Tensor& Sfinal, int B, int Tn, int H, int DK, int DV, float scale,
                  cudaStream_t stream, int segments = 0) {
  constexpr int TK = 32, TV = 32, NW = 4;
  constexpr size_t smem = state_smem<T, KIND, TK, TV>();
  auto kern = state_kernel<T, KIND, REV, TK, TV, NW>;
  cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  // Segments: enough blocks to fill the GPU (about 2048 of 4 warps) with at least 4 chunks each;
  // segments = 1 (or a short sequence) walks the chunks in order, like the ATen forms.
  const int N = Tn / kChunk, base = (DK / TK) * (DV / TV) * H * B;
  int NS = segments > 0 ? segments : std::max(1, std::min(N / 4, (2048 + base - 1) / base));
  NS = std::max(1, std::min(NS, N));
  const int L = (N + NS - 1) / NS;
  NS = (N + L - 1) / L;
  at::Tensor Send = NS == 1 ? Sfinal : at::empty({B, H, NS, DK, DV}, Sfinal.options());
  at::Tensor SegG = NS == 1 || KIND == kNone ? at::Tensor() : at::empty({B, H, NS, DK}, Sfinal.options());
  dim3 grid((DK / TK) * (DV / TV), H, B * NS);
  kern<<<grid, NW * 32, smem, stream>>>(reinterpret_cast<const T*>(X.data_ptr()),
                                        reinterpret_cast<const T*>(Y.data_ptr()),
                                        KIND == kNone ? nullptr : G.data_ptr<float>(), S0.data_ptr<float>(),
                                        reinterpret_cast<T*>(Hsave.data_ptr()), Send.data_ptr<float>(), Tn, H,
                                        DK, DV, scale, NS, L, SegG.defined() ? SegG.data_ptr<float>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (NS > 1) {
    segment_fix_kernel<T, KIND, REV, TK, TV><<<grid, 128, 0, stream>>>(
        KIND == kNone ? nullptr : G.data_ptr<float>(), Send.data_ptr<float>(), reinterpret_cast<T*>(Hsave.data_ptr()),
        Sfinal.data_ptr<float>(), Tn, H, DK, DV, NS, L, SegG.defined() ? SegG.data_ptr<float>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace carry_decay
