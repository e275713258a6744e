// Device helpers shared by every family's kernels (delta rule, scalar and diagonal decay): element types, 16-byte async tile copies
// (global -> shared), and one block-level GEMM on shared-memory tiles.
//
// The GEMM is the one design decision: every kernel keeps its chunk tiles in shared memory and
// multiplies them with gemm<T,M,N,K,TA,TB,NW>, which writes an fp32 tile back to shared memory.
// For bf16 it runs on tensor cores (wmma 16x16x16, fp32 accumulation, one 16x16 output tile per
// warp at a time); for fp32 it runs plain FMA on the CUDA cores, so fp32 inputs keep fp32
// accuracy end to end. The kernels are therefore written once for both element types.
//
// Under CARRY_LA_EMU (tests/emulation/warp_emulation.h, included first) the raw pieces (cp.async, ldmatrix,
// mma.sync) are the emulation's and the wmma path is absent: kernels built on gemm_rb64, frag_mma and the
// fp32 gemm run on the CPU.
#pragma once

#include <cuda_bf16.h>
#ifndef CARRY_LA_EMU
#include <mma.h>
#endif

#include <type_traits>

namespace carry::kernels::primitives {

constexpr int kChunk = 64;  // tokens per chunk, C

using bf16 = __nv_bfloat16;

// Row padding (elements) that keeps every shared row 16-byte aligned and shifts rows across banks.
template <typename T>
constexpr int pad_of() { return 16 / (int)sizeof(T); }
constexpr int kPadF = 4;  // fp32 tiles

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16(x); }

// N consecutive elements as one aligned access (N·sizeof(T) bytes: 16 for 8 bf16 or 4 fp32).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

#ifdef CARRY_LA_EMU
using ::cp_async16;
using ::cp_async_commit;
using ::cp_async_wait;
#else
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
#endif

// ROWS x COLS tile of T from global (row stride gstride elements) into shared (row stride lds).
// When the block's threads cover whole rows a pass (NT a multiple of the row's 16-byte pieces, and
// the tile a multiple of NT pieces), a thread's pieces sit a fixed number of rows apart: it computes
// its addresses once and steps them, in an unrolled loop (a state kernel issues these every chunk,
// and their address arithmetic was a large share of its instructions).
template <typename T, int ROWS, int COLS, int NT>
__device__ __forceinline__ void load_tile_async(T* s, int lds, const T* g, long gstride) {
  constexpr int E = 16 / sizeof(T);
  constexpr int VPR = COLS / E;
  static_assert(COLS % E == 0, "tile width must be a multiple of 16 bytes");
  if constexpr (NT % VPR == 0 && (ROWS * VPR) % NT == 0) {
    constexpr int STEP = NT / VPR, PASSES = ROWS * VPR / NT;  // rows between a thread's pieces, pieces
    if (threadIdx.x >= NT) return;  // a block wider than NT: the others copy nothing (NT covers the tile)
    const int r = threadIdx.x / VPR, c = (threadIdx.x % VPR) * E;
    T* sp = s + r * lds + c;
    const T* gp = g + r * gstride + c;
#pragma unroll
    for (int j = 0; j < PASSES; ++j) cp_async16(sp + j * STEP * lds, gp + (long)j * STEP * gstride);
  } else {
    for (int i = threadIdx.x; i < ROWS * VPR; i += NT) {
      int r = i / VPR, c = (i % VPR) * E;
      cp_async16(s + r * lds + c, g + r * gstride + c);
    }
  }
}

// Store an fp32 shared tile (ld multiple of 4) to global T, 4 elements per thread-step.
template <typename T, int ROWS, int COLS, int NT>
__device__ __forceinline__ void store_tile(T* g, long gstride, const float* s, int lds) {
  constexpr int VPR = COLS / 4;
  for (int i = threadIdx.x; i < ROWS * VPR; i += NT) {
    int r = i / VPR, c = (i % VPR) * 4;
    float4 x = *reinterpret_cast<const float4*>(s + r * lds + c);
    T* p = g + r * gstride + c;
    if constexpr (std::is_same<T, float>::value) {
      *reinterpret_cast<float4*>(p) = x;
    } else {
      __nv_bfloat162 a = __floats2bfloat162_rn(x.x, x.y), b = __floats2bfloat162_rn(x.z, x.w);
      uint2 u;
      u.x = *reinterpret_cast<unsigned*>(&a);
      u.y = *reinterpret_cast<unsigned*>(&b);
      *reinterpret_cast<uint2*>(p) = u;
    }
  }
}

// C[M x N] (fp32, shared, row-major, ldc) = (acc ? C : 0) + op(A) * op(B), A and B in shared.
// op(A)[m,k] = TA ? A[k*lda + m] : A[m*lda + k];  op(B)[k,n] = TB ? B[n*ldb + k] : B[k*ldb + n].
// No __syncthreads inside: the caller orders the phases. Tile ownership is fixed by tile index,
// so two back-to-back calls on the same C need no block barrier between them.
template <int N, int K, bool TA, bool TB, int NW>
__device__ __forceinline__ void gemm_rb64(const bf16* A, int lda, const bf16* B, int ldb, float* C, int ldc,
                                          bool acc);

template <typename T, int M, int N, int K, bool TA, bool TB, int NW>
__device__ __forceinline__ void gemm(const T* A, int lda, const T* B, int ldb, float* C, int ldc,
                                     bool acc) {
  if constexpr (std::is_same<T, bf16>::value && M == 64 && (NW == 8 || NW == 16) && N % (NW * 4) == 0 &&
                K % 16 == 0) {
    gemm_rb64<N, K, TA, TB, NW>(A, lda, B, ldb, C, ldc, acc);
  }
#ifndef CARRY_LA_EMU
  else if constexpr (std::is_same<T, bf16>::value) {
    using namespace nvcuda;
    static_assert(M % 16 == 0 && N % 16 == 0 && K % 16 == 0, "wmma tiles are 16x16x16");
    using LA = typename std::conditional<TA, wmma::col_major, wmma::row_major>::type;
    using LB = typename std::conditional<TB, wmma::col_major, wmma::row_major>::type;
    constexpr int TN = N / 16, NTILE = (M / 16) * TN;
    const int warp = threadIdx.x / 32;
    for (int tile = warp; tile < NTILE; tile += NW) {
      const int m0 = (tile / TN) * 16, n0 = (tile % TN) * 16;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
      float* cp = C + m0 * ldc + n0;
      if (acc) wmma::load_matrix_sync(c, cp, ldc, wmma::mem_row_major);
      else wmma::fill_fragment(c, 0.f);
#pragma unroll 4
      for (int k0 = 0; k0 < K; k0 += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, LA> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, LB> b;
        wmma::load_matrix_sync(a, TA ? A + k0 * lda + m0 : A + m0 * lda + k0, lda);
        wmma::load_matrix_sync(b, TB ? B + n0 * ldb + k0 : B + k0 * ldb + n0, ldb);
        wmma::mma_sync(c, a, b, c);
      }
      wmma::store_matrix_sync(cp, c, ldc, wmma::mem_row_major);
    }
    __syncwarp();
  }
#endif
  else {
    // fp32: each thread owns a 2x2 micro-tile, FMA over K from shared memory.
    static_assert(M % 2 == 0 && N % 2 == 0, "fp32 gemm works on 2x2 micro-tiles");
    constexpr int NT = NW * 32, HN = N / 2;
    for (int idx = threadIdx.x; idx < (M / 2) * HN; idx += NT) {
      const int m = (idx / HN) * 2, n = (idx % HN) * 2;
      float s00 = 0.f, s01 = 0.f, s10 = 0.f, s11 = 0.f;
      if (acc) {
        s00 = C[m * ldc + n]; s01 = C[m * ldc + n + 1];
        s10 = C[(m + 1) * ldc + n]; s11 = C[(m + 1) * ldc + n + 1];
      }
#pragma unroll 8
      for (int k = 0; k < K; ++k) {
        float a0 = TA ? A[k * lda + m] : A[m * lda + k];
        float a1 = TA ? A[k * lda + m + 1] : A[(m + 1) * lda + k];
        float b0 = TB ? B[n * ldb + k] : B[k * ldb + n];
        float b1 = TB ? B[(n + 1) * ldb + k] : B[k * ldb + n + 1];
        s00 = fmaf(a0, b0, s00); s01 = fmaf(a0, b1, s01);
        s10 = fmaf(a1, b0, s10); s11 = fmaf(a1, b1, s11);
      }
      C[m * ldc + n] = s00; C[m * ldc + n + 1] = s01;
      C[(m + 1) * ldc + n] = s10; C[(m + 1) * ldc + n + 1] = s11;
    }
  }
}

// Inclusive cumulative sum of 64 values in shared memory, done by one warp (lanes own pairs).
__device__ __forceinline__ void warp_cumsum64(float* x) {
  const int lane = threadIdx.x % 32;
  float a = x[2 * lane], b = x[2 * lane + 1];
  float s = a + b;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    float t = __shfl_up_sync(0xffffffffu, s, off);
    if (lane >= off) s += t;
  }
  float excl = s - (a + b);
  x[2 * lane] = excl + a;
  x[2 * lane + 1] = excl + a + b;
}


// ---- raw tensor-core pieces for the state kernels (bf16 in, fp32 accumulate) -------------------
// mma.m16n8k16 fragments (PTX ISA): g = lane/4, t = lane%4.
//   A 16x16: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B 16x8:  b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g)
//   C 16x8:  c0,c1 (g, 2t..2t+1), c2,c3 (g+8, 2t..2t+1)
namespace tc {
using u32 = unsigned;

#ifdef CARRY_LA_EMU
using ::ldsm_x4;
using ::ldsm_x4_t;
using ::mma16816;
#else
__device__ __forceinline__ unsigned saddr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(saddr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(saddr(p)));
}
__device__ __forceinline__ void mma16816(float (&c)[4], const u32 (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif
// A (16x16 at m0,k0) from row-major [m][k] storage.
__device__ __forceinline__ void load_a(u32 (&a)[4], const __nv_bfloat16* s, int ld, int m0, int k0) {
  const int l = threadIdx.x & 31;
  ldsm_x4(a, s + (m0 + (l & 15)) * ld + k0 + (l >> 4) * 8);
}
// A (16x16 at m0,k0) = Sᵀ where the storage is [k][m] (row-major in k).
__device__ __forceinline__ void load_a_t(u32 (&a)[4], const __nv_bfloat16* s, int ld, int m0, int k0) {
  const int l = threadIdx.x & 31, j = l >> 3, r = l & 7;
  ldsm_x4_t(a, s + (k0 + r + (j >> 1) * 8) * ld + m0 + (j & 1) * 8);
}
// B for two n-tiles (16 columns at n0) and k16 at k0, from row-major [k][n] storage:
// b[0..1] = n-tile n0 (b0,b1), b[2..3] = n-tile n0+8.
__device__ __forceinline__ void load_b2_t(u32 (&b)[4], const __nv_bfloat16* s, int ld, int k0, int n0) {
  const int l = threadIdx.x & 31, j = l >> 3, r = l & 7;
  ldsm_x4_t(b, s + (k0 + r + (j & 1) * 8) * ld + n0 + (j >> 1) * 8);
}
// B for two n-tiles (16 columns at n0) and k16 at k0, from [n][k] storage (B = storageᵀ).
__device__ __forceinline__ void load_b2(u32 (&b)[4], const __nv_bfloat16* s, int ld, int k0, int n0) {
  const int l = threadIdx.x & 31, j = l >> 3, r = l & 7;
  ldsm_x4(b, s + (n0 + r + (j >> 1) * 8) * ld + k0 + (j & 1) * 8);
}
__device__ __forceinline__ unsigned pack_bf16(float x, float y) {
  __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<unsigned*>(&v);
}
__device__ __forceinline__ float2 unpack_bf16(unsigned u) {
  __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&u);
  return __bfloat1622float2(v);
}

}  // namespace tc

// c += op(A)·op(B) on this warp's fragments (rows m0.., NT8 n-tiles from n0), A and B bf16 in shared.
// op(A)[m,k] = TA ? A[k][m] : A[m][k];  op(B)[k,n] = TB ? B[n][k] : B[k][n]. UNROLL: k-steps unrolled.
template <int NT8, int K, bool TA, bool TB, int UNROLL = K / 16>
__device__ __forceinline__ void frag_mma(float (&c)[NT8][4], const bf16* A, int lda, const bf16* B, int ldb, int m0,
                                         int n0) {
  static_assert(NT8 % 2 == 0, "n-tiles come in pairs");
#pragma unroll UNROLL
  for (int k0 = 0; k0 < K; k0 += 16) {
    tc::u32 a[4];
    if constexpr (TA) tc::load_a_t(a, A, lda, m0, k0);
    else tc::load_a(a, A, lda, m0, k0);
#pragma unroll
    for (int np = 0; np < NT8 / 2; ++np) {
      tc::u32 b[4];
      if constexpr (TB) tc::load_b2(b, B, ldb, k0, n0 + np * 16);
      else tc::load_b2_t(b, B, ldb, k0, n0 + np * 16);
      tc::mma16816(c[2 * np], a, b[0], b[1]);
      tc::mma16816(c[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// The bf16 64-row case of gemm on raw mma.sync (8 or 16 warps): warp w computes rows 16·(w%4) and
// the column group w/4 (N/2 or N/4 columns), with its A fragment reused across the N/16 n-tiles of that half and the
// accumulators in registers for the whole K loop (C is read and written once).
template <int N, int K, bool TA, bool TB, int NW>
__device__ __forceinline__ void gemm_rb64(const bf16* A, int lda, const bf16* B, int ldb, float* C, int ldc,
                                          bool acc) {
  constexpr int NH = N / (NW / 4), NT8 = NH / 8;  // columns per warp, n8-tiles per warp
  static_assert(NT8 % 2 == 0, "n-tiles come in pairs");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int m0 = (warp & 3) * 16, n0 = (warp >> 2) * NH;
  float c[NT8][4];
#pragma unroll
  for (int nt = 0; nt < NT8; ++nt) {
    const int col = n0 + nt * 8 + 2 * t4;
    if (acc) {
      const float2 x0 = *reinterpret_cast<const float2*>(C + (m0 + g) * ldc + col);
      const float2 x1 = *reinterpret_cast<const float2*>(C + (m0 + g + 8) * ldc + col);
      c[nt][0] = x0.x; c[nt][1] = x0.y; c[nt][2] = x1.x; c[nt][3] = x1.y;
    } else {
      c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.f;
    }
  }
  frag_mma<NT8, K, TA, TB, 2>(c, A, lda, B, ldb, m0, n0);
#pragma unroll
  for (int nt = 0; nt < NT8; ++nt) {
    const int col = n0 + nt * 8 + 2 * t4;
    *reinterpret_cast<float2*>(C + (m0 + g) * ldc + col) = make_float2(c[nt][0], c[nt][1]);
    *reinterpret_cast<float2*>(C + (m0 + g + 8) * ldc + col) = make_float2(c[nt][2], c[nt][3]);
  }
  __syncwarp();
}

// Stores this warp's fragments (rows m0 + g and m0 + g + 8, NT8 n-tiles from n0) to global bf16
// rows of stride ld, two columns (4 bytes) a store.
template <int NT8>
__device__ __forceinline__ void frag_store_bf16(bf16* g, long ld, const float (&c)[NT8][4], int m0, int n0) {
  const int lane = threadIdx.x & 31, r = m0 + (lane >> 2), t4 = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT8; ++nt) {
    const int col = n0 + nt * 8 + 2 * t4;
    *reinterpret_cast<unsigned*>(g + (long)r * ld + col) = tc::pack_bf16(c[nt][0], c[nt][1]);
    *reinterpret_cast<unsigned*>(g + (long)(r + 8) * ld + col) = tc::pack_bf16(c[nt][2], c[nt][3]);
  }
}

// The same fragments stored fp32, two columns (8 bytes) a store.
template <int NT8>
__device__ __forceinline__ void frag_store_f32(float* g, long ld, const float (&c)[NT8][4], int m0, int n0) {
  const int lane = threadIdx.x & 31, r = m0 + (lane >> 2), t4 = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT8; ++nt) {
    const int col = n0 + nt * 8 + 2 * t4;
    *reinterpret_cast<float2*>(g + (long)r * ld + col) = make_float2(c[nt][0], c[nt][1]);
    *reinterpret_cast<float2*>(g + (long)(r + 8) * ld + col) = make_float2(c[nt][2], c[nt][3]);
  }
}

}  // namespace carry::kernels::primitives
