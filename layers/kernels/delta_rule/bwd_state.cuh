// Stage 2 of the delta rule's backward (bwd.cu): the reverse state recurrence, dS walked backwards
// over the chunks writing dH_c and dV_new: bwd_state_kernel (shared tiles) and bwd_state_mma_kernel
// (bf16 on tensor cores, dS in mma registers). Device code of bwd.cu's translation unit: included by
// bwd.cu alone, after its constants (al128, kBwdStateStages).
#pragma once

namespace carry::kernels::delta_rule {
namespace {

// ---------------------------------------------------------------------------------------------
// 2. reverse state recurrence
template <typename T, int DK, int BV, int NBUF>
struct BwdStateSmem {
  static constexpr int C = kChunk, P = pad_of<T>();
  static constexpr int LK = DK + P, LS = BV + kPadF, LSb = BV + P;
  static constexpr size_t oS = 0;
  static constexpr size_t oSb = al128(oS + DK * LS * 4);
  static constexpr size_t oQ = al128(oSb + DK * LSb * sizeof(T));
  static constexpr size_t oK = al128(oQ + NBUF * C * LK * sizeof(T));
  static constexpr size_t oW = al128(oK + NBUF * C * LK * sizeof(T));
  static constexpr size_t odO = al128(oW + NBUF * C * LK * sizeof(T));
  static constexpr size_t odVl = al128(odO + NBUF * C * LSb * sizeof(T));
  static constexpr size_t oG = al128(odVl + NBUF * C * LS * 4);
  static constexpr size_t odVn = al128(oG + NBUF * C * 4);
  static constexpr size_t odVnb = al128(odVn + C * LS * 4);
  static constexpr size_t bytes = odVnb + C * LSb * sizeof(T);
};

template <typename T, int DK, int DV, int BV, int NBUF, int NW>
__global__ void __launch_bounds__(NW * 32) bwd_state_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                                        const T* __restrict__ W, const float* __restrict__ Gc,
                                                        const T* __restrict__ dO, const float* __restrict__ dVl,
                                                        const float* __restrict__ dSfin, T* __restrict__ dHs,
                                                        T* __restrict__ dVn, float* __restrict__ dS0, float scale,
                                                        int T_, int H) {
  constexpr int C = kChunk, NT = NW * 32;
  using L = BwdStateSmem<T, DK, BV, NBUF>;
  extern __shared__ __align__(128) char smem[];
  float* sdS = reinterpret_cast<float*>(smem + L::oS);
  T* sdSb = reinterpret_cast<T*>(smem + L::oSb);
  T* sQ = reinterpret_cast<T*>(smem + L::oQ);
  T* sK = reinterpret_cast<T*>(smem + L::oK);
  T* sW = reinterpret_cast<T*>(smem + L::oW);
  T* sdO = reinterpret_cast<T*>(smem + L::odO);
  float* sdVl = reinterpret_cast<float*>(smem + L::odVl);
  float* sG = reinterpret_cast<float*>(smem + L::oG);
  float* sdVn = reinterpret_cast<float*>(smem + L::odVn);
  T* sdVnb = reinterpret_cast<T*>(smem + L::odVnb);

  const int v0 = blockIdx.x * BV, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int N = T_ / C;
  const long bh = (long)b * H + h, rowk = (long)H * DK, rowv = (long)H * DV;

  auto issue = [&](int c, int buf) {
    const long t0 = (long)c * C;
    load_tile_async<T, C, DK, NT>(sQ + buf * C * L::LK, L::LK, q + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
    load_tile_async<T, C, DK, NT>(sK + buf * C * L::LK, L::LK, k + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
    load_tile_async<T, C, DK, NT>(sW + buf * C * L::LK, L::LK, W + (bh * T_ + t0) * DK, DK);
    load_tile_async<T, C, BV, NT>(sdO + buf * C * L::LSb, L::LSb, dO + ((long)b * T_ + t0) * rowv + (long)h * DV + v0,
                                  rowv);
    load_tile_async<float, C, BV, NT>(sdVl + buf * C * L::LS, L::LS, dVl + (bh * T_ + t0) * DV + v0, DV);
    if (tid < C / 4) cp_async16(sG + buf * C + tid * 4, Gc + bh * T_ + t0 + tid * 4);
  };

  for (int i = tid; i < DK * BV; i += NT) {
    const int r = i / BV, j = i % BV;
    sdS[r * L::LS + j] = dSfin ? dSfin[(bh * DK + r) * DV + v0 + j] : 0.f;
  }
  if constexpr (NBUF == 2) {
    issue(N - 1, 0);
    cp_async_commit();
  }
  __syncthreads();

  for (int it = 0; it < N; ++it) {
    const int c = N - 1 - it;
    const int buf = NBUF == 2 ? (it & 1) : 0;
    T* dh = dHs + (bh * N + c) * DK * DV + v0;
    for (int i = tid; i < DK * BV; i += NT) {
      const int r = i / BV, j = i % BV;
      const T x = from_f<T>(sdS[r * L::LS + j]);
      sdSb[r * L::LSb + j] = x;
      dh[(long)r * DV + j] = x;
    }
    if constexpr (NBUF == 2) {
      if (c > 0) issue(c - 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      issue(c, 0);
      cp_async_commit();
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* cQ = sQ + buf * C * L::LK;
    const T* cK = sK + buf * C * L::LK;
    const T* cW = sW + buf * C * L::LK;
    T* cdO = sdO + buf * C * L::LSb;
    const float* cdVl = sdVl + buf * C * L::LS;
    const float* G = sG + buf * C;

    gemm<T, C, BV, DK, false, false, NW>(cK, L::LK, sdSb, L::LSb, sdVn, L::LS, false);  // K·dS
    __syncthreads();
    const float gl = G[C - 1], egl = expf(gl);
    T* dvn = dVn + (bh * T_ + (long)c * C) * DV + v0;
    for (int i = tid; i < C * BV; i += NT) {
      const int r = i / BV, j = i % BV;
      const T x = from_f<T>(sdVn[r * L::LS + j] * expf(gl - G[r]) + cdVl[r * L::LS + j]);
      dvn[(long)r * DV + j] = x;
      sdVnb[r * L::LSb + j] = from_f<T>(-to_f(x));
      cdO[r * L::LSb + j] = from_f<T>(to_f(cdO[r * L::LSb + j]) * scale * expf(G[r]));
    }
    for (int i = tid; i < DK * BV; i += NT) {
      const int r = i / BV, j = i % BV;
      sdS[r * L::LS + j] *= egl;
    }
    __syncthreads();
    gemm<T, DK, BV, C, true, false, NW>(cQ, L::LK, cdO, L::LSb, sdS, L::LS, true);    // += (scale e^G Q)ᵀ dO
    gemm<T, DK, BV, C, true, false, NW>(cW, L::LK, sdVnb, L::LSb, sdS, L::LS, true);  // −= Wᵀ dV_new
    __syncthreads();
  }
  for (int i = tid; i < DK * BV; i += NT) {
    const int r = i / BV, j = i % BV;
    dS0[(bh * DK + r) * DV + v0 + j] = sdS[r * L::LS + j];
  }
}

// 2b. bf16 reverse recurrence on raw tensor cores (the plan of bwd_state_kernel, with dS in
// registers as mma accumulators; unit ownership as in fwd_state_mma_kernel).
template <int DK, int BV, int NBUF>
struct BwdStateMmaSmem {
  static constexpr int C = kChunk, LK = DK + 8, LB = BV + 8, LF = BV + kPadF;
  static constexpr size_t oSb = 0;
  static constexpr size_t oQ = al128(oSb + DK * LB * 2);
  static constexpr size_t oK = al128(oQ + NBUF * C * LK * 2);
  static constexpr size_t oW = al128(oK + NBUF * C * LK * 2);
  static constexpr size_t odO = al128(oW + NBUF * C * LK * 2);
  static constexpr size_t odVl = al128(odO + NBUF * C * LB * 2);
  static constexpr size_t oG = al128(odVl + NBUF * C * LF * 4);
  static constexpr size_t oVb = al128(oG + NBUF * C * 4);
  static constexpr size_t bytes = oVb + C * LB * 2;
  static_assert(bytes <= 227 * 1024, "state kernel shared memory");
};

template <int DK, int DV, int BV, int NW, int NBUF>
__global__ void __launch_bounds__(NW * 32) bwd_state_mma_kernel(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ W, const float* __restrict__ Gc,
    const bf16* __restrict__ dO, const float* __restrict__ dVl, const float* __restrict__ dSfin,
    bf16* __restrict__ dHs, bf16* __restrict__ dVn, float* __restrict__ dS0, float scale, int T_, int H,
    int c_begin, int c_end) {
  constexpr int C = kChunk, NT = NW * 32, NP = BV / 16;
  constexpr int U2 = (DK / 16) * NP, U2W = U2 / NW, U1 = (C / 16) * NP;
  static_assert(U2 % NW == 0, "state units must split evenly over warps");
  static_assert(NBUF >= 2, "at least one chunk in flight");
  using L = BwdStateMmaSmem<DK, BV, NBUF>;
  constexpr int LK = L::LK, LB = L::LB, LF = L::LF;
  extern __shared__ __align__(128) char smem[];
  bf16* sSb = reinterpret_cast<bf16*>(smem + L::oSb);
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::oQ);
  bf16* sK = reinterpret_cast<bf16*>(smem + L::oK);
  bf16* sW = reinterpret_cast<bf16*>(smem + L::oW);
  bf16* sdO = reinterpret_cast<bf16*>(smem + L::odO);
  float* sdVl = reinterpret_cast<float*>(smem + L::odVl);
  float* sG = reinterpret_cast<float*>(smem + L::oG);
  bf16* sVb = reinterpret_cast<bf16*>(smem + L::oVb);

  const int v0 = blockIdx.x * BV, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const int N = T_ / C;
  const long bh = (long)b * H + h, rowk = (long)H * DK, rowv = (long)H * DV;

  auto issue = [&](int c, int buf) {
    const long t0 = (long)c * C;
    load_tile_async<bf16, C, DK, NT>(sQ + buf * C * LK, LK, q + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
    load_tile_async<bf16, C, DK, NT>(sK + buf * C * LK, LK, k + ((long)b * T_ + t0) * rowk + (long)h * DK, rowk);
    load_tile_async<bf16, C, DK, NT>(sW + buf * C * LK, LK, W + (bh * T_ + t0) * DK, DK);
    load_tile_async<bf16, C, BV, NT>(sdO + buf * C * LB, LB, dO + ((long)b * T_ + t0) * rowv + (long)h * DV + v0, rowv);
    load_tile_async<float, C, BV, NT>(sdVl + buf * C * LF, LF, dVl + (bh * T_ + t0) * DV + v0, DV);
    if (tid < C / 4) cp_async16(sG + buf * C + tid * 4, Gc + bh * T_ + t0 + tid * 4);
  };

  float acc[U2W][2][4];
#pragma unroll
  for (int i = 0; i < U2W; ++i) {
    const int u = warp + i * NW, m0 = (u / NP) * 16, n0 = (u % NP) * 16;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int col = v0 + n0 + nt * 8 + 2 * t4;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = m0 + g + hf * 8;
        acc[i][nt][2 * hf] = dSfin ? dSfin[(bh * DK + row) * DV + col] : 0.f;
        acc[i][nt][2 * hf + 1] = dSfin ? dSfin[(bh * DK + row) * DV + col + 1] : 0.f;
      }
    }
  }
  // NBUF − 1 chunks in flight, walking backwards (as in fwd_state_mma_kernel) over the chunks
  // [c_begin, c_end): dSfin is the state gradient leaving chunk c_end − 1, dS0 gets the one entering
  // c_begin (a piece of the walk; pieces chained through fp32 memory give the whole walk's bits).
  const int count = c_end - c_begin;
#pragma unroll
  for (int it = 0; it < NBUF - 1; ++it) {
    if (it < count) issue(c_end - 1 - it, it);
    cp_async_commit();
  }

  for (int it = 0; it < count; ++it) {
    const int c = c_end - 1 - it, buf = it % NBUF;
#pragma unroll
    for (int i = 0; i < U2W; ++i) {
      const int u = warp + i * NW, m0 = (u / NP) * 16, n0 = (u % NP) * 16;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = n0 + nt * 8 + 2 * t4;
        *reinterpret_cast<unsigned*>(sSb + (m0 + g) * LB + col) = tc::pack_bf16(acc[i][nt][0], acc[i][nt][1]);
        *reinterpret_cast<unsigned*>(sSb + (m0 + g + 8) * LB + col) = tc::pack_bf16(acc[i][nt][2], acc[i][nt][3]);
      }
    }
    if (it + NBUF - 1 < count) issue(c - (NBUF - 1), (it + NBUF - 1) % NBUF);
    cp_async_commit();
    cp_async_wait<NBUF - 1>();
    __syncthreads();
    const bf16* cQ = sQ + buf * C * LK;
    const bf16* cK = sK + buf * C * LK;
    const bf16* cW = sW + buf * C * LK;
    bf16* cdO = sdO + buf * C * LB;
    const float* cdVl = sdVl + buf * C * LF;
    const float* G = sG + buf * C;
    {  // dH_c = dS (16-byte copies)
      bf16* dh = dHs + (bh * N + c) * DK * DV + v0;
      constexpr int VR = BV / 8;
      static_assert(NT % VR == 0 && (DK * VR) % NT == 0, "whole rows a pass");
      const int r0 = tid / VR, cv = (tid % VR) * 8;
#pragma unroll
      for (int j = 0; j < DK * VR / NT; ++j) {
        const int r = r0 + j * (NT / VR);
        *reinterpret_cast<uint4*>(dh + (long)r * DV + cv) = *reinterpret_cast<const uint4*>(sSb + r * LB + cv);
      }
    }
    const float gl = G[C - 1];
    // aq = Qᵀ·(scale e^G ⊙ dO), which does not depend on dS: issued before the dV_new product so it
    // runs beside it, and added to the decayed dS after the barrier (the update's chain is then the
    // Wᵀ·Vb product alone, 4 k-steps deep instead of 8). The factor scale·e^{G_t} scales Qᵀ's
    // fragments in registers (A columns = tokens k0 + 2·t4 + {0, 1, 8, 9}) instead of a pass over dO.
    float aq[U2W][2][4];
    {
      float sq[C / 16][4];
#pragma unroll
      for (int ks = 0; ks < C / 16; ++ks) {
        const int t = 16 * ks + 2 * t4;
        sq[ks][0] = scale * __expf(G[t]);
        sq[ks][1] = scale * __expf(G[t + 1]);
        sq[ks][2] = scale * __expf(G[t + 8]);
        sq[ks][3] = scale * __expf(G[t + 9]);
      }
#pragma unroll
      for (int i = 0; i < U2W; ++i) {
        const int u = warp + i * NW, n0 = (u % NP) * 16, m0 = (u / NP) * 16;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) aq[i][nt][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < C / 16; ++ks) {
          unsigned a[4], bb[4];
          tc::load_a_t(a, cQ, LK, m0, 16 * ks);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 x = tc::unpack_bf16(a[e]);
            const int p = (e >> 1) * 2;
            a[e] = tc::pack_bf16(x.x * sq[ks][p], x.y * sq[ks][p + 1]);
          }
          tc::load_b2_t(bb, cdO, LB, 16 * ks, n0);
          tc::mma16816(aq[i][0], a, bb[0], bb[1]);
          tc::mma16816(aq[i][1], a, bb[2], bb[3]);
        }
      }
    }
    // dV_new = e^{G_C−G} ⊙ K·dS + dV_local; Vb = −dV_new
    for (int u1 = warp; u1 < U1; u1 += NW) {
      const int m0 = (u1 / NP) * 16, n0 = (u1 % NP) * 16;
      float v[2][4];
      frag_mma_2chain<DK>(v, cK, LK, sSb, LB, m0, n0);
      bf16* dvn = dVn + (bh * T_ + (long)c * C) * DV + v0;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = m0 + g + hf * 8;
        const float e = __expf(gl - G[r]);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int col = n0 + nt * 8 + 2 * t4;
          const float2 l = *reinterpret_cast<const float2*>(cdVl + r * LF + col);
          const unsigned x = tc::pack_bf16(v[nt][2 * hf] * e + l.x, v[nt][2 * hf + 1] * e + l.y);
          *reinterpret_cast<unsigned*>(dvn + (long)r * DV + col) = x;
          const float2 xf = tc::unpack_bf16(x);
          *reinterpret_cast<unsigned*>(sVb + r * LB + col) = tc::pack_bf16(-xf.x, -xf.y);
        }
      }
    }
    __syncthreads();
    const float egl = __expf(gl);
#pragma unroll
    for (int i = 0; i < U2W; ++i) {
      const int u = warp + i * NW, m0 = (u / NP) * 16, n0 = (u % NP) * 16;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][nt][e] = acc[i][nt][e] * egl + aq[i][nt][e];
#pragma unroll
      for (int k0 = 0; k0 < C; k0 += 16) {
        unsigned a[4], bb[4];
        tc::load_a_t(a, cW, LK, m0, k0);
        tc::load_b2_t(bb, sVb, LB, k0, n0);
        tc::mma16816(acc[i][0], a, bb[0], bb[1]);
        tc::mma16816(acc[i][1], a, bb[2], bb[3]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < U2W; ++i) {
    const int u = warp + i * NW, m0 = (u / NP) * 16, n0 = (u % NP) * 16;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int col = v0 + n0 + nt * 8 + 2 * t4;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = m0 + g + hf * 8;
        *reinterpret_cast<float2*>(dS0 + (bh * DK + row) * DV + col) =
            make_float2(acc[i][nt][2 * hf], acc[i][nt][2 * hf + 1]);
      }
    }
  }
}

}  // namespace
}  // namespace carry::kernels::delta_rule
