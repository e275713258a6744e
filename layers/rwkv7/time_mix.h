// RWKV-7's time mixing, the layer kind `rwkv7`: flash-linear-attention's RWKV7Attention (fla/layers/rwkv7.py)
// around the family rwkv7 (rwkv7.h). x [B,T,d] -> y [B,T,d], per token t (H heads of dk keys, dv values):
//
//   δ_t  = x_{t−1} − x_t                          token shift; x_{−1} = 0 at a sequence's or document's start
//   x_c  = x + δ ⊙ x_c       for c in r, w, k, v, a, g          six lerps (addcmul)
//   r = r_proj x_r,  k = k_proj x_k,  v = v_proj x_v
//   w = −e^{−1/2}·σ(w_lora(x_w))                  w_lora = B·tanh(A x) + bias: a log decay in (−0.6065, 0)
//   v ← v + σ(v_lora(x_v)) ⊙ (v_first − v)        v_lora = B·A x + bias; not on the first rwkv7 layer,
//                                                 whose v is v_first (the value residual)
//   a = σ(a_lora(x_a))                            a_lora = B·A x + bias: the in-context learning rate
//   g = g_lora(x_g)                               g_lora = B·σ(A x), no bias: the output gate
//   κ̂ = L2-normalize(k ⊙ k_k) per head,  k ← k ⊙ (1 + (a − 1) ⊙ k_a)
//   o = family rwkv7(q = r, k, v, gk = w, a = −κ̂, b = κ̂ ⊙ a, scale 1)
//   o = GroupNorm_H(o) (eps = dk·1e-5, affine)
//   y = o_proj((o + (Σ_d r ⊙ k ⊙ r_k)·v) ⊙ g)    the bonus term per head, FLA's gate_output_correction
//
// The log decay w goes to the family as gk unchanged (FLA's chunk_rwkv7 passes w as chunk_dplr_delta_rule's
// gk). FLA's safe_gate and lower_bound = −0.6065 only license its kernels' tensor-core path; they change no
// value, and the family's chunkwise form is exact for any gk ≤ 0.
//
// The token shift reads one token before the slice through MixerLayerContext::halo (the mechanism of the
// short convolutions: parallel::halo_exchange across ranks, the decoder's cache), and restarts at the
// document starts of packed documents as the convolutions do.
//
// Parameters carry the names of RWKV7Attention's state-dict keys (x_r ... g_norm.bias) and FLA's
// `_initialize_weights` values (rwkv7_parameters). Low-rank widths: the spec's, where set (FLA's
// RWKV7Config keys), else RWKV7Attention's defaults from d_model and dk (rwkv7_low_rank_dims).
#pragma once

#include "layers/blocks/mixer_layer.h"

namespace carry {

// RWKV7Attention's default LoRA widths: decay and a max(32, 32·round(2.5·√d·dk/64 / 32)), v
// max(32, 32·round(1.7·√d·dk/64 / 32)), gate max(32, 32·round(5·√d / 32)) (round half to even).
struct Rwkv7LowRankDims {
  int64_t decay = 0, a = 0, v = 0, gate = 0;
};
Rwkv7LowRankDims rwkv7_low_rank_dims(int64_t d_model, int64_t head_dim);
// The widths a layer of `spec` has: its *_low_rank_dim where > 0, the defaults above otherwise.
Rwkv7LowRankDims rwkv7_low_rank_dims(const MixerLayerSpec& spec);

// torch.nn.init.orthogonal_ of a [rows, cols] weight times gain, from init's draws (shapes only on the meta
// device).
Tensor rwkv7_orthogonal(ParameterInit& init, int64_t rows, int64_t cols, double gain);

// Appends the layer's parameters to `params`, in RWKV7Attention's order, initialized as FLA does for layer
// spec.layer of spec.n_layers (see docs/families.md, rwkv7, for what differs).
void rwkv7_parameters(const MixerLayerSpec& spec, ParameterInit& init, NamedParameters& params);

// δ_t = x_{t−1} − x_t over the slice x [B,T,C]; the token before the slice from context.halo (zeros at the
// sequence's start), zeros at document starts.
Tensor rwkv7_token_shift(const Tensor& x, const MixerLayerContext& context);

// What the layer computes around the family: its inputs, and what the output reads.
struct Rwkv7Projected {
  MixerInputs in;
  Tensor r, k, v;  // [B,T,H,dk], [B,T,H,dk], [B,T,H,dv]: the bonus term's (k after its update, v after the lerp)
  Tensor g;        // [B,T,H·dv]
};

// The family's inputs for x [B,T,d]. value_first [B,T,H·dv]: see MixerLayer::forward.
Rwkv7Projected rwkv7_project(const MixerLayerSpec& spec, const NamedParameters& params, const Tensor& x,
                             const MixerLayerContext& context, const Tensor& value_first);

// v_proj(x + δ ⊙ x_v) [B,T,H·dv]: the values later layers lerp toward.
Tensor rwkv7_value_first(const MixerLayerSpec& spec, const NamedParameters& params, const Tensor& x,
                         const MixerLayerContext& context);

// The family's output o [B,T,H,dv] -> y [B,T,d]: group norm, bonus term, gate, o_proj.
Tensor rwkv7_output(const MixerLayerSpec& spec, const NamedParameters& params, const Rwkv7Projected& p,
                    const Tensor& o);

}  // namespace carry
