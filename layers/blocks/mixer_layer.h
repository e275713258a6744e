// A token-mixer layer: the projections around a registered mixer family (layers/mixer.h), for one
// config kind ("gated_deltanet", "mamba2", "gla", "softmax_attn", ...). x [B,T,d] -> y [B,T,d]:
//
//   q, k, v = linear(x)                      heads × head dims (Mamba-2: q = C, k = B, v = x)
//   short causal depthwise convolutions on q, k, v (conv_size > 0), then silu for the kinds that use it
//   family inputs: g (scalar log decay), gk (GLA), beta, l (log-linear levels); feature map, L2 norm
//   o = family forward over this slice (chunkwise by default; see MixerLayerContext)
//   y = o_proj(gated_rms_norm(o, z = g_proj(x)))   (softmax attention: y = o_proj(o))
//
// Per kind (mixer_layer_kinds() lists them; "family" is the registered mixer run):
//   linear_attn       family linear_attn; φ(q), φ(k) with φ = elu+1, or with feature_map "performer"
//                     Performer's FAVOR+ features of q·d^(−1/4), k·d^(−1/4) (layers/linear_attn/performer.h:
//                     φ(q)ᵀφ(k) estimates exp(qᵀk/√d), the family runs with dk = num_features and scale 1);
//                     normalize from the options
//   retnet            family scalar_decay; fixed decay γ_h = 1 − 2^(−5−h) per head (no parameter)
//   gla               family gla; gk = logsigmoid(W_b W_a x + b) / 16 (low rank 16)
//   deltanet          family deltanet; silu on q,k,v; q, k L2-normalized; beta = sigmoid(W x)
//   gated_deltanet    family gated_deltanet; as deltanet plus g = −exp(A_log)·softplus(W x + dt_bias)
//   gated_deltaproduct  family gated_deltaproduct; as gated_deltanet with num_householder (n_h) keys,
//                     values and betas a token (k, v, beta projections and convolutions n_h times as wide,
//                     rows '(n h d)'), beta = 2·sigmoid(W x) (FLA's allow_neg_eigval)
//   mamba1            family mamba1 (one head per channel): channels D = n_heads·head_dim_v, state
//                     N = head_dim_k; x = silu(conv(v_proj x)), Δ = softplus(low-rank(x) + dt_bias),
//                     A = −exp(A_log), B = k_proj x, C = q_proj x; y = (ssm + D⊙x) ⊙ silu(z), no norm
//   mamba2            family scalar_decay with scale 1: silu on q,k,v; dt = softplus(W x + dt_bias),
//                     A = −exp(A_log) per head, g = dt·A, k = B·dt; o += D_h · v (skip)
//   hla2, ahla        families hla2 / ahla; q, k L2-normalized; g as gated_deltanet's
//   loglinear_mamba2  family loglinear_mamba2: mamba2's inputs plus l = softplus(W x) over L levels
//   loglinear_gdn     family loglinear_gdn: gated_deltanet's inputs plus l = softplus(W x)
//   softmax_attn      family softmax_attn (window, global_tokens and stride from the options); q, k, v, o
//                     projections only
//   rwkv7             family rwkv7: FLA's RWKV7Attention (layers/rwkv7/time_mix.h: token shift, six lerps,
//                     LoRA decay, in-context rate, value residual and gate, GroupNorm, bonus term); its own
//                     parameters, names and initialization
// Log-linear levels: L = `levels` when set; levels = 0 means as many as the sequence needs,
// fenwick_levels_needed(sequence length), read from a projection of kMaxLogLinearLevels rows per head
// (its first L rows are used; sequences up to 2^31 − 1 tokens).
//
// Initialization (all from the model's ParameterInit, in the order above):
//   projections from x (q, k, v, z, beta, g's and l's linear, GLA's low-rank gate): N(0, init_std²);
//   o_proj: N(0, (init_std/sqrt(2·n_layers))²) (GPT-2's residual scaling);
//   convolutions: U(−1/sqrt(conv_size), 1/sqrt(conv_size)) (PyTorch's depthwise Conv1d default);
//   Mamba-style scalar decays (gated_deltanet, mamba2, hla2, ahla, loglinear_*): A ~ U[1, 16]
//   (A_log = log A), dt ~ log-uniform on [1e-3, 1e-1], dt_bias = softplus⁻¹(dt): per-token decays
//   exp(−A·dt) start in [exp(−1.6), exp(−0.001)], i.e. memories from ~1 to ~1000 tokens;
//   Mamba-1: A_log[c, n] = log(n + 1) (S4D-real), dt as above; GLA's gate bias 0 (decay ≈ 0.96 per
//   token at init); D = 1; norm weights = 1. rwkv7: FLA's RWKV7Attention._initialize_weights (time_mix.h).
//
// Sequence parallelism: everything the layer needs from other ranks goes through MixerLayerContext —
// the family's forward over this rank's slice (`run_mixer`, e.g. parallel::sp_mixer_forward) and the
// tokens before the slice (`halo`, e.g. parallel::halo_exchange) for the convolutions and for a
// sliding window, and the rows passed from slice to slice (`relay`) for softmax attention's sparse
// patterns (global tokens, summary columns) with their window. By default the slice is the whole sequence.
#pragma once

#include "layers/mixer.h"
#include "layers/blocks/norm.h"
#include "layers/blocks/parameters.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace carry {

// Rows per head of the level-weight projection when levels = 0 (as many as the sequence needs).
constexpr int64_t kMaxLogLinearLevels = 32;

// The layer's shape and options: one resolved layer of a model config (framework/model/model.cpp fills it
// from layer_mixer()).
struct MixerLayerSpec {
  std::string kind;  // a name from mixer_layer_kinds()
  int64_t d_model = 0, n_heads = 0, head_dim_k = 0, head_dim_v = 0;
  int64_t n_v_heads = 0;  // value heads (grouped values, a multiple of n_heads); 0 = n_heads
  int64_t chunk_size = 64;
  int64_t window = 0;     // softmax_attn: sliding window (0 = full causal)
  int64_t global_tokens = 0, stride = 0;  // softmax_attn: sparse patterns beside the window (softmax_attn.h)
  int64_t conv_size = 0;  // short convolution width (0 = none)
  bool normalize = false;
  int64_t levels = 0;     // log-linear: level weights (0 = as many as the sequence needs)
  int64_t num_householder = 2;  // gated_deltaproduct: keys, values and betas a token (n_h)
  double lower_bound = 0;       // kda: < 0 for the bounded gate lower_bound·σ(e^{A_log}(W x + dt_bias))
  std::string feature_map = "elu";  // linear_attn: "elu" (elu + 1) or "performer"
  int64_t num_features = 128;       // performer: random features m (the family's dk)
  uint64_t feature_seed = 0;        // performer: with `layer`, the seed of the random features
  int64_t layer = 0;                // the layer's index in the model (each layer draws its own features)
  double norm_eps = 1e-6;
  double init_std = 0.02;
  int64_t n_layers = 1;   // of the model: scales o_proj's initialization
  // rwkv7: v is lerped toward the values of the model's first rwkv7 layer (FLA's v_first, passed to
  // forward as value_first); false: this layer's own values are those (no v_lora).
  bool value_residual = false;
  // rwkv7: the LoRA widths (decay, in-context rate, value residual, gate); 0 = RWKV7Attention's defaults.
  int64_t decay_low_rank_dim = 0, a_low_rank_dim = 0, v_low_rank_dim = 0, gate_low_rank_dim = 0;
};

// The config kinds a layer can be built for, and the registered family each runs ("" if unknown).
const std::vector<std::string>& mixer_layer_kinds();
std::string mixer_layer_family(const std::string& kind);

struct MixerCoreStash;  // layers/blocks/recompute.h

// How the layer reaches the rest of the sequence. The defaults describe one slice that is the whole
// sequence.
struct MixerLayerContext {
  // Absolute position of this slice's first token (log-linear levels; MixerOptions::offset).
  int64_t offset = 0;
  // Tokens in the whole sequence (all slices); 0 = offset + this slice's length. Fixes the number of
  // log-linear levels when levels = 0, so every slice uses the same.
  int64_t sequence_length = 0;
  // The family's forward over this slice from `initial_state`. Empty: mixer.chunkwise(in, state, opt).
  std::function<MixerOutput(const Mixer&, const MixerInputs&, const State&, const MixerOptions&)>
      run_mixer;
  // The `halo` tokens just before this slice of x [B,T,C] -> [B,halo,C], or an undefined tensor when
  // the slice starts the sequence. Empty: the slice starts the sequence. Called once per forward for
  // the convolutions (on q, k, v concatenated) and once for a sliding window (on k, v concatenated);
  // differentiable in x.
  std::function<Tensor(const Tensor& x, int64_t halo)> halo;
  // As `halo`, for an x whose gradient from its other uses is one tensor that nothing else holds (the
  // fused convolution's input): the next slice's gradient of x's last tokens is added into it in
  // place (parallel::halo_exchange's owned_gradient). Empty: `halo`.
  std::function<Tensor(const Tensor& x, int64_t halo)> halo_owned_gradient;
  // The rows this slice receives from the previous one when each slice passes rows on to the next
  // (parallel::relay_exchange): this slice sends rows `index` [B, N] (CPU int64; −1 = a zero row) of
  // cat(received, rows) and returns the received [B, incoming_rows, C]; differentiable in `rows` and the
  // received. Softmax attention's sparse patterns carry their keys before the slice and the window's halo
  // this way (softmax_attn_relay_plan). Empty: the slice starts the sequence.
  std::function<Tensor(const Tensor& rows, const Tensor& index, int64_t incoming_rows)> relay;
  // Packed documents: [B, sequence length] bool on the CPU, true where a document starts (the whole
  // sequence, on every rank). The family's state restarts there (MixerOptions::document_starts), the
  // short convolutions and a sliding window see only the document's own tokens. Undefined: one
  // document a sequence.
  Tensor document_starts;
  // The ordered scan mode (at any sp): MixerOptions::serial_states, and the scan calls only the
  // family's forward, so a kernel form reads q, k, v in the autocast dtype as on one rank.
  bool serial_states = false;
  // What the layers read of the packed documents, derived from document_starts once per model call
  // by index_documents() (Model::hidden does), so that no layer reads the starts on the host or copies
  // them to the device per call. Undefined / empty: each layer derives what it needs itself.
  //   document_start_at         [B, sequence length] int64, CPU: the latest document start at or before
  //                             each position (−1: none), as document_start_of;
  //   document_start_at_device  the same on the layers' device (undefined on the CPU), read there by the
  //                             convolutions' document masks;
  //   slice_document_starts     document_starts over this slice's tokens [B, T], CPU, contiguous;
  //   slice_document_offsets    per sequence, the tokens of its first document before this slice
  //                             (MixerOptions::document_offsets).
  Tensor document_start_at, document_start_at_device, slice_document_starts;
  std::vector<int64_t> slice_document_offsets;
  // Selective recomputation (layers/blocks/recompute.h): where set, and the core runs on this rank alone
  // (no run_mixer) from the zero state, the core goes through this layer's stash: run once in the
  // forward, its graph kept for the recomputation in the backward.
  std::shared_ptr<MixerCoreStash> core_stash;
};

// Fills the derived packed-document fields of `context` (see MixerLayerContext) for a slice of
// `length` tokens at context.offset, the device copy on `device` (one host-to-device copy when it is
// not the CPU). Does nothing without document_starts.
void index_documents(MixerLayerContext& context, int64_t length, const at::Device& device);

struct MixerLayerOutput {
  Tensor y;           // [B,T,d_model]
  State final_state;  // the family's state after the slice (empty for softmax attention)
};

class MixerLayer {
 public:
  MixerLayer(const MixerLayerSpec& spec, ParameterInit& init);

  // x [B,T,d_model] -> y [B,T,d_model]. initial_state: the family's state tuple before the slice (empty
  // = zeros). T must be a multiple of chunk_size (the family's check() says so otherwise).
  // value_first: for an rwkv7 layer with value_residual, the first rwkv7 layer's values
  // [B,T,n_heads·head_dim_v] (value_first() of that layer on its input); for that first layer itself, used
  // as its values when given (the same tensor, so that their gradients meet). Other kinds ignore it.
  MixerLayerOutput forward(const Tensor& x, const State& initial_state = {},
                           const MixerLayerContext& context = {}, const Tensor& value_first = {}) const;
  Tensor operator()(const Tensor& x) const { return forward(x).y; }
  // rwkv7: this layer's values v_proj(x + shift·x_v) [B,T,n_heads·head_dim_v] over the slice (the token
  // shift's one token before it through context.halo), what later rwkv7 layers lerp toward.
  Tensor value_first(const Tensor& x, const MixerLayerContext& context = {}) const;

  // The options the family runs with for a slice of `length` tokens in `context`.
  MixerOptions mixer_options(int64_t length, const MixerLayerContext& context = {}) const;

  const MixerLayerSpec& spec() const { return spec_; }
  const Mixer& mixer() const { return *mixer_; }
  // Names relative to the layer ("q_proj.weight", ...), in a fixed order.
  NamedParameters parameters() const;

 private:
  struct Projected;
  // kernel_bf16: the mixer will run its kernel form on bf16 inputs (CUDA under autocast), so the
  // convolutions may write q, k, v in bf16 directly.
  Projected project(const Tensor& x, const MixerLayerContext& context, bool kernel_bf16 = false,
                    const Tensor& value_first = {}) const;
  int64_t levels_for(int64_t length, const MixerLayerContext& context) const;
  int64_t value_heads() const;  // n_v_heads, or n_heads

  MixerLayerSpec spec_;
  const Mixer* mixer_ = nullptr;
  NamedParameters params_;  // every parameter, by name; the members below alias them
  Tensor q_proj_, k_proj_, v_proj_, o_proj_, z_proj_;
  Tensor z_proj1_, z_bias_;               // the low-rank output gate's second factor and bias (KDA)
  Tensor q_conv_, k_conv_, v_conv_;
  Tensor a_proj_, dt_bias_, A_log_, D_;   // Mamba-style decays, Mamba-2/1 skip
  Tensor gk_proj0_, gk_proj1_, gk_bias_;  // GLA's low-rank gate (KDA's f_proj: no bias)
  Tensor dt_proj0_, dt_proj1_;            // Mamba-1 low-rank Δ
  Tensor b_proj_, l_proj_;                // beta, log-linear levels
  // RetNet's fixed log decays [H], made by the first forward on its device and dtype (no gradient).
  mutable Tensor retnet_g_;
  // Performer: the random features ω [num_features, head_dim_k], not a parameter (regenerated from the
  // spec's seed and layer), and the keys' stabilizer (performer.h).
  Tensor performer_features_;
  double performer_key_shift_ = 0;
  RMSNorm o_norm_;
  bool has_o_norm_ = false;
};

// Short causal depthwise convolution over time: y[:,t,c] = Σ_j weight[c,j] · x[:, t−K+1+j, c] with
// K = weight.size(1); positions before the slice come from `halo` [B,K−1,C] (undefined = zeros, the
// sequence start). x [B,T,C]. `tap_mask` [B,T,K] (optional, 0 or 1): tap j of output t counts only
// where it is 1 (packed documents: a token's taps stop at its document's start).
Tensor causal_conv1d(const Tensor& x, const Tensor& weight, const Tensor& halo = {}, const Tensor& tap_mask = {});

// For packed documents: `starts` [B, N] bool (the whole sequence) -> for positions [offset, offset+T),
// the position of the latest document start at or before each ([B, T] int64; -1 where none).
Tensor document_start_of(const Tensor& starts, int64_t offset, int64_t T);

}  // namespace carry
