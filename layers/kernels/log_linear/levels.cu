// The kernels of log-linear Mamba-2's levels above the chunk (api.h states the products).
//
// level_sum: one thread block owns one level's block, one side (half) of it, a segment of at most kSeg
//   64-token chunks of that half and a 64- or 128-wide column tile of y; it walks the segment's chunks,
//   each time copying x (64 × dx) and y (64 × tile) into shared memory, scaling x's rows by wt, and adding
//   x̃ᵀ y into a dx × tile fp32 accumulator held in registers (8 warps: 16 rows each, the columns split
//   between 8·16/dx warps). HBM: x and y read once a level (a half of each block), the segment's partial
//   written once (fp32); FLOPs 2·dx·dy per token a level. reduce_segments sums a half's segments in order
//   and writes the bf16 matrix.
// level_read: one thread block owns one 64-token chunk and one 64- or 128-wide tile of the output; it
//   copies x's chunk (64 × dx) into shared memory once, then for each level where the chunk lies on the
//   read side copies that level's matrix tile (dx × tile, double-buffered: the next level's copy runs under
//   this one's products), multiplies (8 warps, 16 rows × half the tile each), and adds wt_t times the
//   product into the output accumulator in registers; with d it also forms the product's row dots with d
//   (two warps a row, summed in shared memory in a fixed order). HBM: x and the output once, each read
//   level's matrix tile (dx·tile·2 bytes) once a chunk; FLOPs 2·64·dx·tile a chunk and level.
// level_weights: one thread a (level, token).
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

constexpr int kMaxLevels = 40;  // levels above the chunk: 2^46 tokens
constexpr int kSeg = 16;        // chunks a level_sum block walks

// The listed levels, by value in each launch's parameters.
struct Table {
  int n;
  int level[kMaxLevels], start_chunk[kMaxLevels], M[kMaxLevels];
  int mat_off[kMaxLevels];               // level i's first matrix among the ΣM
  int nseg[kMaxLevels], seg_off[kMaxLevels];  // level_sum: segments a half, first partial
  int cta_off[kMaxLevels + 1];           // level_sum: first thread block of level i
};

Table make_table(const std::vector<LevelBlocks>& levels, int64_t T, int& nmat, int& npart, int& ctas) {
  TORCH_CHECK((int)levels.size() <= kMaxLevels, "log-linear level kernels: at most ", kMaxLevels, " levels, got ",
              levels.size());
  Table t{};
  t.n = (int)levels.size();
  nmat = npart = ctas = 0;
  for (int i = 0; i < t.n; ++i) {
    const LevelBlocks& b = levels[i];
    TORCH_INTERNAL_ASSERT(b.level >= 7 && b.start % 64 == 0 && b.M > 0 && b.start + (b.M << b.level) <= T,
                          "log-linear level kernels: level ", b.level, " blocks from ", b.start, " (", b.M,
                          ") do not fit ", T, " tokens in whole chunks");
    const int hc = 1 << (b.level - 7);
    t.level[i] = (int)b.level, t.start_chunk[i] = (int)(b.start / 64), t.M[i] = (int)b.M;
    t.mat_off[i] = nmat, nmat += (int)b.M;
    t.nseg[i] = (hc + kSeg - 1) / kSeg, t.seg_off[i] = npart, npart += (int)b.M * t.nseg[i];
    t.cta_off[i] = ctas, ctas += (int)b.M * t.nseg[i];
  }
  t.cta_off[t.n] = ctas;
  return t;
}

__global__ void weights_kernel(const double* __restrict__ cum, const float* __restrict__ lam, float* __restrict__ wt,
                               float* __restrict__ e, Table tab, int T, int L, long total) {
  for (long idx = blockIdx.x * (long)blockDim.x + threadIdx.x; idx < total; idx += (long)gridDim.x * blockDim.x) {
    const int t = (int)(idx % T);
    const long r = idx / T;
    const int i = (int)(r % tab.n);
    const long bh = r / tab.n;
    const int level = tab.level[i];
    const long rel = t - (long)tab.start_chunk[i] * 64;
    float w = 0.f, ee = 0.f;
    if (rel >= 0 && rel < ((long)tab.M[i] << level)) {
      const long mid = (long)tab.start_chunk[i] * 64 + ((rel >> level) << level) + (1L << (level - 1));
      const double* c = cum + bh * (T + 1);
      const double diff = c[t + 1] - c[mid];
      if ((rel >> (level - 1)) & 1) {
        ee = (float)exp(diff);
        w = lam[(bh * L + level) * T + t] * ee;
      } else {
        w = (float)exp(-diff);
      }
    }
    wt[idx] = w;
    e[idx] = ee;
  }
}

template <int DX, int DYT>
__global__ void __launch_bounds__(256) sum_kernel(const bf16* __restrict__ x, const bf16* __restrict__ y,
                                                  const float* __restrict__ wt, float* __restrict__ part, Table tab,
                                                  int T, int dy, int side, int npart) {
  constexpr int LX = DX + 8, LY = DYT + 8, RW = DX / 16, CG = 8 / RW, COLS = DYT / CG, NT8 = COLS / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sX = reinterpret_cast<bf16*>(smem);
  bf16* sY = sX + 64 * LX;
  float* sW = reinterpret_cast<float*>(sY + 64 * LY);
  const int bh = blockIdx.y, tile0 = blockIdx.z * DYT, tid = threadIdx.x;
  int i = 0;
  while (i + 1 < tab.n && (int)blockIdx.x >= tab.cta_off[i + 1]) ++i;
  const int local = blockIdx.x - tab.cta_off[i], nseg = tab.nseg[i];
  const int m = local / nseg, s = local % nseg;
  const int hc = 1 << (tab.level[i] - 7);
  const int c0 = tab.start_chunk[i] + m * 2 * hc + side * hc + s * kSeg;
  const int nc = min(kSeg, hc - s * kSeg);
  const bf16* xb = x + (long)bh * T * DX;
  const bf16* yb = y + (long)bh * T * dy + tile0;
  const float* wb = wt + ((long)bh * tab.n + i) * T;
  const int warp = tid >> 5;
  const int m0 = (warp % RW) * 16, n0 = (warp / RW) * COLS;
  float acc[NT8][4];
#pragma unroll
  for (int nt = 0; nt < NT8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  for (int cc = 0; cc < nc; ++cc) {
    const long t0 = (long)(c0 + cc) * 64;
    pr::load_tile_async<bf16, 64, DX, 256>(sX, LX, xb + t0 * DX, DX);
    pr::load_tile_async<bf16, 64, DYT, 256>(sY, LY, yb + t0 * dy, dy);
    pr::cp_async_commit();
    if (tid < 64) sW[tid] = wb[t0 + tid];
    pr::cp_async_wait<0>();
    __syncthreads();
    for (int idx = tid; idx < 64 * DX / 2; idx += 256) {  // x̃ = wt·x, rounded to bf16 as the operand
      const int r = idx / (DX / 2), c2 = (idx % (DX / 2)) * 2;
      unsigned* p = reinterpret_cast<unsigned*>(sX + r * LX + c2);
      const float2 v = pr::tc::unpack_bf16(*p);
      *p = pr::tc::pack_bf16(v.x * sW[r], v.y * sW[r]);
    }
    __syncthreads();
    pr::frag_mma<NT8, 64, true, false>(acc, sX, LX, sY, LY, m0, n0);
    __syncthreads();
  }
  pr::frag_store_f32<NT8>(part + ((long)bh * npart + tab.seg_off[i] + (long)m * nseg + s) * DX * dy + tile0, dy, acc,
                          m0, n0);
}

// mats[bh, j] = Σ_s part[bh, seg_off + m·nseg + s] in order, as bf16; four elements a thread.
__global__ void reduce_segments(const float* __restrict__ part, bf16* __restrict__ mats, Table tab, int nmat, int npart,
                                int esize, long total4) {
  for (long idx = blockIdx.x * (long)blockDim.x + threadIdx.x; idx < total4; idx += (long)gridDim.x * blockDim.x) {
    const long e4 = idx % (esize / 4), r = idx / (esize / 4);
    const int j = (int)(r % nmat);
    const long bh = r / nmat;
    int i = 0;
    while (i + 1 < tab.n && j >= tab.mat_off[i + 1]) ++i;
    const int m = j - tab.mat_off[i], nseg = tab.nseg[i];
    const float* p = part + ((long)bh * npart + tab.seg_off[i] + (long)m * nseg) * esize + e4 * 4;
    float4 s = *reinterpret_cast<const float4*>(p);
    for (int k = 1; k < nseg; ++k) {
      const float4 v = *reinterpret_cast<const float4*>(p + (long)k * esize);
      s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
    }
    uint2 u;
    u.x = pr::tc::pack_bf16(s.x, s.y);
    u.y = pr::tc::pack_bf16(s.z, s.w);
    *reinterpret_cast<uint2*>(mats + r * esize + e4 * 4) = u;
  }
}

// Shared memory of read_kernel: x's chunk, two matrix tiles, d's chunk, then per read level wt's chunk and the
// row dots' two halves.
template <int DX, int DYT, bool TR, bool RD>
constexpr int read_fixed_smem() {
  constexpr int MS = TR ? DYT * (DX + 8) : DX * (DYT + 8);
  return 2 * (64 * (DX + 8) + 2 * MS + (RD ? 64 * (DYT + 8) : 0));
}
int read_smem_of(int fixed, int n, bool rd) { return fixed + n * 64 * 4 * (rd ? 3 : 1); }

template <int DX, int DYT, bool TR, bool RD>
__global__ void __launch_bounds__(256) read_kernel(const bf16* __restrict__ x, const bf16* __restrict__ mats,
                                                   const float* __restrict__ wt, const bf16* __restrict__ d,
                                                   float* __restrict__ out, float* __restrict__ rowdot, Table tab,
                                                   int T, int ow, int mr, int mc, int nmat, int side) {
  constexpr int LX = DX + 8, LM = TR ? DX + 8 : DYT + 8, LD = DYT + 8;
  constexpr int MS = TR ? DYT * (DX + 8) : DX * (DYT + 8);
  constexpr int NT8 = DYT / 16;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sX = reinterpret_cast<bf16*>(smem);
  bf16* sM = sX + 64 * LX;  // two buffers of MS
  bf16* sD = sM + 2 * MS;
  float* sW = reinterpret_cast<float*>(sD + (RD ? 64 * LD : 0));  // [n][64]
  float* sRD = sW + tab.n * 64;                                  // [n][2][64]
  __shared__ int s_idx[kMaxLevels], s_mat[kMaxLevels], s_cnt;
  const int n = blockIdx.x, bh = blockIdx.y, tile0 = blockIdx.z * DYT, tid = threadIdx.x;
  if (tid == 0) {
    int cnt = 0;
    for (int i = 0; i < tab.n; ++i) {
      const int rel = n - tab.start_chunk[i], lv = tab.level[i];
      if (rel >= 0 && rel < (tab.M[i] << (lv - 6)) && ((rel >> (lv - 7)) & 1) == side) {
        s_idx[cnt] = i;
        s_mat[cnt] = tab.mat_off[i] + (rel >> (lv - 6));
        ++cnt;
      }
    }
    s_cnt = cnt;
  }
  __syncthreads();
  const int cnt = s_cnt;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int m0 = (warp & 3) * 16, n0 = (warp >> 2) * (DYT / 2);
  float* ob = out + ((long)bh * T + (long)n * 64) * ow + tile0;
  float acc[NT8][4];
#pragma unroll
  for (int nt = 0; nt < NT8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  if (cnt > 0) {
    const long row0 = (long)bh * T + (long)n * 64;
    auto load_mat = [&](int j, int buf) {
      const bf16* mp = mats + ((long)bh * nmat + s_mat[j]) * mr * mc;
      if constexpr (TR) pr::load_tile_async<bf16, DYT, DX, 256>(sM + buf * MS, LM, mp + (long)tile0 * mc, mc);
      else pr::load_tile_async<bf16, DX, DYT, 256>(sM + buf * MS, LM, mp + tile0, mc);
    };
    pr::load_tile_async<bf16, 64, DX, 256>(sX, LX, x + row0 * DX, DX);
    if constexpr (RD) pr::load_tile_async<bf16, 64, DYT, 256>(sD, LD, d + row0 * ow + tile0, ow);
    load_mat(0, 0);
    pr::cp_async_commit();
    for (int idx = tid; idx < cnt * 64; idx += 256)
      sW[idx] = wt[((long)bh * tab.n + s_idx[idx / 64]) * T + (long)n * 64 + idx % 64];
    for (int j = 0; j < cnt; ++j) {
      if (j + 1 < cnt) {
        load_mat(j + 1, (j + 1) & 1);
        pr::cp_async_commit();
        pr::cp_async_wait<1>();
      } else {
        pr::cp_async_wait<0>();
      }
      __syncthreads();
      float R[NT8][4];
#pragma unroll
      for (int nt = 0; nt < NT8; ++nt) R[nt][0] = R[nt][1] = R[nt][2] = R[nt][3] = 0.f;
      pr::frag_mma<NT8, DX, false, TR>(R, sX, LX, sM + (j & 1) * MS, LM, m0, n0);
      const int r0 = m0 + g, r1 = r0 + 8;
      const float w0 = sW[j * 64 + r0], w1 = sW[j * 64 + r1];
      float p0 = 0.f, p1 = 0.f;
#pragma unroll
      for (int nt = 0; nt < NT8; ++nt) {
        acc[nt][0] += w0 * R[nt][0], acc[nt][1] += w0 * R[nt][1];
        acc[nt][2] += w1 * R[nt][2], acc[nt][3] += w1 * R[nt][3];
        if constexpr (RD) {
          const int col = n0 + nt * 8 + 2 * t4;
          const float2 d0 = pr::tc::unpack_bf16(*reinterpret_cast<const unsigned*>(sD + r0 * LD + col));
          const float2 d1 = pr::tc::unpack_bf16(*reinterpret_cast<const unsigned*>(sD + r1 * LD + col));
          p0 += R[nt][0] * d0.x + R[nt][1] * d0.y;
          p1 += R[nt][2] * d1.x + R[nt][3] * d1.y;
        }
      }
      if constexpr (RD) {
        p0 += __shfl_xor_sync(0xffffffffu, p0, 1);
        p0 += __shfl_xor_sync(0xffffffffu, p0, 2);
        p1 += __shfl_xor_sync(0xffffffffu, p1, 1);
        p1 += __shfl_xor_sync(0xffffffffu, p1, 2);
        if (t4 == 0) {
          sRD[(j * 2 + (warp >> 2)) * 64 + r0] = p0;
          sRD[(j * 2 + (warp >> 2)) * 64 + r1] = p1;
        }
      }
      __syncthreads();  // this buffer is refilled two levels on
    }
  }
  pr::frag_store_f32<NT8>(ob, ow, acc, m0, n0);
  if constexpr (RD) {
    for (int idx = tid; idx < cnt * 64; idx += 256) {
      const int j = idx / 64, r = idx % 64;
      rowdot[((long)bh * tab.n + s_idx[j]) * T + (long)n * 64 + r] = sRD[(j * 2) * 64 + r] + sRD[(j * 2 + 1) * 64 + r];
    }
  }
}

void check_input(const char* what, const at::Tensor& t, at::ScalarType dt, int dims) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == dt && t.dim() == dims && t.is_contiguous() &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              "log-linear level kernels: ", what, " must be a contiguous 16-byte aligned CUDA ", dt, " tensor of ",
              dims, " dimensions, got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

const bf16* P(const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); }
int blocks_for(long total) { return (int)std::min<long>((total + 255) / 256, 65535L * 8); }

template <int DX, int DYT>
void launch_sum(const at::Tensor& x, const at::Tensor& y, const at::Tensor& wt, at::Tensor& part, const Table& tab, int ctas,
                int side, int npart) {
  const int BH = (int)x.size(0), T = (int)x.size(1), dy = (int)y.size(2);
  const int smem = 2 * 64 * (DX + 8) + 2 * 64 * (DYT + 8) + 64 * 4;
  pr::allow_smem(sum_kernel<DX, DYT>, smem);
  sum_kernel<DX, DYT><<<dim3(ctas, BH, dy / DYT), 256, smem, at::cuda::getCurrentCUDAStream()>>>(
      P(x), P(y), wt.data_ptr<float>(), part.data_ptr<float>(), tab, T, dy, side, npart);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int DX, int DYT, bool TR, bool RD>
void launch_read(const at::Tensor& x, const at::Tensor& mats, const at::Tensor& wt, const at::Tensor& d, at::Tensor& out,
                 at::Tensor& rowdot, const Table& tab, int side) {
  const int BH = (int)x.size(0), T = (int)x.size(1), ow = (int)out.size(2);
  const int smem = read_smem_of(read_fixed_smem<DX, DYT, TR, RD>(), tab.n, RD);
  pr::allow_smem(read_kernel<DX, DYT, TR, RD>, smem);
  read_kernel<DX, DYT, TR, RD><<<dim3(T / 64, BH, ow / DYT), 256, smem, at::cuda::getCurrentCUDAStream()>>>(
      P(x), P(mats), wt.data_ptr<float>(), RD ? P(d) : nullptr, out.data_ptr<float>(),
      RD ? rowdot.data_ptr<float>() : nullptr, tab, T, ow, (int)mats.size(2), (int)mats.size(3), (int)mats.size(1), side);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::vector<at::Tensor> level_weights(const at::Tensor& cum, const at::Tensor& lam, const std::vector<LevelBlocks>& levels) {
  check_input("cum", cum, at::kDouble, 2);
  check_input("lam", lam, at::kFloat, 3);
  c10::cuda::CUDAGuard guard(cum.device());
  const int64_t BH = cum.size(0), T = cum.size(1) - 1;
  int nmat, npart, ctas;
  const Table tab = make_table(levels, T, nmat, npart, ctas);
  auto wt = at::empty({BH, (int64_t)levels.size(), T}, lam.options()), e = at::empty_like(wt);
  const long total = wt.numel();
  if (total == 0) return {wt, e};
  weights_kernel<<<blocks_for(total), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      cum.data_ptr<double>(), lam.data_ptr<float>(), wt.data_ptr<float>(), e.data_ptr<float>(), tab, (int)T,
      (int)lam.size(1), total);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {wt, e};
}

at::Tensor level_sum(const at::Tensor& x, const at::Tensor& y, const at::Tensor& wt, const std::vector<LevelBlocks>& levels,
                     int side) {
  check_input("x", x, at::kBFloat16, 3);
  check_input("y", y, at::kBFloat16, 3);
  check_input("wt", wt, at::kFloat, 3);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t BH = x.size(0), T = x.size(1), dx = x.size(2), dy = y.size(2);
  TORCH_CHECK(T % 64 == 0 && (dx == 64 || dx == 128) && (dy == 64 || dy == 128 || dy == 256) && y.size(0) == BH &&
                  y.size(1) == T && wt.size(0) == BH && wt.size(1) == (int64_t)levels.size() && wt.size(2) == T,
              "log-linear level_sum: x [BH,T,64|128], y [BH,T,64|128|256], wt [BH,levels,T]; got x ", x.sizes(), ", y ",
              y.sizes(), ", wt ", wt.sizes());
  int nmat, npart, ctas;
  const Table tab = make_table(levels, T, nmat, npart, ctas);
  auto mats = at::empty({BH, nmat, dx, dy}, x.options());
  if (nmat == 0) return mats;
  auto part = at::empty({BH, npart, dx, dy}, wt.options());
  const int dyt = dy == 64 ? 64 : 128;
  if (dx == 64) dyt == 64 ? launch_sum<64, 64>(x, y, wt, part, tab, ctas, side, npart)
                          : launch_sum<64, 128>(x, y, wt, part, tab, ctas, side, npart);
  else dyt == 64 ? launch_sum<128, 64>(x, y, wt, part, tab, ctas, side, npart)
                 : launch_sum<128, 128>(x, y, wt, part, tab, ctas, side, npart);
  const long total4 = BH * nmat * dx * dy / 4;
  reduce_segments<<<blocks_for(total4), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      part.data_ptr<float>(), reinterpret_cast<bf16*>(mats.data_ptr()), tab, nmat, npart, (int)(dx * dy), total4);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return mats;
}

std::vector<at::Tensor> level_read(const at::Tensor& x, const at::Tensor& mats, const at::Tensor& wt,
                                   const std::vector<LevelBlocks>& levels, int side, bool transposed, const at::Tensor& d) {
  check_input("x", x, at::kBFloat16, 3);
  check_input("mats", mats, at::kBFloat16, 4);
  check_input("wt", wt, at::kFloat, 3);
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t BH = x.size(0), T = x.size(1), xw = x.size(2);
  const int64_t ow = transposed ? mats.size(2) : mats.size(3), inner = transposed ? mats.size(3) : mats.size(2);
  const bool rd = d.defined();
  TORCH_CHECK(T % 64 == 0 && inner == xw && mats.size(0) == BH && wt.size(0) == BH &&
                  wt.size(1) == (int64_t)levels.size() && wt.size(2) == T &&
                  (xw == 64 || xw == 128 || (transposed && xw == 256)) && (ow == 64 || ow == 128 || ow == 256) &&
                  transposed == rd && (!rd || ow <= 128),
              "log-linear level_read: x [BH,T,w] with w matching the matrices ", mats.sizes(),
              (transposed ? " (transposed)" : ""), ", row dots only with the transpose and an output of width <= 128; got x ",
              x.sizes(), ", wt ", wt.sizes());
  if (rd) check_input("d", d, at::kBFloat16, 3);
  int nmat, npart, ctas;
  const Table tab = make_table(levels, T, nmat, npart, ctas);
  TORCH_CHECK(mats.size(1) == nmat, "log-linear level_read: ", nmat, " matrices expected, got ", mats.size(1));
  auto out = at::empty({BH, T, ow}, wt.options());
  at::Tensor rowdot = rd ? at::zeros({BH, (int64_t)levels.size(), T}, wt.options()) : at::Tensor();
  const int dyt = ow == 64 ? 64 : 128;
  if (!transposed) {
    if (xw == 64) dyt == 64 ? launch_read<64, 64, false, false>(x, mats, wt, d, out, rowdot, tab, side)
                            : launch_read<64, 128, false, false>(x, mats, wt, d, out, rowdot, tab, side);
    else dyt == 64 ? launch_read<128, 64, false, false>(x, mats, wt, d, out, rowdot, tab, side)
                   : launch_read<128, 128, false, false>(x, mats, wt, d, out, rowdot, tab, side);
  } else if (xw == 64) {
    dyt == 64 ? launch_read<64, 64, true, true>(x, mats, wt, d, out, rowdot, tab, side)
              : launch_read<64, 128, true, true>(x, mats, wt, d, out, rowdot, tab, side);
  } else if (xw == 128) {
    dyt == 64 ? launch_read<128, 64, true, true>(x, mats, wt, d, out, rowdot, tab, side)
              : launch_read<128, 128, true, true>(x, mats, wt, d, out, rowdot, tab, side);
  } else {
    dyt == 64 ? launch_read<256, 64, true, true>(x, mats, wt, d, out, rowdot, tab, side)
              : launch_read<256, 128, true, true>(x, mats, wt, d, out, rowdot, tab, side);
  }
  return {out, rowdot};
}

}  // namespace carry::kernels::log_linear
