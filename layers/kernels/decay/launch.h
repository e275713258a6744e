// Host-side helpers shared by fwd.cu and bwd.cu (private to the kernels).
#pragma once

#include "layers/kernels/decay/api.h"
#include "layers/kernels/decay/state_walk.cuh"

#include "layers/kernels/primitives/host.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <functional>
#include <limits>

namespace carry::kernels::decay {

bool poison_enabled();
int forced_segments();  // decay_set_segments' value
int forced_pieces();    // decay_set_pieces' value

using carry::kernels::primitives::join;

// at::empty, filled with NaN when the debug poison is on.
inline at::Tensor alloc(at::IntArrayRef sizes, const at::TensorOptions& opt) {
  return carry::kernels::primitives::alloc_poisoned(sizes, opt, poison_enabled());
}
inline at::Tensor dense(const at::Tensor& t) { return carry::kernels::primitives::dense16(t); }

struct Dims {
  int B, T, H, DK, DV, N;
  int segments = 0;  // the state recurrence's segments: 0 = decay_set_segments' value or automatic
};
// The segments a launch uses: the call's own choice, else the forced (test) value, else automatic (0).
inline int segments_of(const Dims& d) { return d.segments > 0 ? d.segments : forced_segments(); }

// The pieces a bf16 walk runs in: the forced count (decay_set_pieces) when set; else, automatically,
// pieces of about N/12 chunks where the walk's blocks in pieces (piece_walk_blocks) take at most half
// the SMs, so the chunk-local kernels of the finished pieces have the other half, and the sequence has
// at least 1024 chunks; one walk otherwise, for linear attention's reverse walk, and where the walk runs
// in segments (a segmented walk is one launch and its join). Measured on an H200 (H=16, dk=dv=128,
// forward+backward ms, one walk → pieces both ways): at 131072 tokens simple GLA 7.020 / 7.033 →
// 6.353 / 6.386, GLA 15.914 / 15.921 → 15.012 / 14.972, linear attention 6.307 / 6.388 → 6.495 / 6.451
// (its forward 2.290 / 2.368 → 2.143 / 2.065: the reverse walk on 64-column tiles, 0.183 ms a twelfth
// against 1.145 ms for the one walk on 32 columns, cost more than its chunk gradients beside it gave);
// at 16384 (8 pieces) every family ran slower (linear attention 0.890 / 0.940 → 1.023 / 1.067). This
// rule (the next call, one walk → these pieces, 131072 tokens): linear attention 6.326 / 6.357 → 6.149 /
// 6.150, simple GLA 6.967 / 6.957 → 6.354 / 6.298, GLA 15.896 / 15.966 → 14.842 / 14.930; at 65536
// 3.194 / 3.258 → 3.248 / 3.229, 3.512 / 3.596 → 3.365 / 3.360, 8.008 / 8.015 → 7.842 / 7.826.
// Measured and not taken (a later call): linear attention's reverse walk in pieces too (131072: 6.119
// / 6.151 → 6.053 / 6.090; 65536: 3.167 / 3.216 → 3.287 / 3.241), and the forward's walk blocks asking
// only for their own shared memory, so output blocks share their SMs (131072: linear attention 6.119
// / 6.151 → 6.395 / 6.423, simple GLA 6.283 / 6.286 → 6.523 / 6.434, GLA 14.726 / 14.790 → 14.592 /
// 14.632).
// Depends on B, H, dk, dv, the family and the GPU, and on T only through the number of pieces, which
// moves no bit (the pieces give the one walk's bits).
inline int pieces_for(const Dims& d, bool bf16, int segments_used, int kind, bool reverse) {
  if (!bf16 || segments_used != 1) return 1;
  const int n = forced_pieces();
  if (n >= 1) return std::min(n, d.N);
  if (d.N < 1024 || (reverse && kind == kNone)) return 1;
  if (2 * piece_walk_blocks(d.B, d.H, d.DK, d.DV) > sm_count()) return 1;
  return 12;
}

// The walk in `pieces` consecutive ranges of chunks (the last range first when `reverse`), each a launch
// walk(c0, c1, from, to, stream), the state handed from one to the next through fp32 memory
// (`first_from` into the first, the last into `last_to`). The walk runs on a high-priority stream, so
// the SMs a piece's blocks free go to the next piece's blocks before the chunk-local kernels queued on
// the other streams (the delta rule's walk_stream); after each range's walk, local(stream, c0, c1,
// beside) on a second stream runs the chunk-local kernels of that range, `beside` the next range's walk
// (false for the last range). last(): on the caller's stream, right after the last range's walk
// (the hook: a send enqueued there runs beside the last range's chunk-local kernels).
template <typename Walk, typename Local, typename Last>
void walk_in_pieces(int N, int pieces, bool reverse, const float* first_from, float* last_to,
                    const at::Tensor& state, Walk walk, Local local, Last last) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const int len = (N + pieces - 1) / pieces, n = (N + len - 1) / len;
  at::Tensor handover = at::empty({2, state.numel()}, state.options().dtype(at::kFloat));
  auto wst = at::cuda::getStreamFromPool(true, state.device().index());
  auto side = at::cuda::getStreamFromPool(false, state.device().index());
  join(stream, wst);  // the caller's stream has produced every input
  join(stream, side);
  const float* from = first_from;
  for (int i = 0; i < n; ++i) {
    const int p = reverse ? n - 1 - i : i, c0 = p * len, c1 = std::min(N, c0 + len);
    float* to = i == n - 1 ? last_to : handover[i % 2].data_ptr<float>();
    walk(c0, c1, from, to, wst.stream());
    from = to;
    if (i == n - 1) {
      join(wst, stream);
      last();
    }
    join(wst, side);
    local(side.stream(), c0, c1, i < n - 1);
  }
  join(side, stream);
}

// The state walk (REV: in reverse, for the state gradients) from `from` (fp32 [B,H,DK,DV]) into Send,
// saving the per-chunk states in Hsave, then the chunk-local kernels local(stream, c0, c1, beside) over
// every chunk; hook(Send), when set, right after the walk's last launch is enqueued (before the chunk-
// local kernels that follow it: what it enqueues, a send, runs beside them). In bf16 in pieces
// (pieces_for) the walk runs on piece_walk_tv's tiles, each finished piece's chunk-local kernels on a
// second stream beside the next piece's walk, whose blocks ask for an SM's whole shared memory: a
// chunk-local block sharing a walk's SM would slow the walk's chain (the delta rule's finding).
template <typename T, int KIND, bool REV, typename Local>
void walk_then_local(const Dims& d, const at::Tensor& X, const at::Tensor& Y, const at::Tensor& G,
                     const at::Tensor& from, at::Tensor& Hsave, at::Tensor& Send, float scale,
                     const std::function<void(const at::Tensor&)>& hook, Local local) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const int segments = state_segments<T>(d.B, d.T, d.H, d.DK, d.DV, segments_of(d)).first;
  const int pieces = pieces_for(d, sizeof(T) == 2, segments, KIND, REV);
  if (pieces == 1) {
    launch_state<T, KIND, REV>(X, Y, G, from, Hsave, Send, d.B, d.T, d.H, d.DK, d.DV, scale, stream, segments_of(d));
    if (hook) hook(Send);
    local(stream.stream(), 0, d.N, false);
  } else if constexpr (sizeof(T) == 2) {
    int dev = 0, optin = 0;
    C10_CUDA_CHECK(cudaGetDevice(&dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    walk_in_pieces(
        d.N, pieces, REV, from.data_ptr<float>(), Send.data_ptr<float>(), Send,
        [&](int c0, int c1, const float* f, float* t, cudaStream_t st) {
          launch_state_piece<KIND, REV>(X, Y, G, f, Hsave, t, d.B, d.T, d.H, d.DK, d.DV, scale, st, c0, c1,
                                        (size_t)optin);
        },
        local, [&] { if (hook) hook(Send); });
  }
}

inline Dims check_inputs(const char* who, Decay kind, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& g) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 4, who, ": q must be a CUDA tensor [B,T,H,dk], got ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes(), who, ": k must have q's shape ", q.sizes(), ", got ", k.sizes());
  Dims d{(int)q.size(0), (int)q.size(1), (int)q.size(2), (int)q.size(3), 0, 0};
  TORCH_CHECK(v.dim() == 4 && v.size(0) == d.B && v.size(1) == d.T && v.size(2) == d.H, who,
              ": v must be [", d.B, ",", d.T, ",", d.H, ",dv], got ", v.sizes());
  d.DV = (int)v.size(3);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), who,
              ": q, k, v must share one dtype");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, who,
              ": q, k, v must be bf16 or fp32, got ", q.scalar_type());
  TORCH_CHECK(d.DK == 64 || d.DK == 96 || d.DK == 128, who, ": dk must be 64, 96 or 128, got ", d.DK);
  TORCH_CHECK(d.DV % 64 == 0 && d.DV >= 64 && d.DV <= 256, who, ": dv must be 64, 128, 192 or 256, got ", d.DV);
  TORCH_CHECK(d.T % 64 == 0 && d.T > 0, who, ": T must be a positive multiple of 64, got ", d.T);
  if (kind == Decay::none) {
    TORCH_CHECK(!g.defined(), who, ": linear attention takes no gate");
  } else {
    TORCH_CHECK(g.defined() && (g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16) && g.is_cuda(), who,
                ": the gate must be fp32 or bf16 on CUDA (it is cumulated in fp32)");
    if (kind == Decay::scalar) {
      TORCH_CHECK(g.sizes() == at::IntArrayRef({d.B, d.T, d.H}), who, ": g must be [B,T,H], got ", g.sizes());
    } else {
      TORCH_CHECK(g.sizes() == q.sizes(), who, ": gk must be [B,T,H,dk], got ", g.sizes());
    }
  }
  d.N = d.T / 64;
  return d;
}

}  // namespace carry::kernels::decay
