// Forward of softmax attention (api.h), FlashAttention-2's plan: one block a query block, the
// key blocks streamed through shared memory, an online softmax in fp32.
//
// fwd_bf16_kernel, grid (T/64 query blocks, H, B), 128 threads (4 warps), two blocks an SM. One block
// owns 64 query rows of one head; warp w owns rows 16w..16w+15 and keeps, in registers for the whole
// run, its Q fragments (16×dk), its output accumulator (16×dv, fp32) and each row's running max m and
// partial sum l. It walks the key blocks of common.cuh's schedule (the diagonal block first),
// with K and V tiles [64,dk], [64,dv] double-buffered in shared memory by cp.async:
//   S = Q·Kᵀ (mma.sync m16n8k16, fp32), scaled by scale·log2(e), masked to −inf on the diagonal block
//   and on the block the window's edge crosses; m' = max(m, rowmax S); P = 2^{S−m'};
//   l ← 2^{m−m'}·l + rowsum P;  O ← 2^{m−m'}·O + P·V (P as bf16 A fragments straight from the
//   accumulators).
// At the end o = O/l (bf16, through shared memory for 16-byte stores) and lse = m + log2 l (fp32).
// HBM per query block: reads q once and k, v once per key block met (64·(dk+dv)·2 bytes each), writes o
// and lse. FLOPs: 4·64·64·d per (query block, key block) pair met (the diagonal block's hidden half too).
// Shared memory: Q 64×dk, 2×(K, V): 87 KB at d = 128.
//
// fwd_f32_kernel: the fp32 inputs' path, same schedule and order, on shared-memory tiles with the
// FMA gemm of tiles.cuh (256 threads; S, O and the row statistics in shared memory, one thread a
// row for the softmax). Correct to fp32; not tuned.
#include "layers/kernels/softmax_attn/api.h"
#include "layers/kernels/softmax_attn/common.cuh"

#include <atomic>
#include <cmath>

namespace carry::kernels::softmax_attn {
using namespace carry::kernels::primitives;

namespace {
std::atomic<bool> g_poison{false};
}
bool poison_enabled() { return g_poison.load(); }
void attn_set_poison(bool on) { g_poison.store(on); }

namespace {

constexpr float kNegInf = -INFINITY;

// ---------------------------------------------------------------------------------------------
// bf16 on tensor cores
template <int DK, int DV>
struct FwdSmem {
  static constexpr int C = kBlock, LK = DK + 8, LV = DV + 8;
  static constexpr size_t oQ = 0;
  static constexpr size_t oK = al128(oQ + C * LK * 2);
  static constexpr size_t oV = al128(oK + 2 * C * LK * 2);
  static constexpr size_t bytes = oV + 2 * C * LV * 2;
};

template <int DK, int DV>
__global__ void __launch_bounds__(128, 2) fwd_bf16_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                          const bf16* __restrict__ v, bf16* __restrict__ o,
                                                          float* __restrict__ lse, float scale_log2, int T_, int H,
                                                          int window) {
  constexpr int C = kBlock, NT = 128, KT = DK / 16, VT = DV / 8;
  using L = FwdSmem<DK, DV>;
  extern __shared__ __align__(128) char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::oQ);
  bf16* sK = reinterpret_cast<bf16*>(smem + L::oK);
  bf16* sV = reinterpret_cast<bf16*>(smem + L::oV);

  const int N = T_ / C;
  const int i = N - 1 - (int)blockIdx.x;  // the longest rows first (full causal: block i meets i + 1 blocks)
  const int h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int r0 = warp * 16;  // the warp's first row in the block
  const long rowk = (long)H * DK, rowv = (long)H * DV;
  const bf16* qh = q + (long)b * T_ * rowk + (long)h * DK;
  const bf16* kh = k + (long)b * T_ * rowk + (long)h * DK;
  const bf16* vh = v + (long)b * T_ * rowv + (long)h * DV;
  const int j_last = first_key_block(i, window);

  auto issue = [&](int j, int buf) {
    load_tile_async<bf16, C, DK, NT>(sK + buf * C * L::LK, L::LK, kh + (long)j * C * rowk, rowk);
    load_tile_async<bf16, C, DV, NT>(sV + buf * C * L::LV, L::LV, vh + (long)j * C * rowv, rowv);
  };
  load_tile_async<bf16, C, DK, NT>(sQ, L::LK, qh + (long)i * C * rowk, rowk);
  issue(i, 0);
  cp_async_commit();

  tc::u32 qa[KT][4];  // the warp's Q rows as A fragments, k-step by k-step
  float acc[VT][4];   // O, rows r0+g (entries 0, 1) and r0+g+8 (entries 2, 3)
  float m_run[2] = {kNegInf, kNegInf}, l_run[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < VT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

  for (int j = i, n = 0; j >= j_last; --j, ++n) {
    const int buf = n & 1;
    if (j > j_last) issue(j - 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (n == 0) {
#pragma unroll
      for (int kk = 0; kk < KT; ++kk) tc::load_a(qa[kk], sQ, L::LK, r0, kk * 16);
    }
    const bf16* cK = sK + buf * C * L::LK;
    const bf16* cV = sV + buf * C * L::LV;

    float s[8][4];  // S for the warp's 16 rows × the 64 keys (8 n-tiles)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk)
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        tc::u32 bb[4];
        tc::load_b2(bb, cK, L::LK, kk * 16, np * 16);
        tc::mma16816(s[2 * np], qa[kk], bb[0], bb[1]);
        tc::mma16816(s[2 * np + 1], qa[kk], bb[2], bb[3]);
      }

    // Scale to log2 units, mask, and the online softmax update of each row (a row's 64 scores lie in
    // the quad of lanes 4g..4g+3: 16 each).
    const bool masked = block_masked(i, j, window);
    const int dist0 = (i - j) * C + r0 + g - 2 * t4;  // t − s for entry (nt=0, e=0)
    float mx[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[nt][e] * scale_log2;
        if (masked && !visible(dist0 + (e >> 1) * 8 - nt * 8 - (e & 1), window)) x = kNegInf;
        s[nt][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    float alpha[2], rs[2] = {0.f, 0.f};
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 1));
      mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 2));
      const float m_new = fmaxf(m_run[hf], mx[hf]);  // finite: the diagonal block came first
      alpha[hf] = exp2f(m_run[hf] - m_new);          // 0 on the first block (m_run = −inf)
      m_run[hf] = m_new;
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = exp2f(s[nt][e] - m_run[e >> 1]);  // hidden keys: 2^{−inf} = 0
        s[nt][e] = p;
        rs[e >> 1] += p;
      }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) l_run[hf] = l_run[hf] * alpha[hf] + rs[hf];
#pragma unroll
    for (int nt = 0; nt < VT; ++nt) {
      acc[nt][0] *= alpha[0], acc[nt][1] *= alpha[0];
      acc[nt][2] *= alpha[1], acc[nt][3] *= alpha[1];
    }
    // O += P·V: the accumulators of n-tiles 2kk and 2kk+1 are the A fragment of keys 16kk..16kk+15.
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const tc::u32 pa[4] = {tc::pack_bf16(s[2 * kk][0], s[2 * kk][1]), tc::pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                             tc::pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             tc::pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int np = 0; np < DV / 16; ++np) {
        tc::u32 bb[4];
        tc::load_b2_t(bb, cV, L::LV, kk * 16, np * 16);
        tc::mma16816(acc[2 * np], pa, bb[0], bb[1]);
        tc::mma16816(acc[2 * np + 1], pa, bb[2], bb[3]);
      }
    }
    __syncthreads();  // the buffer is refilled by the next iteration's issue
  }

  // The quad's partial sums, in a fixed butterfly order; o = O / l and lse = m + log2 l.
  float inv[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float l = l_run[hf];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[hf] = 1.f / l;
    if (t4 == 0) lse[((long)b * H + h) * T_ + (long)i * C + r0 + g + hf * 8] = m_run[hf] + log2f(l);
  }
  // Stage the warp's rows in V's first buffer (free: the loop ended on a barrier), then 16-byte stores.
  bf16* sO = sV;
#pragma unroll
  for (int nt = 0; nt < VT; ++nt) {
    const int col = nt * 8 + 2 * t4;
    *reinterpret_cast<tc::u32*>(sO + (r0 + g) * L::LV + col) = tc::pack_bf16(acc[nt][0] * inv[0], acc[nt][1] * inv[0]);
    *reinterpret_cast<tc::u32*>(sO + (r0 + g + 8) * L::LV + col) =
        tc::pack_bf16(acc[nt][2] * inv[1], acc[nt][3] * inv[1]);
  }
  __syncwarp();
  constexpr int PR = DV / 8;  // 16-byte pieces a row
  bf16* oh = o + ((long)b * T_ + (long)i * C + r0) * rowv + (long)h * DV;
#pragma unroll
  for (int p = lane; p < 16 * PR; p += 32) {
    const int r = p / PR, c = (p % PR) * 8;
    *reinterpret_cast<uint4*>(oh + (long)r * rowv + c) = *reinterpret_cast<const uint4*>(sO + (r0 + r) * L::LV + c);
  }
}

// ---------------------------------------------------------------------------------------------
// fp32 on shared-memory tiles
template <int DK, int DV>
struct FwdF32Smem {
  static constexpr int C = kBlock, LK = DK + kPadF, LV = DV + kPadF, LS = C + kPadF;
  static constexpr size_t oQ = 0;
  static constexpr size_t oK = al128(oQ + C * LK * 4);
  static constexpr size_t oV = al128(oK + C * LK * 4);
  static constexpr size_t oS = al128(oV + C * LV * 4);
  static constexpr size_t oO = al128(oS + C * LS * 4);
  static constexpr size_t oStat = al128(oO + C * LV * 4);  // m, l, alpha: [64] each
  static constexpr size_t bytes = oStat + 3 * C * 4;
};

template <int DK, int DV>
__global__ void __launch_bounds__(256) fwd_f32_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                                      const float* __restrict__ v, float* __restrict__ o,
                                                      float* __restrict__ lse, float scale_log2, int T_, int H,
                                                      int window) {
  constexpr int C = kBlock, NW = 8, NT = NW * 32;
  using L = FwdF32Smem<DK, DV>;
  extern __shared__ __align__(128) char smem[];
  float* sQ = reinterpret_cast<float*>(smem + L::oQ);
  float* sK = reinterpret_cast<float*>(smem + L::oK);
  float* sV = reinterpret_cast<float*>(smem + L::oV);
  float* sS = reinterpret_cast<float*>(smem + L::oS);
  float* sO = reinterpret_cast<float*>(smem + L::oO);
  float* sM = reinterpret_cast<float*>(smem + L::oStat);
  float* sL = sM + C;
  float* sA = sL + C;

  const int N = T_ / C;
  const int i = N - 1 - (int)blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const long rowk = (long)H * DK, rowv = (long)H * DV;
  const float* qh = q + (long)b * T_ * rowk + (long)h * DK;
  const float* kh = k + (long)b * T_ * rowk + (long)h * DK;
  const float* vh = v + (long)b * T_ * rowv + (long)h * DV;

  load_tile_async<float, C, DK, NT>(sQ, L::LK, qh + (long)i * C * rowk, rowk);
  for (int x = tid; x < C * DV; x += NT) sO[(x / DV) * L::LV + x % DV] = 0.f;
  if (tid < C) sM[tid] = kNegInf, sL[tid] = 0.f;
  const int j_last = first_key_block(i, window);
  for (int j = i; j >= j_last; --j) {
    load_tile_async<float, C, DK, NT>(sK, L::LK, kh + (long)j * C * rowk, rowk);
    load_tile_async<float, C, DV, NT>(sV, L::LV, vh + (long)j * C * rowv, rowv);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    gemm<float, C, C, DK, false, true, NW>(sQ, L::LK, sK, L::LK, sS, L::LS, false);  // S = Q·Kᵀ
    __syncthreads();
    if (tid < C) {  // row tid: scale, mask, online softmax (one thread a row, keys in order)
      const bool masked = block_masked(i, j, window);
      float* srow = sS + tid * L::LS;
      float mx = kNegInf;
      for (int c = 0; c < C; ++c) {
        float x = srow[c] * scale_log2;
        if (masked && !visible((i - j) * C + tid - c, window)) x = kNegInf;
        srow[c] = x;
        mx = fmaxf(mx, x);
      }
      const float m_new = fmaxf(sM[tid], mx);
      float rs = 0.f;
      for (int c = 0; c < C; ++c) {
        const float p = exp2f(srow[c] - m_new);
        srow[c] = p;
        rs += p;
      }
      const float alpha = exp2f(sM[tid] - m_new);
      sA[tid] = alpha;
      sL[tid] = sL[tid] * alpha + rs;
      sM[tid] = m_new;
    }
    __syncthreads();
    for (int x = tid; x < C * DV; x += NT) sO[(x / DV) * L::LV + x % DV] *= sA[x / DV];
    __syncthreads();
    gemm<float, C, DV, C, false, false, NW>(sS, L::LS, sV, L::LV, sO, L::LV, true);  // O += P·V
    __syncthreads();
  }
  float* oh = o + ((long)b * T_ + (long)i * C) * rowv + (long)h * DV;
  for (int x = tid; x < C * DV; x += NT) {
    const int r = x / DV, c = x % DV;
    oh[(long)r * rowv + c] = sO[r * L::LV + c] / sL[r];
  }
  if (tid < C) lse[((long)b * H + h) * T_ + (long)i * C + tid] = sM[tid] + log2f(sL[tid]);
}

template <int DK, int DV>
void fwd_impl(const Dims& d, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale_log2,
              at::Tensor& o, at::Tensor& lse) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(d.N, d.H, d.B);
  if (q.scalar_type() == at::kBFloat16) {
    auto kern = fwd_bf16_kernel<DK, DV>;
    const size_t sm = FwdSmem<DK, DV>::bytes;
    carry::kernels::primitives::allow_smem(kern, sm);
    kern<<<grid, 128, sm, stream>>>(reinterpret_cast<const bf16*>(q.data_ptr()),
                                    reinterpret_cast<const bf16*>(k.data_ptr()),
                                    reinterpret_cast<const bf16*>(v.data_ptr()), reinterpret_cast<bf16*>(o.data_ptr()),
                                    lse.data_ptr<float>(), scale_log2, d.T, d.H, d.window);
  } else {
    auto kern = fwd_f32_kernel<DK, DV>;
    const size_t sm = FwdF32Smem<DK, DV>::bytes;
    carry::kernels::primitives::allow_smem(kern, sm);
    kern<<<grid, 256, sm, stream>>>(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                                    o.data_ptr<float>(), lse.data_ptr<float>(), scale_log2, d.T, d.H, d.window);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::vector<at::Tensor> attn_fwd(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, double scale,
                                 int64_t window) {
  const Dims d = check_inputs("attn_fwd", q_, k_, v_, window);
  c10::cuda::CUDAGuard guard(q_.device());
  auto q = dense16(q_), k = dense16(k_), v = dense16(v_);
  at::Tensor o = alloc({d.B, d.T, d.H, d.DV}, q.options());
  at::Tensor lse = alloc({d.B, d.H, d.T}, q.options().dtype(at::kFloat));
  const float scale_log2 = (float)(scale * kLog2e);
  if (d.DK == 64) fwd_impl<64, 64>(d, q, k, v, scale_log2, o, lse);
  else fwd_impl<128, 128>(d, q, k, v, scale_log2, o, lse);
  return {o, lse};
}

}  // namespace carry::kernels::softmax_attn
