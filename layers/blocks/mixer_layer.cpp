// The token-mixer layer (mixer_layer.h): projections, short causal convolutions, gates and the output
// norm around a registered family, per config kind (the registry of layers/layer_kind.h; each family registers its kinds). The family's forward
// over the slice goes through MixerLayerContext::run_mixer (default: chunkwise), the tokens before the
// slice through MixerLayerContext::halo (default: none, the slice starts the sequence).
#include "layers/blocks/mixer_layer.h"
#include "layers/blocks/recompute.h"

#include "layers/layer_kind.h"

#include "layers/core/fused_switch.h"
#include "layers/layout.h"
#include "layers/log_linear/fenwick.h"
#include "layers/linear_attn/linear_attn.h"
#include "layers/linear_attn/performer.h"
#include "layers/diag_decay/mamba1.h"
#include "layers/rwkv7/time_mix.h"
#include "layers/softmax_attn/softmax_attn.h"
#include "layers/blocks/precision.h"

#ifdef CARRY_WITH_CUDA
#include "layers/kernels/blocks/conv_op.h"
#endif

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <optional>

namespace carry {

namespace {

constexpr int64_t kGlaGateRank = 16;
constexpr double kGlaGateNormalizer = 16.0;

bool is_mamba1(const MixerLayerSpec& s) { return layer_kind(s.kind).selective_scan; }
bool is_rwkv7(const MixerLayerSpec& s) { return layer_kind(s.kind).time_mix; }

Tensor l2_normalize(const Tensor& x) { return x * at::rsqrt(x.pow(2).sum(-1, /*keepdim=*/true) + 1e-6); }

// softplus⁻¹(y) = y + log(−expm1(−y)), y > 0.
Tensor inverse_softplus(const Tensor& y) { return y + at::log(-at::expm1(-y)); }

int64_t ceil_to(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The fused CUDA ops (layers/kernels/blocks/conv_op.h) run for CUDA tensors unless the switch says
// otherwise; on the CPU (and in builds without CUDA) the ATen forms always run.
#ifdef CARRY_WITH_CUDA
bool use_fused(const Tensor& x) { return x.is_cuda() && fused_ops_enabled(); }
#endif

Tensor l2_normalize_any(const Tensor& x) {
#ifdef CARRY_WITH_CUDA
  if (use_fused(x) && fused_l2_supports(x)) return fused_l2_normalize(x);
#endif
  return l2_normalize(x);
}

// The latest document start at or before positions [first, first + n) ([B, n] int64, CPU): from the
// context's index when it has one.
Tensor document_start_host(const MixerLayerContext& ctx, int64_t first, int64_t n) {
  if (ctx.document_start_at.defined()) return ctx.document_start_at.narrow(1, first, n);
  return document_start_of(ctx.document_starts, first, n);
}

// The same over the whole sequence on `device` (the index's copy when it has one there).
Tensor document_start_device(const MixerLayerContext& ctx, const at::Device& device) {
  const Tensor& d = ctx.document_start_at_device;
  if (d.defined() && d.device() == device) return d;
  return document_start_host(ctx, 0, ctx.document_starts.size(1)).to(device);
}

}  // namespace

const std::vector<std::string>& mixer_layer_kinds() { return layer_kind_names(); }

std::string mixer_layer_family(const std::string& kind) {
  const LayerKind* k = find_layer_kind(kind);
  return k ? k->family : "";
}

Tensor document_start_of(const Tensor& starts, int64_t offset, int64_t T) {
  TORCH_CHECK(starts.dim() == 2 && starts.scalar_type() == at::kBool && offset >= 0 && offset + T <= starts.size(1),
              "document starts must be [B, N] bool covering positions [", offset, ", ", offset + T, "), got ",
              starts.scalar_type(), " ", shape_str(starts.sizes()));
  auto pos = at::arange(starts.size(1), at::kLong).expand_as(starts);
  auto latest = std::get<0>(at::where(starts.cpu(), pos, at::full_like(pos, -1)).cummax(1));
  return latest.narrow(1, offset, T).contiguous();
}

void index_documents(MixerLayerContext& ctx, int64_t length, const at::Device& device) {
  if (!ctx.document_starts.defined()) return;
  const Tensor& starts = ctx.document_starts;
  TORCH_CHECK(starts.dim() == 2 && starts.scalar_type() == at::kBool && starts.device().is_cpu() && length >= 0 &&
                  ctx.offset >= 0 && ctx.offset + length <= starts.size(1),
              "index_documents: document_starts must be a CPU bool tensor [B, N] covering positions [", ctx.offset,
              ", ", ctx.offset + length, "), got ", starts.scalar_type(), " ", shape_str(starts.sizes()), " on ",
              starts.device());
  const int64_t B = starts.size(0);
  ctx.document_start_at = document_start_of(starts, 0, starts.size(1));
  ctx.document_start_at_device = device.is_cpu() ? Tensor() : ctx.document_start_at.to(device);
  ctx.slice_document_starts = starts.narrow(1, ctx.offset, length).contiguous();
  ctx.slice_document_offsets.clear();
  if (length == 0) return;
  auto pos = ctx.document_start_at.accessor<int64_t, 2>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s0 = pos[b][ctx.offset];
    ctx.slice_document_offsets.push_back(s0 >= 0 ? ctx.offset - s0 : ctx.offset);
  }
}

Tensor causal_conv1d(const Tensor& x, const Tensor& weight, const Tensor& halo, const Tensor& tap_mask) {
  TORCH_CHECK(x.dim() == 3, "causal_conv1d: x must be [B, T, C], got ", shape_str(x.sizes()));
  int64_t B = x.size(0), C = x.size(2);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == C && weight.size(1) >= 1,
              "causal_conv1d: weight must be [", C, ", K], got ", shape_str(weight.sizes()));
  int64_t K = weight.size(1), T = x.size(1);
  Tensor before = halo.defined() ? halo : at::zeros({B, K - 1, C}, x.options());
  TORCH_CHECK(before.dim() == 3 && before.size(0) == B && before.size(1) == K - 1 && before.size(2) == C,
              "causal_conv1d: halo must be [", B, ", ", K - 1, ", ", C, "] (the K-1 tokens before the "
              "slice), got ", shape_str(before.sizes()));
  auto xp = at::cat({before.to(x.scalar_type()), x}, 1);  // [B, K-1+T, C]
  TORCH_CHECK(!tap_mask.defined() || tap_mask.sizes() == at::IntArrayRef({B, T, K}),
              "causal_conv1d: tap_mask must be [", B, ", ", T, ", ", K, "], got ",
              tap_mask.defined() ? shape_str(tap_mask.sizes()) : std::string("undefined"));
  // Taps in a fixed order j = 0..K-1 (oldest token first); each output depends on tokens ≤ t only.
  Tensor y;
  for (int64_t j = 0; j < K; ++j) {
    auto term = xp.narrow(1, j, T) * weight.select(1, j);
    if (tap_mask.defined()) term = term * tap_mask.select(2, j).unsqueeze(-1).to(term.scalar_type());
    y = y.defined() ? y + term : term;
  }
  return y;
}

// ---------------------------------------------------------------------------------------------

struct MixerLayer::Projected {
  MixerInputs in;
  Tensor z;       // output gate [B,T,H,dv] (mamba1: [B,T,D])
  Tensor skip;    // what D multiplies (Mamba-2: v [B,T,H,dv]; Mamba-1: x [B,T,D])
  int64_t kv_halo = 0;  // softmax_attn: tokens of halo prepended to q, k, v (outputs dropped)
  Tensor unused_halo;    // softmax_attn: an exchange kept in the graph with weight 0 (the halo at the sequence's start, the relay)
  State memory;          // softmax_attn's sparse patterns: the keys before the slice (its initial state)
  std::shared_ptr<Rwkv7Projected> rwkv7;  // rwkv7: what its output reads (time_mix.h)
};

MixerLayer::MixerLayer(const MixerLayerSpec& spec, ParameterInit& init) : spec_(spec) {
  const auto& tr = layer_kind(spec.kind);
  mixer_ = &get_mixer(tr.family);
  const int64_t d = spec.d_model, H = spec.n_heads, dk = spec.head_dim_k, dv = spec.head_dim_v;
  TORCH_CHECK(d > 0 && H > 0 && dk > 0 && dv > 0, "mixer layer '", spec.kind, "': d_model, n_heads, "
              "head_dim_k and head_dim_v must be positive, got ", d, ", ", H, ", ", dk, ", ", dv);
  TORCH_CHECK(spec.conv_size >= 0, "mixer layer '", spec.kind, "': conv_size must be >= 0, got ",
              spec.conv_size);
  TORCH_CHECK(spec.levels >= 0 && spec.levels <= kMaxLogLinearLevels, "mixer layer '", spec.kind,
              "': levels must lie in [0, ", kMaxLogLinearLevels, "], got ", spec.levels);
  TORCH_CHECK(spec.feature_map == "elu" || spec.feature_map == "performer", "mixer layer '", spec.kind,
              "': feature_map must be \"elu\" or \"performer\", got \"", spec.feature_map, "\"");
  TORCH_CHECK(spec.feature_map == "elu" || tr.feature_map, "mixer layer '", spec.kind, "': feature_map \"",
              spec.feature_map, "\" applies to linear_attn layers only");
  if (spec.feature_map == "performer") {
    TORCH_CHECK(spec.num_features > 0, "mixer layer '", spec.kind, "': num_features must be positive, got ",
                spec.num_features);
    // Generated, not stored: the features are a function of the config (seed, layer, widths), which every
    // rank reads and every checkpoint holds, so all ranks, a resumed run and a decoder rebuild the same bits.
    Tensor omega = performer_random_features(spec.num_features, dk, performer_layer_seed(spec.feature_seed, spec.layer));
    performer_key_shift_ = performer_key_shift(omega);
    performer_features_ = init.meta() ? at::empty({spec.num_features, dk}, init.options())
                                      : omega.to(init.options()).detach();
  }
  const double std = spec.init_std;
  const double out_std = std / std::sqrt(2.0 * static_cast<double>(std::max<int64_t>(spec.n_layers, 1)));
  const int64_t K = spec.conv_size;
  const double conv_bound = K > 0 ? 1.0 / std::sqrt(static_cast<double>(K)) : 0.0;
  auto add = [&](const std::string& name, Tensor t) {
    params_.emplace_back(name, t);
    return t;
  };
  // dt ~ log-uniform on [1e-3, 1e-1], as its softplus pre-image.
  auto dt_bias = [&](int64_t n) {
    auto u = init.uniform_cpu({n}, std::log(1e-3), std::log(1e-1));
    return init.leaf(inverse_softplus(at::exp(u)));
  };

  if (is_rwkv7(spec)) {
    TORCH_CHECK(K == 0, "mixer layer 'rwkv7': conv_size must be 0 (its token shift takes the short "
                "convolutions' place), got ", K);
    TORCH_CHECK(value_heads() == H, "mixer layer 'rwkv7': n_v_heads must equal n_heads (", H, "), got ", value_heads());
    rwkv7_parameters(spec, init, params_);
    return;
  }
  if (is_mamba1(spec)) {
    const int64_t D = H * dv, N = dk, R = (d + 15) / 16;
    v_proj_ = add("v_proj.weight", init.normal({D, d}, std));
    if (K > 0) v_conv_ = add("v_conv.weight", init.uniform({D, K}, -conv_bound, conv_bound));
    q_proj_ = add("q_proj.weight", init.normal({N, D}, std));  // C
    k_proj_ = add("k_proj.weight", init.normal({N, D}, std));  // B
    dt_proj0_ = add("dt_proj.0.weight", init.normal({R, D}, std));
    dt_proj1_ = add("dt_proj.1.weight", init.normal({D, R}, std));
    dt_bias_ = add("dt_bias", dt_bias(D));
    A_log_ = add("A_log", init.leaf(at::log(at::arange(1, N + 1, at::kFloat)).expand({D, N}).clone()));
    D_ = add("D", init.full({D}, 1.0));
    z_proj_ = add("z_proj.weight", init.normal({D, d}, std));
    o_proj_ = add("o_proj.weight", init.normal({d, D}, out_std));
    return;
  }

  // Gated DeltaProduct: n_h keys, values and betas a token, the sub-step outermost in each row ('(n h d)').
  const int64_t nh = tr.householder ? spec.num_householder : 1;
  TORCH_CHECK(nh >= 1, "mixer layer '", spec.kind, "': num_householder must be >= 1, got ", nh);
  // Grouped value heads: Hv value heads, each group of Hv / H consecutive ones reading one query/key head.
  const int64_t Hv = value_heads();
  TORCH_CHECK(Hv % H == 0 && (Hv == H || tr.grouped_values), "mixer layer '", spec.kind, "': n_v_heads (", Hv,
              ") must be a multiple of n_heads (", H, ") and differ from it only for kinds with grouped value heads");
  q_proj_ = add("q_proj.weight", init.normal({H * dk, d}, std));
  k_proj_ = add("k_proj.weight", init.normal({nh * H * dk, d}, std));
  v_proj_ = add("v_proj.weight", init.normal({nh * Hv * dv, d}, std));
  if (K > 0) {
    q_conv_ = add("q_conv.weight", init.uniform({H * dk, K}, -conv_bound, conv_bound));
    k_conv_ = add("k_conv.weight", init.uniform({nh * H * dk, K}, -conv_bound, conv_bound));
    v_conv_ = add("v_conv.weight", init.uniform({nh * Hv * dv, K}, -conv_bound, conv_bound));
  }
  if (tr.decay == Decay::mamba) {
    a_proj_ = add("a_proj.weight", init.normal({Hv, d}, std));
    dt_bias_ = add("dt_bias", dt_bias(Hv));
    A_log_ = add("A_log", init.leaf(at::log(init.uniform_cpu({Hv}, 1.0, 16.0))));
  } else if (tr.decay == Decay::gla) {
    gk_proj0_ = add("gk_proj.0.weight", init.normal({kGlaGateRank, d}, std));
    gk_proj1_ = add("gk_proj.1.weight", init.normal({H * dk, kGlaGateRank}, std));
    gk_bias_ = add("gk_proj.1.bias", init.full({H * dk}, 0.0));
  } else if (tr.decay == Decay::kda) {
    gk_proj0_ = add("f_proj.0.weight", init.normal({dv, d}, std));
    gk_proj1_ = add("f_proj.1.weight", init.normal({H * dk, dv}, std));
    dt_bias_ = add("dt_bias", dt_bias(H * dk));
    A_log_ = add("A_log", init.leaf(at::log(init.uniform_cpu({H}, 1.0, 16.0))));
  }
  if (tr.beta) b_proj_ = add("b_proj.weight", init.normal({nh * Hv, d}, std));
  if (tr.levels) {
    int64_t L = spec.levels > 0 ? spec.levels : kMaxLogLinearLevels;
    l_proj_ = add("l_proj.weight", init.normal({H * L, d}, std));
  }
  if (tr.mamba2) D_ = add("D", init.full({H}, 1.0));
  if (tr.gated_norm && tr.low_rank_gate) {
    z_proj_ = add("z_proj.0.weight", init.normal({dv, d}, std));
    z_proj1_ = add("z_proj.1.weight", init.normal({Hv * dv, dv}, std));
    z_bias_ = add("z_proj.1.bias", init.full({Hv * dv}, 0.0));
  } else if (tr.gated_norm) {
    z_proj_ = add("z_proj.weight", init.normal({Hv * dv, d}, std));
  }
  if (tr.gated_norm) {
    o_norm_ = RMSNorm(dv, spec.norm_eps, init);
    add("o_norm.weight", o_norm_.weight);
    has_o_norm_ = true;
  }
  o_proj_ = add("o_proj.weight", init.normal({d, Hv * dv}, out_std));
}

int64_t MixerLayer::value_heads() const { return spec_.n_v_heads > 0 ? spec_.n_v_heads : spec_.n_heads; }

NamedParameters MixerLayer::parameters() const { return params_; }

int64_t MixerLayer::levels_for(int64_t length, const MixerLayerContext& ctx) const {
  if (spec_.levels > 0) return spec_.levels;
  int64_t total = ctx.sequence_length > 0 ? ctx.sequence_length : ctx.offset + length;
  int64_t L = fenwick_levels_needed(total);
  TORCH_CHECK(L <= kMaxLogLinearLevels, "mixer layer '", spec_.kind, "': a sequence of ", total,
              " tokens needs ", L, " log-linear levels, more than the ", kMaxLogLinearLevels,
              " this layer provides");
  return L;
}

MixerOptions MixerLayer::mixer_options(int64_t, const MixerLayerContext& ctx) const {
  const auto& tr = layer_kind(spec_.kind);
  MixerOptions opt;
  opt.chunk_size = spec_.chunk_size;
  opt.window = spec_.window;
  opt.global_tokens = spec_.global_tokens;
  opt.stride = spec_.stride;
  opt.normalize = spec_.normalize;
  opt.offset = ctx.offset;
  opt.check_values = check_values_requested();
  opt.serial_states = ctx.serial_states;
  if (tr.householder) opt.num_householder = spec_.num_householder;
  if (tr.mamba2) opt.scale = 1.0;  // Mamba-2 reads C·h unscaled
  if (tr.time_mix) opt.scale = 1.0;  // RWKV-7 reads rᵀS unscaled (FLA's chunk_rwkv7 with scale 1)
  if (performer_features_.defined()) {
    opt.scale = 1.0;  // φ(q)ᵀφ(k) is already the estimate of exp(qᵀk/√d)
    // The keys' features carry the factor exp(−c) (performer.h): the normalizer's guard with it.
    opt.eps *= std::exp(-performer_key_shift_);
  }
  return opt;
}

Tensor MixerLayer::value_first(const Tensor& x, const MixerLayerContext& ctx) const {
  TORCH_CHECK(is_rwkv7(spec_), "mixer layer '", spec_.kind, "': value_first is an rwkv7 layer's, not this kind's");
  return rwkv7_value_first(spec_, params_, x, ctx);
}

MixerLayer::Projected MixerLayer::project(const Tensor& x, const MixerLayerContext& ctx, bool kernel_bf16,
                                          const Tensor& value_first) const {
  const auto& tr = layer_kind(spec_.kind);
  TORCH_CHECK(x.dim() == 3 && x.size(2) == spec_.d_model, "mixer layer '", spec_.kind,
              "': x must be [B, T, ", spec_.d_model, "], got ", shape_str(x.sizes()));
  const int64_t B = x.size(0), T = x.size(1), H = spec_.n_heads, dk = spec_.head_dim_k,
                dv = spec_.head_dim_v, K = spec_.conv_size;
  // Packed documents: tap j of token t (at absolute position offset+t) reads position offset+t-K+1+j,
  // which counts only from t's document start on. The fused convolution (CUDA) reads the document
  // starts itself; the ATen form takes a tap mask, built on the device from the context's index there,
  // or on the host (the CPU, or no index).
  const bool documents = ctx.document_starts.defined() && K > 1;
  auto tap_mask = [&]() -> Tensor {
    if (!documents) return Tensor();
    if (x.is_cuda() && ctx.document_start_at_device.defined()) {
      auto start = document_start_device(ctx, x.device()).narrow(1, ctx.offset, T);     // [B,T]
      auto lo = x.options().dtype(at::kLong);
      auto source = at::arange(ctx.offset - K + 1, ctx.offset - K + 1 + T, lo).view({1, T, 1}) +
                    at::arange(K, lo).view({1, 1, K});                                    // [1,T,K]
      return source >= start.unsqueeze(-1);
    }
    auto start = document_start_host(ctx, ctx.offset, T);                                // [B,T]
    auto source = at::arange(ctx.offset - K + 1, ctx.offset - K + 1 + T, at::kLong).view({1, T, 1}) +
                  at::arange(K, at::kLong).view({1, 1, K});                                   // [1,T,K]
    return (source >= start.unsqueeze(-1)).to(x.device());
  };
  auto convolve = [&](std::vector<Tensor> pre, const std::vector<Tensor>& weights) {
    if (K == 0) return pre;
    Tensor halo;
    if (K > 1 && ctx.halo) halo = ctx.halo(pre.size() == 1 ? pre[0] : at::cat(pre, -1), K - 1);
    const Tensor mask = tap_mask();
    std::vector<Tensor> out;
    int64_t c0 = 0;
    for (size_t i = 0; i < pre.size(); ++i) {
      int64_t c = pre[i].size(-1);
      out.push_back(causal_conv1d(pre[i], weights[i], halo.defined() ? halo.narrow(-1, c0, c) : Tensor(), mask));
      c0 += c;
    }
    return out;
  };
  // The convolutions of the projections x·Wᵢᵀ, then silu when `silu`: with the fused op one projection
  // and one convolution over the channels of all (the weights concatenated per call, the parameters
  // stay apart), else one per projection. The halo: the K-1 tokens before the slice of the
  // concatenated channels, split back per tensor.
  auto project_convolve = [&](const std::vector<Tensor>& proj, const std::vector<Tensor>& weights, bool silu) {
    std::vector<Tensor> pre;
#ifdef CARRY_WITH_CUDA
    if (use_fused(x) && K > 0) {
      auto cat_proj = proj.size() == 1 ? proj[0] : at::cat(proj, 0);
      auto cat_conv = weights.size() == 1 ? weights[0] : at::cat(weights, 0);
      auto all = at::linear(x, cat_proj);
      if (fused_conv_supports(all, cat_conv)) {
        // `all` is read by the convolution and the halo only, and the convolution's backward returns
        // its gradient as a fresh tensor.
        const auto& exchange = ctx.halo_owned_gradient ? ctx.halo_owned_gradient : ctx.halo;
        Tensor halo = K > 1 && exchange ? exchange(all, K - 1) : Tensor();
        std::vector<int64_t> widths;
        for (const auto& w : proj) widths.push_back(w.size(0));
        return fused_causal_conv1d(all, cat_conv, halo, documents ? document_start_device(ctx, x.device()) : Tensor(),
                                   ctx.offset, silu, widths, kernel_bf16);
      }
      int64_t c0 = 0;
      for (const auto& w : proj) pre.push_back(all.narrow(-1, c0, w.size(0))), c0 += w.size(0);
    }
#endif
    if (pre.empty())
      for (const auto& w : proj) pre.push_back(at::linear(x, w));
    auto out = convolve(pre, weights);
    if (silu)
      for (auto& t : out) t = at::silu(t);
    return out;
  };
  Projected p;

  if (is_rwkv7(spec_)) {
    p.rwkv7 = std::make_shared<Rwkv7Projected>(rwkv7_project(spec_, params_, x, ctx, value_first));
    p.in = p.rwkv7->in;
    return p;
  }
  if (is_mamba1(spec_)) {
    auto xc = project_convolve({v_proj_}, {v_conv_}, /*silu=*/true)[0];  // [B,T,D]
    auto Bm = at::linear(xc, k_proj_), Cm = at::linear(xc, q_proj_);      // [B,T,N]
    auto dt = at::softplus(at::linear(at::linear(xc, dt_proj0_), dt_proj1_) + dt_bias_);
    // Under autocast the projections come out in bf16 next to fp32 ones: the core takes one dtype.
    auto common = at::promote_types(at::promote_types(xc.scalar_type(), dt.scalar_type()),
                                    at::promote_types(Bm.scalar_type(), Cm.scalar_type()));
    p.in = mamba1_inputs(xc.to(common), dt.to(common), -at::exp(A_log_).to(common), Bm.to(common), Cm.to(common),
                         /*check_values=*/false);
    p.skip = xc;
    p.z = at::linear(x, z_proj_);
    return p;
  }

  auto qkv = project_convolve({q_proj_, k_proj_, v_proj_}, {q_conv_, k_conv_, v_conv_}, tr.silu_qkv);
  auto q = qkv[0], k = qkv[1], v = qkv[2];
  // Rows of n_h sub-steps a token: [B, T, n_h·H·d] is [B, T·n_h, H, d] with the sub-steps interleaved.
  const int64_t nh = tr.householder ? spec_.num_householder : 1, Hv = value_heads();
  q = q.view({B, T, H, dk}), k = k.reshape({B, T * nh, H, dk}), v = v.reshape({B, T * nh, Hv, dv});
  if (performer_features_.defined()) {
    const double s = std::pow(static_cast<double>(dk), -0.25);
    q = performer_feature_map(q * s, performer_features_, /*is_query=*/true, 0);
    k = performer_feature_map(k * s, performer_features_, /*is_query=*/false, performer_key_shift_);
  } else if (tr.elu_qk) {
    q = elu_feature_map(q), k = elu_feature_map(k);
  }
  if (tr.l2_qk) q = l2_normalize_any(q), k = l2_normalize_any(k);
  // Grouped value heads: value head h reads query/key head h / (Hv / H) (FLA's GVA), so the family sees Hv
  // heads in every form and scan.
  if (Hv != H) q = q.repeat_interleave(Hv / H, 2), k = k.repeat_interleave(Hv / H, 2);

  MixerInputs& in = p.in;
  switch (tr.decay) {
    case Decay::none: break;
    case Decay::retnet: {
      // At least fp32: under autocast on CUDA x is the norm's bf16 output, and a log decay in bf16 loses
      // its cumulative sum. Made once a device and dtype: no host-to-device copy in later forwards (a
      // step captured as a CUDA graph cannot hold one).
      const auto dt = at::promote_types(x.scalar_type(), at::kFloat);
      if (!retnet_g_.defined() || retnet_g_.device() != x.device() || retnet_g_.scalar_type() != dt) {
        std::vector<double> g(H);
        for (int64_t h = 0; h < H; ++h) g[h] = std::log1p(-std::pow(2.0, -5.0 - static_cast<double>(h)));
        retnet_g_ = at::tensor(g, at::TensorOptions().dtype(at::kDouble)).to(x.options().dtype(dt));
      }
      in.g = retnet_g_.view({1, 1, H}).expand({B, T, H});
      break;
    }
    case Decay::mamba: {
      auto dt = at::softplus(at::linear(x, a_proj_) + dt_bias_);  // [B,T,H]
      in.g = -at::exp(A_log_) * dt;                               // dt·A, A = −exp(A_log)
      if (tr.mamba2) k = k * dt.unsqueeze(-1);                    // B·dt
      break;
    }
    case Decay::kda: {  // in fp32 at least: the chunk sums gk
      const auto dt = at::promote_types(x.scalar_type(), at::kFloat);
      auto f = at::linear(at::linear(x, gk_proj0_), gk_proj1_).to(dt) + dt_bias_.to(dt);  // [B,T,H·dk]
      const Tensor A = at::exp(A_log_.to(dt)).repeat_interleave(dk);
      in.gk = (spec_.lower_bound < 0 ? spec_.lower_bound * at::sigmoid(A * f) : -A * at::softplus(f)).view({B, T, H, dk});
      break;
    }
    case Decay::gla:
      in.gk = (at::log_sigmoid(at::linear(at::linear(x, gk_proj0_), gk_proj1_, gk_bias_)) / kGlaGateNormalizer)
                  .view({B, T, H, dk});
      break;
  }
  if (tr.beta) {
    in.beta = at::sigmoid(at::linear(x, b_proj_));
    if (nh > 1) in.beta = in.beta.reshape({B, T * nh, H});
    if (tr.beta_scale != 1) in.beta = in.beta * tr.beta_scale;
  }
  if (tr.levels) {
    int64_t L = levels_for(T, ctx), Lp = l_proj_.size(0) / H;
    auto w = l_proj_.view({H, Lp, spec_.d_model}).narrow(1, 0, L).reshape({H * L, spec_.d_model});
    in.l = at::softplus(at::linear(x, w)).view({B, T, H, L});
  }
  if (tr.mamba2) p.skip = v;
  if (tr.gated_norm)
    p.z = (tr.low_rank_gate ? at::linear(at::linear(x, z_proj_), z_proj1_, z_bias_) : at::linear(x, z_proj_))
              .view({B, T, Hv, dv});

  // Sliding window across slices: prepend the previous slice's last keys and values (rounded up to
  // whole chunks); their query rows are zeros and their outputs are dropped. With the sparse patterns
  // the relay brings them, after the pattern keys before them (softmax_attn_relay_plan), which become the
  // family's initial state.
  if (tr.window && (spec_.global_tokens > 0 || spec_.stride > 0) && ctx.relay) {
    const int64_t h = spec_.window > 1 ? ceil_to(spec_.window - 1, spec_.chunk_size) : 0;
    const int64_t total = ctx.sequence_length > 0 ? ctx.sequence_length : ctx.offset + T;
    TORCH_CHECK(T > 0 && ctx.offset % T == 0 && total % T == 0, "mixer layer '", spec_.kind, "': the sparse "
                "patterns across slices need slices of one length; this one has ", T, " tokens at ", ctx.offset,
                " of ", total);
    auto plan = softmax_attn_relay_plan(ctx.document_starts, B, total, ctx.offset / T, T, h, spec_.global_tokens,
                                        spec_.stride);
    auto kv = at::cat({k.reshape({B, T, H * dk}), v.reshape({B, T, H * dv})}, -1);
    auto got = ctx.relay(kv, plan.index, plan.memory_rows + plan.halo_rows);
    if (plan.memory_rows > 0) {
      auto mem = got.narrow(1, 0, plan.memory_rows);
      p.memory = {mem.narrow(-1, 0, H * dk).view({B, plan.memory_rows, H, dk}),
                  mem.narrow(-1, H * dk, H * dv).view({B, plan.memory_rows, H, dv}),
                  plan.valid.to(k.options())};
    }
    if (plan.halo_rows > 0) {
      auto halo = got.narrow(1, plan.memory_rows, plan.halo_rows);
      k = at::cat({halo.narrow(-1, 0, H * dk).view({B, h, H, dk}), k}, 1);
      v = at::cat({halo.narrow(-1, H * dk, H * dv).view({B, h, H, dv}), v}, 1);
      q = at::cat({at::zeros({B, h, H, dk}, q.options()), q}, 1);
      p.kv_halo = h;
    }
    // The exchange stays in the graph whatever reads it (nothing on the sequence's first slice): its backward
    // is collective.
    p.unused_halo = got;
  } else if (tr.window && spec_.window > 1 && ctx.halo) {
    int64_t h = ceil_to(spec_.window - 1, spec_.chunk_size);
    auto kv = at::cat({k.reshape({B, T, H * dk}), v.reshape({B, T, H * dv})}, -1);
    auto halo = ctx.halo(kv, h);
    if (halo.defined() && ctx.offset == 0) {
      // The slice starts the sequence: there is nothing before it to attend to. The exchange is
      // collective (its backward brings this slice's last keys and values their gradient from the
      // next slice), so the halo stays in the graph, with weight 0 (see forward).
      p.unused_halo = halo;
    } else if (halo.defined()) {
      k = at::cat({halo.narrow(-1, 0, H * dk).view({B, h, H, dk}), k}, 1);
      v = at::cat({halo.narrow(-1, H * dk, H * dv).view({B, h, H, dv}), v}, 1);
      q = at::cat({at::zeros({B, h, H, dk}, q.options()), q}, 1);
      p.kv_halo = h;
    }
  }
  in.q = q, in.k = k, in.v = v;
  return p;
}

MixerLayerOutput MixerLayer::forward(const Tensor& x, const State& initial_state, const MixerLayerContext& ctx,
                                     const Tensor& value_first) const {
  // Whether the core will run a kernel form on bf16 inputs (CUDA, autocast): then the convolutions write
  // q, k, v in bf16 (what the kernel would cast them to). The scans of every mode run the kernel form
  // too (the delta rule's summary is two kernel forwards; the ATen summaries cast their inputs up).
  const bool kernel_bf16 = x.is_cuda() && autocast_active_for(x) && mixer_->has_kernel() && fused_ops_enabled();
  auto p = project(x, ctx, kernel_bf16, value_first);
  const int64_t B = x.size(0), T = x.size(1);
  auto opt = mixer_options(T, ctx);
  opt.offset -= p.kv_halo;  // the halo's first token leads the slice the family sees
  if (ctx.document_starts.defined()) {
    // This slice's document starts (with the halo's positions before it when a sliding window took
    // them), and where each sequence's first document began, for log-linear's levels.
    const int64_t first = ctx.offset - p.kv_halo, n = T + p.kv_halo;
    TORCH_CHECK(ctx.document_starts.size(0) == B && first >= 0 && first + n <= ctx.document_starts.size(1),
                "mixer layer '", spec_.kind, "': document_starts must be [", B, ", sequence length] covering positions [",
                first, ", ", first + n, "), got ", shape_str(ctx.document_starts.sizes()));
    // The context's index (index_documents) has both for the slice itself: no host work per layer.
    if (p.kv_halo == 0 && ctx.slice_document_starts.defined() && ctx.slice_document_starts.size(0) == B &&
        ctx.slice_document_starts.size(1) == n && static_cast<int64_t>(ctx.slice_document_offsets.size()) == B) {
      opt.document_starts = ctx.slice_document_starts;
      opt.document_offsets = ctx.slice_document_offsets;
    } else {
      opt.document_starts = ctx.document_starts.narrow(1, first, n).cpu().contiguous();
      auto start = document_start_host(ctx, first, 1).contiguous();
      const int64_t* s = start.data_ptr<int64_t>();
      for (int64_t b = 0; b < B; ++b) opt.document_offsets.push_back(s[b] >= 0 ? first - s[b] : first);
    }
  }
  MixerOutput out;
  {
    // Under autocast the core (chunkwise form, recurrent state, cross-rank scan) still runs in fp32;
    // a kernel form reads q, k, v in the autocast dtype (bf16) and the gates and states in fp32, and
    // accumulates in fp32 (on one rank: the cross-rank scan keeps fp32 summaries).
    std::optional<FullPrecisionScope> fp32;
    MixerInputs in = p.in;
    State s0 = initial_state;
    if (!p.memory.empty()) {
      TORCH_CHECK(initial_state.empty(), "mixer layer '", spec_.kind, "': softmax attention takes no initial state");
      s0 = p.memory;
    }
    if (autocast_active_for(x)) {
      fp32.emplace();
      // The kernel forms take bf16 and fp32 alike, so the form is known before any cast. With a kernel
      // form the tree and allgather scans get the same bf16 inputs as the ordered one (an fp32 copy ran
      // the kernels' fp32 path, several times slower): the decay class's one pass and the delta rule's
      // summary run the kernel form, and the ATen summaries cast their inputs up themselves.
      const bool kernel = mixer_->resolve_form(in, opt) == Form::kernel;
      in = kernel ? kernel_precision(in) : full_precision(in);
      s0 = full_precision(s0);
    }
    if (ctx.core_stash && !ctx.run_mixer && s0.empty()) out = stashed_mixer_core(ctx.core_stash, *mixer_, in, opt);
    else out = ctx.run_mixer ? ctx.run_mixer(*mixer_, in, s0, opt) : mixer_->forward(in, s0, opt);
  }
  Tensor o = out.o;
  if (p.kv_halo > 0) o = o.narrow(1, p.kv_halo, T);
  // Under autocast on CUDA, x is the norm's bf16 output (layers/blocks/norm.h), and o keeps the core's dtype
  // (fp32, or bf16 from a kernel form): what follows reads it exactly, and o_proj casts it to bf16 anyway.
  if (!(x.is_cuda() && autocast_active_for(x))) o = o.to(x.scalar_type());
  if (p.unused_halo.defined()) o = o + (p.unused_halo.sum() * 0).to(o.scalar_type());

  if (p.rwkv7) return {rwkv7_output(spec_, params_, *p.rwkv7, o), out.final_state};
  if (is_mamba1(spec_)) {
    auto y = o.squeeze(-1) + D_ * p.skip;  // [B,T,D]
    return {at::linear(y * at::silu(p.z), o_proj_), out.final_state};
  }
  if (p.skip.defined()) o = o + D_.view({1, 1, -1, 1}) * p.skip;
  if (has_o_norm_)
    o = o_norm_.forward_gated(o, p.z, layer_kind(spec_.kind).sigmoid_gate ? GateActivation::sigmoid : GateActivation::silu);
  return {at::linear(o.reshape({B, T, -1}), o_proj_), out.final_state};
}

}  // namespace carry
