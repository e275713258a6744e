// The kernel form of the families whose state transport is a scalar or a diagonal (layers/kernels/decay):
// linear attention (no decay), scalar decay (RetNet, Lightning, simple GLA, Mamba-2 SSD core) and GLA
// (a log decay per key dimension). One recurrence, FLA conventions:
//   S_t = diag(e^{g_t}) S_{t−1} + k_t v_tᵀ,   o_t = scale · S_tᵀ q_t,
// with g_t = 0 (none), a scalar per token and head (scalar), or a vector over dk (diag).
// Inputs q, k [B,T,H,dk], v [B,T,H,dv] (bf16 or fp32, one dtype); g fp32: undefined (none),
// [B,T,H] (scalar) or [B,T,H,dk] (diag); initial_state [B,H,dk,dv] fp32. T a multiple of 64,
// dk ∈ {64,96,128}, dv ∈ {64,128,192,256}. States and accumulation are fp32.
//
// decay_fwd returns {o, final_state, saved...}; pass the saved tensors unchanged to decay_bwd.
// decay_bwd returns {dq, dk, dv, dg (undefined for none), d_initial_state}.
// `segments` cuts the state recurrence into that many segments walked in parallel and joined (0: by
// the grid's size, or decay_set_segments' value). 1 walks the chunks in order: every chunk then runs
// the same operations wherever the sequence is cut, so a sequence split over ranks (the ordered scan)
// gives the bits of the whole (MixerOptions::serial_states).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

namespace carry::kernels::decay {

enum class Decay : int { none = 0, scalar = 1, diag = 2 };

// Saved for backward, in order: G (the gate's cumulative sum inside each chunk, g's shape, fp32;
// empty for none), H (the state entering each chunk, input dtype [B,H,N,dk,dv]), P (the scaled,
// decayed, causal intra-chunk matrix, input dtype [B,H,N,64,64]; empty in bf16 for the scalar decay and
// linear attention with dk 64 or 128, whose backward recomputes it).
// on_final_state, when set, is called with the final state (fp32 [B,H,dk,dv]) right after its walk is
// enqueued, before the output kernel: what it enqueues on the stream (a send) runs beside the output.
std::vector<at::Tensor> decay_fwd(Decay kind, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& g, double scale, const at::Tensor& initial_state,
                                  int segments = 0,
                                  const std::function<void(const at::Tensor&)>& on_final_state = {});

// on_initial_state_grad, when set, is called with d_initial_state right after the reverse walk is
// enqueued, before the dV and dq/dk/dg kernels.
std::vector<at::Tensor> decay_bwd(Decay kind, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& g, double scale, const at::Tensor& initial_state,
                                  const std::vector<at::Tensor>& saved, const at::Tensor& d_o,
                                  const at::Tensor& d_final_state, int segments = 0,
                                  const std::function<void(const at::Tensor&)>& on_initial_state_grad = {});

// Debug: fill every output and intermediate with NaN right after allocation. Off by default.
void decay_set_poison(bool on);
// The state recurrence's segments (tests): 0 chooses by the grid's size (the default), 1 walks the
// chunks in order, n > 1 cuts the chunks into n segments walked in parallel and joined.
void decay_set_segments(int n);
// The bf16 walk in n pieces of consecutive chunks (tests and `carry bench kernels --decay-pieces`): the
// output kernel (forward) and the dV and dq/dk/dg kernels (backward) of each finished piece run on a
// second stream while the next piece walks. The bits are the one walk's. 0: automatic (the default;
// pieces where the walk's blocks take at most half the SMs: launch.h, pieces_for); 1: one
// walk; used only where the walk runs as one segment.
void decay_set_pieces(int n);

}  // namespace carry::kernels::decay
