// Host-side helpers shared by fwd.cu and bwd.cu (private to the folder).
#pragma once

#include "layers/kernels/primitives/host.h"
#include "layers/core/knobs.h"
#include "layers/kernels/primitives/piece_cuts.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace carry::kernels::delta_rule {

bool poison_enabled();
int forced_pieces();  // gdn_set_pieces' value
bool ramp_pieces();  // whether the pieces may ramp (gdn_set_pieces' flag for forced pieces)
int forced_segments();  // gdn_set_segments' value

// at::empty, filled with NaN when the debug poison is on.
inline at::Tensor alloc(at::IntArrayRef sizes, const at::TensorOptions& opt) {
  return carry::kernels::primitives::alloc_poisoned(sizes, opt, poison_enabled());
}
inline at::Tensor dense(const at::Tensor& t) { return carry::kernels::primitives::dense16(t); }

struct Dims {
  int B, T, H, DK, DV, N;
};

// How a bf16 state walk (forward from chunk 0, reverse from the sequence's end) cuts the chunks: n
// pieces at the boundaries cut (carry::kernels::primitives::piece_cuts; n + 1 of them, 0 to N). The forced (test)
// value, else automatic: about N/12 chunks a piece (at least 32; at least 64 where the state tiles are
// wide, H=16 with dk=dv=128: 4 pieces instead of 8 at 16384 tokens gave DeltaNet 1.568 / 1.616 → 1.522 /
// 1.493 ms and Gated DeltaNet 1.663 / 1.700 → 1.635 / 1.668 forward+backward, 6 and 12 pieces no better,
// on an H200) when the walk's tiles (value_blocks blocks) fill at most half the SMs,
// one walk otherwise. The automatic pieces ramp where the state
// tiles are narrow (not wide_state_tiles: H=4, dv=256) and the end pieces keep 32 chunks (from 1216
// chunks, 77824 tokens, in 12 pieces): the two at each end a quarter and a half of the others, so what
// waits before the first walk and after the last is a quarter of a piece's chunk-local work; the
// forced ones are uniform unless gdn_set_pieces asks for the ramp (ramp_pieces). Measured on an H200
// (with the reverse walk's dV beside it, bwd_pieces): H=4, dv=256, 131072 tokens, DeltaNet 6.432 / 6.298 → 5.973 / 5.943 ms
// forward+backward, Gated DeltaNet 6.483 / 6.269 → 5.951 / 5.940; at H=16, dk=dv=128 (wide tiles) level
// (9.179 / 9.214 → 9.300 / 9.264), hence narrow tiles only. idle: whether the walk leaves at least half
// the SMs to the other kernels (else they would share its SMs); ramped: whether the pieces ramp.
struct Pieces {
  int n;
  std::vector<int> cut;
  bool idle, ramped;
  // Chunks [c0, c1) of piece p in walk order: from chunk 0 forward, from chunk N − 1 in reverse.
  int c0(int p, bool reverse) const { return reverse ? cut[n - 1 - p] : cut[p]; }
  int c1(int p, bool reverse) const { return reverse ? cut[n - p] : cut[p + 1]; }
};
using carry::kernels::primitives::sm_count;
// The bf16 state walks' column tiles: 16 columns (4 warps) where those tiles leave at least half the
// SMs idle (the walk then runs in pieces with the chunk-local kernels beside it), else 32 columns (8
// warps): half the blocks, each reading a chunk's W and K (and Q) once for twice the columns. Measured
// on an H200, forward+backward ms, 16 → 32 columns: H=16, dk=dv=128 Gated DeltaNet 2.078 / 2.008 →
// 2.068 at 16k and 15.265 / 15.138 → 13.858 at 131k; at H=4, dv=256 (64 tiles of 16) 32 columns
// ran slower (2.125 → 2.755 ms at 32k). Depends on B, H, dv and the GPU only, never on T: every cut
// of a sequence runs the same tiles.
// (The warpgroup walks, 32 columns, use it to tell the many-head shapes from the few-head ones.)
inline bool wide_state_tiles(const Dims& d) { return 2 * (d.DV / 16) * d.H * d.B > sm_count(); }

// The segments of the segmented bf16 walk at dk = 128 (fwd.cu, bwd.cu): the chunks cut into P segments
// of N/P that walk at once, each from its exact incoming state (segment summaries S ↦ A·S + B, scanned in
// order). `asked` is gdn_fwd's segments: 1 walks the chunks in order (serial_states: the bits then do not
// depend on where a sequence is cut); n > 1 that many; 0 gdn_set_segments' value, else automatic: where
// the walk's 32-column tiles take at most a quarter of the SMs, the largest power of two P with P times
// the tiles within two an SM, segments of at least kMinSegmentChunks chunks, P dividing N; else one walk.
// The summaries cost two more walks' work (B over dv columns, A over dk) and the output kernel no longer
// runs beside the walk, so the segments pay only where the one walk leaves most SMs idle and the
// segments are long. Gated DeltaNet forward / forward+backward ms on an H200, one walk → automatic
// (4 segments forward): H=4, dk=128, dv=256 at 32768 tokens 0.728 / 1.620 → 0.579 / 1.474, at 131072
// 2.293 / 5.076 → 1.837 / 4.614; H=8, dk=dv=128 at 32768 1.818 → 1.714 f+b, at 131072 5.663 → 5.615;
// at 8192 tokens (segments of 32 chunks) slower, 0.515 → 0.740 (hence 128 chunks at least); on an H100
// two segments at H=16, dk=dv=128 were slower too (16384 tokens 1.553 → 1.807). The backward walks the
// forward's segments only where they were forced (segmented_backward): on an H100 it ran 0.982 → 0.970 ms
// at H=4, 32768 tokens, and 2.899 → 3.420 at 131072.
constexpr int kMinSegmentChunks = 128;
inline int plan_segments(const Dims& d, int asked) {
  if (asked == 1) return 1;
  const int forced = asked > 1 ? asked : forced_segments();
  if (forced > 0) {
    TORCH_CHECK(d.N % forced == 0, "delta rule: ", forced, " walk segments do not divide the ", d.N, " chunks");
    return forced;
  }
  const int tiles = (d.DV / 32) * d.H * d.B;
  if (4 * tiles > sm_count()) return 1;
  int P = 1;
  while (2 * P * tiles <= 2 * sm_count() && d.N % (2 * P) == 0 && d.N / (2 * P) >= kMinSegmentChunks) P *= 2;
  return P;
}
// Whether the backward walks the forward's segments too (the forward then saves every segment's map):
// where the segments were forced, not chosen.
inline bool segmented_backward(int asked) { return asked > 1 || (asked == 0 && forced_segments() > 1); }

inline Pieces plan_pieces(const Dims& d, int value_blocks) {
  const bool idle = 2 * value_blocks <= sm_count();
  const int forced = forced_pieces();
  const int n = forced > 0 ? forced : idle ? std::max(1, std::min(12, d.N / (wide_state_tiles(d) ? 64 : 32))) : 1;
  const bool ramp = ramp_pieces() && (forced > 0 || !wide_state_tiles(d));
  std::vector<int> cut = carry::kernels::primitives::piece_cuts(d.N, n, ramp, forced > 0 ? 1 : 32);
  const int pieces = (int)cut.size() - 1;
  const bool ramped = ramp && pieces >= 5 && cut[1] - cut[0] < cut[3] - cut[2];
  return {pieces, std::move(cut), idle, ramped};
}

// Warpgroups (32-column tiles) a warpgroup walk block, forward and reverse: 1 or 2 (fwd.cu).
int walk_warpgroups(const Dims& d);


// The stream a bf16 state walk in pieces runs on (the forward's; the reverse walk's where the
// intra-chunk dV runs in pieces beside it): a high-priority one, so that the SMs a piece's blocks free
// go to the next piece's blocks before the chunk-local kernels queued on the other streams. Measured
// on an H200 (forward ms, caller's stream → high priority): H=16, dk=dv=128, 131072 tokens, Gated
// DeltaNet 5.083 / 5.026 → 4.904 / 4.917, DeltaNet 5.083 / 5.042 → 4.890 / 4.889; at H=4, dv=256
// 2.976 / 3.111 → 2.895 / 2.882. (The reverse walk alone on such a stream ran no faster.)
inline at::cuda::CUDAStream walk_stream(const at::cuda::CUDAStream& caller) {
  return at::cuda::getStreamFromPool(true, caller.device_index());
}
using carry::kernels::primitives::join;

// A debug timeline of a pieces schedule (CARRY_GDN_TIMELINE=1; read once): events recorded around
// each launch, on its stream after its waits, and printed to stderr as "[timeline] <schedule> <kernel>
// <piece> <start ms> <end ms>" (from the schedule's start) when the schedule object ends, which
// synchronizes the device: for profiling runs only. A start is when the stream reached the launch
// (its waits met), so a kernel held back by busy SMs shows that wait inside its span.
class Timeline {
 public:
  Timeline(const char* name, cudaStream_t origin_stream) : name_(name) {
    static const bool env = [] {
      const char* e = knob_value("CARRY_GDN_TIMELINE");
      return e && e[0] == '1';
    }();
    on_ = env;
    if (on_) {
      C10_CUDA_CHECK(cudaEventCreate(&origin_));
      C10_CUDA_CHECK(cudaEventRecord(origin_, origin_stream));
    }
  }
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;
  template <class Launch>
  void span(const char* what, int piece, cudaStream_t st, Launch&& launch) {
    if (!on_) return launch();
    Span sp{what, piece, nullptr, nullptr};
    C10_CUDA_CHECK(cudaEventCreate(&sp.a));
    C10_CUDA_CHECK(cudaEventCreate(&sp.b));
    C10_CUDA_CHECK(cudaEventRecord(sp.a, st));
    launch();
    C10_CUDA_CHECK(cudaEventRecord(sp.b, st));
    spans_.push_back(sp);
  }
  ~Timeline() {
    if (!on_) return;
    cudaDeviceSynchronize();
    std::fprintf(stderr, "[timeline] %s begin\n", name_);
    for (const Span& sp : spans_) {
      float a = 0.f, b = 0.f;
      cudaEventElapsedTime(&a, origin_, sp.a);
      cudaEventElapsedTime(&b, origin_, sp.b);
      std::fprintf(stderr, "[timeline] %s %s %d %.4f %.4f\n", name_, sp.what, sp.piece, a, b);
      cudaEventDestroy(sp.a);
      cudaEventDestroy(sp.b);
    }
    cudaEventDestroy(origin_);
  }

 private:
  struct Span {
    const char* what;
    int piece;
    cudaEvent_t a, b;
  };
  const char* name_;
  bool on_ = false;
  cudaEvent_t origin_ = nullptr;
  std::vector<Span> spans_;
};

inline Dims check_inputs(const char* who, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& g, const at::Tensor& beta, int64_t chunk) {
  TORCH_CHECK(chunk == 64, who, ": chunk_size must be 64, got ", chunk);
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
  TORCH_CHECK(d.DK == 64 || d.DK == 128, who, ": dk must be 64 or 128, got ", d.DK);
  TORCH_CHECK(d.DV == 64 || d.DV == 128 || d.DV == 256, who, ": dv must be 64, 128 or 256, got ", d.DV);
  TORCH_CHECK(d.T % 64 == 0 && d.T > 0, who, ": T must be a positive multiple of 64, got ", d.T);
  TORCH_CHECK(beta.sizes() == at::IntArrayRef({d.B, d.T, d.H}), who, ": beta must be [B,T,H] = [", d.B,
              ",", d.T, ",", d.H, "], got ", beta.sizes());
  TORCH_CHECK(!g.defined() || g.sizes() == beta.sizes(), who, ": g must be [B,T,H] or undefined, got ",
              g.sizes());
  d.N = d.T / 64;
  return d;
}

}  // namespace carry::kernels::delta_rule
