// Backward of the delta rule (DeltaNet, Gated DeltaNet), chunk C = 64, from the saved forward
// pieces (G, T = (I+A)⁻¹, W, H_c = state entering chunk c, V_new). The kernels of each stage are in
// bwd_dv.cuh (1.), bwd_state.cuh (2.) and bwd_chunk.cuh (3.); this file launches them: in order, or
// with the walk in pieces beside the chunk-local kernels (bwd_pieces).
//
//  1. bwd_dv_local_kernel, grid (N, H, B), 256 threads. One block owns one chunk of one head:
//     P = scale·(QKᵀ ⊙ Γ ⊙ causal) in shared memory, then per dv tile of 64 the intra-chunk part of
//     dV_new, Pᵀ·dO, written in fp32 [B,H,T,dv].
//  2. bwd_state_kernel, grid (dv/BV, H, B), 128 threads: the reverse recurrence. One block owns a
//     BV-wide column tile of one head's state gradient dS [dk,BV] (fp32, shared memory) and walks
//     the chunks backwards, streaming Q, K, W [C,dk], dO, dV_local [C,BV] (double-buffered with
//     cp.async for bf16). Per chunk: writes dH_c = dS (gradient of the state leaving chunk c),
//       dV_new = (e^{G_C−G} ⊙ K)·dS + dV_local,
//       dS ← e^{G_C} dS + (scale·e^G ⊙ Q)ᵀ dO − Wᵀ dV_new,
//     and at the end d_initial_state = dS. With few heads the bf16 walk runs in pieces and the
//     chunk-gradient kernel (3.) of each finished piece runs beside the next (bwd_pieces).
//  3. bwd_chunk_reg_kernel (bf16), grid (N, H, B), 512 threads: the chunk-local gradients dq, dk,
//     dv, dg, dbeta from H_c, dH_c, V_new, dV_new, T, every C×dk and C×C intermediate in mma.sync
//     registers (see 3b below; ~197 KB of shared memory at dk = 128, dv tiles double-buffered).
//     bwd_chunk_kernel (fp32), 256 threads: the same formulas on shared fp32 tiles with FMA
//     products; fp32 with dk=128 does not fit: it falls back to chunk_grads (batched ATen).
//  For bf16 the intra-chunk dV is bwd_dv_local_reg_kernel (1b), the same product from registers; where
//  the warpgroup reverse walk (walk_wg.cuh) follows, it also writes Q̃ = scale·e^G ⊙ Q (bf16) into dq's
//  memory for the walk, which 3. overwrites with dq once the walk has passed the chunk.
#include "layers/kernels/delta_rule/api.h"
#include "layers/kernels/primitives/tiles.cuh"
#include "layers/kernels/delta_rule/launch.h"
#include "layers/kernels/primitives/mma_frag.cuh"
#include "layers/kernels/delta_rule/walk_wg.cuh"

#include <ATen/cuda/CUDAEvent.h>

#include <cstdlib>
#include <limits>
#include <type_traits>

namespace carry::kernels::delta_rule {
using namespace carry::kernels::primitives;

namespace {

constexpr size_t al128(size_t x) { return (x + 127) & ~size_t(127); }
// Chunks buffered by the bf16 reverse recurrence (see kStateStages in fwd.cu). It streams
// Q, K and W a chunk: 3 stages at dk = 128, BV = 16 take 191 KB (2 took 129 KB, also one block an
// SM) and ran 3% faster on an H200 (H=4, dk=128, dv=256, T=32768: 1084 vs 1114 µs).
constexpr int kBwdStateStages = 3;


}  // namespace
}  // namespace carry::kernels::delta_rule

// The three stages' kernels (device code of this translation unit).
#include "layers/kernels/delta_rule/bwd_dv.cuh"
#include "layers/kernels/delta_rule/bwd_state.cuh"
#include "layers/kernels/delta_rule/bwd_chunk.cuh"

namespace carry::kernels::delta_rule {
namespace {

// The chunk-gradient kernel's phase count to run, 0 = all of them (a nonzero value ends it early, for
// timing one phase in a profiling build; gradients are then wrong). Not read from the environment.
int chunk_stop() { return 0; }

struct BwdArgs {
  Dims d;
  at::Tensor q, k, v, beta, W, Gc, Tm, Hs, Vn, dO;
  float scale;
  const float* dSfin;
  at::Tensor dVl, dHs, dVn, dS0;        // recurrence outputs
  at::Tensor dq, dk, dv, dg, dbeta;     // chunk-kernel outputs (dg undefined: DeltaNet)
  at::Tensor As;                        // the forward's segment maps (gdn_fwd; empty: one walk)
  // MixerOptions::on_initial_state_grad: called with dS0 once the reverse walk is enqueued.
  std::function<void(const at::Tensor&)> on_s0_grad;
};

// The bf16 intra-chunk dV (bwd_dv_local_reg_kernel) of chunks [c0, c1) on stream st; scaled_q: it also
// leaves Q̃ = scale·e^G ⊙ Q in dq's memory for the warpgroup reverse walk (the chunk-gradient kernel,
// which writes dq, runs on a chunk only after the walk has passed it).
template <int DK, int DV>
void dv_local_reg(const BwdArgs& a, cudaStream_t st, int c0, int c1, bool scaled_q) {
  auto kern = bwd_dv_local_reg_kernel<DK, DV>;
  constexpr size_t sm = DvRegSmem<DK>::bytes;
  carry::kernels::primitives::allow_smem(kern, sm);
  auto P = [](const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); };
  kern<<<dim3(c1 - c0, a.d.H, a.d.B), 256, sm, st>>>(P(a.q), P(a.k), a.Gc.data_ptr<float>(), P(a.dO),
                                                      a.dVl.data_ptr<float>(),
                                                      scaled_q ? reinterpret_cast<bf16*>(a.dq.data_ptr()) : nullptr,
                                                      a.scale, a.d.T, a.d.H, c0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// bf16: the reverse recurrence (bwd_state_mma_kernel, BV = 16 and 4 warps, or 32 and 8 where
// wide_state_tiles says so) and the chunk-gradient
// kernel. When the recurrence's tiles leave at least half the SMs idle (few heads), it walks the
// chunks in pieces (consecutive launches on one stream, the state gradient handed on through fp32
// memory: the same operations and bits as one walk), and the chunk-gradient kernel of each finished
// piece runs on a second stream on the SMs the recurrence leaves idle while the next piece walks; the
// caller's stream then waits for the last one. Otherwise one walk, then the chunk-gradient kernel
// over every chunk. (The timeline of a run: CARRY_GDN_TIMELINE=1, launch.h.)
// own_dv: the intra-chunk dV is not computed yet, bwd_pieces runs it too: piece by piece on a stream
// of its own in the walk's order when the walk is in pieces with wide state tiles or ramped pieces
// (the first piece's alone, the others beside the walk, whose first piece would otherwise leave the
// SMs it does not use idle; with narrow tiles two pieces ahead of the walk), else before the walk.
// WG: the walk is wg::bwd_walk_wg (walk_wg.cuh; dk = 128, 32 columns, one warpgroup) instead of
// bwd_state_mma_kernel<BV, NW>.
template <int DK, int DV, int BV = 16, int NW = 4, bool WG = false>
bool bwd_pieces(BwdArgs& a, bool own_dv = false) {
  static_assert(!WG || (DK == wg::kDK && BV == wg::kBV), "the warpgroup walk takes dk = 128 in 32-column tiles");
  auto stream = at::cuda::getCurrentCUDAStream();
  const Dims& d = a.d;
  auto P = [](const at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); };
  // two warpgroups a block buffer two chunks (three would not fit in shared memory)
  const int nwg = WG ? walk_warpgroups(d) : 1;
  const size_t ssm = !WG ? BwdStateMmaSmem<DK, BV, kBwdStateStages>::bytes
                     : nwg == 2 ? size_t(wg::BwdSmem<2, 2>::bytes)
                                : size_t(wg::BwdSmem<1, wg::kWalkStages>::bytes);
  CUtensorMap tmQ{}, tmK{}, tmW{}, tmdO{}, tmdVl{}, tmG{}, tmH{}, tmV{};
  // DeltaNet (no gate, dg undefined) walks without the gate's reads and unit factors (the same bits)
  constexpr int S = wg::kWalkStages;
  const bool gate = a.dg.defined();
  auto wkern = nwg == 2 ? (gate ? wg::bwd_walk_wg<DV, 2, 2, true> : wg::bwd_walk_wg<DV, 2, 2, false>)
                        : (gate ? wg::bwd_walk_wg<DV, 1, S, true> : wg::bwd_walk_wg<DV, 1, S, false>);
  if constexpr (WG) {
    const long rows = (long)d.B * d.H * d.T;
    wg::check_coords(rows);
    tmQ = wg::map_tokens(P(a.dq), d.B, d.T, d.H);  // Q̃, which the intra-chunk dV kernel left in dq
    tmK = wg::map_tokens(P(a.k), d.B, d.T, d.H);
    tmW = wg::map_w(P(a.W), rows);
    tmdO = wg::map_do(P(a.dO), d.B, d.T, d.H, DV);
    tmdVl = wg::map_dvl(a.dVl.data_ptr<float>(), rows, DV);
    tmG = wg::map_g(a.Gc.data_ptr<float>(), rows);
    tmH = wg::map_store(P(a.dHs), (long)d.B * d.H * d.N * DK, DV, DK);
    tmV = wg::map_store(P(a.dVn), rows, DV, wg::kC);
    carry::kernels::primitives::allow_smem(wkern, ssm);
  } else {
    carry::kernels::primitives::allow_smem(bwd_state_mma_kernel<DK, DV, BV, NW, kBwdStateStages>, ssm);
  }
  auto ckern = bwd_chunk_reg_kernel<DK, DV>;
  constexpr size_t csm = ChunkRegSmem<DK, 64>::bytes;
  static_assert(csm <= kMaxSmem, "bf16 chunk kernel must fit");
  carry::kernels::primitives::allow_smem(ckern, csm);
  at::cuda::CUDAStream wst = stream;  // the walk's stream
  auto walk = [&](int c0, int c1, const float* from, float* to) {
    if constexpr (WG) {
      wkern<<<dim3(DV / (BV * nwg), d.H, d.B), 128 * nwg, ssm, wst>>>(
          tmQ, tmK, tmW, tmdO, tmdVl, tmG, tmH, tmV, from, P(a.dHs), P(a.dVn), to, d.T, d.H, c0, c1, 1, 0);
    } else
      bwd_state_mma_kernel<DK, DV, BV, NW, kBwdStateStages><<<dim3(DV / BV, d.H, d.B), NW * 32, ssm, wst>>>(
          P(a.q), P(a.k), P(a.W), a.Gc.data_ptr<float>(), P(a.dO), a.dVl.data_ptr<float>(), from, P(a.dHs),
          P(a.dVn), to, a.scale, d.T, d.H, c0, c1);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  auto chunks = [&](cudaStream_t st, int c0, int c1) {
    ckern<<<dim3(c1 - c0, d.H, d.B), 512, csm, st>>>(
        P(a.q), P(a.k), P(a.v), a.Gc.data_ptr<float>(), a.beta.data_ptr<float>(), P(a.Tm), P(a.Hs),
        P(a.dHs), P(a.Vn), P(a.dVn), P(a.dO), P(a.dq), P(a.dk), P(a.dv),
        a.dg.defined() ? a.dg.data_ptr<float>() : nullptr, a.dbeta.data_ptr<float>(), a.scale, d.T, d.H, c0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if constexpr (WG) {
    // The segmented reverse walk, over the forward's P segments: segments 1..P−1 give their summaries b
    // (the gradient entering each from its own chunks, from a zero gradient at its end; no stores); in
    // order from the end, dS_end(P−1) = dSfin, dS_end(p−1) = A(p)ᵀ·dS_end(p) + b(p) (fp32, cuBLAS); then
    // every segment walks at once from its dS_end, writing dH_c and dV_new as the one walk does.
    const int NS = a.As.numel() > 0 ? (int)a.As.size(0) : 1;
    if (NS > 1) {
      const int L = d.N / NS;
      constexpr int kNwg = 2;
      const size_t wsm = wg::BwdSmem<kNwg, 2>::bytes;
      auto k0 = gate ? wg::bwd_walk_wg<DV, kNwg, 2, true, true> : wg::bwd_walk_wg<DV, kNwg, 2, false, true>;
      auto k1 = gate ? wg::bwd_walk_wg<DV, kNwg, 2, true, false> : wg::bwd_walk_wg<DV, kNwg, 2, false, false>;
      carry::kernels::primitives::allow_smem(k0, wsm);
      carry::kernels::primitives::allow_smem(k1, wsm);
      const auto f32 = a.dS0.options();
      const long bh = (long)d.B * d.H;
      at::Tensor bs = at::empty({NS - 1, d.B, d.H, DK, DV}, f32);
      at::Tensor dEnd = at::empty({NS, d.B, d.H, DK, DV}, f32), dStart = at::empty({NS, d.B, d.H, DK, DV}, f32);
      if (own_dv) dv_local_reg<DK, DV>(a, stream, 0, d.N, WG);
      k1<<<dim3(DV / (BV * kNwg), d.H, d.B * (NS - 1)), 128 * kNwg, wsm, stream>>>(
          tmQ, tmK, tmW, tmdO, tmdVl, tmG, tmH, tmV, nullptr, P(a.dHs), P(a.dVn), bs.data_ptr<float>(), d.T, d.H, L,
          d.N, NS - 1, L);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (a.dSfin) dEnd[NS - 1].view({bh, DK, DV}).copy_(at::from_blob(const_cast<float*>(a.dSfin), {bh, DK, DV}, f32));
      else dEnd[NS - 1].zero_();
      for (int p = NS - 1; p >= 1; --p) {
        at::Tensor out_p = dEnd[p - 1].view({bh, DK, DV});
        at::baddbmm_out(out_p, bs[p - 1].view({bh, DK, DV}), a.As[p].view({bh, DK, DK}).transpose(1, 2),
                        dEnd[p].view({bh, DK, DV}));
      }
      k0<<<dim3(DV / (BV * kNwg), d.H, d.B * NS), 128 * kNwg, wsm, stream>>>(
          tmQ, tmK, tmW, tmdO, tmdVl, tmG, tmH, tmV, dEnd.data_ptr<float>(), P(a.dHs), P(a.dVn),
          dStart.data_ptr<float>(), d.T, d.H, 0, d.N, NS, L);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      a.dS0.copy_(dStart[0]);
      if (a.on_s0_grad) a.on_s0_grad(a.dS0);  // before the chunk kernels: a send runs beside them
      chunks(stream, 0, d.N);
      return true;
    }
  }
  const Pieces pc = plan_pieces(d, (DV / (BV * nwg)) * d.H * d.B);
  // Narrow state tiles (H=4, dv=256) take the intra-chunk dV beside the walk only where the pieces ramp
  // (from 1216 chunks): at 32768 tokens beside it Gated DeltaNet ran 1.987 / 1.921 ms against 1.868 /
  // 1.829 before the walk (one H200), where the walk's pieces are too short to hide it.
  if (own_dv && !wide_state_tiles(d) && !pc.ramped) {
    dv_local_reg<DK, DV>(a, stream, 0, d.N, WG);
    own_dv = false;
  }
  if (pc.n == 1) {
    if (own_dv) dv_local_reg<DK, DV>(a, stream, 0, d.N, WG);
    walk(0, d.N, a.dSfin, a.dS0.data_ptr<float>());
    if (a.on_s0_grad) a.on_s0_grad(a.dS0);  // before the chunk kernels: a send runs beside them
    chunks(stream, 0, d.N);
    return true;
  }
  at::Tensor tmp = at::empty({2, d.B, d.H, d.DK, d.DV}, a.dS0.options());
  auto side = at::cuda::getStreamFromPool(false, a.q.device().index());
  Timeline tl("bwd", stream);
  std::vector<at::cuda::CUDAEvent> dv_done(own_dv ? pc.n : 0), reached(pc.n);
  at::cuda::CUDAStream dvs = stream;  // the intra-chunk dV's stream (own_dv)
  auto dv_piece = [&](int p) {
    tl.span("dv", p, dvs, [&] { dv_local_reg<DK, DV>(a, dvs, pc.c0(p, true), pc.c1(p, true), WG); });
    dv_done[p].record(dvs);
  };
  // Narrow tiles: the dV of piece p + 2 waits until the walk's stream has reached piece p (reached[p]:
  // its dV done, the piece before walked), so the dV blocks do not take the SMs before the walk's (one
  // piece ahead the next walk could wait for its dV). Wide tiles: every piece's dV queued at once (it
  // then held the first piece's walk back 90 µs at H=16, 16384 tokens, but throttled two ahead the
  // layer ran no faster: 9.179 / 9.214 → 9.300 / 9.264 ms at 131072 tokens, with the ramp).
  const int kDvAhead = wide_state_tiles(d) ? pc.n : 2;
  if (own_dv) {
    // the walk on a high-priority stream: it then takes the SMs ahead of the pieces' dV blocks
    wst = walk_stream(stream);
    dvs = at::cuda::getStreamFromPool(false, a.q.device().index());
    join(stream, wst);
    join(stream, dvs);  // the caller's stream has produced the inputs
    for (int p = 0; p < std::min(kDvAhead, pc.n); ++p) dv_piece(p);
  }
  const float* from = a.dSfin;
  for (int p = 0; p < pc.n; ++p) {
    const int c0 = pc.c0(p, true), c1 = pc.c1(p, true);
    float* to = c0 == 0 ? a.dS0.data_ptr<float>() : tmp[p % 2].data_ptr<float>();
    if (own_dv) {
      dv_done[p].block(wst);
      reached[p].record(wst);
    }
    tl.span("walk", p, wst, [&] { walk(c0, c1, from, to); });
    from = to;
    if (c0 == 0) {  // the reverse walk's last piece: the caller's stream gets dS0
      join(wst, stream);
      if (a.on_s0_grad) a.on_s0_grad(a.dS0);
    }
    if (own_dv && p + kDvAhead < pc.n) {
      reached[p].block(dvs);
      dv_piece(p + kDvAhead);
    }
    join(wst, side);
    tl.span("chunks", p, side, [&] { chunks(side, c0, c1); });
  }
  join(side, stream);
  join(dvs, stream);
  return true;
}

// Runs the dv-local and reverse-recurrence kernels, then the chunk-gradient kernel where its
// shared memory fits (returns false otherwise: the caller uses chunk_grads in ATen).
template <typename T, int DK, int DV>
bool bwd_impl(BwdArgs& a) {
  const Dims& d = a.d;
  if constexpr (std::is_same<T, bf16>::value) {
    // bf16 always walks in pieces (bwd_pieces; one piece where the walk's tiles fill the GPU). The
    // intra-chunk dV runs in pieces beside the walk (bwd_pieces' own_dv) with the warpgroup walks
    // (dk = 128) where the state tiles are wide (wide_state_tiles, launch.h) or the pieces ramp
    // (bwd_pieces decides: at H=4, dv=256 the dV kernel, 0.11 ms at 32768 tokens, ran ahead of the whole
    // walk), and with the mma.sync walks (dk = 64) in 32-column tiles (wide_state_tiles); before the walk
    // otherwise. Measured on an H200 (docs/benchmarks/log/2026-11-26.md): at H=16, dk=dv=128, 131072
    // tokens, dV before the walk → in pieces, Gated DeltaNet 12.879 / 13.069 → 12.677 / 12.598 ms
    // forward+backward, DeltaNet 12.921 / 12.984 → 12.550 / 12.471.
    if constexpr (DK == wg::kDK) {
      return bwd_pieces<DK, DV, wg::kBV, 4, true>(a, true);
    } else {
      if (wide_state_tiles(d)) return bwd_pieces<DK, DV, 32, 8>(a, true);
      dv_local_reg<DK, DV>(a, at::cuda::getCurrentCUDAStream(), 0, d.N, false);
      return bwd_pieces<DK, DV>(a);
    }
  } else {
    // fp32: the generic kernels on shared tiles, one walk (16-column tiles, 4 warps); the chunk gradients
    // in ATen (chunk_grads) where the chunk kernel's shared memory does not fit (dk = 128).
    auto stream = at::cuda::getCurrentCUDAStream();
    auto P = [](const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); };
    {
      auto kern = bwd_dv_local_kernel<T, DK, DV>;
      size_t sm = DvSmem<T, DK>::bytes;
      carry::kernels::primitives::allow_smem(kern, sm);
      kern<<<dim3(d.N, d.H, d.B), 256, sm, stream>>>(P(a.q), P(a.k), a.Gc.data_ptr<float>(), P(a.dO),
                                                      a.dVl.data_ptr<float>(), a.scale, d.T, d.H);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    {
      constexpr int BV = 16, NW = 4, NBUF = 1;
      auto kern = bwd_state_kernel<T, DK, DV, BV, NBUF, NW>;
      size_t sm = BwdStateSmem<T, DK, BV, NBUF>::bytes;
      carry::kernels::primitives::allow_smem(kern, sm);
      kern<<<dim3(DV / BV, d.H, d.B), NW * 32, sm, stream>>>(P(a.q), P(a.k), P(a.W), a.Gc.data_ptr<float>(), P(a.dO),
                                                            a.dVl.data_ptr<float>(), a.dSfin, P(a.dHs), P(a.dVn),
                                                            a.dS0.data_ptr<float>(), a.scale, d.T, d.H);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (a.on_s0_grad) a.on_s0_grad(a.dS0);  // before the chunk kernels: a send runs beside them
    constexpr int BVt = 16, NWC = 8;  // FMA products on shared tiles
    if constexpr (ChunkSmem<T, DK, BVt>::bytes <= kMaxSmem) {
      auto kern = bwd_chunk_kernel<T, DK, DV, BVt, NWC>;
      size_t sm = ChunkSmem<T, DK, BVt>::bytes;
      carry::kernels::primitives::allow_smem(kern, sm);
      kern<<<dim3(d.N, d.H, d.B), NWC * 32, sm, stream>>>(
          P(a.q), P(a.k), P(a.v), a.Gc.data_ptr<float>(), a.beta.data_ptr<float>(), P(a.Tm), P(a.Hs),
          P(a.dHs), P(a.Vn), P(a.dVn), P(a.dO), P(a.dq), P(a.dk), P(a.dv),
          a.dg.defined() ? a.dg.data_ptr<float>() : nullptr, a.dbeta.data_ptr<float>(), a.scale, d.T, d.H,
          chunk_stop());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return true;
    } else {
      return false;
    }
  }
}

template <typename T, typename... A>
bool bwd_dispatch(int DK, int DV, A&&... a) {
#define CARRY_GDN_CASE(dk, dv) \
  if (DK == dk && DV == dv) return bwd_impl<T, dk, dv>(std::forward<A>(a)...);
  CARRY_GDN_CASE(64, 64) CARRY_GDN_CASE(64, 128) CARRY_GDN_CASE(64, 256)
  CARRY_GDN_CASE(128, 64) CARRY_GDN_CASE(128, 128) CARRY_GDN_CASE(128, 256)
#undef CARRY_GDN_CASE
  TORCH_CHECK(false, "gdn_bwd: unsupported dk=", DK, " dv=", DV);
  return false;
}

// ---------------------------------------------------------------------------------------------
// 3. chunk-local gradients, batched ATen over [B,H,N,C,·] in fp32. With P = scale·(QKᵀ⊙Γ),
// A = diag(β)(KKᵀ)⊙Γ strictly lower, T = (I+A)⁻¹, Kb = β e^G K, Vb = β V:
//   dQ = scale e^G ⊙ dO Hᵀ + (dP⊙Γ·scale) K,  dP = dO V_newᵀ (causal)
//   dK = (dP⊙Γ·scale)ᵀ Q + e^{G_C−G} ⊙ V_new dH'ᵀ + β e^G ⊙ Tᵀ dW + (βD + (βD)ᵀ) K,
//        dW = −dV_new Hᵀ, dT = dV_new Vbᵀ + dW Kbᵀ, dA = −Tᵀ dT Tᵀ (strictly lower), D = dA ⊙ Γ
//   dV = β ⊙ Tᵀ dV_new;  dβ = Σ V⊙TᵀdV_new + Σ e^G K⊙TᵀdW + Σ_s D⊙KKᵀ
//   dG: every e^{±G} factor's share, then dg = reverse cumsum within the chunk.
std::vector<at::Tensor> chunk_grads(const Dims& d, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    bool gated, const at::Tensor& beta, double scale, const at::Tensor& Gc,
                                    const at::Tensor& Tm, const at::Tensor& Hs_, const at::Tensor& Vn_,
                                    const at::Tensor& dO, const at::Tensor& dHs_, const at::Tensor& dVn_) {
  using at::Tensor;
  const int64_t B = d.B, H = d.H, N = d.N, C = kChunk, DK = d.DK, DV = d.DV;
  auto f32 = at::kFloat;
  auto bhn = [&](const Tensor& x, int64_t D) { return x.view({B, N, C, H, D}).permute({0, 3, 1, 2, 4}).to(f32); };
  Tensor q5 = bhn(q, DK), k5 = bhn(k, DK), v5 = bhn(v, DV), do5 = bhn(dO, DV);
  Tensor G = Gc.view({B, H, N, C});
  Tensor b4 = beta.view({B, N, C, H}).permute({0, 3, 1, 2}).to(f32);
  Tensor Hs = Hs_.to(f32), dHs = dHs_.to(f32);
  Tensor Vn = Vn_.view({B, H, N, C, DV}).to(f32), dVn = dVn_.view({B, H, N, C, DV}).to(f32);
  auto bopt = q.options().dtype(at::kBool);
  Tensor causal = at::ones({C, C}, bopt).tril(), strict = at::ones({C, C}, bopt).tril(-1);
  const double ninf = -std::numeric_limits<double>::infinity();
  Tensor Gd = G.unsqueeze(-1) - G.unsqueeze(-2);
  Tensor Gam = Gd.masked_fill(causal.logical_not(), ninf).exp();
  Tensor Gs = Gd.masked_fill(strict.logical_not(), ninf).exp();
  Tensor eG = G.exp().unsqueeze(-1);
  Tensor Glast = G.select(-1, C - 1);
  Tensor eout = (Glast.unsqueeze(-1) - G).exp().unsqueeze(-1);
  Tensor bcol = b4.unsqueeze(-1);

  Tensor dQi = at::matmul(do5, Hs.transpose(-1, -2)) * eG * scale;
  Tensor P = at::matmul(q5, k5.transpose(-1, -2)) * Gam * scale;
  Tensor dP = at::matmul(do5, Vn.transpose(-1, -2)).masked_fill(causal.logical_not(), 0);
  Tensor dPs = dP * Gam * scale;
  Tensor dq = dQi + at::matmul(dPs, k5);
  Tensor dk = at::matmul(dPs.transpose(-1, -2), q5);
  Tensor dKs = at::matmul(Vn, dHs.transpose(-1, -2)) * eout;
  dk += dKs;
  Tensor dW = -at::matmul(dVn, Hs.transpose(-1, -2));
  Tensor Kb = k5 * bcol * eG, Vb = v5 * bcol;
  Tensor dT = at::matmul(dVn, Vb.transpose(-1, -2)) + at::matmul(dW, Kb.transpose(-1, -2));
  Tensor TmT = Tm.to(f32).transpose(-1, -2);
  Tensor X = at::matmul(TmT, dW), Y = at::matmul(TmT, dVn);
  Tensor dv = Y * bcol;
  Tensor dbeta = (v5 * Y).sum(-1) + (k5 * X * eG).sum(-1);
  dk += X * bcol * eG;
  Tensor dA = -at::matmul(at::matmul(TmT, dT), TmT).masked_fill(strict.logical_not(), 0);
  Tensor KK = at::matmul(k5, k5.transpose(-1, -2));
  Tensor D = dA * Gs;
  dbeta += (D * KK).sum(-1);
  Tensor bD = D * bcol;
  dk += at::matmul(bD, k5) + at::matmul(bD.transpose(-1, -2), k5);

  auto back = [&](const Tensor& x, const at::Tensor& like) {  // [B,H,N,C,D] -> [B,T,H,D]
    return x.permute({0, 2, 3, 1, 4}).reshape({B, N * C, H, x.size(-1)}).to(like.scalar_type());
  };
  auto back3 = [&](const Tensor& x, at::ScalarType st) {  // [B,H,N,C] -> [B,T,H]
    return x.permute({0, 2, 3, 1}).reshape({B, N * C, H}).to(st);
  };
  Tensor dg;
  if (gated) {
    Tensor dG = (Kb * X).sum(-1);
    Tensor A = KK * Gs * bcol;
    Tensor dAA = dA * A;
    dG += dAA.sum(-1) - dAA.sum(-2);
    Tensor dPP = dP * P;
    dG += dPP.sum(-1) - dPP.sum(-2);
    dG += (q5 * dQi).sum(-1);
    Tensor kd = (k5 * dKs).sum(-1);
    dG -= kd;
    Tensor last = kd.sum(-1) + Glast.exp() * (dHs * Hs).sum({-1, -2});
    dG.select(-1, C - 1).add_(last);
    dg = dG.flip(-1).cumsum(-1).flip(-1);
    dg = back3(dg, f32);
  }
  return {back(dq, q), back(dk, k), back(dv, v), dg, back3(dbeta, f32)};
}

}  // namespace

std::vector<at::Tensor> gdn_bwd(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                const at::Tensor& g_, const at::Tensor& beta_, double scale,
                                const at::Tensor& S0_, const std::vector<at::Tensor>& saved,
                                const at::Tensor& d_o, const at::Tensor& dSfin_, int64_t chunk_size,
                                const std::function<void(const at::Tensor&)>& on_initial_state_grad) {
  const Dims d = check_inputs("gdn_bwd", q_, k_, v_, g_, beta_, chunk_size);
  TORCH_CHECK(saved.size() == 6, "gdn_bwd: saved must be the 6 tensors gdn_fwd returned after o and final_state");
  TORCH_CHECK(d_o.sizes() == v_.sizes(), "gdn_bwd: d_o must have v's shape ", v_.sizes(), ", got ", d_o.sizes());
  c10::cuda::CUDAGuard guard(q_.device());
  auto q = dense(q_), k = dense(k_), v = dense(v_);
  auto dO = dense(d_o.to(q.scalar_type()));
  auto beta = beta_.to(at::kFloat).contiguous();
  const at::Tensor &Gc = saved[0], &Tm = saved[1], &W = saved[2], &Hs = saved[3], &Vn = saved[4];
  at::Tensor dSfin;
  if (dSfin_.defined()) {
    TORCH_CHECK(dSfin_.sizes() == at::IntArrayRef({d.B, d.H, d.DK, d.DV}), "gdn_bwd: d_final_state must be [B,H,dk,dv]");
    dSfin = dSfin_.to(at::kFloat).contiguous();
  }
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dVl = alloc({d.B, d.H, d.T, d.DV}, f32);
  at::Tensor dHs = alloc({d.B, d.H, d.N, d.DK, d.DV}, q.options());
  at::Tensor dVn = alloc({d.B, d.H, d.T, d.DV}, q.options());
  at::Tensor dS0 = alloc({d.B, d.H, d.DK, d.DV}, f32);
  BwdArgs a{d, q, k, v, beta, W, Gc, Tm, Hs, Vn, dO, (float)scale,
            dSfin.defined() ? dSfin.data_ptr<float>() : nullptr, dVl, dHs, dVn, dS0};
  a.dq = alloc({d.B, d.T, d.H, d.DK}, q.options());
  a.dk = alloc({d.B, d.T, d.H, d.DK}, q.options());
  a.dv = alloc({d.B, d.T, d.H, d.DV}, q.options());
  if (g_.defined()) a.dg = alloc({d.B, d.T, d.H}, f32);
  a.dbeta = alloc({d.B, d.T, d.H}, f32);
  a.on_s0_grad = on_initial_state_grad;
  a.As = saved[5];
  TORCH_CHECK(a.As.numel() == 0 || (a.As.size(0) > 1 && d.N % a.As.size(0) == 0),
              "gdn_bwd: the saved segment maps must be empty or [P,B,H,dk,dk] with P dividing the chunks");
  const bool fused = q.scalar_type() == at::kBFloat16 ? bwd_dispatch<bf16>(d.DK, d.DV, a)
                                                      : bwd_dispatch<float>(d.DK, d.DV, a);
  std::vector<at::Tensor> gr;
  if (fused) gr = {a.dq, a.dk, a.dv, a.dg, a.dbeta};
  else gr = chunk_grads(d, q, k, v, g_.defined(), beta, scale, Gc, Tm, Hs, Vn, dO, dHs, dVn);
  at::Tensor dg = gr[3];
  if (dg.defined()) dg = dg.to(g_.scalar_type());
  return {gr[0], gr[1], gr[2], dg, gr[4].to(beta_.scalar_type()), dS0};
}

}  // namespace carry::kernels::delta_rule
