// Host launchers of the delta-rule kernel form (DeltaNet, Gated DeltaNet), FLA conventions:
//   S_t = exp(g_t) (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,   o_t = scale · S_tᵀ q_t.
// Inputs q, k [B,T,H,dk], v [B,T,H,dv] (bf16 or fp32, one dtype), g [B,T,H] log decay (undefined:
// DeltaNet), beta [B,T,H], initial_state [B,H,dk,dv] fp32 (undefined: zeros). T a multiple of 64,
// dk ∈ {64,128}, dv ∈ {64,128,256}. States and accumulation are fp32.
//
// gdn_fwd returns {o, final_state, saved...}; pass the saved tensors unchanged to gdn_bwd.
// gdn_bwd returns {dq, dk, dv, dg (undefined for DeltaNet), dbeta, d_initial_state}.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

namespace carry::kernels::delta_rule {  // the delta rule's kernels (layers/delta_rule)

// Saved for backward, in order: G (gate cumsums per chunk, fp32 [B,H,T]), Tinv ((I+L)⁻¹ per chunk,
// fp32 [B,H,N,64,64]), W ([B,H,T,dk], input dtype), H (state entering each chunk, input dtype
// [B,H,N,dk,dv]), V_new (U − W·S per chunk, input dtype [B,H,T,dv]), A (the maps of the walk's
// P segments, fp32 [P,B,H,dk,dk], where the backward walks them too; else empty): the backward walks the same segments.
// on_final_state, when set, is called with the final state (fp32 [B,H,dk,dv]) right after its walk is
// enqueued, before the output kernel: what it enqueues on the stream (a send) runs beside the output.
// segments (bf16, dk = 128): 1 walks the chunks in order, so every chunk runs the same operations
// wherever the sequence is cut (MixerOptions::serial_states: the ordered scan gives the bits of the
// whole); 0 chooses (launch.h, plan_segments), n > 1 walks n segments of the chunks at once, each from its
// exact incoming state (the segments' maps S ↦ A·S + B scanned in order; bits depend on n, and agree
// with the one walk to rounding). Where the segments are forced (n > 1, or gdn_set_segments), the backward
// walks them too, from the segments' maps A saved after V_new.
std::vector<at::Tensor> gdn_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& g, const at::Tensor& beta, double scale,
                                const at::Tensor& initial_state, int64_t chunk_size = 64,
                                const std::function<void(const at::Tensor&)>& on_final_state = {},
                                int segments = 0);

std::vector<at::Tensor> gdn_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& g, const at::Tensor& beta, double scale,
                                const at::Tensor& initial_state, const std::vector<at::Tensor>& saved,
                                const at::Tensor& d_o, const at::Tensor& d_final_state,
                                int64_t chunk_size = 64,
                                const std::function<void(const at::Tensor&)>& on_initial_state_grad = {});

// Tests and `carry bench kernels --delta-segments`: the segments of the bf16 walks at dk = 128 where
// gdn_fwd is asked for 0 (automatic): 0 automatic (the default), 1 one walk, n > 1 n segments.
void gdn_set_segments(int n);

// The forward's chunk preparation alone, for bf16 k [B,T,H,dk], v [B,T,H,dv], g (undefined: DeltaNet) and beta
// [B,T,H]: {G [B,H,T] fp32, T [B,H,N,64,64], W [B,H,T,dk], U [B,H,T,dv] bf16} as gdn_fwd saves them (G the gate's
// cumulative sum within each chunk, T = (I + strictly_lower(diag(β) KKᵀ ⊙ Γ))⁻¹, W = T·diag(β e^G)·K, U = T·diag(β)·V).
// Log-linear Gated DeltaNet's chunk pieces start from it (layers/kernels/log_linear/api.h).
std::vector<at::Tensor> gdn_prep(const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                 const at::Tensor& beta);

// Whether gdn_set_poison is on (the kernels built on these fill their outputs with NaN first too).
bool gdn_poison_enabled();

// Tests: the pieces the bf16 state walks are cut into (0: automatic, 1: one walk), uniform or, with
// ramp, the end pieces shorter (carry::kernels::primitives::piece_cuts; the automatic pieces ramp). Pieces give the
// bits of one walk; they let the chunk-local kernels of finished pieces run beside the walk.
void gdn_set_pieces(int n, bool ramp = false);

// Tests: the warpgroups a block of the bf16 state walks at dk = 128 (walk_wg.cuh) holds, forward and
// reverse: 0 (default) as fwd.cu's walk_warpgroups decides, 1, or 2 (64 columns a block). One or two
// give the same bits.
void gdn_set_walk_warpgroups(int n);

// Debug: fill every output and intermediate with NaN right after allocation (unwritten
// elements then show up in tests). Off by default.
void gdn_set_poison(bool on);

}  // namespace carry::kernels::delta_rule
