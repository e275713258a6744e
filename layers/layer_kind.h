// The registry of layer kinds: what a model config's mixer kind (e.g. "gated_deltanet", "mamba2")
// is, written once, beside its family (layers/<family>/layer.cpp registers the kinds it serves).
// MixerLayer builds its projections, gates and convolutions from it; the config validation asks it
// which kinds exist, which options each reads and which chunk sizes it accepts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace carry {

// How a kind turns its input into the family's log decay.
enum class Decay {
  none,    // no decay input
  retnet,  // a fixed per-head decay γ_h = 1 − 2^(−5−h)
  mamba,   // g = −exp(A_log)·softplus(W x + dt_bias) per token and head
  gla,     // gk = log σ(low-rank W x) / 16 per key dimension
  kda,     // gk = −exp(A_log)·softplus(low-rank W x + dt_bias) per key dimension (KDA; rank dv, A_log a head)
};

struct LayerKind {
  const char* kind;    // the config's name
  const char* family;  // the registered mixer family it runs
  int listing = 0;     // its place when kinds are listed (messages keep one order)
  Decay decay = Decay::none;
  bool beta = false;        // beta = beta_scale·sigmoid(W x) (delta rule)
  double beta_scale = 1;    // 2 admits negative eigenvalues of I − β k kᵀ (FLA's allow_neg_eigval)
  bool householder = false; // num_householder keys, values and betas a token (Gated DeltaProduct)
  bool grouped_values = false;  // may have more value heads than query/key heads (n_v_heads, GVA)
  bool levels = false;      // l = softplus(W x) over L levels (log-linear); reads the `levels` option
  bool silu_qkv = false;    // short causal convolutions (kernel 4, a halo of 3 tokens across ranks) + silu on q, k, v
  bool l2_qk = false;       // L2-normalized q, k
  bool elu_qk = false;      // φ = elu + 1 on q, k
  bool feature_map = false; // reads feature_map, num_features, feature_seed (φ: elu + 1 or Performer's features)
  bool mamba2 = false;      // k = B·dt, scale 1, skip o += D·v
  bool selective_scan = false;  // Mamba-1 (S6): x, Δ, B, C per channel through mamba1_inputs, one head a channel
  bool gated_norm = false;  // y = o_proj(gated_rms_norm(o, z)); false: y = o_proj(o)
  bool low_rank_gate = false;  // with gated_norm: z = W₂(W₁ x) + b, rank head_dim_v (KDA's g_proj); else z = W x
  bool sigmoid_gate = false;   // with gated_norm: the norm's gate is sigmoid(z) (KDA); else silu(z)
  bool time_mix = false;    // RWKV-7's time mixing through layers/rwkv7/time_mix.h (token shift, LoRA gates, value residual)
  bool window = false;      // reads the `window` option (sliding-window attention; halo = window), and global_tokens, stride
  bool normalize = false;   // reads the `normalize` option
  bool power_of_two_chunk = false;  // chunk_size must be a power of two (Fenwick levels)
  // With `levels`: how many level weights a sequence of seq_len tokens needs, and the most a kind accepts.
  int64_t (*levels_needed)(int64_t seq_len) = nullptr;
  int64_t max_levels = 0;
};

bool register_layer_kind(const LayerKind& kind);
// The kind, or nullptr when none of that name is registered.
const LayerKind* find_layer_kind(const std::string& kind);
// The kind; throws naming the known kinds when there is none.
const LayerKind& layer_kind(const std::string& kind);
// Every registered kind's name, in listing order.
const std::vector<std::string>& layer_kind_names();

}  // namespace carry
