// Mamba-1's selective scan (S6) on the GPU (api.h): the segment algorithm of scan.cuh, in plain fp32 FMAs.
// The kernels are kernels.cuh's; this file checks the inputs, plans the segments and launches them.
//
// Tiling. A block is 128 threads; a thread owns a tile of kChan = 2 consecutive channels of one sequence and
// kGroup = 4 consecutive states of each (N/4 threads a tile, 256·4/N channels a block: 64 for N = 16), for one
// segment of L tokens (L a multiple of kSub = 8). Grid (⌈D/channels⌉, S, B). The tile's states, its A entries
// (times log2 e: the exponentials are ex2) and, in the backward, its gradient carry and one sub-chunk's 8
// recomputed states stay in registers. A block stages its inputs in shared memory 8 tokens at a time
// (kernels.cuh's Stager: cp.async into two buffers, the next 8 tokens in flight while the block walks the
// current ones; the block's channels of u, Δ, dy, zero past D, and the rows of B, C). Per token a thread reads
// u_t, Δ_t (and dy_t) of its two channels as one pair and B_t, C_t of its 4 states as one read, the same
// address for every tile of a warp's state group. Sums over n (y, du, dΔ) and over the warp's channels (dB, dC, each thread's
// two channels summed first) are transposing warp shuffles: at each level a lane keeps half of its values
// and adds its partner's share of them, so a sum of v values over w lanes costs about v shuffles. The
// block's 4 warps are then added in order through shared memory, written as one row a block of a
// [blocks, 2·B·T·N] fp32 buffer that primitives::column_sum adds in order. dA is one row a (b, segment) of a
// [B·S, D·N] buffer, added the same way. No atomics: the bits repeat.
//
// Kernels. Forward: local (segments 0..S−2 from zero: end state, ΣΔ) → scan (one thread a (b,d,n), the S
// segments in order: the state entering each, saved for the backward) → output (every segment from its
// incoming state: y; the last one writes h_T). With one segment only the output kernel runs, from h0.
// Backward: local (segments 1..S−1 from a zero gradient: outgoing gradient, ΣΔ) → reverse scan (the gradient
// arriving at each segment's last state) → checkpoints (the state entering every 8-token sub-chunk, the
// forward again from the segment states: fp32 [B,⌈T/8⌉,D,N], freed after the call) → main (every segment,
// sub-chunk by sub-chunk from the last: du, dΔ, the dB/dC and dA partials; segment 0 writes dh0) → the two
// column sums.
//
// Floor. Forward: reads u, Δ (2·B·T·D elements) twice with S > 1 and writes y; B, C are B·T·N. Backward: reads
// u, Δ, dy three to four times and writes du, dΔ; the checkpoints are 4·B·T·D·N/8 bytes each way, the dB/dC
// partials 8·B·T·N·⌈D·N/1024⌉ bytes. The arithmetic is one exp and a few FMAs a (token, d, n) a pass (six
// passes with an exp: two forward, four backward): the exp unit and the issue rate bound it.
#include "layers/kernels/selective_scan/api.h"
#include "layers/kernels/selective_scan/kernels.cuh"
#include "layers/kernels/selective_scan/scan.cuh"

#include "layers/kernels/primitives/host.h"
#include "layers/kernels/primitives/reduce.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace carry::kernels::selective_scan {
namespace {

using namespace core;
using namespace kernels;

std::atomic<bool> g_poison{false};
std::atomic<int> g_segments{0};

at::Tensor alloc(at::IntArrayRef sizes, const at::TensorOptions& opt) {
  return carry::kernels::primitives::alloc_poisoned(sizes, opt, g_poison.load());
}

// The kernels read their inputs as 16-byte vectors and pairs: a tensor whose data does not start on a
// 16-byte boundary (a view into a larger one) is copied.
at::Tensor aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone();
}

void check_inputs(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                  const at::Tensor& C) {
  TORCH_CHECK(u.is_cuda() && u.dim() == 3, "selective_scan: u must be a CUDA tensor [B,T,D]; got ", u.sizes(),
              " on ", u.device());
  const int64_t Bs = u.size(0), T = u.size(1), D = u.size(2);
  TORCH_CHECK(T >= 1 && D >= 1, "selective_scan: u [B,T,D] needs T >= 1 and D >= 1; got ", u.sizes());
  TORCH_CHECK(u.scalar_type() == at::kFloat || u.scalar_type() == at::kBFloat16,
              "selective_scan: u, delta, B, C must be bf16 or fp32; got ", u.scalar_type());
  TORCH_CHECK(delta.sizes() == u.sizes() && delta.scalar_type() == u.scalar_type(),
              "selective_scan: delta must match u (", u.sizes(), " ", u.scalar_type(), "); got ", delta.sizes(),
              " ", delta.scalar_type());
  TORCH_CHECK(A.dim() == 2 && A.size(0) == D && A.scalar_type() == at::kFloat,
              "selective_scan: A must be fp32 [D,N] with D = ", D, "; got ", A.sizes(), " ", A.scalar_type());
  const int64_t N = A.size(1);
  TORCH_CHECK(N == 4 || N == 8 || N == 16, "selective_scan: the state size N (A's second dimension) must be 4, 8 "
              "or 16; got ", N);
  for (const at::Tensor* t : {&B, &C})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == Bs && t->size(1) == T && t->size(2) == N &&
                    t->scalar_type() == u.scalar_type(),
                "selective_scan: B and C must be [", Bs, ",", T, ",", N, "] in ", u.scalar_type(), "; got ",
                t->sizes(), " ", t->scalar_type());
  for (const at::Tensor* t : {&u, &delta, &A, &B, &C})
    TORCH_CHECK(t->is_contiguous() && t->device() == u.device(),
                "selective_scan: inputs must be contiguous and on one device");
  TORCH_CHECK(Bs <= 65535 && (double)Bs * T * D * N < 9e18, "selective_scan: too many sequences (", Bs, ")");
}

Dims dims_of(const at::Tensor& u, const at::Tensor& A, int L) {
  Dims m;
  m.Bs = (int)u.size(0), m.T = (int)u.size(1), m.D = (int)u.size(2), m.N = (int)A.size(1);
  m.L = L;
  m.S = segment_count(m.T, L);
  m.P = channel_blocks(m.D, m.N);
  return m;
}

// The blocks of the forward's output kernel that one SM holds at once (its registers bound it).
template <typename In, int N>
int output_blocks_per_sm() {
  static const int n = [] {
    int k = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&k, fwd_output_kernel<In, N>, kThreads,
                                                                 stage_smem<In, N>()));
    return std::max(1, k);
  }();
  return n;
}

// Lets kernel k take `bytes` of dynamic shared memory (above 48 KiB it must ask).
template <class K>
void allow_smem(K* k, size_t bytes) {
  if (bytes > 48 * 1024) C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

// The kernels of <In, N> allowed their shared memory, once a process.
template <typename In, int N>
void allow_kernels_smem() {
  static const bool done = [] {
    allow_smem(fwd_local_kernel<In, N>, stage_smem<In, N>());
    allow_smem(fwd_output_kernel<In, N>, stage_smem<In, N>());
    allow_smem(checkpoint_kernel<In, N>, stage_smem<In, N>());
    allow_smem(bwd_local_kernel<In, N>, stage_smem<In, N>());
    allow_smem(bwd_main_kernel<In, N>, bwd_main_smem<In, N>());
    return true;
  }();
  (void)done;
}

// The segments asked for: the call's, else the forced one, else by the grid: as many blocks as the SMs
// hold at once (`per_sm` each, one wave: rounded down), at least 64 tokens a segment.
int segments_asked(int segments, int Bs, int T, int D, int N, int per_sm) {
  if (segments <= 0) segments = g_segments.load();
  if (segments > 0) return std::min(segments, T);
  const long row = (long)Bs * channel_blocks(D, N);
  const long fill = (long)per_sm * carry::kernels::primitives::sm_count() / row;
  return (int)std::max<long>(1, std::min<long>(fill, (T + 63) / 64));
}

template <typename In, int N>
void launch_fwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                const at::Tensor& C, const Dims& m, const at::Tensor& h0, at::Tensor& y, at::Tensor& h_final,
                at::Tensor& h_in) {
  allow_kernels_smem<In, N>();
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto* pu = reinterpret_cast<const In*>(u.data_ptr());
  const auto* pd = reinterpret_cast<const In*>(delta.data_ptr());
  const auto* pb = reinterpret_cast<const In*>(B.data_ptr());
  const auto* pc = reinterpret_cast<const In*>(C.data_ptr());
  const float* pa = A.data_ptr<float>();
  const auto f32 = u.options().dtype(at::kFloat);
  if (m.S > 1) {
    at::Tensor end_state = alloc({m.Bs, m.S, m.D, m.N}, f32), delta_sum = alloc({m.Bs, m.S, m.D}, f32);
      fwd_local_kernel<In, N><<<dim3(m.P, m.S - 1, m.Bs), kThreads, stage_smem<In, N>(), stream>>>(
        pu, pd, pa, pb, pc, m, end_state.data_ptr<float>(), delta_sum.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const long n = (long)m.Bs * m.D * m.N;
    scan_kernel<false><<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(
        h0.data_ptr<float>(), pa, end_state.data_ptr<float>(), delta_sum.data_ptr<float>(), m,
        h_in.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  fwd_output_kernel<In, N><<<dim3(m.P, m.S, m.Bs), kThreads, stage_smem<In, N>(), stream>>>(
      pu, pd, pa, pb, pc, m, h_in.data_ptr<float>(), reinterpret_cast<In*>(y.data_ptr()),
      h_final.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename In, int N>
void launch_bwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                const at::Tensor& C, const Dims& m, const at::Tensor& h_in, const at::Tensor& dy,
                const at::Tensor& dh_final, std::vector<at::Tensor>& out) {
  allow_kernels_smem<In, N>();
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto* pu = reinterpret_cast<const In*>(u.data_ptr());
  const auto* pd = reinterpret_cast<const In*>(delta.data_ptr());
  const auto* pb = reinterpret_cast<const In*>(B.data_ptr());
  const auto* pc = reinterpret_cast<const In*>(C.data_ptr());
  const auto* pdy = reinterpret_cast<const In*>(dy.data_ptr());
  const float* pa = A.data_ptr<float>();
  const auto f32 = u.options().dtype(at::kFloat);
  at::Tensor g_in = dh_final.view({m.Bs, 1, m.D, m.N});
  if (m.S > 1) {
    at::Tensor out_grad = alloc({m.Bs, m.S, m.D, m.N}, f32), delta_sum = alloc({m.Bs, m.S, m.D}, f32);
      bwd_local_kernel<In, N><<<dim3(m.P, m.S - 1, m.Bs), kThreads, stage_smem<In, N>(), stream>>>(
        pu, pd, pa, pb, pc, pdy, m, out_grad.data_ptr<float>(), delta_sum.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    g_in = alloc({m.Bs, m.S, m.D, m.N}, f32);
    const long n = (long)m.Bs * m.D * m.N;
    scan_kernel<true><<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(
        dh_final.data_ptr<float>(), pa, out_grad.data_ptr<float>(), delta_sum.data_ptr<float>(), m,
        g_in.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const long nk = (m.T + kSub - 1) / kSub;
  at::Tensor ck = alloc({m.Bs, nk, m.D, m.N}, f32);
  checkpoint_kernel<In, N><<<dim3(m.P, m.S, m.Bs), kThreads, stage_smem<In, N>(), stream>>>(pu, pd, pa, pb, pc, m,
                                                                          h_in.data_ptr<float>(),
                                                                          ck.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor du = alloc(u.sizes(), u.options()), ddelta = alloc(u.sizes(), u.options());
  at::Tensor part = alloc({m.P, 2, m.Bs, m.T, m.N}, f32), dA_part = alloc({m.Bs, m.S, m.D, m.N}, f32);
  at::Tensor dh0 = alloc({m.Bs, m.D, m.N}, f32);
  bwd_main_kernel<In, N><<<dim3(m.P, m.S, m.Bs), kThreads, bwd_main_smem<In, N>(), stream>>>(
      pu, pd, pa, pb, pc, pdy, m, g_in.data_ptr<float>(), ck.data_ptr<float>(),
      reinterpret_cast<In*>(du.data_ptr()), reinterpret_cast<In*>(ddelta.data_ptr()), part.data_ptr<float>(),
      dA_part.data_ptr<float>(), dh0.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor dbc = alloc({2, m.Bs, m.T, m.N}, f32), dA = alloc({m.D, m.N}, f32);
  carry::kernels::primitives::column_sum(part.data_ptr<float>(), dbc.data_ptr<float>(), m.P,
                                         2L * m.Bs * m.T * m.N, f32, stream);
  carry::kernels::primitives::column_sum(dA_part.data_ptr<float>(), dA.data_ptr<float>(), (long)m.Bs * m.S,
                                         (long)m.D * m.N, f32, stream);
  out = {du, ddelta, dA, dbc[0].to(u.scalar_type()), dbc[1].to(u.scalar_type()), dh0};
}

template <typename In, class F>
void by_state_size(int N, F&& f) {
  switch (N) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: f(std::integral_constant<int, 16>{}); break;
  }
}

template <class F>
void by_dtype(at::ScalarType dt, F&& f) {
  if (dt == at::kBFloat16)
    f(__nv_bfloat16{});
  else
    f(float{});
}

}  // namespace

std::vector<at::Tensor> selective_scan_fwd(const at::Tensor& u_, const at::Tensor& delta_, const at::Tensor& A_,
                                           const at::Tensor& B_, const at::Tensor& C_,
                                           const at::Tensor& initial_state, int segments) {
  check_inputs(u_, delta_, A_, B_, C_);
  const at::Tensor u = aligned(u_), delta = aligned(delta_), A = aligned(A_), B = aligned(B_), C = aligned(C_);
  const c10::cuda::CUDAGuard guard(u.device());
  const int Bs = (int)u.size(0), T = (int)u.size(1), D = (int)u.size(2), N = (int)A.size(1);
  int per_sm = 1;
  by_dtype(u.scalar_type(), [&](auto in) {
    using In = decltype(in);
    by_state_size<In>(N, [&](auto n) { per_sm = output_blocks_per_sm<In, decltype(n)::value>(); });
  });
  const Dims m = dims_of(u, A, segment_length(T, segments_asked(segments, Bs, T, D, N, per_sm)));
  TORCH_CHECK(m.S <= 65535, "selective_scan: ", m.S, " segments; at most 65535");
  const auto f32 = u.options().dtype(at::kFloat);
  at::Tensor h0 = initial_state.defined() ? aligned(initial_state) : at::zeros({Bs, D, N}, f32);
  TORCH_CHECK(h0.sizes() == at::IntArrayRef({Bs, D, N}) && h0.scalar_type() == at::kFloat && h0.is_contiguous() &&
                  h0.device() == u.device(),
              "selective_scan: initial_state must be contiguous fp32 [", Bs, ",", D, ",", N, "] on ", u.device(),
              "; got ", h0.sizes(), " ", h0.scalar_type(), " on ", h0.device());
  at::Tensor y = alloc(u.sizes(), u.options()), h_final = alloc({Bs, D, N}, f32);
  at::Tensor h_in = m.S > 1 ? alloc({Bs, m.S, D, N}, f32) : h0.view({Bs, 1, D, N});
  by_dtype(u.scalar_type(), [&](auto in) {
    using In = decltype(in);
    by_state_size<In>(N, [&](auto n) { launch_fwd<In, decltype(n)::value>(u, delta, A, B, C, m, h0, y, h_final, h_in); });
  });
  return {y, h_final, h_in};
}

std::vector<at::Tensor> selective_scan_bwd(const at::Tensor& u_, const at::Tensor& delta_, const at::Tensor& A_,
                                           const at::Tensor& B_, const at::Tensor& C_,
                                           const at::Tensor& segment_states_, const at::Tensor& dy_,
                                           const at::Tensor& d_final_state_) {
  check_inputs(u_, delta_, A_, B_, C_);
  const at::Tensor u = aligned(u_), delta = aligned(delta_), A = aligned(A_), B = aligned(B_), C = aligned(C_);
  const at::Tensor segment_states = aligned(segment_states_), dy = aligned(dy_), d_final_state = aligned(d_final_state_);
  const c10::cuda::CUDAGuard guard(u.device());
  const int Bs = (int)u.size(0), T = (int)u.size(1), D = (int)u.size(2), N = (int)A.size(1);
  TORCH_CHECK(segment_states.dim() == 4 && segment_states.size(0) == Bs && segment_states.size(2) == D &&
                  segment_states.size(3) == N && segment_states.scalar_type() == at::kFloat &&
                  segment_states.is_contiguous(),
              "selective_scan: segment_states must be selective_scan_fwd's, fp32 [", Bs, ",S,", D, ",", N,
              "]; got ", segment_states.sizes());
  const Dims m = dims_of(u, A, segment_length(T, (int)segment_states.size(1)));
  TORCH_INTERNAL_ASSERT(m.S == segment_states.size(1), "selective_scan: segments do not round-trip");
  TORCH_CHECK(dy.sizes() == u.sizes() && dy.scalar_type() == u.scalar_type() && dy.is_contiguous(),
              "selective_scan: dy must be contiguous ", u.sizes(), " ", u.scalar_type(), "; got ", dy.sizes(), " ",
              dy.scalar_type());
  TORCH_CHECK(d_final_state.sizes() == at::IntArrayRef({Bs, D, N}) && d_final_state.scalar_type() == at::kFloat &&
                  d_final_state.is_contiguous(),
              "selective_scan: d_final_state must be contiguous fp32 [", Bs, ",", D, ",", N, "]; got ",
              d_final_state.sizes(), " ", d_final_state.scalar_type());
  std::vector<at::Tensor> out;
  by_dtype(u.scalar_type(), [&](auto in) {
    using In = decltype(in);
    by_state_size<In>(N, [&](auto n) {
      launch_bwd<In, decltype(n)::value>(u, delta, A, B, C, m, segment_states, dy, d_final_state, out);
    });
  });
  return out;
}

void selective_scan_set_poison(bool on) { g_poison.store(on); }
void selective_scan_set_segments(int n) { g_segments.store(n); }

}  // namespace carry::kernels::selective_scan
