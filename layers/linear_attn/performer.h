// Performer's FAVOR+ feature map (Choromanski et al. 2021) for linear attention: positive orthogonal
// random features φ(x)_j = exp(ω_jᵀx − ‖x‖²/2) / √m, j = 1..m, with E_ω[φ(q)ᵀφ(k)] = exp(qᵀk). The
// linear_attn family then runs unchanged on φ(q), φ(k) (dk = m): the state stays S = Σ φ(k) vᵀ, summed
// with the identity transport, so every form and every scan mode applies.
//
// The features ω [m, d]: ⌈m/d⌉ blocks of d rows, each block the Gram–Schmidt orthogonalization of a
// d×d standard Gaussian matrix (the last block truncated), every row rescaled to the norm of an
// independent Gaussian d-vector (chi-distributed with d degrees of freedom), so that each row has the
// distribution of a Gaussian vector and rows of a block are exactly orthogonal. They are drawn from a
// seed by a generator written here (splitmix64, the polar method, a logarithm of plain double
// arithmetic): only exactly rounded operations (+ − × ÷, sqrt, frexp), no libm transcendental and no
// libtorch random stream, so one seed gives the same bits on every rank of a run, at every resume and in
// every later decoding. They are not parameters:
// a layer regenerates them from its config (seed and layer index), which the checkpoint already holds.
//
// Stabilizers (exp overflows in fp32 above 88): a query's features are divided by their largest,
// exp(a_t) with a_t = max_j (ω_jᵀq_t − ‖q_t‖²/2) — a factor of that token alone, which the normalized
// output cancels exactly and which only rescales the token's unnormalized output; a key's by one
// constant exp(c) shared by every token, c = max(0, max_j ‖ω_j‖²/2 − 40), computed from ω alone.
// Completing the square gives ω_jᵀk − ‖k‖²/2 ≤ ‖ω_j‖²/2 for every k, so every key feature is at most
// e^40/√m whatever the input, and S = Σ φ(k) vᵀ stays finite in fp32 for any T < 2^31 and |v| < 1e11.
// A per-token key stabilizer would weight the terms of the sum differently, and one taken from the data
// (the sequence's largest key) would depend on future tokens and on other ranks' slices: a constant
// keeps the recurrence a plain sum, the same on every rank, at resume and in decoding.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace carry {

using at::Tensor;

// The headroom of the key stabilizer, in nats: every key feature is at most exp(this) / √m.
constexpr double kPerformerKeyHeadroom = 40.0;

// ω: [num_features, dim] in fp64 on the CPU, orthogonal random features drawn from `seed` (above).
Tensor performer_random_features(int64_t num_features, int64_t dim, uint64_t seed);

// The seed of layer `layer`'s features in a model whose config says `feature_seed`: every layer its own.
uint64_t performer_layer_seed(uint64_t feature_seed, int64_t layer);

// The key stabilizer c = max(0, max_j ‖ω_j‖²/2 − kPerformerKeyHeadroom) of features ω [m, d].
double performer_key_shift(const Tensor& omega);

// φ of x [..., d] with features ω [m, d] → [..., m], in x's dtype or fp32 if narrower (bf16 inputs
// are computed and returned in fp32; the kernel forms round them to bf16 where they read bf16).
// is_query: divide each token's features by their largest; else by exp(key_shift). Differentiable in x.
Tensor performer_feature_map(const Tensor& x, const Tensor& omega, bool is_query, double key_shift);

}  // namespace carry
