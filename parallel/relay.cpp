// The relay along the ranks with its gradient (see relay.h): the forward's message is a gather of rows
// of cat(received, own rows), so the backward scatters the gradient of the sent rows back onto the
// received ones (added to their own gradient and passed on to the previous rank) and onto the own rows.
#include "parallel/relay.h"

#include "layers/blocks/recompute.h"
#include "layers/layout.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

namespace carry::parallel {

namespace {

constexpr int kTagRelayForward = 7201;
constexpr int kTagRelayBackward = 7202;

// The rows `index` [B, N] (device, −1 = zero) of src [B, n, C].
Tensor gather_rows(const Tensor& src, const Tensor& index) {
  const int64_t B = src.size(0), N = index.size(1), C = src.size(2);
  auto safe = index.clamp_min(0).unsqueeze(-1).expand({B, N, C});
  auto keep = (index >= 0).unsqueeze(-1).to(src.scalar_type());
  return src.gather(1, safe) * keep;
}

class RelayBackward final : public torch::autograd::Node {
 public:
  RelayBackward(Communicator* sp, std::vector<int64_t> rows_shape, at::TensorOptions opt, Tensor index,
                int64_t incoming)
      : sp_(sp), rows_shape_(std::move(rows_shape)), opt_(opt), index_(std::move(index)), incoming_(incoming) {}
  std::string name() const override { return "carry::parallel::RelayBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const int r = sp_->rank(), P = sp_->size();
    const int64_t B = rows_shape_[0], T = rows_shape_[1], C = rows_shape_[2];
    Tensor d_in = grads[0].defined() ? grads[0].contiguous() : at::zeros({B, incoming_, C}, opt_);
    Tensor d_src = at::zeros({B, incoming_ + T, C}, opt_);
    if (r + 1 < P && index_.size(1) > 0) {
      Tensor d_sent = at::zeros({B, index_.size(1), C}, opt_);
      {
        CommContext ctx("relay backward: gradient of the sent rows from the next rank");
        sp_->recv(d_sent, r + 1, kTagRelayBackward);
      }
      auto index = index_.to(opt_.device());
      auto keep = (index >= 0).unsqueeze(-1).to(d_sent.scalar_type());
      d_src.scatter_add_(1, index.clamp_min(0).unsqueeze(-1).expand({B, index.size(1), C}), d_sent * keep);
    }
    d_in = d_in + d_src.narrow(1, 0, incoming_);
    if (r > 0 && incoming_ > 0) {
      CommContext ctx("relay backward: gradient of the received rows to the previous rank");
      sp_->send(d_in.contiguous(), r - 1, kTagRelayBackward);
    }
    return {d_src.narrow(1, incoming_, T)};
  }

 private:
  Communicator* sp_;
  std::vector<int64_t> rows_shape_;
  at::TensorOptions opt_;
  Tensor index_;
  int64_t incoming_;
};

}  // namespace

Tensor relay_exchange(Communicator& sp, const Tensor& rows, const Tensor& index, int64_t incoming_rows) {
  const int r = sp.rank(), P = sp.size();
  TORCH_CHECK(rows.dim() == 3, "relay_exchange: rows must be [B, T, C], got ", shape_str(rows.sizes()));
  TORCH_CHECK(incoming_rows >= 0 && (r > 0 || incoming_rows == 0), "relay_exchange: rank ", r, " expects ",
              incoming_rows, " rows from the previous rank");
  const int64_t B = rows.size(0), T = rows.size(1), C = rows.size(2);
  const bool sends = r + 1 < P;
  if (sends)
    TORCH_CHECK(index.defined() && index.dim() == 2 && index.size(0) == B && index.scalar_type() == at::kLong,
                "relay_exchange: index must be [", B, ", N] int64, got ",
                index.defined() ? shape_str(index.sizes()) : std::string("undefined"));
  Tensor got = at::zeros({B, incoming_rows, C}, rows.options());
  {
    // A recomputation takes what its forward received and sends nothing (layers/blocks/recompute.h).
    got = received_once([&] {
      if (incoming_rows > 0) {
        CommContext ctx("relay forward: rows from the previous rank");
        sp.recv(got, r - 1, kTagRelayForward);
      }
      if (sends && index.size(1) > 0) {
        auto sent = gather_rows(at::cat({got, rows.detach()}, 1), index.to(rows.device())).contiguous();
        CommContext ctx("relay forward: rows to the next rank");
        sp.send(sent, r + 1, kTagRelayForward);
      }
      return std::vector<Tensor>{got};
    })[0];
  }
  if (!(rows.requires_grad() && at::GradMode::is_enabled())) return got;
  auto node = std::shared_ptr<RelayBackward>(
      new RelayBackward(&sp, {B, T, C}, rows.options(), sends ? index.cpu() : at::zeros({B, 0}, at::kLong), incoming_rows),
      torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(rows));
  torch::autograd::set_history(got, node);
  return got;
}

}  // namespace carry::parallel
