// hla2 and ahla as passes of the decay class's recurrence (the kernel form of both families).
//
// One pass is the decay class's recurrence (layers/decay_pass.h; scale 1 unless said):
//   X_t = γ_t X_{t−1} + a_t b_tᵀ,   r_t = X_tᵀ c_t         (pass(c, a, b, g, X_0) → (r, X_T))
// with γ_t = e^{g_t} (no g: γ ≡ 1). Every state of both families follows this recurrence with some key
// and value, and every product the outputs need is such a read-out, so each family is a few passes
// whose kernels (forward and hand-written backward) already exist; autograd chains them.
//
// hla2 (hla.h), with v' = [v, 1, 0…] and C' = [C, m, 0…], G' = [G, h, 0…]: the ones column carries the
// normalizer states m and h, padded to 64 columns, the kernels' step of value widths:
//   1. (R, S_T)   = pass(q, k, k, g, S_0)                 R_t = q_tᵀ S_t                   [dk]
//   2. (W, ·)     = pass(k, ←q, ←v', ←g, C'_0)            W_t = k_tᵀ C'_{t−1}               [dv']
//   3. (SC, C'_T) = pass(R, q, v', g, C'_0)               SC_t = q_tᵀ S_t C'_t
//   4. (Gq, G'_T) = pass(q, k, W, g, G'_0)                Gq_t = q_tᵀ G'_t  (G'_t = γ_t G'_{t−1} + k_t W_tᵀ)
//   Y = SC − Gq; o = s·Y[:, :dv] (normalized: divided by s·Y[:, dv] + eps).
// ←x is x one token later (←x_t = x_{t−1}, ←x_0 = 0, ←g_0 = 0): pass 2 then holds C'_{t−1} at token t,
// the state before token t's write and decay, which is what G's update reads. Pass 2's state restarts
// from C'_0 with no token of the slice before it, so its values at a cut between slices are rounded
// differently from a run through the cut: the ordered scan's bits rest on the segments
// (parallel.segments), which cut the one-GPU run at the same places.
// Passes 1 and 4 read the same q through the same keys k, so with `joint_read` they are one pass of
// values [k, W] from the state [S_0, G'_0] (pass 2 runs first). Without `normalize` the output reads no
// normalizer: the passes carry v, C and G alone (no ones column), m and h come from normalizer_states,
// passes 1 and 4 read with the scale s, and o = SC − Gq in the inputs' dtype.
//
// ahla (hla.h), with v' and P' = [P, m_K, 0…], E' = [E, n, 0…] alike:
//   1. (Y, P'_T) = pass(q, k, v', g, P'_0)     Y_t = q_tᵀ P'_t
//   2. (Z, E'_T) = pass(q, k, Y, g, E'_0)      Z_t = q_tᵀ E'_t  (E'_t = γ_t E'_{t−1} + k_t Y_tᵀ)
//   o = s·Z[:, :dv] (normalized: divided by s·Z[:, dv] + eps). Every pass is chunk-local, so a cut at a
//   chunk boundary gives the bits of the whole. Without `normalize` the output reads no normalizer: the
//   passes carry v, P and E alone (a third fewer columns), pass 2 reads with the scale s (its read is o)
//   and m_K, n come from normalizer_states, except with serial_states, where the ones column stays
//   (normalizer_states's sum over the whole slice would round n differently at a cut).
//
// States go in and come out in fp32 (fp64 for fp64 inputs); the passes' reads (R, W, Y) are in the
// inputs' dtype, as the kernels return them; Y = SC − Gq is formed in fp32. The gate g goes to every pass
// in the states' dtype, so its gradient from the passes is summed there and rounded to g's dtype once, not
// once a pass (bf16 shares that cancel lose the sum's precision).
#pragma once

#include "layers/decay_pass.h"

namespace carry {

// The value block's width beside v: the ones column padded to the kernels' 64.
inline constexpr int64_t kNormalizerColumns = 64;

MixerOutput hla2_by_decay_passes(const MixerInputs& in, const State& initial_state, const MixerOptions& opt,
                                 const DecayPass& pass, bool joint_read);
MixerOutput ahla_by_decay_passes(const MixerInputs& in, const State& initial_state, const MixerOptions& opt,
                                 const DecayPass& pass);

// The two vector states of a normalizer at the end: x_t = γ_t x_{t−1} + a_t and
// y_t = γ_t y_{t−1} + e_t (f_tᵀ x_{t−1}) (strict; f_tᵀ x_t otherwise), from x_0, y_0 [B,H,d]; a, e, f
// [B,T,H,d], g [B,T,H] or undefined (γ ≡ 1). hla2's (m, h) are (a, e, f) = (q, k, k), strict; ahla's
// (m_K, n) are (k, k, q), not strict. One pass of 64 columns (a ones column) gives w_t = f_tᵀ x_t (x_{t−1}:
// a and g one token later) and x at the end; y_T = e^{G_T} y_0 + Σ_t e^{G_T − G_t} e_t w_t is one weighted
// sum, its exponents the gates after t summed from the end (never positive). States in x_0's dtype.
std::pair<Tensor, Tensor> normalizer_states(const DecayPass& pass, const Tensor& a, const Tensor& e, const Tensor& f,
                                            const Tensor& g, const Tensor& x0, const Tensor& y0, bool strict);

}  // namespace carry
