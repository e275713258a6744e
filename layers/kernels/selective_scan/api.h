// The kernel form of Mamba-1's selective scan (S6), one recurrence per channel d and state n:
//   h_t[d,n] = exp(Δ_t[d]·A[d,n]) · h_{t−1}[d,n] + B_t[n] · u_t[d],   y_t[d] = Σ_n C_t[n] · h_t[d,n],
// with u = Δ⊙x given (the caller's product), Δ ≥ 0 and A < 0. Inputs u, delta [B,T,D] and B, C [B,T,N] in one
// dtype (bf16 or fp32), A [D,N] fp32, initial_state [B,D,N] fp32 (undefined: zeros); N ∈ {4, 8, 16}, T ≥ 1.
// States and accumulation are fp32. The scan runs in parallel over T: the tokens are cut into segments,
// each walked from zero, the segments' end states scanned in order, each segment walked again from its
// incoming state (scan.cu's plan).
//
// selective_scan_fwd returns {y [B,T,D] in the inputs' dtype, final_state [B,D,N] fp32, segment_states};
// segment_states (fp32 [B,S,D,N], the state entering each segment) goes unchanged to selective_scan_bwd,
// which returns {du, ddelta, dA, dB, dC, d_initial_state}: du, ddelta, dB, dC in the inputs' dtype, dA and
// d_initial_state fp32. dA and dB, dC (sums over the sequences and tokens, over the channels) are added in a
// fixed order: the same inputs give the same bits run after run.
// `segments`: 0 chooses by the grid's size (or selective_scan_set_segments' value); 1 walks the tokens in
// order (one segment): every token then runs the same operations wherever the sequence is cut, so a
// sequence split over ranks (the ordered scan) gives the bits of the whole (MixerOptions::serial_states),
// dA excepted (its sum over tokens is split with the sequence); n > 1 asks for n segments.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace carry::kernels::selective_scan {

std::vector<at::Tensor> selective_scan_fwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
                                           const at::Tensor& B, const at::Tensor& C,
                                           const at::Tensor& initial_state, int segments = 0);

std::vector<at::Tensor> selective_scan_bwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
                                           const at::Tensor& B, const at::Tensor& C,
                                           const at::Tensor& segment_states, const at::Tensor& dy,
                                           const at::Tensor& d_final_state);

// Debug: fill every output and intermediate with NaN right after allocation. Off by default.
void selective_scan_set_poison(bool on);
// The segments when a call asks for 0 (tests): 0 chooses by the grid's size (the default), n ≥ 1 asks for n.
void selective_scan_set_segments(int n);

}  // namespace carry::kernels::selective_scan
