// RWKV-7's time mixing around the family rwkv7 (time_mix.h states the layer): FLA's RWKV7Attention forward
// in ATen ops, its parameters under FLA's names with FLA's initial values.
#include "layers/rwkv7/time_mix.h"

#include "layers/layout.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <string>

namespace carry {
namespace {

// e^{−1/2}: the log decay lies in (−e^{−1/2}, 0), per token a decay in (0.545, 1) (FLA's −0.6065306597126334).
constexpr double kDecayScale = 0.6065306597126334;
// GroupNorm's eps is dk times this (FLA: head_dim · norm_eps, norm_eps = 1e-5).
constexpr double kGroupNormEps = 1e-5;

const Tensor& param(const NamedParameters& params, const std::string& name) {
  for (const auto& [n, t] : params)
    if (n == name) return t;
  TORCH_INTERNAL_ASSERT(false, "rwkv7 layer: no parameter '", name, "'");
  static const Tensor none;
  return none;
}

// B·act(A·x) + bias (FLA's LoRA: lora.0 = A without bias, lora.2 = B with or without bias).
Tensor lora(const NamedParameters& ps, const std::string& name, const Tensor& x, Tensor (*act)(const Tensor&),
            bool bias) {
  Tensor h = at::linear(x, param(ps, name + ".lora.0.weight"));
  if (act) h = act(h);
  return bias ? at::linear(h, param(ps, name + ".lora.2.weight"), param(ps, name + ".lora.2.bias"))
              : at::linear(h, param(ps, name + ".lora.2.weight"));
}

Tensor tanh_of(const Tensor& x) { return at::tanh(x); }
Tensor sigmoid_of(const Tensor& x) { return at::sigmoid(x); }

// FLA's profiles over n = 0..N−1 (heads of width hd): linear n/(N−1) − 1/2 and the zigzag z·|z| with
// z = ((n mod hd) − (hd−1)/2) / ((hd−1)/2).
Tensor linear_profile(int64_t N) {
  auto n = at::arange(N, at::kDouble);
  return N > 1 ? n / static_cast<double>(N - 1) - 0.5 : n * 0.0;
}
Tensor zigzag_profile(int64_t N, int64_t hd) {
  auto n = at::arange(N, at::kDouble);
  if (hd <= 1) return n * 0.0;
  const double half = (static_cast<double>(hd) - 1) / 2;
  auto z = (at::remainder(n, static_cast<double>(hd)) - half) / half;
  return z * z.abs();
}

}  // namespace

// torch.nn.init.orthogonal_ for a [rows, cols] weight: Q of a Gaussian matrix's QR (of its transpose when
// rows < cols), columns signed by R's diagonal, times gain. Computed in fp64 from fp32 draws.
Tensor rwkv7_orthogonal(ParameterInit& init, int64_t rows, int64_t cols, double gain) {
  if (init.meta()) return init.full({rows, cols}, 0.0);
  Tensor g = init.normal({rows, cols}, 1.0).detach().to(at::kDouble).cpu();
  const bool wide = rows < cols;
  if (wide) g = g.t();
  auto [q, r] = at::linalg_qr(g);
  q = q * at::sign(at::diagonal(r, 0, -2, -1)).unsqueeze(0);
  if (wide) q = q.t();
  return init.leaf((q * gain).to(at::kFloat).contiguous());
}

Rwkv7LowRankDims rwkv7_low_rank_dims(int64_t d_model, int64_t head_dim) {
  const double root = std::sqrt(static_cast<double>(d_model)), factor = static_cast<double>(head_dim) / 64.0;
  auto width = [](double x) { return std::max<int64_t>(32, static_cast<int64_t>(std::nearbyint(x / 32)) * 32); };
  Rwkv7LowRankDims r;
  r.decay = width(2.5 * root * factor);
  r.a = width(2.5 * root * factor);
  r.v = width(1.7 * root * factor);
  r.gate = width(5 * root);
  return r;
}

Rwkv7LowRankDims rwkv7_low_rank_dims(const MixerLayerSpec& spec) {
  Rwkv7LowRankDims r = rwkv7_low_rank_dims(spec.d_model, spec.head_dim_k);
  if (spec.decay_low_rank_dim > 0) r.decay = spec.decay_low_rank_dim;
  if (spec.a_low_rank_dim > 0) r.a = spec.a_low_rank_dim;
  if (spec.v_low_rank_dim > 0) r.v = spec.v_low_rank_dim;
  if (spec.gate_low_rank_dim > 0) r.gate = spec.gate_low_rank_dim;
  return r;
}

void rwkv7_parameters(const MixerLayerSpec& spec, ParameterInit& init, NamedParameters& params) {
  const int64_t d = spec.d_model, H = spec.n_heads, dk = spec.head_dim_k, dv = spec.head_dim_v;
  const int64_t K = H * dk, V = H * dv;
  const auto ranks = rwkv7_low_rank_dims(spec);
  const double layer = static_cast<double>(spec.layer), L = static_cast<double>(std::max<int64_t>(spec.n_layers, 1));
  const double ratio_0_to_1 = L > 1 ? layer / (L - 1) : 0.0;
  const double ratio_1_to_almost0 = 1.0 - layer / L;
  auto add = [&](const std::string& name, Tensor t) { params.emplace_back(name, t); };
  auto value = [&](const Tensor& cpu) { return init.leaf(cpu.to(at::kFloat).contiguous()); };

  // x_c = 1 − (n/d)^(p·ratio_1_to_almost0), n = 0..d−1.
  const Tensor ddd = at::arange(d, at::kDouble) / static_cast<double>(d);
  for (auto [name, p] : {std::pair<const char*, double>{"x_r", 0.2}, {"x_w", 0.9}, {"x_k", 0.7}, {"x_v", 0.7},
                         {"x_a", 0.9}, {"x_g", 0.2}})
    add(name, value((1.0 - at::pow(ddd, p * ratio_1_to_almost0)).view({1, 1, d})));
  add("k_k", value(0.71 - linear_profile(K) * 0.1));
  add("k_a", init.full({K}, 1.02));
  add("r_k", init.full({H, dk}, -0.04));
  add("r_proj.weight", rwkv7_orthogonal(init, K, d, 1.0));
  add("k_proj.weight", rwkv7_orthogonal(init, K, d, 0.1));
  add("v_proj.weight", rwkv7_orthogonal(init, V, d, 1.0));
  add("o_proj.weight", init.full({d, V}, 0.0));
  // FLA's LoRA init: A = 0, B orthogonal with gain 0.1·max(1, √(rank/out)), the bias as set below.
  auto lora_params = [&](const std::string& name, int64_t rank, int64_t out, const Tensor& bias) {
    add(name + ".lora.0.weight", init.full({rank, d}, 0.0));
    const double gain = rank > out ? std::sqrt(static_cast<double>(rank) / static_cast<double>(out)) : 1.0;
    add(name + ".lora.2.weight", rwkv7_orthogonal(init, out, rank, 0.1 * gain));
    if (bias.defined()) add(name + ".lora.2.bias", value(bias));
  };
  const Tensor linear_k = linear_profile(K), zigzag_k = zigzag_profile(K, dk);
  const Tensor www = -6.0 + 6.0 * at::pow(at::arange(K, at::kDouble) / static_cast<double>(std::max<int64_t>(K - 1, 1)),
                                          1.0 + std::pow(ratio_0_to_1, 0.3));
  lora_params("w_lora", ranks.decay, K, www + 0.5 + zigzag_k * 2.5);
  if (spec.value_residual) lora_params("v_lora", ranks.v, V, 0.73 - linear_profile(V) * 0.4);
  lora_params("a_lora", ranks.a, K, -0.19 + zigzag_k * 0.3 + linear_k * 0.4);
  lora_params("g_lora", ranks.gate, V, Tensor());
  add("g_norm.weight", init.full({V}, std::pow((layer + 1) / L, 0.7)));
  add("g_norm.bias", init.full({V}, 0.0));
}

Tensor rwkv7_token_shift(const Tensor& x, const MixerLayerContext& ctx) {
  TORCH_CHECK(x.dim() == 3, "rwkv7 token shift: x must be [B, T, C], got ", shape_str(x.sizes()));
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  Tensor before = ctx.halo ? ctx.halo(x, 1) : Tensor();
  before = before.defined() ? before.to(x.scalar_type()) : at::zeros({B, 1, C}, x.options());
  TORCH_CHECK(before.sizes() == at::IntArrayRef({B, 1, C}), "rwkv7 token shift: the halo must be [", B, ", 1, ", C,
              "] (the token before the slice), got ", shape_str(before.sizes()));
  Tensor prev = T > 1 ? at::cat({before, x.narrow(1, 0, T - 1)}, 1) : before;
  if (ctx.document_starts.defined()) {
    // A document's first token sees no token before it, as a convolution's taps stop at its start.
    const Tensor& s = ctx.slice_document_starts;
    Tensor starts = s.defined() && s.dim() == 2 && s.size(0) == B && s.size(1) == T
                        ? s
                        : ctx.document_starts.narrow(1, ctx.offset, T);
    prev = prev.masked_fill(starts.to(x.device()).unsqueeze(-1), 0.0);
  }
  return prev - x;
}

Tensor rwkv7_value_first(const MixerLayerSpec& spec, const NamedParameters& ps, const Tensor& x,
                         const MixerLayerContext& ctx) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == spec.d_model, "mixer layer 'rwkv7': x must be [B, T, ", spec.d_model,
              "], got ", shape_str(x.sizes()));
  return at::linear(x + rwkv7_token_shift(x, ctx) * param(ps, "x_v"), param(ps, "v_proj.weight"));
}

Rwkv7Projected rwkv7_project(const MixerLayerSpec& spec, const NamedParameters& ps, const Tensor& x,
                             const MixerLayerContext& ctx, const Tensor& value_first) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == spec.d_model, "mixer layer 'rwkv7': x must be [B, T, ", spec.d_model,
              "], got ", shape_str(x.sizes()));
  const int64_t B = x.size(0), T = x.size(1), H = spec.n_heads, dk = spec.head_dim_k, dv = spec.head_dim_v;
  TORCH_CHECK(!spec.value_residual || value_first.defined(), "mixer layer 'rwkv7' (layer ", spec.layer,
              "): its value residual needs the values of the model's first rwkv7 layer (value_first), got none");
  TORCH_CHECK(!value_first.defined() || value_first.sizes() == at::IntArrayRef({B, T, H * dv}),
              "mixer layer 'rwkv7' (layer ", spec.layer, "): value_first must be [", B, ", ", T, ", ", H * dv,
              "], got ", shape_str(value_first.sizes()));
  const Tensor delta = rwkv7_token_shift(x, ctx);
  auto mix = [&](const char* name) { return x + delta * param(ps, name); };  // x.addcmul(δ, x_c)
  const Tensor xr = mix("x_r"), xw = mix("x_w"), xk = mix("x_k"), xv = mix("x_v"), xa = mix("x_a"), xg = mix("x_g");

  Rwkv7Projected p;
  Tensor r = at::linear(xr, param(ps, "r_proj.weight"));
  // The log decay in fp32 at least: the chunk sums it.
  const auto gate_type = at::promote_types(x.scalar_type(), at::kFloat);
  Tensor w = -kDecayScale * at::sigmoid(lora(ps, "w_lora", xw, tanh_of, true).to(gate_type));
  Tensor k = at::linear(xk, param(ps, "k_proj.weight"));
  Tensor v;
  if (spec.value_residual) {
    v = at::linear(xv, param(ps, "v_proj.weight"));
    v = v + at::sigmoid(lora(ps, "v_lora", xv, nullptr, true)) * (value_first.to(v.scalar_type()) - v);  // lerp
  } else {
    v = value_first.defined() ? value_first : at::linear(xv, param(ps, "v_proj.weight"));
  }
  Tensor a = at::sigmoid(lora(ps, "a_lora", xa, nullptr, true));
  p.g = lora(ps, "g_lora", xg, sigmoid_of, false);
  Tensor kk = (k * param(ps, "k_k")).view({B, T, H, dk});
  kk = kk / at::clamp_min(kk.norm(2, -1, /*keepdim=*/true), 1e-12);  // F.normalize
  k = k + k * (a - 1) * param(ps, "k_a");                            // k·(1 + (a − 1)·k_a)
  p.r = r.view({B, T, H, dk});
  p.k = k.view({B, T, H, dk});
  p.v = v.reshape({B, T, H, dv});
  Tensor a4 = a.view({B, T, H, dk});
  p.in.q = p.r, p.in.k = p.k, p.in.v = p.v;
  p.in.gk = w.view({B, T, H, dk});
  p.in.a = -kk;
  p.in.b = kk * a4;
  return p;
}

Tensor rwkv7_output(const MixerLayerSpec& spec, const NamedParameters& ps, const Rwkv7Projected& p, const Tensor& o) {
  const int64_t B = o.size(0), T = o.size(1), H = spec.n_heads, dv = spec.head_dim_v;
  const double eps = static_cast<double>(spec.head_dim_k) * kGroupNormEps;
  // GroupNorm with one group a head, over its dv channels (biased variance, as torch's), then affine.
  auto mean = o.mean(-1, /*keepdim=*/true);
  auto centered = o - mean;
  auto normed = centered * at::rsqrt(centered.pow(2).mean(-1, /*keepdim=*/true) + eps);
  auto n = normed.reshape({B, T, H * dv}) * param(ps, "g_norm.weight") + param(ps, "g_norm.bias");
  // FLA's gate_output_correction: (o + (Σ_d r ⊙ k ⊙ r_k)·v) ⊙ g.
  auto bonus = ((p.r * p.k * param(ps, "r_k")).sum(-1, /*keepdim=*/true) * p.v).reshape({B, T, H * dv});
  auto gated = (n + bonus.to(n.scalar_type())) * p.g.to(n.scalar_type());
  return at::linear(gated, param(ps, "o_proj.weight"));
}

}  // namespace carry
