// Device pieces shared by the forward and backward kernels of the scalar/diagonal-decay class
// (layers/kernels/decay/api.h): the state recurrence over chunks (one
// kernel, run forward for the states and in reverse for their gradients), and tile copies.
#pragma once

#include "layers/kernels/primitives/host.h"
#include "layers/kernels/primitives/tiles.cuh"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <utility>

namespace carry::kernels::decay {
using namespace carry::kernels::primitives;

constexpr int kNone = 0, kScalar = 1, kDiag = 2;

constexpr size_t al128(size_t x) { return (x + 127) & ~size_t(127); }

// The register-fragment path: bf16 scalar decay and linear attention (frag_kind) with dk 64 or 128
// (frag_path). Its forward output is out_frag_kernel, which saves no P, and its backward's chunk
// gradients are grad_frag_kernel, which recomputes P: the forward and the backward must agree on it.
template <typename T, int KIND>
constexpr bool frag_kind() { return sizeof(T) == 2 && KIND != kDiag; }
template <typename T, int KIND>
constexpr bool frag_path(int dk) { return frag_kind<T, KIND>() && dk % 64 == 0; }

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

// 4-byte asynchronous copy (the scalar gate: one float a token, H apart in global memory).
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
}

// bf16: the same recurrence with the state tile in mma.sync accumulators (the plan of the delta
// rule's fwd_state_mma_kernel, without its W·S product). A block of NW warps owns a TK = 16·NW by
// TV tile of one head's state; warp w owns its rows 16w..16w+15 and all TV columns (TV/8 m16n8
// accumulators). X, Y (and G) of a chunk stream through NBUF shared-memory stages, NBUF − 1 chunks
// in flight. Per chunk, one block barrier, then each warp alone: writes S to Hsave[n] through a
// warp-private staging tile (16-byte stores), decays S by e^{Γ} per row, and adds X̃ᵀ·Y in 4 k-steps
// of 16 tokens, where X̃ᵀ's fragments are scaled in registers right after ldmatrix by the
// recurrence's factor (rounded to bf16, as state_kernel rounds X̃ in shared memory). Every warp keeps
// TV = 32 columns (a short chain of instructions a chunk), so the grid holds as many warps as the
// state has 16 x 32 pieces; the launcher puts four of them in a block (two for dk = 96), which share
// X's chunk in shared memory: with one warp a block every warp loaded its own 16 columns of X and
// the L2 traffic set the pace (ncu, H=16, dk=dv=128: L2 77% busy). SPLIT (with four warps) adds the
// chunk's product into two fresh accumulator sets (even and odd k-steps) and then S ← e^{Γ} ⊙ S +
// U₀ + U₁, so S's dependency chain a chunk is one FMA. Grid and segments as state_kernel.
// __launch_bounds__(NW·32, 1): one block an SM lets ptxas take the registers it wants (linear
// attention's reverse split walk 76 → 118 at dk = 128, TV = 32; at TV = 64 96 with a spill → 180),
// the same operations and bits (`carry bench kernels --checksum`: the same hashes). Measured on an
// H200, forward+backward ms, without → with: H=16, dk=dv=128, 16384 tokens simple GLA 0.996 → 0.915,
// GLA 2.142 → 2.029, linear attention 0.953 → 0.892; 131072 GLA 14.927 / 15.012 → 14.726 / 14.790
// (the others level); H=4, dk=128, dv=256 (segments) simple GLA 1.025 / 1.055 → 0.949 at 32768 and
// 3.681 / 3.692 → 3.544 at 131072, GLA 7.037 / 6.976 → 6.828.
template <int KIND, int NW, int TV, int NBUF>
struct StateMmaSmem {
  static constexpr int C = kChunk, TK = 16 * NW, LX = TK + 8, LY = TV + 8, LG = TK + 4;
  static constexpr size_t oX = 0;
  static constexpr size_t oY = oX + (size_t)NBUF * C * LX * 2;
  static constexpr size_t oG = oY + (size_t)NBUF * C * LY * 2;
  static constexpr size_t oSt = oG + (size_t)NBUF * (KIND == kDiag ? C * LG : C) * 4;
  static constexpr size_t bytes = oSt + (size_t)NW * 16 * LY * 2;
  static_assert(bytes <= 227 * 1024, "state_mma_kernel shared memory");
};

// The factor X is scaled by, for token t and state row d: forward e^{Γ_d − G_td}, reverse
// scale · e^{G_td} (scalar decay: G_t; none: 1 or scale). Gb: the chunk's G stage; gl: Γ_d.
template <int KIND, bool REV>
__device__ __forceinline__ float state_factor(const float* Gb, int LG, int t, int d, float gl, float scale) {
  if constexpr (KIND == kNone) return REV ? scale : 1.f;
  const float gt = KIND == kDiag ? Gb[t * LG + d] : Gb[t];
  return REV ? scale * __expf(gt) : __expf(gl - gt);
}

template <int KIND, bool REV, int NW, int TV, int NBUF, bool SPLIT = false>
__global__ void __launch_bounds__(NW * 32, 1) state_mma_kernel(const bf16* __restrict__ X, const bf16* __restrict__ Y,
                                                            const float* __restrict__ G, const float* __restrict__ S0,
                                                            bf16* __restrict__ Hsave, float* __restrict__ Sfinal,
                                                            int Tn, int H, int DK, int DV, float scale, int NS, int L,
                                                            float* __restrict__ SegG, int c0, int c1) {
  using Sm = StateMmaSmem<KIND, NW, TV, NBUF>;
  constexpr int C = kChunk, TK = Sm::TK, NT = NW * 32, LX = Sm::LX, LY = Sm::LY, LG = Sm::LG, NTL = TV / 8;
  static_assert(NBUF >= 2 && TV % 16 == 0, "state_mma_kernel tiling");
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* Xs = reinterpret_cast<bf16*>(smem + Sm::oX);
  bf16* Ys = reinterpret_cast<bf16*>(smem + Sm::oY);
  float* Gs = reinterpret_cast<float*>(smem + Sm::oG);
  bf16* St = reinterpret_cast<bf16*>(smem + Sm::oSt);

  const int ntv = DV / TV, ik = blockIdx.x / ntv, iv = blockIdx.x % ntv;
  const int h = blockIdx.y, b = blockIdx.z / NS, seg = blockIdx.z % NS, N = Tn / C;
  // chunks [c0, c1) of the sequence's N (a piece of the walk; 0, N for the whole), cut into NS segments
  const int n_begin = c0 + seg * L, n_end = min(c1, n_begin + L), count = n_end - n_begin;
  const bool from_given = REV ? seg == NS - 1 : seg == 0;
  const long xs = (long)H * DK, ys = (long)H * DV, bh = (long)b * H + h;
  const int k0 = ik * TK, v0 = iv * TV;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const int r0 = 16 * warp;  // the warp's first state row in the tile
  constexpr int GSTAGE = KIND == kDiag ? C * LG : C;

  auto chunk_at = [&](int it) { return REV ? n_end - 1 - it : n_begin + it; };
  auto issue = [&](int it, int buf) {
    const long tok = (long)b * Tn + (long)chunk_at(it) * C;
    load_tile_async<bf16, C, TK, NT>(Xs + buf * C * LX, LX, X + tok * xs + (long)h * DK + k0, xs);
    load_tile_async<bf16, C, TV, NT>(Ys + buf * C * LY, LY, Y + tok * ys + (long)h * DV + v0, ys);
    if constexpr (KIND == kDiag) {
      load_tile_async<float, C, TK, NT>(Gs + buf * GSTAGE, LG, G + tok * xs + (long)h * DK + k0, xs);
    } else if constexpr (KIND == kScalar) {
      for (int t = tid; t < C; t += NT) cp_async4(Gs + buf * GSTAGE + t, G + (tok + t) * H + h);
    }
  };

  float acc[NTL][4];
#pragma unroll
  for (int j = 0; j < NTL; ++j) {
    const int col = v0 + 8 * j + 2 * t4;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const long row = bh * DK + k0 + r0 + g + 8 * hf;
      acc[j][2 * hf] = from_given ? S0[row * DV + col] : 0.f;
      acc[j][2 * hf + 1] = from_given ? S0[row * DV + col + 1] : 0.f;
    }
  }
  float seg_gate[2] = {0.f, 0.f};  // Σ Γ over this segment's chunks for rows r0+g and r0+g+8
#pragma unroll
  for (int s = 0; s < NBUF - 1; ++s) {
    if (s < count) issue(s, s);
    cp_async_commit();
  }
  bf16* st = St + warp * 16 * LY;
  const int da = r0 + g, db = da + 8;  // this lane's state rows (in the tile), as A-fragment rows
  for (int it = 0; it < count; ++it) {
    const int buf = it % NBUF, n = chunk_at(it);
    cp_async_wait<NBUF - 2>();
    __syncthreads();  // chunk it is in shared memory; every warp is past chunk it − 1 (its buffer is free)
    if (it + NBUF - 1 < count) issue(it + NBUF - 1, (it + NBUF - 1) % NBUF);
    cp_async_commit();
    const bf16* Xb = Xs + buf * C * LX;
    const bf16* Yb = Ys + buf * C * LY;
    const float* Gb = Gs + buf * GSTAGE;
    // Hsave[n] = S (bf16), through the staging tile
#pragma unroll
    for (int j = 0; j < NTL; ++j) {
      const int col = 8 * j + 2 * t4;
      *reinterpret_cast<unsigned*>(st + g * LY + col) = tc::pack_bf16(acc[j][0], acc[j][1]);
      *reinterpret_cast<unsigned*>(st + (g + 8) * LY + col) = tc::pack_bf16(acc[j][2], acc[j][3]);
    }
    __syncwarp();
    {
      bf16* hn = Hsave + ((bh * N + n) * DK + k0 + r0) * DV + v0;
      constexpr int VR = TV / 8;
#pragma unroll
      for (int i = lane; i < 16 * VR; i += 32) {
        const int r = i / VR, c = (i % VR) * 8;
        *reinterpret_cast<uint4*>(hn + (long)r * DV + c) = *reinterpret_cast<const uint4*>(st + r * LY + c);
      }
    }
    // S ← e^{Γ} ⊙ S
    float gla = 0.f, glb = 0.f;  // Γ of rows da, db
    float ea = 1.f, eb = 1.f;
    if constexpr (KIND != kNone) {
      gla = KIND == kDiag ? Gb[(C - 1) * LG + da] : Gb[C - 1];
      glb = KIND == kDiag ? Gb[(C - 1) * LG + db] : gla;
      seg_gate[0] += gla, seg_gate[1] += glb;
      ea = __expf(gla), eb = __expf(glb);
      if constexpr (!SPLIT) {
#pragma unroll
        for (int j = 0; j < NTL; ++j) acc[j][0] *= ea, acc[j][1] *= ea, acc[j][2] *= eb, acc[j][3] *= eb;
      }
    }
    // SPLIT: the chunk's product goes to two fresh accumulator sets (even and odd k-steps), independent of
    // S, and S ← e^{Γ} ⊙ S + U₀ + U₁ after them: S's chain a chunk is one FMA, not four dependent mma.
    float u[2][NTL][4];
    if constexpr (SPLIT) {
#pragma unroll
      for (int p = 0; p < 2; ++p)
#pragma unroll
        for (int j = 0; j < NTL; ++j) u[p][j][0] = u[p][j][1] = u[p][j][2] = u[p][j][3] = 0.f;
    }
    // S += X̃ᵀ Y; A fragment (16 rows d x 16 tokens): a0 (da; t, t+1), a1 (db; t, t+1), a2 (da; t+8, t+9),
    // a3 (db; t+8, t+9) with t = k + 2·t4.
#pragma unroll
    for (int k = 0; k < C; k += 16) {
      tc::u32 a[4];
      tc::load_a_t(a, Xb, LX, r0, k);
      // Linear attention's forward factor is 1: x · 1 rounds back to x, so the fragments stay as loaded.
      if constexpr (KIND != kNone || REV) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = k + 2 * t4 + (e >> 1) * 8, d = (e & 1) ? db : da;
          const float gl = (e & 1) ? glb : gla;
          const float2 x = tc::unpack_bf16(a[e]);
          a[e] = tc::pack_bf16(x.x * state_factor<KIND, REV>(Gb, LG, t, d, gl, scale),
                               x.y * state_factor<KIND, REV>(Gb, LG, t + 1, d, gl, scale));
        }
      }
#pragma unroll
      for (int jp = 0; jp < NTL / 2; ++jp) {
        tc::u32 bb[4];
        tc::load_b2_t(bb, Yb, LY, k, 16 * jp);
        if constexpr (SPLIT) {
          float(&up)[NTL][4] = u[(k >> 4) & 1];
          tc::mma16816(up[2 * jp], a, bb[0], bb[1]);
          tc::mma16816(up[2 * jp + 1], a, bb[2], bb[3]);
        } else {
          tc::mma16816(acc[2 * jp], a, bb[0], bb[1]);
          tc::mma16816(acc[2 * jp + 1], a, bb[2], bb[3]);
        }
      }
    }
    if constexpr (SPLIT) {
#pragma unroll
      for (int j = 0; j < NTL; ++j) {
        acc[j][0] = fmaf(acc[j][0], ea, u[0][j][0] + u[1][j][0]);
        acc[j][1] = fmaf(acc[j][1], ea, u[0][j][1] + u[1][j][1]);
        acc[j][2] = fmaf(acc[j][2], eb, u[0][j][2] + u[1][j][2]);
        acc[j][3] = fmaf(acc[j][3], eb, u[0][j][3] + u[1][j][3]);
      }
    }
  }
  if (NS > 1 && SegG != nullptr && iv == 0 && t4 == 0) {
    SegG[(bh * NS + seg) * DK + k0 + da] = seg_gate[0];
    SegG[(bh * NS + seg) * DK + k0 + db] = seg_gate[1];
  }
  float* out = Sfinal + ((bh * NS + seg) * DK + k0 + r0) * DV + v0;
#pragma unroll
  for (int j = 0; j < NTL; ++j) {
    const int col = 8 * j + 2 * t4;
    *reinterpret_cast<float2*>(out + g * DV + col) = make_float2(acc[j][0], acc[j][1]);
    *reinterpret_cast<float2*>(out + (g + 8) * DV + col) = make_float2(acc[j][2], acc[j][3]);
  }
}

// Eight consecutive elements of a row (16- or 32-byte aligned) as floats, and back.
template <typename T>
__device__ __forceinline__ void load_row8(const T* p, float (&f)[8]) {
  if constexpr (sizeof(T) == 2) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 x = tc::unpack_bf16(w[e]);
      f[2 * e] = x.x;
      f[2 * e + 1] = x.y;
    }
  } else {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
  }
}
template <typename T>
__device__ __forceinline__ void store_row8(T* p, const float (&f)[8]) {
  if constexpr (sizeof(T) == 2) {
    *reinterpret_cast<uint4*>(p) = make_uint4(tc::pack_bf16(f[0], f[1]), tc::pack_bf16(f[2], f[3]),
                                              tc::pack_bf16(f[4], f[5]), tc::pack_bf16(f[6], f[7]));
  } else {
    reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
  }
}

// Segments joined. For one TK x TV tile of one head and one segment j: the state carried into it
// from the segments before (forward) or after (reverse), X_j = Σ over those segments i of
// (the decay between i's end and j) ⊙ Send_i, is added to every saved state of the segment with the
// decay from the segment's edge to that chunk: forward Hsave[n] += e^{Σ_{m=start_j}^{n−1} Γ_m} ⊙ X_j,
// reverse Hsave[n] += e^{Σ_{m=n+1}^{end_j} Γ_m} ⊙ X_j (Γ_m the gate summed over chunk m). The block of
// the last segment in walking order also writes the final state (forward: e^{Σ_j Γ} ⊙ X + Send;
// reverse: the initial state's gradient). Grid ((dk/TK)·(dv/TV), H, B·NS), 128 threads: a thread
// owns 8 consecutive columns of one state row (16-byte loads and stores), keeps that row's decay
// sums itself (no block barriers), and reads kUnroll chunks' states before writing any of them, so
// several loads are in flight: the pass runs at memory speed.
template <typename T, int KIND, bool REV, int TK, int TV>
__global__ void __launch_bounds__(128) segment_fix_kernel(const float* __restrict__ G, const float* __restrict__ Send,
                                                          T* __restrict__ Hsave, float* __restrict__ Sfinal, int Tn,
                                                          int H, int DK, int DV, int NS, int L,
                                                          const float* __restrict__ SegG) {
  constexpr int C = kChunk, VPR = TV / 8, kUnroll = 4;
  static_assert(TK * VPR == 128, "one thread per 8 columns of a state row");
  const int ntv = DV / TV, ik = blockIdx.x / ntv, iv = blockIdx.x % ntv;
  const int h = blockIdx.y, b = blockIdx.z / NS, j = blockIdx.z % NS, N = Tn / C;
  const int r = threadIdx.x / VPR, col = iv * TV + (threadIdx.x % VPR) * 8, row = ik * TK + r;
  const long bh = (long)b * H + h;
  const int GD = KIND == kDiag ? DK : 1;
  auto chunk_gate = [&](int m) -> float {  // Γ_m for this row
    if constexpr (KIND == kNone) return 0.f;
    const long tok = (long)b * Tn + (long)m * C + C - 1;
    return G[(tok * H + h) * GD + (KIND == kDiag ? row : 0)];
  };
  auto seg_sum = [&](int i) -> float {  // Σ Γ over segment i (summed by state_kernel)
    if constexpr (KIND == kNone) return 0.f;
    return SegG[(bh * NS + i) * DK + row];
  };
  const bool first = REV ? j == NS - 1 : j == 0;  // walked first: nothing carried in
  const bool last = REV ? j == 0 : j == NS - 1;
  if (first && !last) return;
  float X[8] = {};
  // X_j, walking the segments between the first one and j in order.
  const int step = REV ? -1 : 1;
  for (int i = REV ? NS - 1 : 0; i != j; i += step) {
    const float gm = __expf(seg_sum(i));
    float si[8];
    load_row8(Send + ((bh * NS + i) * DK + row) * DV + col, si);
#pragma unroll
    for (int e = 0; e < 8; ++e) X[e] = gm * X[e] + si[e];
  }
  const int n0 = j * L, n1 = min(N, n0 + L), count = n1 - n0;
  if (!first) {
    float run = 0.f;  // Σ Γ from the segment's edge to the chunk
    for (int it0 = 0; it0 < count; it0 += kUnroll) {
      float hv[kUnroll][8], fac[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (it0 + u < count) {
          const int n = REV ? n1 - 1 - (it0 + u) : n0 + it0 + u;
          load_row8(Hsave + ((bh * N + n) * DK + row) * DV + col, hv[u]);
          fac[u] = __expf(run);
          run += chunk_gate(n);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (it0 + u < count) {
          const int n = REV ? n1 - 1 - (it0 + u) : n0 + it0 + u;
#pragma unroll
          for (int e = 0; e < 8; ++e) hv[u][e] = hv[u][e] + fac[u] * X[e];
          store_row8(Hsave + ((bh * N + n) * DK + row) * DV + col, hv[u]);
        }
      }
    }
  }
  if (last) {
    const float gm = first ? 0.f : __expf(seg_sum(j));
    float sj[8];
    load_row8(Send + ((bh * NS + j) * DK + row) * DV + col, sj);
#pragma unroll
    for (int e = 0; e < 8; ++e) sj[e] = gm * X[e] + sj[e];
    store_row8(Sfinal + (bh * DK + row) * DV + col, sj);
  }
}

template <typename T, int KIND, int TK, int TV>
constexpr size_t state_smem() {
  constexpr int C = kChunk, P = pad_of<T>();
  return (size_t)2 * C * (TK + P) * sizeof(T) + (size_t)2 * C * (TV + P) * sizeof(T) +
         (KIND == kDiag ? (size_t)2 * C * (TK + 4) * 4 : (size_t)2 * C * 4) + (size_t)TK * (TV + 4) * 4 + TK * 4;
}

}  // namespace carry::kernels::decay

namespace carry::kernels::decay {

using carry::kernels::primitives::sm_count;

// Launch the state recurrence (forward or reverse). bf16: state_mma_kernel (16 x 32 pieces, one a warp,
// four warps a block with split accumulators where dk is a multiple of 64, else two; 3 stages). Measured
// on an H100 (ncu, scalar decay, H=16, dk=dv=128, T=131072, forward / reverse state pass): one warp a
// block 2.31 / 2.44 ms, two 1.55 / 1.57, four 1.46 / 1.44, four split 1.36 / 1.38, eight 2.05 / 2.06;
// at H=4, dk=96, dv=192 two warps beat one and split (GLA 7.254 → 6.998 ms forward+backward at 131072).
// fp32: state_kernel (32 x 32 tiles on shared memory, 4 warps). Segments: the forced count,
// else (bf16) at least 16 chunks each and, when the tiles alone give fewer than half the SM
// schedulers a warp, enough for two warps a scheduler, otherwise enough for one (the join pass
// reads and writes the saved states once more). Measured on an H200: at H=16, dk=dv=128 (512 tiles)
// two segments ran slower than one (simple GLA 1.797 → 1.895 ms forward+backward at 16k); at H=4
// (dk=128, dv=256: 256 tiles; dk=96, dv=192: 144) two warps a scheduler ran faster than one (1.827 →
// 1.716 and 1.468 → 1.260 ms). fp32: enough to fill the GPU with about 2048 blocks, at least 4 chunks each.
// The segments launch_state cuts the walk into, and their length in chunks.
template <typename T>
std::pair<int, int> state_segments(int B, int Tn, int H, int DK, int DV, int segments) {
  constexpr bool kMma = sizeof(T) == 2;
  constexpr int TK = kMma ? 16 : 32, TV = 32;
  const int N = Tn / kChunk, base = (DK / TK) * (DV / TV) * H * B;
  int NS = segments;
  if (NS <= 0) {
    if (kMma) {
      const int sms = sm_count();
      NS = std::min(N / 16, (base > 2 * sms ? 4 : 8) * sms / base);
    } else {
      NS = std::min(N / 4, (2048 + base - 1) / base);
    }
  }
  NS = std::max(1, std::min(NS, N));
  const int L = (N + NS - 1) / NS;
  return {(N + L - 1) / L, L};
}

// bf16: state_mma_kernel over chunks [c0, c1) cut into NS segments of L chunks, from S0 (fp32
// [B,H,DK,DV]) into Send (the final state; with segments, each segment's end state, [B,H,NS,DK,DV]).
// Four warps a block (a 64 x TV tile, with the split accumulators) where dk allows, else two (dk = 96,
// TV = 32). TV = 64 (dk a multiple of 64) halves the blocks: a warp's chunk then runs 32 products on
// the X̃ᵀ fragments it loaded and scaled once, every state element's operations those of TV = 32, so
// the bits do not depend on TV. smem: the dynamic shared memory a block asks for, at least the
// kernel's own (more keeps other kernels' blocks off its SM: walk_then_local).
template <int KIND, bool REV>
void launch_state_mma(const at::Tensor& X, const at::Tensor& Y, const float* g, const float* S0, at::Tensor& Hsave,
                      float* Send, int B, int Tn, int H, int DK, int DV, float scale, cudaStream_t stream, int NS,
                      int L, float* segg, int c0, int c1, int tv = 32, size_t smem = 0) {
  constexpr int NBUF = 3;
  auto run = [&](auto nw_tag, auto split_tag, auto tv_tag) {
    constexpr int W = decltype(nw_tag)::value;
    constexpr bool SP = decltype(split_tag)::value;
    constexpr int TV = decltype(tv_tag)::value;
    using Sm = StateMmaSmem<KIND, W, TV, NBUF>;
    auto kern = state_mma_kernel<KIND, REV, W, TV, NBUF, SP>;
    const size_t bytes = std::max(smem, Sm::bytes);
    carry::kernels::primitives::allow_smem(kern, bytes);
    dim3 mgrid((DK / (16 * W)) * (DV / TV), H, B * NS);
    kern<<<mgrid, W * 32, bytes, stream>>>(reinterpret_cast<const bf16*>(X.data_ptr()),
                                           reinterpret_cast<const bf16*>(Y.data_ptr()), g, S0,
                                           reinterpret_cast<bf16*>(Hsave.data_ptr()), Send, Tn, H, DK, DV, scale,
                                           NS, L, segg, c0, c1);
  };
  using I4 = std::integral_constant<int, 4>;
  if (DK % 64 == 0 && tv == 64) run(I4(), std::true_type(), std::integral_constant<int, 64>());
  else if (DK % 64 == 0) run(I4(), std::true_type(), std::integral_constant<int, 32>());
  else run(std::integral_constant<int, 2>(), std::false_type(), std::integral_constant<int, 32>());
}

// The walk's tiles a block: TV = 64 where dk allows it (else 32), for a walk in pieces beside the
// chunk-local kernels (walk_then_local).
inline int piece_walk_tv(int DK) { return DK % 64 == 0 ? 64 : 32; }
// Its blocks: (dk/64)·(dv/64) a head at TV = 64; (dk/32)·(dv/32) at dk = 96 (two warps, TV = 32).
inline int piece_walk_blocks(int B, int H, int DK, int DV) {
  return piece_walk_tv(DK) == 64 ? (DK / 64) * (DV / 64) * H * B : (DK / 32) * (DV / 32) * H * B;
}

// bf16, one segment: the walk over chunks [c0, c1) only, from the state `from` (fp32 [B,H,DK,DV]) to
// `to`, with piece_walk_tv's tiles. Consecutive pieces chained through fp32 memory run the whole walk's
// operations on the same values: its bits (api.h, decay_set_pieces).
template <int KIND, bool REV>
void launch_state_piece(const at::Tensor& X, const at::Tensor& Y, const at::Tensor& G, const float* from,
                        at::Tensor& Hsave, float* to, int B, int Tn, int H, int DK, int DV, float scale,
                        cudaStream_t stream, int c0, int c1, size_t smem) {
  launch_state_mma<KIND, REV>(X, Y, KIND == kNone ? nullptr : G.data_ptr<float>(), from, Hsave, to, B, Tn, H, DK, DV,
                              scale, stream, 1, c1 - c0, nullptr, c0, c1, piece_walk_tv(DK), smem);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int KIND, bool REV>
void launch_state(const at::Tensor& X, const at::Tensor& Y, const at::Tensor& G, const at::Tensor& S0,
                  at::Tensor& Hsave, at::Tensor& Sfinal, int B, int Tn, int H, int DK, int DV, float scale,
                  cudaStream_t stream, int segments = 0) {
  constexpr bool kMma = sizeof(T) == 2;
  constexpr int TK = kMma ? 16 : 32, TV = 32, NW = kMma ? 1 : 4;
  const int N = Tn / kChunk;
  const std::pair<int, int> segs = state_segments<T>(B, Tn, H, DK, DV, segments);
  const int NS = segs.first, L = segs.second;
  at::Tensor Send = NS == 1 ? Sfinal : at::empty({B, H, NS, DK, DV}, Sfinal.options());
  at::Tensor SegG = NS == 1 || KIND == kNone ? at::Tensor() : at::empty({B, H, NS, DK}, Sfinal.options());
  const float* g = KIND == kNone ? nullptr : G.data_ptr<float>();
  float* segg = SegG.defined() ? SegG.data_ptr<float>() : nullptr;
  if constexpr (kMma) {
    launch_state_mma<KIND, REV>(X, Y, g, S0.data_ptr<float>(), Hsave, Send.data_ptr<float>(), B, Tn, H, DK, DV, scale,
                                stream, NS, L, segg, 0, N);
  } else {
    constexpr size_t smem = state_smem<T, KIND, TK, TV>();
    auto kern = state_kernel<T, KIND, REV, TK, TV, NW>;
    carry::kernels::primitives::allow_smem(kern, smem);
    dim3 grid((DK / TK) * (DV / TV), H, B * NS);
    kern<<<grid, NW * 32, smem, stream>>>(reinterpret_cast<const T*>(X.data_ptr()),
                                          reinterpret_cast<const T*>(Y.data_ptr()), g, S0.data_ptr<float>(),
                                          reinterpret_cast<T*>(Hsave.data_ptr()), Send.data_ptr<float>(), Tn, H, DK,
                                          DV, scale, NS, L, segg);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (NS > 1) {  // the join pass has its own 32 x 32 tiling, whatever the state kernel's
    constexpr int FK = 32, FV = 32;
    dim3 fgrid((DK / FK) * (DV / FV), H, B * NS);
    segment_fix_kernel<T, KIND, REV, FK, FV><<<fgrid, 128, 0, stream>>>(
        g, Send.data_ptr<float>(), reinterpret_cast<T*>(Hsave.data_ptr()), Sfinal.data_ptr<float>(), Tn, H, DK, DV,
        NS, L, segg);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace carry::kernels::decay
