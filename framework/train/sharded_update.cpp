// The update split over the sp group (see the header).
#include "framework/train/sharded_update.h"

#include "parallel/segments.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace carry {

at::Tensor flat_gradients(const NamedParameters& params, const parallel::FlatLayout& layout) {
  TORCH_CHECK(layout.offset.size() == params.size(), "flat_gradients: the layout has ", layout.offset.size(),
              " parameters, the model ", params.size());
  at::NoGradGuard no_grad;
  const auto& p0 = params.at(0).second;
  auto flat = at::empty({layout.numel}, p0.options());
  // One piece at a time by one cat: each parameter's gradient in its place, and views of one zero tensor
  // for the gaps and the absent gradients.
  int64_t most = 0;
  for (int j = 0; j < layout.pieces; ++j) {
    int64_t at_ = j * layout.piece_numel;
    for (int i = layout.piece_first[j]; i < layout.piece_first[j + 1]; ++i) {
      most = std::max(most, layout.offset[i] - at_);
      if (!params[i].second.grad().defined()) most = std::max(most, params[i].second.numel());
      at_ = layout.offset[i] + params[i].second.numel();
    }
    most = std::max(most, (j + 1) * layout.piece_numel - at_);
  }
  const auto zeros = at::zeros({most}, p0.options());
  for (int j = 0; j < layout.pieces; ++j) {
    std::vector<at::Tensor> parts;
    int64_t at_ = j * layout.piece_numel;
    for (int i = layout.piece_first[j]; i < layout.piece_first[j + 1]; ++i) {
      const auto& p = params[i].second;
      if (layout.offset[i] > at_) parts.push_back(zeros.narrow(0, 0, layout.offset[i] - at_));
      parts.push_back(p.grad().defined() ? p.grad().reshape({-1}) : zeros.narrow(0, 0, p.numel()));
      at_ = layout.offset[i] + p.numel();
    }
    const int64_t end = (j + 1) * layout.piece_numel;
    if (end > at_) parts.push_back(zeros.narrow(0, 0, end - at_));
    auto piece = flat.narrow(0, j * layout.piece_numel, layout.piece_numel);
    at::cat_out(piece, parts);
  }
  return flat;
}

void set_gradients(const NamedParameters& params, const at::Tensor& buffer, const parallel::FlatLayout& layout,
                   int first, int last) {
  const int end = last < 0 ? static_cast<int>(params.size()) : last;
  for (int i = first; i < end; ++i) {
    const auto& p = params[i].second;
    p.mutable_grad() = buffer.narrow(0, layout.offset[i], p.numel()).view(p.sizes());
  }
}

std::string ShardedUpdate::unavailable(const NamedParameters& params, const parallel::Communicator* sp) {
  if (!sp || sp->size() < 2) return "one rank a sequence";
  const int P = sp->size();
  if ((P & (P - 1)) != 0) return "sp = " + std::to_string(P) + " is not a power of two";
  if (params.empty()) return "no parameters";
  for (auto& [name, p] : params)
    if (p.scalar_type() != params[0].second.scalar_type() || p.device() != params[0].second.device())
      return "parameter '" + name + "' is not of the first parameter's dtype and device";
  return "";
}

ShardedUpdate::ShardedUpdate(NamedParameters params, AdamW& optimizer, parallel::Communicator* sp)
    : params_(std::move(params)), sp_(sp) {
  const std::string why = unavailable(params_, sp_);
  TORCH_CHECK(why.empty(), "sharded update: not available (", why, ")");
  std::vector<int64_t> numels;
  for (auto& [name, p] : params_) numels.push_back(p.numel());
  layout_ = parallel::FlatLayout::make(numels, sp_->size());
  piece_ = parallel::tree_piece(sp_->rank(), sp_->size());
  first_ = layout_.piece_first[piece_], last_ = layout_.piece_first[piece_ + 1];
  at::NoGradGuard no_grad;
  const auto options = params_[0].second.options();
  params_flat_ = at::zeros({layout_.numel}, options);
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i].second;
    auto view = params_flat_.narrow(0, layout_.offset[i], p.numel()).view(p.sizes());
    view.copy_(p.detach());
    p.set_data(view);  // every holder of the parameter (its module, the optimizer) now reads the buffer
  }
  exp_avg_flat_ = at::zeros({layout_.numel}, options);
  exp_avg_sq_flat_ = at::zeros({layout_.numel}, options);
  optimizer.place_state(exp_avg_flat_, exp_avg_sq_flat_, layout_.offset);
  optimizer.update_only(first_, last_);
}

at::Tensor ShardedUpdate::mine(const at::Tensor& flat) const {
  return flat.narrow(0, piece_ * layout_.piece_numel, layout_.piece_numel);
}

void ShardedUpdate::set_gradients(const at::Tensor& flat) const {
  for (auto& [name, p] : params_) p.mutable_grad() = at::Tensor();
  carry::set_gradients(params_, flat, layout_, first_, last_);
}

at::Tensor ShardedUpdate::clip(double max_norm) const {
  std::vector<at::Tensor> grads;
  for (int i = first_; i < last_; ++i) grads.push_back(params_[i].second.grad());
  auto options = params_[0].second.options().dtype(at::kDouble);
  auto parts = at::zeros({static_cast<int64_t>(params_.size())}, options);
  if (!grads.empty()) parts.narrow(0, first_, last_ - first_).copy_(gradient_norm_parts(grads));
  {
    parallel::CommContext ctx("the gradient norm's parts from every rank's piece");
    sp_->all_reduce_sum(parts);
  }
  auto norm = parts.sum().sqrt();
  scale_gradients(grads, norm, max_norm);
  return norm;
}

void ShardedUpdate::gather_parameters() {
  at::NoGradGuard no_grad;
  parallel::tree_all_gather(params_flat_, sp_);
}

void ShardedUpdate::gather_optimizer_state() {
  at::NoGradGuard no_grad;
  parallel::tree_all_gather(exp_avg_flat_, sp_);
  parallel::tree_all_gather(exp_avg_sq_flat_, sp_);
}

}  // namespace carry
