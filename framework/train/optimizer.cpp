// AdamW, the learning-rate schedules and gradient clipping (see optimizer.h).
#include "framework/train/optimizer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <map>

namespace carry {

int64_t wsd_decay_steps(const config::OptimizerConfig& opt) {
  return std::llround(opt.decay_fraction() * static_cast<double>(opt.total_steps()));
}

double learning_rate(const config::OptimizerConfig& opt, int64_t step) {
  using config::OptimizerConfig;
  const double lr = opt.lr();
  const int64_t warmup = opt.warmup_steps(), total = opt.total_steps();
  if (warmup > 0 && step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double ratio = opt.min_lr_ratio();
  // The decay's start and length, and its shape.
  int64_t start = warmup;
  config::LrDecay::Shape shape = config::LrDecay::COSINE;
  switch (opt.schedule()) {
    case OptimizerConfig::CONSTANT: return lr;
    case OptimizerConfig::COSINE: break;
    case OptimizerConfig::LINEAR: shape = config::LrDecay::LINEAR; break;
    case OptimizerConfig::WSD:
      start = std::max(warmup, total - wsd_decay_steps(opt));
      shape = opt.decay_shape();
      break;
  }
  const int64_t span = total - start;
  double progress = span > 0 ? static_cast<double>(step - start) / static_cast<double>(span) : 1.0;
  progress = std::min(1.0, std::max(0.0, progress));
  switch (shape) {
    case config::LrDecay::LINEAR: return lr * (ratio + (1.0 - ratio) * (1.0 - progress));
    case config::LrDecay::ONE_MINUS_SQRT: return lr * (ratio + (1.0 - ratio) * (1.0 - std::sqrt(progress)));
    case config::LrDecay::COSINE: break;
  }
  return lr * (ratio + (1.0 - ratio) * 0.5 * (1.0 + std::cos(M_PI * progress)));
}

namespace {
bool cuda_fp32_on_one_device(const std::vector<at::Tensor>& grads) {
  for (const auto& g : grads)
    if (!g.is_cuda() || g.scalar_type() != at::kFloat || g.device() != grads[0].device()) return false;
  return !grads.empty();
}
}  // namespace

at::Tensor gradient_norm_parts(const std::vector<at::Tensor>& grads) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(!grads.empty(), "gradient_norm_parts: no gradient");
  // Every part stays on the device. On one GPU: a few multi-tensor launches instead of three kernels a tensor.
  if (cuda_fp32_on_one_device(grads)) return at::stack(at::_foreach_norm(grads, 2)).to(at::kDouble).pow(2);
  std::vector<at::Tensor> sums;
  for (const auto& g : grads) sums.push_back(g.to(at::kDouble).pow(2).sum());
  return at::stack(sums);
}

void scale_gradients(const std::vector<at::Tensor>& grads, const at::Tensor& norm, double max_norm) {
  if (max_norm <= 0 || grads.empty()) return;
  at::NoGradGuard no_grad;
  // max_norm / (norm + 1e-6) as a division (Scalar / Tensor would multiply by a reciprocal).
  auto scale = at::where(norm > max_norm, at::full_like(norm, max_norm).div_(norm + 1e-6), at::ones_like(norm));
  if (cuda_fp32_on_one_device(grads)) at::_foreach_mul_(grads, scale.to(at::kFloat));
  else
    for (const auto& g : grads) g.mul_(scale);
}

at::Tensor clip_grad_norm_on_device(const NamedParameters& params, double max_norm) {
  std::vector<at::Tensor> grads;
  for (auto& [name, p] : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return {};
  auto norm = gradient_norm_parts(grads).sum().sqrt();
  scale_gradients(grads, norm, max_norm);
  return norm;
}

double clip_grad_norm(const NamedParameters& params, double max_norm) {
  auto norm = clip_grad_norm_on_device(params, max_norm);
  return norm.defined() ? norm.item<double>() : 0.0;
}

AdamW::AdamW(NamedParameters params, const config::OptimizerConfig& opt, bool fused)
    : params_(std::move(params)), opt_(opt), fused_(fused) {
  for (auto& [name, p] : params_) {
    exp_avg_.push_back(at::zeros(p.sizes(), p.options()));
    exp_avg_sq_.push_back(at::zeros(p.sizes(), p.options()));
  }
}

void AdamW::step(double lr) {
  at::NoGradGuard no_grad;
  ++steps_;
  const double b1 = opt_.beta1(), b2 = opt_.beta2(), eps = opt_.eps(), wd = opt_.weight_decay();
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(steps_));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(steps_));
  const double step_size = lr / bc1, bc2_sqrt = std::sqrt(bc2);
  // The fused form's lists: [decayed, not decayed] × (parameters, gradients, exp_avg, exp_avg_sq, steps).
  std::vector<at::Tensor> lists[2][5];
  const size_t end = last_ < 0 ? params_.size() : static_cast<size_t>(last_);
  for (size_t i = static_cast<size_t>(first_); i < end; ++i) {
    at::Tensor p = params_[i].second;
    auto& m = exp_avg_[i];
    auto& v = exp_avg_sq_[i];
    TORCH_CHECK(m.defined(), "AdamW::step: parameter '", params_[i].first, "' is updated here but its moments are "
                "held by another rank (update_only and place_state disagree)");
    at::Tensor g = p.grad().defined() ? p.grad() : at::zeros_like(p);
    if (g.scalar_type() != p.scalar_type()) g = g.to(p.scalar_type());
    if (fused_ && p.is_cuda()) {
      // The fused kernel needs every list's tensors laid out as the parameter.
      if (g.strides() != p.strides()) g = at::empty_like(p).copy_(g);
      auto it = step_tensors_.find(p.device());
      if (it == step_tensors_.end())
        it = step_tensors_.emplace(p.device(), at::zeros({}, p.options().dtype(at::kFloat))).first;
      auto& l = lists[(wd != 0 && p.dim() >= 2) ? 0 : 1];
      l[0].push_back(p), l[1].push_back(g), l[2].push_back(m), l[3].push_back(v), l[4].push_back(it->second);
      continue;
    }
    if (wd != 0 && p.dim() >= 2) p.mul_(1.0 - lr * wd);
    m.mul_(b1).add_(g, 1.0 - b1);
    v.mul_(b2).addcmul_(g, g, 1.0 - b2);
    auto denom = (v.sqrt() / bc2_sqrt).add_(eps);
    p.addcdiv_(m, denom, -step_size);
  }
  if (lists[0][0].empty() && lists[1][0].empty()) return;
  // The step count t on each device (a fill kernel, no host read); fp32 holds every count up to 2^24.
  for (auto& [device, t] : step_tensors_) t.fill_(static_cast<double>(steps_));
  for (int decayed = 0; decayed < 2; ++decayed) {
    auto& l = lists[decayed];
    if (l[0].empty()) continue;
    at::_fused_adamw_(l[0], l[1], l[2], l[3], /*max_exp_avg_sqs=*/{}, l[4], lr, b1, b2, decayed == 0 ? wd : 0.0, eps,
                      /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/std::nullopt, /*found_inf=*/std::nullopt);
  }
}

void AdamW::update_only(int first, int last) {
  TORCH_CHECK(first >= 0 && first <= last && last <= static_cast<int>(params_.size()), "AdamW::update_only: expected ",
              "0 <= first <= last <= ", params_.size(), ", got [", first, ", ", last, ")");
  first_ = first, last_ = last;
}

void AdamW::place_state(const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, const std::vector<int64_t>& offset) {
  place_state(exp_avg, exp_avg_sq, offset, 0, static_cast<int>(params_.size()), 0);
}

void AdamW::place_state(const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, const std::vector<int64_t>& offset,
                        int first, int last, int64_t base) {
  TORCH_CHECK(offset.size() == params_.size(), "AdamW::place_state: expected ", params_.size(), " offsets, got ",
              offset.size());
  TORCH_CHECK(first >= 0 && first <= last && last <= static_cast<int>(params_.size()), "AdamW::place_state: expected ",
              "0 <= first <= last <= ", params_.size(), ", got [", first, ", ", last, ")");
  at::NoGradGuard no_grad;
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
    if (i < first || i >= last) {
      exp_avg_[i] = at::Tensor(), exp_avg_sq_[i] = at::Tensor();
      continue;
    }
    const auto& p = params_[i].second;
    TORCH_CHECK(offset[i] >= base && offset[i] - base + p.numel() <= exp_avg.numel() && exp_avg.numel() == exp_avg_sq.numel(),
                "AdamW::place_state: parameter '", params_[i].first, "' (", p.numel(), " elements at ", offset[i],
                ") lies outside the buffers (", exp_avg.numel(), " elements from ", base, ")");
    auto m = exp_avg.narrow(0, offset[i] - base, p.numel()).view(p.sizes());
    auto v = exp_avg_sq.narrow(0, offset[i] - base, p.numel()).view(p.sizes());
    if (exp_avg_[i].defined()) m.copy_(exp_avg_[i]), v.copy_(exp_avg_sq_[i]);
    else m.zero_(), v.zero_();
    exp_avg_[i] = m, exp_avg_sq_[i] = v;
  }
}

std::vector<std::pair<std::string, at::Tensor>> AdamW::state() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < params_.size(); ++i) out.emplace_back("exp_avg." + params_[i].first, exp_avg_[i]);
  for (size_t i = 0; i < params_.size(); ++i)
    out.emplace_back("exp_avg_sq." + params_[i].first, exp_avg_sq_[i]);
  return out;
}

void AdamW::load_state(const std::vector<std::pair<std::string, at::Tensor>>& state, int64_t steps) {
  TORCH_CHECK(steps >= 0, "AdamW::load_state: the step count must be >= 0, got ", steps);
  std::map<std::string, at::Tensor> by_name;
  for (auto& [name, t] : state) by_name[name] = t;
  TORCH_CHECK(by_name.size() == 2 * params_.size(), "AdamW::load_state: expected ", 2 * params_.size(),
              " optimizer tensors (exp_avg.* and exp_avg_sq.* for ", params_.size(), " parameters), found ",
              by_name.size());
  at::NoGradGuard no_grad;
  std::vector<int64_t> shape;  // the parameter's
  auto restore = [&](const std::string& name, at::Tensor& into) {
    auto it = by_name.find(name);
    TORCH_CHECK(it != by_name.end(), "AdamW::load_state: optimizer tensor '", name, "' is missing");
    TORCH_CHECK(it->second.sizes() == at::IntArrayRef(shape), "AdamW::load_state: optimizer tensor '", name,
                "' has shape ", it->second.sizes(), ", expected ", at::IntArrayRef(shape));
    if (into.defined()) into.copy_(it->second);  // else another rank holds it
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    shape = params_[i].second.sizes().vec();
    restore("exp_avg." + params_[i].first, exp_avg_[i]);
    restore("exp_avg_sq." + params_[i].first, exp_avg_sq_[i]);
  }
  steps_ = steps;
}

}  // namespace carry
