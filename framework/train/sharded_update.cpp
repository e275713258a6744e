// The update split over the sp group (see the header).
#include "framework/train/sharded_update.h"

#include "parallel/segments.h"

#ifdef CARRY_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <optional>

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

struct ShardedUpdate::Overlap {
#ifdef CARRY_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> side;
  at::cuda::CUDAEvent updated, gathered;
#endif
  bool pending = false;  // a gather not yet waited for
};

namespace {
// The block index of a "layers.<i>.*" parameter name (Model::parameters), else -1.
int64_t layer_of(const std::string& name) {
  if (name.rfind("layers.", 0) != 0) return -1;
  const auto dot = name.find('.', 7);
  if (dot == std::string::npos || dot == 7) return -1;
  int64_t i = 0;
  for (size_t k = 7; k < dot; ++k) {
    if (name[k] < '0' || name[k] > '9') return -1;
    i = i * 10 + (name[k] - '0');
  }
  return i;
}

// The forward's part that reads a parameter: the embedding -1, block i's i, the rest (the final norm,
// the head) `blocks`.
int64_t part_of(const std::string& name, int64_t blocks) {
  if (name.rfind("embedding.", 0) == 0) return -1;
  const int64_t i = layer_of(name);
  return i >= 0 ? i : blocks;
}
}  // namespace

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

std::string ShardedUpdate::dp_unavailable(const parallel::Communicator* dp, const parallel::Communicator* world) {
  if (!dp || dp->size() < 2) return "one replica";
  const int P = dp->size();
  if ((P & (P - 1)) != 0) return "dp = " + std::to_string(P) + " is not a power of two";
  if (!world) return "no world communicator";
  return "";
}

ShardedUpdate::ShardedUpdate(NamedParameters params, AdamW& optimizer, parallel::Communicator* sp,
                             bool gather_overlap, parallel::Communicator* dp, parallel::Communicator* world)
    : params_(std::move(params)), sp_(sp) {
  const std::string why = unavailable(params_, sp_);
  TORCH_CHECK(why.empty(), "sharded update: not available (", why, ")");
  if (dp_unavailable(dp, world).empty()) dp_ = dp, world_ = world, sub_pieces_ = dp->size();
  std::vector<int64_t> numels;
  for (auto& [name, p] : params_) numels.push_back(p.numel());
  layout_ = parallel::FlatLayout::make(numels, sp_->size() * sub_pieces_);
  sp_piece_ = parallel::tree_piece(sp_->rank(), sp_->size());
  piece_ = sp_piece_ * sub_pieces_ + (dp_ ? parallel::tree_piece(dp_->rank(), sub_pieces_) : 0);
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
  // The moments of this rank's piece only.
  exp_avg_flat_ = at::zeros({layout_.piece_numel}, options);
  exp_avg_sq_flat_ = at::zeros({layout_.piece_numel}, options);
  optimizer.place_state(exp_avg_flat_, exp_avg_sq_flat_, layout_.offset, first_, last_, piece_ * layout_.piece_numel);
  optimizer.update_only(first_, last_);
  // The first part of the forward that reads another rank's parameter. The block count comes from the
  // names (the largest layer index + 1); a tied head reads the embedding at the end, after every part.
  int64_t blocks = 0;
  for (auto& [name, p] : params_) blocks = std::max(blocks, layer_of(name) + 1);
  first_foreign_part_ = blocks;
  for (int i = 0; i < static_cast<int>(params_.size()); ++i)
    if (i < first_ || i >= last_) first_foreign_part_ = std::min(first_foreign_part_, part_of(params_[i].first, blocks));
  overlap_ = std::make_shared<Overlap>();
#ifdef CARRY_WITH_CUDA
  if (params_flat_.is_cuda() && gather_overlap)
    overlap_->side = c10::cuda::getStreamFromPool(false, params_flat_.device().index());
#endif
}

ShardedUpdate::~ShardedUpdate() {
#ifdef CARRY_WITH_CUDA
  if (overlap_ && overlap_->pending) {
    try {
      overlap_->gathered.synchronize();
    } catch (const std::exception&) {  // a failed communicator: the error was reported where it happened
    }
  }
#endif
}

at::Tensor ShardedUpdate::mine(const at::Tensor& flat) const {
  return flat.narrow(0, piece_ * layout_.piece_numel, layout_.piece_numel);
}

at::Tensor ShardedUpdate::sp_piece(const at::Tensor& flat) const {
  const int64_t n = layout_.piece_numel * sub_pieces_;
  return flat.narrow(0, sp_piece_ * n, n);
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
    (world_ ? world_ : sp_)->all_reduce_sum(parts);
  }
  auto norm = parts.sum().sqrt();
  scale_gradients(grads, norm, max_norm);
  return norm;
}

void ShardedUpdate::gather_parameters() {
  at::NoGradGuard no_grad;
  wait_parameters();  // the previous gather (every step waits in its forward; this is for a step without one)
  // Every parameter must still be its view of the buffer: one replaced instead of copied into (set_data,
  // an assignment) would train on values the gather no longer reaches. A pointer compare a parameter.
  const auto* base = static_cast<const char*>(params_flat_.data_ptr());
  for (size_t i = 0; i < params_.size(); ++i)
    TORCH_INTERNAL_ASSERT(params_[i].second.data_ptr() == base + layout_.offset[i] * params_flat_.element_size(),
                          "sharded update: parameter '", params_[i].first, "' no longer lives in the flat buffer "
                          "(replaced instead of copied into)");
#ifdef CARRY_WITH_CUDA
  if (overlap_->side) {
    // The side stream starts after the update on the current stream, gathers, and marks the end; the
    // buffer lives as long as this object, so no stream needs recording for the caching allocator.
    const auto device = params_flat_.device().index();
    auto current = c10::cuda::getCurrentCUDAStream(device);
    overlap_->updated.record(current);
    overlap_->updated.block(*overlap_->side);
    {
      c10::cuda::CUDAStreamGuard on_side(*overlap_->side);
      gather_pieces(params_flat_);
      overlap_->gathered.record(*overlap_->side);
    }
    overlap_->pending = true;
    return;
  }
#endif
  gather_pieces(params_flat_);
}

void ShardedUpdate::gather_pieces(at::Tensor& flat) const {
  if (dp_) {  // the sub-pieces of this rank's sp piece from its replicas, then the sp pieces
    at::Tensor mine_sp = sp_piece(flat);
    parallel::tree_all_gather(mine_sp, dp_);
  }
  parallel::tree_all_gather(flat, sp_);
}

void ShardedUpdate::wait_parameters() const {
  if (!overlap_->pending) return;
#ifdef CARRY_WITH_CUDA
  overlap_->gathered.block(c10::cuda::getCurrentCUDAStream(params_flat_.device().index()));
#endif
  overlap_->pending = false;
}

void ShardedUpdate::before_block(int64_t part) const {
  if (overlap_->pending && part >= first_foreign_part_) wait_parameters();
}

std::vector<std::pair<std::string, at::Tensor>> ShardedUpdate::whole_optimizer_state() const {
  at::NoGradGuard no_grad;
  wait_parameters();
  parallel::Communicator* comm = world_ ? world_ : sp_;
  const bool root = comm->rank() == 0;
  // Which rank holds which piece.
  auto mine_index = at::full({1}, static_cast<int64_t>(piece_), exp_avg_flat_.options().dtype(at::kLong));
  std::vector<int> holder(layout_.pieces, -1);
  {
    parallel::CommContext ctx("which rank holds which piece of the optimizer's moments");
    const auto all = at::cat(comm->all_gather(mine_index)).cpu();
    for (int r = 0; r < static_cast<int>(all.numel()); ++r) holder.at(all[r].item<int64_t>()) = r;
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto* piece : {&exp_avg_flat_, &exp_avg_sq_flat_}) {
    at::Tensor whole = root ? at::zeros({layout_.numel}, piece->options().device(at::kCPU)) : at::Tensor();
    at::Tensor buffer = at::empty_like(*piece);
    for (int j = 0; j < layout_.pieces; ++j) {
      TORCH_INTERNAL_ASSERT(holder[j] >= 0, "sharded update: no rank holds piece ", j, " of the moments");
      if (comm->rank() == holder[j]) buffer.copy_(*piece);
      {
        parallel::CommContext ctx("a piece of the optimizer's moments to the checkpoint's writer");
        comm->broadcast(buffer, holder[j]);
      }
      if (root) whole.narrow(0, j * layout_.piece_numel, layout_.piece_numel).copy_(buffer);
    }
    if (!root) continue;
    const std::string prefix = piece == &exp_avg_flat_ ? "exp_avg." : "exp_avg_sq.";
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& p = params_[i].second;
      out.emplace_back(prefix + params_[i].first, whole.narrow(0, layout_.offset[i], p.numel()).view(p.sizes()));
    }
  }
  return out;
}

}  // namespace carry
