// Forward kernels of the scalar/diagonal-decay class (api.h), chunk C = 64.
//
//  1. cumsum_kernel: G = the gate cumulated inside each chunk (fp32, saved for backward).
//  2. state_kernel (state_walk.cuh), grid ((dk/32)·(dv/32), H, B), 128 threads: one block
//     walks the chunks in order for one 32x32 tile of one head's state (fp32 in shared memory),
//     saves the state entering each chunk (input dtype) and the final state (fp32).
//     Per chunk: reads 2·C·(32+32) bytes (bf16), 2·C·32·32·2 FLOPs; the rows of the state are
//     independent, so B·H·(dk/32)·(dv/32) blocks fill the GPU even at B·H = 4.
//  3. out_kernel, grid (N, 1, B·H), 256 threads: one block owns one chunk of one head. P =
//     scale·(intra-chunk decayed causal QKᵀ), once; then for each TV-wide tile of dv in turn,
//     O = scale·(Q ⊙ e^G)·H_n + P·V. For the diagonal decay, P's off-diagonal 16x16 blocks are
//     tensor-core products of Q and K rescaled against the gate just before the row block (every
//     factor ≤ 1, no overflow for any decay), its diagonal blocks are summed elementwise, exactly.
//     P is saved (input dtype) for the backward. bf16 GLA takes 3. from out_diag_frag_kernel (below),
//     its diagonal blocks on tensor cores too; out_kernel serves fp32, and bf16 at dk = 96 without the
//     diagonal decay.
// In bf16 the walk is state_mma_kernel (state_walk.cuh: 16 x 32 state pieces in mma.sync
// registers, four warps a block sharing the chunk's K tile), and the scalar decay and linear attention
// with dk 64 or 128 take 3. from out_frag_kernel (eight warps a chunk, P and the output's accumulators
// in registers, 64-wide dv tiles double-buffered), which saves no P: the backward's grad_frag_kernel
// recomputes it. Where the walk's blocks take at most half the SMs (pieces_for) it runs in ranges of
// chunks on 64-column tiles and each finished range's output kernel runs on a second stream beside the
// next range's walk (walk_in_pieces, launch.h); the final state goes to
// MixerOptions::on_final_state between the walk and the output.
#include "layers/kernels/decay/api.h"
#include "layers/kernels/decay/state_walk.cuh"
#include "layers/kernels/decay/launch.h"
#include "layers/kernels/primitives/mma_frag.cuh"

#include <atomic>

namespace carry::kernels::decay {

namespace {
std::atomic<bool> g_poison{false};
}
bool poison_enabled() { return g_poison.load(); }
void decay_set_poison(bool on) { g_poison.store(on); }
namespace {
std::atomic<int> g_segments{0};
}
int forced_segments() { return g_segments.load(); }
void decay_set_segments(int n) { g_segments.store(n < 0 ? 0 : n); }
namespace {
std::atomic<int> g_pieces{0};
}
int forced_pieces() { return g_pieces.load(); }
void decay_set_pieces(int n) { g_pieces.store(n < 0 ? 0 : n); }

namespace {

// G = the cumulative sum of g inside each 64-token chunk, in fp32; g (fp32 or bf16: read as it is, no
// fp32 copy of it first: H200, GLA with a bf16 gate at H=16, dk=dv=128, forward 7.40 → 6.51 ms at 131072
// tokens), G [B,T,H,D] (D = 1 scalar, dk diag). One thread per (b, chunk, h, d) column.
template <typename TG>
__global__ void cumsum_kernel(const TG* __restrict__ g, float* __restrict__ G, int B, int T, int H, int D) {
  const long id = (long)blockIdx.x * blockDim.x + threadIdx.x;
  const int N = T / kChunk;
  if (id >= (long)B * N * H * D) return;
  const int d = (int)(id % D);
  long r = id / D;
  const int h = (int)(r % H);
  r /= H;
  const int n = (int)(r % N), b = (int)(r / N);
  const long stride = (long)H * D;
  const long off = ((long)b * T + (long)n * kChunk) * stride + (long)h * D + d;
  float acc = 0.f;
  for (int t = 0; t < kChunk; ++t) {
    acc += to_f(g[off + t * stride]);
    G[off + t * stride] = acc;
  }
}

template <typename T, int KIND, int DK, int TV>
struct OutSmem {
  static constexpr int C = kChunk, P = pad_of<T>();
  static constexpr int LQ = DK + P, LG = DK + 4, LH = TV + P, LA = C + 4, LAb = C + P, LO = TV + 4;
  static constexpr bool kAlias = sizeof(T) == 4;  // fp32: P is written over the fp32 A
  static constexpr size_t oQ = 0;
  static constexpr size_t oK = al128(oQ + C * LQ * sizeof(T));
  static constexpr size_t oG = al128(oK + C * LQ * sizeof(T));
  static constexpr size_t oH = al128(oG + (KIND == kDiag ? C * LG * 4 : KIND == kScalar ? C * 4 : 0));
  static constexpr size_t oV = al128(oH + DK * LH * sizeof(T));
  static constexpr size_t oA = al128(oV + C * LH * sizeof(T));
  static constexpr size_t oAb = kAlias ? oA : al128(oA + C * LA * 4);
  static constexpr size_t oScr = al128(oAb + C * LAb * sizeof(T));
  static constexpr size_t kScr = C * LO * 4 > C * LQ * sizeof(T) ? C * LO * 4 : C * LQ * sizeof(T);
  static constexpr size_t bytes = al128(oScr + kScr);
  static_assert(bytes <= 227 * 1024, "out_kernel shared memory");
};

// P's off-diagonal row block I (rows 16I..16I+15, columns 0..16I-1) for the diagonal decay:
// Qh = Q_I ⊙ e^{G − r}, Kh = K_{<16I} ⊙ e^{r − G}, r = G of row 16I−1; P block = Qh·Khᵀ.
template <typename T, int I, int DK, int LQ, int LG, int LA, int NW>
__device__ __forceinline__ void diag_offdiag_block(const T* Qs, const T* Ks, const float* Gs, T* Qh, T* Kh,
                                                    float* As) {
  constexpr int NT = NW * 32, R = 16 * I;
  for (int i = threadIdx.x; i < (16 + R) * DK; i += NT) {
    const int r = i / DK, d = i % DK;
    const float ref = Gs[(R - 1) * LG + d];
    if (r < 16) {
      Qh[r * LQ + d] = from_f<T>(to_f(Qs[(R + r) * LQ + d]) * __expf(Gs[(R + r) * LG + d] - ref));
    } else {
      const int s = r - 16;
      Kh[s * LQ + d] = from_f<T>(to_f(Ks[s * LQ + d]) * __expf(ref - Gs[s * LG + d]));
    }
  }
  __syncthreads();
  gemm<T, 16, R, DK, false, true, NW>(Qh, LQ, Kh, LQ, As + R * LA, LA, false);
  __syncthreads();
}

// The intra-chunk matrix into Ab (input dtype): Ab[t][s] = scale · Σ_d q_td k_sd e^{G_td − G_sd} for
// s ≤ t, else 0. Uses As (fp32) and the scratch; ends with a block barrier.
template <typename T, int KIND, int DK, int LQ, int LG, int LA, int LAb, int NW>
__device__ __forceinline__ void intra_matrix(const T* Qs, const T* Ks, const float* Gs, float* As, T* Ab,
                                             T* scratch, float scale) {
  constexpr int C = kChunk, NT = NW * 32;
  if constexpr (KIND == kDiag) {
    T* Qh = scratch;
    T* Kh = scratch + 16 * LQ;
    diag_offdiag_block<T, 1, DK, LQ, LG, LA, NW>(Qs, Ks, Gs, Qh, Kh, As);
    diag_offdiag_block<T, 2, DK, LQ, LG, LA, NW>(Qs, Ks, Gs, Qh, Kh, As);
    diag_offdiag_block<T, 3, DK, LQ, LG, LA, NW>(Qs, Ks, Gs, Qh, Kh, As);
    // Diagonal 16x16 blocks, s ≤ t: 4 blocks x 136 pairs, summed over d exactly.
    for (int p = threadIdx.x; p < 4 * 136; p += NT) {
      const int blk = p / 136;
      int q = p % 136, t = 0;
      while (q > t) { q -= t + 1; ++t; }
      const int tt = 16 * blk + t, ss = 16 * blk + q;
      float a = 0.f;
#pragma unroll 8
      for (int d = 0; d < DK; ++d)
        a += to_f(Qs[tt * LQ + d]) * to_f(Ks[ss * LQ + d]) * __expf(Gs[tt * LG + d] - Gs[ss * LG + d]);
      As[tt * LA + ss] = a;
    }
  } else {
    gemm<T, C, C, DK, false, true, NW>(Qs, LQ, Ks, LQ, As, LA, false);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < C * C; i += NT) {
    const int t = i / C, s = i % C;
    float a = 0.f;
    if (s <= t) {
      a = As[t * LA + s] * scale;
      if constexpr (KIND == kScalar) a *= __expf(Gs[t] - Gs[s]);
    }
    // fp32: Ab aliases As; every element is read and written by the same thread.
    Ab[t * LAb + s] = from_f<T>(a);
  }
  __syncthreads();
}

template <typename T, int KIND, int DK, int TV, int NW>
__global__ void __launch_bounds__(NW * 32) out_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                                      const T* __restrict__ v, const float* __restrict__ G,
                                                      const T* __restrict__ Hsave, T* __restrict__ o,
                                                      T* __restrict__ Psave, int Tn, int H, int DV, float scale,
                                                      int c0) {
  using L = OutSmem<T, KIND, DK, TV>;
  constexpr int C = kChunk, NT = NW * 32;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem + L::oQ);
  T* Ks = reinterpret_cast<T*>(smem + L::oK);
  float* Gs = reinterpret_cast<float*>(smem + L::oG);
  T* Hs = reinterpret_cast<T*>(smem + L::oH);
  T* Vs = reinterpret_cast<T*>(smem + L::oV);
  float* As = reinterpret_cast<float*>(smem + L::oA);
  T* Ab = reinterpret_cast<T*>(smem + L::oAb);
  T* scratch = reinterpret_cast<T*>(smem + L::oScr);  // Qh, Kh of the diagonal decay's rescaled blocks
  float* Os = reinterpret_cast<float*>(smem + L::oScr);

  const int n = c0 + blockIdx.x, bh = blockIdx.z, b = bh / H, h = bh % H, N = Tn / C;
  const long tok = (long)b * Tn + (long)n * C, qs = (long)H * DK, vs = (long)H * DV;
  auto load_hv = [&](int iv) {  // the state rows and values of dv tile iv
    load_tile_async<T, DK, TV, NT>(Hs, L::LH, Hsave + ((long)bh * N + n) * DK * DV + iv * TV, DV);
    load_tile_async<T, C, TV, NT>(Vs, L::LH, v + tok * vs + (long)h * DV + iv * TV, vs);
  };
  load_tile_async<T, C, DK, NT>(Qs, L::LQ, q + tok * qs + (long)h * DK, qs);
  load_tile_async<T, C, DK, NT>(Ks, L::LQ, k + tok * qs + (long)h * DK, qs);
  load_hv(0);
  if constexpr (KIND == kDiag) load_tile_async<float, C, DK, NT>(Gs, L::LG, G + tok * qs + (long)h * DK, qs);
  cp_async_commit();
  if constexpr (KIND == kScalar) {
    if (threadIdx.x < C) Gs[threadIdx.x] = G[(tok + threadIdx.x) * H + h];
  }
  cp_async_wait<0>();
  __syncthreads();

  // P once per chunk, for every dv tile.
  intra_matrix<T, KIND, DK, L::LQ, L::LG, L::LA, L::LAb, NW>(Qs, Ks, Gs, As, Ab, scratch, scale);
  // Q ⊙ e^{G} · scale, in place.
  for (int i = threadIdx.x; i < C * DK; i += NT) {
    const int t = i / DK, d = i % DK;
    Qs[t * L::LQ + d] = from_f<T>(to_f(Qs[t * L::LQ + d]) * scale * __expf(gate<KIND>(Gs, L::LG, t, d)));
  }
  __syncthreads();
  copy_tile_out<T, C, C, NT>(Psave + ((long)bh * N + n) * C * C, C, Ab, L::LAb);
  for (int iv = 0; iv < DV / TV; ++iv) {
    if (iv > 0) {  // the previous tile's H, V and O are done with
      load_hv(iv);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
    }
    gemm<T, C, TV, DK, false, false, NW>(Qs, L::LQ, Hs, L::LH, Os, L::LO, false);
    gemm<T, C, TV, C, false, false, NW>(Ab, L::LAb, Vs, L::LH, Os, L::LO, true);
    __syncthreads();
    store_tile<T, C, TV, NT>(o + tok * vs + (long)h * DV + iv * TV, vs, Os, L::LO);
    __syncthreads();
  }
}

// The output tiles of out_frag_kernel and out_diag_frag_kernel: for each 64-wide dv tile it (its H_n
// tile at `buffer(it & 1)`, its V tile oV bytes after; loaded by the caller, tile it + 2 by
// load_tiles(v0, buffer) once this one is used), O = (Q·H_n) ⊙ (e0 | e1 for the rows m0+g | m0+g+8)
// + P·V on this warp's fragments, stored straight to `out` (row stride vs).
template <int DK, int LK, int LPb, int LV, size_t oV, typename Buffer, typename LoadTiles>
__device__ __forceinline__ void output_tiles(const bf16* sQ, const bf16* sPb, Buffer buffer, LoadTiles load_tiles,
                                             int ntile, bf16* out, long vs, int m0, int n0, float e0, float e1) {
  for (int it = 0; it < ntile; ++it) {
    const unsigned char* base = buffer(it & 1);
    const bf16* sH = reinterpret_cast<const bf16*>(base);
    const bf16* sV = reinterpret_cast<const bf16*>(base + oV);
    if (it + 1 < ntile) cp_async_wait<1>();
    else cp_async_wait<0>();
    __syncthreads();  // this tile's loads are visible
    float acc[4][4] = {};
    frag_mma<4, DK, false, false>(acc, sQ, LK, sH, LV, m0, n0);  // Q·H_n
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      acc[nt][0] *= e0, acc[nt][1] *= e0, acc[nt][2] *= e1, acc[nt][3] *= e1;
    }
    frag_mma<4, kChunk, false, false>(acc, sPb, LPb, sV, LV, m0, n0);  // += P·V
    frag_store_bf16<4>(out + it * 64, vs, acc, m0, n0);
    if (it + 2 < ntile) {
      __syncthreads();  // every warp is done with this buffer
      load_tiles((it + 2) * 64, it & 1);
    }
  }
}

// bf16 output of the scalar decay and linear attention on register fragments (the plan of the delta
// rule's fwd_o_reg_kernel on this class's layouts): eight warps, warp w owns rows 16·(w%4) and the column
// half w/4 of P = scale·(QKᵀ ⊙ e^{G_t−G_s}) (causal) and of each 64-wide output tile. P goes to shared
// bf16 once (the backward recomputes it: grad_frag_kernel); each tile's O = scale·e^{G_t}·(Q·H_n) + P·V is summed in
// registers and stored straight to global, the H_n and V tiles double-buffered. The fp32-staged
// out_kernel spent two block barriers and an fp32 shared-memory round trip a tile.
template <int DK>
struct OutFragSmem {
  static constexpr int C = kChunk, LK = DK + 8, LPb = C + 8, LV = 64 + 8;
  static constexpr size_t oQ = 0;
  static constexpr size_t oK = al128(oQ + C * LK * 2);
  static constexpr size_t oPb = al128(oK + C * LK * 2);
  static constexpr size_t oG = al128(oPb + C * LPb * 2);
  static constexpr size_t oBuf = al128(oG + C * 4);
  static constexpr size_t oV = al128(DK * LV * 2);  // within a buffer: the H_n tile, then the V tile
  static constexpr size_t buf = al128(oV + C * LV * 2);
  static constexpr size_t bytes = oBuf + 2 * buf;
  static_assert(2 * (bytes + 1024) <= 228 * 1024, "out_frag_kernel: two blocks an SM");
};

template <int KIND, int DK>
__global__ void __launch_bounds__(256) out_frag_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                       const bf16* __restrict__ v, const float* __restrict__ G,
                                                       const bf16* __restrict__ Hsave, bf16* __restrict__ o,
                                                       int Tn, int H, int DV, float scale,
                                                       int c0) {
  static_assert(KIND == kScalar || KIND == kNone, "the diagonal decay keeps out_kernel");
  using L = OutFragSmem<DK>;
  constexpr int C = kChunk, NT = 256;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::oQ);
  bf16* sK = reinterpret_cast<bf16*>(smem + L::oK);
  bf16* sPb = reinterpret_cast<bf16*>(smem + L::oPb);
  float* sG = reinterpret_cast<float*>(smem + L::oG);

  const int n = c0 + blockIdx.x, h = blockIdx.y, b = blockIdx.z, N = Tn / C, ntile = DV / 64;
  const long bh = (long)b * H + h, tok = (long)b * Tn + (long)n * C, qs = (long)H * DK, vs = (long)H * DV;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int m0 = (warp & 3) * 16, n0 = (warp >> 2) * 32;
  auto load_tiles = [&](int v0, int bi) {  // the H_n and V tiles at column v0 into buffer bi
    unsigned char* base = smem + L::oBuf + bi * L::buf;
    load_tile_async<bf16, DK, 64, NT>(reinterpret_cast<bf16*>(base), L::LV, Hsave + (bh * N + n) * DK * DV + v0, DV);
    load_tile_async<bf16, C, 64, NT>(reinterpret_cast<bf16*>(base + L::oV), L::LV, v + tok * vs + (long)h * DV + v0,
                                     vs);
    cp_async_commit();
  };
  carry::kernels::primitives::load_qk_and_p<DK, NT>(sQ, sK, L::LK, q + tok * qs + (long)h * DK, k + tok * qs + (long)h * DK, qs,
                                   load_tiles, ntile, sG, KIND == kScalar ? G + tok * H + h : nullptr, H, scale, sPb,
                                   L::LPb);
  __syncthreads();  // P is whole
  const float e0 = scale * __expf(sG[m0 + g]), e1 = scale * __expf(sG[m0 + g + 8]);
  output_tiles<DK, L::LK, L::LPb, L::LV, L::oV>(
      sQ, sPb, [&](int bi) { return smem + L::oBuf + bi * L::buf; }, load_tiles, ntile,
      o + tok * vs + (long)h * DV, vs, m0, n0, e0, e1);
}

// bf16 output of GLA (the diagonal decay) on register fragments, the plan of out_frag_kernel: eight warps,
// warp w owns the row block I = w%4 (rows 16I..16I+15) and the column half w/4 of P and of each 64-wide
// output tile. P's row block I is one product over every column it reaches, Q_I and K rescaled in
// registers right after ldmatrix against r = G of row 16I + 8 (per key column d): P_ts = scale·Σ_d
// (q_td e^{G_td − r_d})(k_sd e^{r_d − G_sd}) for s ≤ t. A factor above 1 comes only from the rows of
// block I (t or s within 8 tokens of row 16I+8); where some |G − r| there exceeds kDiagSpan (or a K
// factor's exponent does), the warp sums its P entries elementwise instead, exactly. P goes to shared
// bf16 once and to Psave for the backward's dv_kernel; Q is then scaled by scale·e^{G} in place, and
// each tile's O = Q̃·H_n + P·V is summed in registers and stored straight to global. The gate tile [C][dk]
// (fp32) is needed only until then: its region holds the second H_n/V buffer afterwards, so the kernel
// takes 105 KB at dk = 128, two blocks an SM. out_kernel (fp32 A and O in shared memory, dv tiles of 32
// loaded and used without overlap) is kept for fp32 inputs.
// The rescaling's limit: a factor e^x with |x| ≤ 40 (≈ 2.4e17) overflows nothing for any |q|, |k| below
// 1e21; about 5 nats of decay a token and more take the exact path.
constexpr float kDiagSpan = 40.f;

template <int DK>
struct OutDiagFragSmem {
  static constexpr int C = kChunk, LK = DK + 8, LG = DK + 4, LPb = C + 8, LV = 64 + 8;
  static constexpr size_t oQ = 0;
  static constexpr size_t oK = al128(oQ + C * LK * 2);
  static constexpr size_t oPb = al128(oK + C * LK * 2);
  static constexpr size_t oG = al128(oPb + C * LPb * 2);  // the gate tile, then buffer 1 (the larger of the two)
  static constexpr size_t oV = al128(DK * LV * 2);         // within a buffer: the H_n tile, then the V tile
  static constexpr size_t buf = al128(oV + C * LV * 2);
  static constexpr size_t gbytes = al128((size_t)C * LG * 4);
  static constexpr size_t oBuf0 = oG + (gbytes > buf ? gbytes : buf);
  static constexpr size_t bytes = oBuf0 + buf;
  static_assert(2 * (bytes + 1024) <= 228 * 1024, "out_diag_frag_kernel: two blocks an SM");
};

template <int DK>
__global__ void __launch_bounds__(256) out_diag_frag_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                            const bf16* __restrict__ v, const float* __restrict__ G,
                                                            const bf16* __restrict__ Hsave, bf16* __restrict__ o,
                                                            bf16* __restrict__ Psave, int Tn, int H, int DV,
                                                            float scale, int c0) {
  using L = OutDiagFragSmem<DK>;
  constexpr int C = kChunk, NT = 256, LK = L::LK, LG = L::LG;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::oQ);
  const bf16* sK = reinterpret_cast<const bf16*>(smem + L::oK);
  bf16* sPb = reinterpret_cast<bf16*>(smem + L::oPb);
  const float* sG = reinterpret_cast<const float*>(smem + L::oG);

  const int n = c0 + blockIdx.x, h = blockIdx.y, b = blockIdx.z, N = Tn / C, ntile = DV / 64;
  const long bh = (long)b * H + h, tok = (long)b * Tn + (long)n * C, qs = (long)H * DK, vs = (long)H * DV;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int m0 = (warp & 3) * 16, n0 = (warp >> 2) * 32;
  auto buffer = [&](int bi) { return smem + (bi == 0 ? L::oBuf0 : L::oG); };
  auto load_tiles = [&](int v0, int bi) {  // the H_n and V tiles at column v0 into buffer bi
    unsigned char* base = buffer(bi);
    load_tile_async<bf16, DK, 64, NT>(reinterpret_cast<bf16*>(base), L::LV, Hsave + (bh * N + n) * DK * DV + v0, DV);
    load_tile_async<bf16, C, 64, NT>(reinterpret_cast<bf16*>(base + L::oV), L::LV, v + tok * vs + (long)h * DV + v0,
                                     vs);
    cp_async_commit();
  };
  load_tile_async<bf16, C, DK, NT>(sQ, LK, q + tok * qs + (long)h * DK, qs);
  load_tile_async<bf16, C, DK, NT>(const_cast<bf16*>(sK), LK, k + tok * qs + (long)h * DK, qs);
  load_tile_async<float, C, DK, NT>(const_cast<float*>(sG), LG, G + tok * qs + (long)h * DK, qs);
  cp_async_commit();
  load_tiles(0, 0);
  cp_async_wait<1>();
  __syncthreads();  // Q, K, G have landed

  // P's row block I = m0/16, columns n0..n0+31 (those ≤ the block's last row)
  float p[4][4] = {};
  bool far = false;
  if (n0 <= m0 + 15) {
    const float* gref = sG + (m0 + 8) * LG;
#pragma unroll 2
    for (int k0 = 0; k0 < DK; k0 += 16) {
      tc::u32 a[4];
      tc::load_a(a, sQ, LK, m0, k0);
      const float2 ra = *reinterpret_cast<const float2*>(gref + k0 + 2 * t4);
      const float2 rb = *reinterpret_cast<const float2*>(gref + k0 + 8 + 2 * t4);
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // a[e]: row m0 + g + 8·(e&1), columns k0 + 2t4 + 8·(e>>1) + {0, 1}
        const float2 rr = (e >> 1) ? rb : ra;
        const float2 gg = *reinterpret_cast<const float2*>(sG + (m0 + g + 8 * (e & 1)) * LG + k0 + 8 * (e >> 1) + 2 * t4);
        const float x0 = gg.x - rr.x, x1 = gg.y - rr.y;
        far |= !(fabsf(x0) <= kDiagSpan) || !(fabsf(x1) <= kDiagSpan);
        const float2 x = tc::unpack_bf16(a[e]);
        a[e] = tc::pack_bf16(x.x * __expf(x0), x.y * __expf(x1));
      }
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        const int cb = n0 + 16 * np;
        if (cb > m0 + 15) continue;  // above the diagonal: zero (the same in every lane of the warp)
        tc::u32 bb[4];
        tc::load_b2(bb, sK, LK, k0, cb);
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // bb[j]: key row cb + g + 8·(j>>1), columns k0 + 2t4 + 8·(j&1) + {0, 1}
          const float2 rr = (j & 1) ? rb : ra;
          const float2 gs = *reinterpret_cast<const float2*>(sG + (cb + g + 8 * (j >> 1)) * LG + k0 + 8 * (j & 1) + 2 * t4);
          const float x0 = rr.x - gs.x, x1 = rr.y - gs.y;
          far |= !(x0 <= kDiagSpan) || !(x1 <= kDiagSpan);
          const float2 x = tc::unpack_bf16(bb[j]);
          bb[j] = tc::pack_bf16(x.x * __expf(x0), x.y * __expf(x1));
        }
        tc::mma16816(p[2 * np], a, bb[0], bb[1]);
        tc::mma16816(p[2 * np + 1], a, bb[2], bb[3]);
      }
    }
  }
  if (__any_sync(0xffffffffu, far)) {  // this warp's entries, elementwise and exact
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = m0 + g + 8 * (e >> 1), c = n0 + nt * 8 + 2 * t4 + (e & 1);
        float acc = 0.f;
        if (c <= r)
          for (int d = 0; d < DK; ++d)
            acc += __bfloat162float(sQ[r * LK + d]) * __bfloat162float(sK[c * LK + d]) *
                   __expf(sG[r * LG + d] - sG[c * LG + d]);
        p[nt][e] = acc;
      }
  }
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = m0 + g + hf * 8, c = n0 + nt * 8 + 2 * t4;
      const float x0 = c <= r ? scale * p[nt][2 * hf] : 0.f;
      const float x1 = c + 1 <= r ? scale * p[nt][2 * hf + 1] : 0.f;
      *reinterpret_cast<unsigned*>(sPb + r * L::LPb + c) = tc::pack_bf16(x0, x1);
    }
  }
  __syncthreads();  // P is whole; every warp is done with the unscaled Q
  copy_tile_out<bf16, C, C, NT>(Psave + (bh * N + n) * C * C, C, sPb, L::LPb);
  for (int i = threadIdx.x; i < C * DK / 2; i += NT) {  // Q ⊙ scale·e^{G}, two columns a step
    const int t = i / (DK / 2), d = 2 * (i % (DK / 2));
    const float2 gg = *reinterpret_cast<const float2*>(sG + t * LG + d);
    unsigned* qp = reinterpret_cast<unsigned*>(sQ + t * LK + d);
    const float2 x = tc::unpack_bf16(*qp);
    *qp = tc::pack_bf16(x.x * scale * __expf(gg.x), x.y * scale * __expf(gg.y));
  }
  __syncthreads();  // the gate tile is free: buffer 1
  if (ntile > 1) load_tiles(64, 1);
  // Q already holds scale·(Q ⊙ e^G): the rows' factors are 1 (x · 1 rounds back to x)
  output_tiles<DK, LK, L::LPb, L::LV, L::oV>(sQ, sPb, buffer, load_tiles, ntile, o + tok * vs + (long)h * DV, vs,
                                             m0, n0, 1.f, 1.f);
}

template <typename T, int KIND, int DK>
void launch_out(const Dims& d, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& G, const at::Tensor& Hsave, at::Tensor& o, at::Tensor& P, float scale,
                cudaStream_t stream, int c0, int c1) {
  if constexpr (frag_path<T, KIND>(DK)) {
    using L = OutFragSmem<DK>;
    auto kern = out_frag_kernel<KIND, DK>;
    carry::kernels::primitives::allow_smem(kern, L::bytes);
    kern<<<dim3(c1 - c0, d.H, d.B), 256, L::bytes, stream>>>(
        reinterpret_cast<const bf16*>(q.data_ptr()), reinterpret_cast<const bf16*>(k.data_ptr()),
        reinterpret_cast<const bf16*>(v.data_ptr()), KIND == kNone ? nullptr : G.data_ptr<float>(),
        reinterpret_cast<const bf16*>(Hsave.data_ptr()), reinterpret_cast<bf16*>(o.data_ptr()),
        d.T, d.H, d.DV, scale, c0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  if constexpr (sizeof(T) == 2 && KIND == kDiag) {
    using L = OutDiagFragSmem<DK>;
    auto kern = out_diag_frag_kernel<DK>;
    carry::kernels::primitives::allow_smem(kern, L::bytes);
    kern<<<dim3(c1 - c0, d.H, d.B), 256, L::bytes, stream>>>(
        reinterpret_cast<const bf16*>(q.data_ptr()), reinterpret_cast<const bf16*>(k.data_ptr()),
        reinterpret_cast<const bf16*>(v.data_ptr()), G.data_ptr<float>(),
        reinterpret_cast<const bf16*>(Hsave.data_ptr()), reinterpret_cast<bf16*>(o.data_ptr()),
        reinterpret_cast<bf16*>(P.data_ptr()), d.T, d.H, d.DV, scale, c0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    constexpr int TV = sizeof(T) == 2 ? 64 : 32, NW = 8;
    using L = OutSmem<T, KIND, DK, TV>;
    auto kern = out_kernel<T, KIND, DK, TV, NW>;
    carry::kernels::primitives::allow_smem(kern, L::bytes);
    dim3 grid(c1 - c0, 1, d.B * d.H);
    kern<<<grid, NW * 32, L::bytes, stream>>>(
        reinterpret_cast<const T*>(q.data_ptr()), reinterpret_cast<const T*>(k.data_ptr()),
        reinterpret_cast<const T*>(v.data_ptr()), KIND == kNone ? nullptr : G.data_ptr<float>(),
        reinterpret_cast<const T*>(Hsave.data_ptr()), reinterpret_cast<T*>(o.data_ptr()),
        reinterpret_cast<T*>(P.data_ptr()), d.T, d.H, d.DV, scale, c0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename T, int KIND>
std::vector<at::Tensor> fwd_impl(const Dims& d, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& g, double scale, const at::Tensor& s0,
                                 const std::function<void(const at::Tensor&)>& on_final_state) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor G;
  if constexpr (KIND != kNone) {
    G = alloc(g.sizes(), f32);
    const int D = KIND == kDiag ? d.DK : 1;
    const long cols = (long)d.B * d.N * d.H * D;
    const unsigned blocks = (unsigned)((cols + 255) / 256);
    if (g.scalar_type() == at::kBFloat16)
      cumsum_kernel<<<blocks, 256, 0, stream>>>(reinterpret_cast<const bf16*>(g.data_ptr()), G.data_ptr<float>(), d.B,
                                                d.T, d.H, D);
    else
      cumsum_kernel<<<blocks, 256, 0, stream>>>(g.data_ptr<float>(), G.data_ptr<float>(), d.B, d.T, d.H, D);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  auto Hsave = alloc({d.B, d.H, d.N, d.DK, d.DV}, q.options());
  auto Sfinal = alloc({d.B, d.H, d.DK, d.DV}, f32);
  auto o = alloc({d.B, d.T, d.H, d.DV}, q.options());
  // P for the backward, unless its chunk-gradient kernel recomputes it (grad_frag_kernel)
  auto P = frag_path<T, KIND>(d.DK) ? at::empty({0}, q.options()) : alloc({d.B, d.H, d.N, kChunk, kChunk}, q.options());
  auto out = [&](cudaStream_t st, int c0, int c1, bool /*beside the walk*/) {
    if (d.DK == 64) launch_out<T, KIND, 64>(d, q, k, v, G, Hsave, o, P, (float)scale, st, c0, c1);
    else if (d.DK == 96) launch_out<T, KIND, 96>(d, q, k, v, G, Hsave, o, P, (float)scale, st, c0, c1);
    else launch_out<T, KIND, 128>(d, q, k, v, G, Hsave, o, P, (float)scale, st, c0, c1);
  };
  // the final state to on_final_state before the output kernel: a send runs beside it
  walk_then_local<T, KIND, false>(d, k, v, G, s0, Hsave, Sfinal, (float)scale, on_final_state, out);
  return {o, Sfinal, G.defined() ? G : at::empty({0}, f32), Hsave, P};
}

template <typename T>
std::vector<at::Tensor> fwd_kind(Decay kind, const Dims& d, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const at::Tensor& g, double scale, const at::Tensor& s0,
                                 const std::function<void(const at::Tensor&)>& on_final_state) {
  switch (kind) {
    case Decay::none: return fwd_impl<T, kNone>(d, q, k, v, g, scale, s0, on_final_state);
    case Decay::scalar: return fwd_impl<T, kScalar>(d, q, k, v, g, scale, s0, on_final_state);
    default: return fwd_impl<T, kDiag>(d, q, k, v, g, scale, s0, on_final_state);
  }
}

}  // namespace

std::vector<at::Tensor> decay_fwd(Decay kind, const at::Tensor& q_in, const at::Tensor& k_in,
                                  const at::Tensor& v_in, const at::Tensor& g_in, double scale,
                                  const at::Tensor& initial_state, int segments,
                                  const std::function<void(const at::Tensor&)>& on_final_state) {
  Dims d = check_inputs("decay_fwd", kind, q_in, k_in, v_in, g_in);
  d.segments = segments;
  c10::cuda::CUDAGuard guard(q_in.device());
  auto q = dense(q_in), k = dense(k_in), v = dense(v_in);
  at::Tensor g = g_in.defined() ? dense(g_in) : g_in;
  TORCH_CHECK(initial_state.sizes() == at::IntArrayRef({d.B, d.H, d.DK, d.DV}) &&
                  initial_state.scalar_type() == at::kFloat,
              "decay_fwd: initial_state must be fp32 [B,H,dk,dv], got ", initial_state.sizes());
  auto s0 = initial_state.contiguous();
  if (q.scalar_type() == at::kBFloat16) return fwd_kind<bf16>(kind, d, q, k, v, g, scale, s0, on_final_state);
  return fwd_kind<float>(kind, d, q, k, v, g, scale, s0, on_final_state);
}

}  // namespace carry::kernels::decay
