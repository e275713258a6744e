// Chunked linear + cross entropy as a torch autograd Function (see chunked_loss.h).
#include "framework/model/chunked_loss.h"

#include "layers/blocks/cross_entropy.h"
#include "layers/core/fused_switch.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

namespace carry {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t default_loss_chunk_tokens(int64_t vocab_size, int64_t fused_logit_bytes) {
  const int64_t bytes = fused_logit_bytes > 0 ? int64_t{256} << 20 : int64_t{64} << 20;
  const int64_t n = bytes / ((fused_logit_bytes > 0 ? fused_logit_bytes : 4) * std::max<int64_t>(vocab_size, 1));
  return std::max<int64_t>(64, n / 64 * 64);
}

namespace {

// What one pass over the chunks gives. hidden [N,d], weight [V,d], targets [N], weights [N] (loss dtype).
struct Pass {
  Tensor ce;            // [N], loss dtype
  Tensor predictions;   // [N] int64 (if asked)
  Tensor grad_hidden;   // [N,d], hidden's dtype (if asked)
  Tensor grad_weight;   // [V,d], weight's dtype promoted to fp32 at least (if asked)
};

// The matmul dtype: the autocast dtype when autocast is on for the device and the inputs are
// eligible (floating, not fp64), as at::linear would run; else the promoted dtype of the inputs.
at::ScalarType matmul_type(const Tensor& hidden, const Tensor& weight) {
  const auto dev = hidden.device().type();
  const bool eligible = hidden.scalar_type() != at::kDouble && weight.scalar_type() != at::kDouble;
  if (eligible && at::autocast::is_autocast_enabled(dev)) return at::autocast::get_autocast_dtype(dev);
  return at::promote_types(hidden.scalar_type(), weight.scalar_type());
}

// Whether the chunks' cross-entropy runs as one CUDA kernel per chunk (layers/blocks/cross_entropy.h):
// a build with the kernels, CUDA logits in bf16 or fp32 (the loss then in fp32), the fused ops on.
bool fused_loss(const Tensor& hidden, at::ScalarType ct) {
  return fused_cross_entropy_built() && hidden.is_cuda() && fused_ops_enabled() &&
         (ct == at::kBFloat16 || ct == at::kFloat);
}

// One chunk's share of the head weight's gradient, dlogitsᵀ·h, added into the fp32 (or wider) sum: by
// cuBLAS in its epilogue for bf16 products on CUDA (no bf16 rounding per chunk, no separate add pass).
void add_weight_gradient(Tensor& sum, const Tensor& dlogits, const Tensor& h, bool fp32_accumulate) {
  if (fp32_accumulate) at::addmm_out(sum, sum, dlogits.t(), h, at::kFloat);
  else sum.add_(at::mm(dlogits.t(), h));
}

}  // namespace

struct DeferredHeadAccess {
  static bool anchored(const DeferredHeadGradient& d) { return d.anchored_; }
  static void anchor(DeferredHeadGradient& d) { d.anchored_ = true; }
  static void setup(DeferredHeadGradient& d, at::ScalarType weight_dtype, const Tensor& sum, bool fp32_accumulate) {
    d.weight_dtype_ = weight_dtype;
    d.sum_ = sum;
    d.fp32_accumulate_ = fp32_accumulate;
  }
  static void keep(DeferredHeadGradient& d, const Tensor& dlogits, const Tensor& h) {
    d.dlogits_.push_back(dlogits);
    d.hidden_.push_back(h);
  }
  static void arrived(DeferredHeadGradient& d, const Tensor& incoming) { d.incoming_ = incoming; }
  // The weight's gradient: the deferred chunks added to the sum in their order, scaled as
  // LinearCrossEntropyFunction::backward scales it; undefined when nothing waits. Frees the chunks.
  static Tensor take(DeferredHeadGradient& d) {
    Tensor dw;
    if (d.incoming_.defined() && !d.dlogits_.empty()) {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < d.dlogits_.size(); ++i) add_weight_gradient(d.sum_, d.dlogits_[i], d.hidden_[i], d.fp32_accumulate_);
      dw = (d.sum_ * d.incoming_.to(d.sum_.scalar_type())).to(d.weight_dtype_);
    }
    d.dlogits_.clear();
    d.hidden_.clear();
    d.sum_ = Tensor();
    d.incoming_ = Tensor();
    return dw;
  }
};

int64_t DeferredHeadGradient::bytes() const {
  int64_t b = 0;
  for (auto& t : dlogits_) b += t.numel() * static_cast<int64_t>(t.element_size());
  return b;
}

namespace {

// A DeferredHeadGradient in an autograd context.
struct DeferredHolder : torch::CustomClassHolder {
  explicit DeferredHolder(std::shared_ptr<DeferredHeadGradient> d) : deferred(std::move(d)) {}
  std::shared_ptr<DeferredHeadGradient> deferred;
};
at::IValue hold(const std::shared_ptr<DeferredHeadGradient>& d) {
  return at::IValue::make_capsule(c10::make_intrusive<DeferredHolder>(d));
}
DeferredHeadGradient& held(AutogradContext* ctx) {
  return *c10::static_intrusive_pointer_cast<DeferredHolder>(ctx->saved_data["deferred"].toCapsule())->deferred;
}

// The anchor: x as is; in the backward x's gradient as is and the weight's deferred gradient.
struct DeferredHeadAnchor : public torch::autograd::Function<DeferredHeadAnchor> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& /*weight*/,
                               const std::shared_ptr<DeferredHeadGradient>& deferred) {
    ctx->saved_data["deferred"] = hold(deferred);
    return {x};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0], DeferredHeadAccess::take(held(ctx)), Tensor()};
  }
};

}  // namespace

Tensor anchor_deferred_head_gradient(const Tensor& x, const Tensor& weight,
                                     const std::shared_ptr<DeferredHeadGradient>& deferred) {
  TORCH_CHECK(deferred, "anchor_deferred_head_gradient: no DeferredHeadGradient given");
  if (!at::GradMode::is_enabled() || !x.requires_grad() || !weight.requires_grad()) return x;
  DeferredHeadAccess::anchor(*deferred);
  return DeferredHeadAnchor::apply(x, weight, deferred)[0];
}

namespace {

// deferred (with grads): the last chunks whose logit gradients fit in defer_bytes keep them in
// *deferred instead of adding their product into grad_weight.
Pass chunked_pass(const Tensor& hidden, const Tensor& weight, const Tensor& targets, const Tensor& weights,
                  int64_t chunk, bool grads, bool predictions, int64_t defer_bytes = 0,
                  DeferredHeadGradient* deferred = nullptr) {
  at::NoGradGuard no_grad;
  const int64_t N = hidden.size(0);
  const auto ct = matmul_type(hidden, weight);
  const auto lt = at::promote_types(ct, at::kFloat);
  const Tensor hc = hidden.to(ct), wc = weight.to(ct);
  const bool fused = fused_loss(hidden, ct);
  Pass out;
  out.ce = at::empty({N}, hidden.options().dtype(lt));
  if (predictions) out.predictions = at::empty({N}, hidden.options().dtype(at::kLong));
  if (grads) {
    out.grad_hidden = at::empty_like(hidden, at::MemoryFormat::Contiguous);
    out.grad_weight = at::zeros(weight.sizes(), weight.options().dtype(at::promote_types(weight.scalar_type(), at::kFloat)));
  }
  // On CUDA with bf16 products, cuBLAS adds each chunk's weight gradient into the fp32 sum in its
  // epilogue (no bf16 rounding per chunk, no separate add pass).
  const bool fp32_accumulate = fused && ct == at::kBFloat16 && grads && out.grad_weight.scalar_type() == at::kFloat;
  // The first chunk whose weight gradient is deferred: the last chunks whose logit gradients fit the budget.
  int64_t defer_from = N;
  if (grads && deferred && defer_bytes > 0) {
    const int64_t V = weight.size(0), elem = static_cast<int64_t>(c10::elementSize(ct));
    int64_t used = 0;
    for (int64_t start = (N - 1) / chunk * chunk; start >= 0; start -= chunk) {
      used += std::min(chunk, N - start) * V * elem;
      if (used > defer_bytes) break;
      defer_from = start;
    }
    // (nothing deferred: the anchor's object keeps no reference to the sum)
    if (defer_from < N) DeferredHeadAccess::setup(*deferred, weight.scalar_type(), out.grad_weight, fp32_accumulate);
  }
  for (int64_t start = 0; start < N; start += chunk) {
    const int64_t n = std::min(chunk, N - start);
    const Tensor h = hc.narrow(0, start, n);
    const Tensor t = targets.narrow(0, start, n);
    Tensor logits = at::mm(h, wc.t());  // [n,V] in ct
    Tensor dlogits;
    if (fused) {
      // The loss of each row, the predictions, and the gradient written over the logits, in one kernel.
      fused_cross_entropy_rows(logits, t, weights.narrow(0, start, n), out.ce.narrow(0, start, n),
                               predictions ? out.predictions.narrow(0, start, n) : Tensor(), grads);
      dlogits = logits;
    } else {
      if (predictions) out.predictions.narrow(0, start, n).copy_(logits.argmax(-1));
      // The log-softmax row by row, as the full form computes it: the same per-token losses.
      Tensor logp = at::log_softmax(logits.to(lt), -1);
      const Tensor valid = t.ge(0);
      const Tensor index = t.clamp_min(0).unsqueeze(1);
      const Tensor picked = logp.gather(1, index).squeeze(1);
      out.ce.narrow(0, start, n).copy_(at::where(valid, -picked, at::zeros({}, picked.options())));
      if (!grads) continue;
      // dL/dlogits = w_t·(p_t − onehot(y_t)), zero for ignored targets; in place over logp.
      Tensor w = at::where(valid, weights.narrow(0, start, n), at::zeros({}, logp.options())).unsqueeze(1);
      Tensor p = logp.exp_();
      p.scatter_(1, index, p.gather(1, index) - valid.to(lt).unsqueeze(1));
      dlogits = p.mul_(w).to(ct);
    }
    if (!grads) continue;
    Tensor gh = out.grad_hidden.narrow(0, start, n);
    if (gh.scalar_type() == ct) at::mm_out(gh, dlogits, wc);
    else gh.copy_(at::mm(dlogits, wc));
    if (start >= defer_from) DeferredHeadAccess::keep(*deferred, dlogits, h);
    else add_weight_gradient(out.grad_weight, dlogits, h, fp32_accumulate);
  }
  return out;
}

struct LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
  // Outputs: the weighted sum, the per-token losses (no gradient), the predictions (if asked; else empty).
  // deferred (may be null): where the last chunks' weight gradient waits (defer_bytes of their logit gradients).
  static variable_list forward(AutogradContext* ctx, const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                               const Tensor& weights, int64_t chunk, bool predictions, int64_t defer_bytes,
                               const std::shared_ptr<DeferredHeadGradient>& deferred) {
    auto pass = chunked_pass(hidden, weight, targets, weights, chunk, /*grads=*/true, predictions, defer_bytes,
                             deferred.get());
    const bool later = deferred && deferred->chunks() > 0;
    // Deferred: the anchor adds the last chunks into the weight's sum in place; the backward reads none of it.
    if (later) ctx->saved_data["deferred"] = hold(deferred);
    ctx->save_for_backward({pass.grad_hidden, later ? Tensor() : pass.grad_weight});
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    Tensor loss = (pass.ce * weights).sum();
    Tensor preds = predictions ? pass.predictions : at::empty({0}, targets.options());
    ctx->mark_non_differentiable({pass.ce, preds});
    return {loss, pass.ce, preds};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor& g = grads[0];
    if (!g.defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    const auto weight_dtype = static_cast<at::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
    Tensor dh = saved[0] * g.to(saved[0].scalar_type());
    if (ctx->saved_data.count("deferred")) {  // the weight's gradient comes from the anchor's backward
      DeferredHeadAccess::arrived(held(ctx), g);
      return {dh, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    }
    Tensor dw = (saved[1] * g.to(saved[1].scalar_type())).to(weight_dtype);
    return {dh, dw, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

LinearCrossEntropy linear_cross_entropy(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                        const Tensor& token_weights, int64_t chunk_tokens, bool predictions,
                                        int64_t defer_bytes, const std::shared_ptr<DeferredHeadGradient>& anchored) {
  TORCH_CHECK(hidden.dim() >= 1 && hidden.is_floating_point(),
              "linear_cross_entropy: hidden must be floating [..., d], got ", hidden.scalar_type(), " ", hidden.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.is_floating_point() && weight.size(1) == hidden.size(-1),
              "linear_cross_entropy: weight must be floating [vocab, d] with d = ", hidden.size(-1), ", got ",
              weight.scalar_type(), " ", weight.sizes());
  const auto lead = hidden.sizes().slice(0, hidden.dim() - 1);
  TORCH_CHECK(targets.sizes() == lead, "linear_cross_entropy: targets must have the leading shape of hidden ", lead,
              ", got ", targets.sizes());
  TORCH_CHECK(targets.scalar_type() == at::kLong, "linear_cross_entropy: targets must be int64, got ",
              targets.scalar_type());
  TORCH_CHECK(!token_weights.defined() || token_weights.sizes() == lead,
              "linear_cross_entropy: token weights must have the shape of targets ", lead, ", got ",
              token_weights.sizes());
  const int64_t d = hidden.size(-1), V = weight.size(0);
  const auto ct = matmul_type(hidden, weight);
  const int64_t chunk =
      chunk_tokens > 0 ? chunk_tokens : default_loss_chunk_tokens(V, fused_loss(hidden, ct) ? c10::elementSize(ct) : 0);
  const auto lt = at::promote_types(ct, at::kFloat);
  const Tensor h = hidden.reshape({-1, d});
  const Tensor t = targets.to(hidden.device()).reshape({-1}).contiguous();
  const Tensor w = token_weights.defined() ? token_weights.to(hidden.device(), lt).reshape({-1}).contiguous()
                                           : at::ones({h.size(0)}, hidden.options().dtype(lt));
  LinearCrossEntropy out;
  const bool grads = at::GradMode::is_enabled() && (hidden.requires_grad() || weight.requires_grad());
  if (grads) {
    const bool defer = defer_bytes > 0 && anchored && DeferredHeadAccess::anchored(*anchored) && weight.requires_grad();
    const auto deferred = defer ? anchored : nullptr;
    auto r = LinearCrossEntropyFunction::apply(h, weight, t, w, chunk, predictions, defer_bytes, deferred);
    if (deferred && deferred->chunks() > 0) out.deferred = deferred;
    out.loss = r[0];
    out.token_losses = r[1].view(lead);
    if (predictions) out.predictions = r[2].view(lead);
  } else {
    auto pass = chunked_pass(h, weight, t, w, chunk, /*grads=*/false, predictions);
    out.loss = (pass.ce * w).sum();
    out.token_losses = pass.ce.view(lead);
    if (predictions) out.predictions = pass.predictions.view(lead);
  }
  return out;
}

}  // namespace carry
