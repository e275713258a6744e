// Gated Linear Attention (Yang et al. 2023), family "gla", and the diagonal-decay machinery it shares
// with Mamba-1 (layers/diag_decay/mamba1.*): S_t = diag(exp(gk_t)) S_{t-1} + k_t v_tᵀ, o_t = scale · q_tᵀ S_t.
// State {S [B,H,dk,dv]}; transport diagonal, Π_t exp(gk_t) per key dimension, [B,H,dk].
// The families are registered in gla.cpp and mamba1.cpp; this header shows the shared machinery.
#pragma once

#include "layers/mixer.h"

namespace carry {

struct DiagDecayResult {
  Tensor o;          // [B,T,H,dv]
  Tensor S;          // final state [B,H,dk,dv]
  Tensor transport;  // Π_t exp(gk_t) over the slice, [B,H,dk]
};

// The chunkwise form of the diagonal-decay recurrence S_t = diag(exp(gk_t)) S_{t-1} + k_t v_tᵀ,
// o_t = scale · q_tᵀ S_t, from `initial_state` S [B,H,dk,dv]. Inputs [B,T,H,·], T a multiple of
// chunk_size (the caller checks). Chunk by chunk, in order: cumulative gates G restart per chunk; the
// intra-chunk C×C mixing Σ_d q_td k_sd exp(G_td − G_sd) on s ≤ t is decayed_pairs' (pairwise inside
// 8-token blocks, matrix products across them; every factor ≤ 1, no overflow for any decay); the state
// enters as (q ⊙ exp(G)) S and leaves as exp(G_C) ⊙ S + (k ⊙ exp(G_C − G))ᵀ V.
DiagDecayResult diag_decay_chunkwise(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& gk, const Tensor& initial_state,
                                     int64_t chunk_size, double scale);

// The summary algebra of a diagonal transport A [B,H,dk] acting on a state [B,H,dk,dv]:
// compose = (A2 ⊙ A1, A2 ⊙ B1 + B2), apply = A ⊙ S + B (A broadcast over dv).
Summary diag_decay_compose(const Summary& first, const Summary& second);
State diag_decay_apply(const Summary& summary, const State& state);

// A family whose recurrence is the diagonal-decay one on inputs q, k, v, gk (GLA, Mamba-1): the
// chunkwise form, zero state and summary algebra live here; a family adds its name, state name,
// naive form and the scale its outputs use.
class DiagonalDecayMixer : public Mixer {
 public:
  std::vector<std::string> input_names() const override { return {"q", "k", "v", "gk"}; }
  State zero_state(const MixerInputs& in, const MixerOptions& opt) const override;
  MixerOutput chunkwise(const MixerInputs& in, const State& initial_state,
                        const MixerOptions& opt) const override;
  Summary summarize(const MixerInputs& in, const MixerOptions& opt) const override;
  Summary compose(const Summary& first, const Summary& second) const override;
  State apply(const Summary& summary, const State& state) const override;
  // S_in reaches token t decayed per state row by e^{c_t}, c_t = Σ_{u ≤ t} gk_u over the slice: the
  // one-pass tree and allgather scans (Mixer::state_output).
  bool has_state_output(const MixerInputs&, const MixerOptions&) const override { return true; }
  Tensor state_output(const MixerInputs& in, const State& s_in, const MixerOptions& opt) const override;
  std::vector<Tensor> transport(const MixerInputs& in, const MixerOptions& opt) const override;
  // transport zero: S_out = s whatever comes in.
  std::optional<Summary> fixed_summary(const MixerInputs& in, const State& s) const override;

 protected:
  // The factor on q: GLA's scale (default 1/sqrt(dk)), 1 for Mamba-1.
  virtual double output_scale(const MixerInputs& in, const MixerOptions& opt) const = 0;
  // The initial state, or zeros; checks that it has one entry of the right shape.
  Tensor initial(const MixerInputs& in, const State& initial_state) const;
};

}  // namespace carry
