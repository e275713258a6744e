// Halo exchange with its gradient (see halo.h): one send_recv shift to the right in the forward, one
// to the left in the backward, so neither direction can deadlock.
#include "parallel/halo.h"

#include "layers/recompute.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace carry::parallel {

namespace {

constexpr int kTagHaloForward = 7101;
constexpr int kTagHaloBackward = 7102;

class HaloBackward final : public torch::autograd::Node {
 public:
  HaloBackward(Communicator* sp, std::vector<int64_t> x_shape, at::TensorOptions opt, int64_t halo)
      : sp_(sp), x_shape_(std::move(x_shape)), opt_(opt), halo_(halo) {}
  std::string name() const override { return "carry::parallel::HaloBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    int r = sp_->rank(), P = sp_->size();
    auto d_halo = grads[0].defined() ? grads[0].contiguous()
                                     : at::zeros(halo_shape(), opt_);
    auto d_tail = at::zeros(halo_shape(), opt_);
    {
      CommContext ctx("halo exchange backward: halo gradient to the previous rank");
      sp_->send_recv(d_halo, r > 0 ? r - 1 : -1, d_tail, r + 1 < P ? r + 1 : -1, kTagHaloBackward);
    }
    auto dx = at::zeros(x_shape_, opt_);
    if (r + 1 < P) dx.narrow(1, x_shape_[1] - halo_, halo_).copy_(d_tail);
    return {dx};
  }

 private:
  std::vector<int64_t> halo_shape() const {
    auto s = x_shape_;
    s[1] = halo_;
    return s;
  }
  Communicator* sp_;
  std::vector<int64_t> x_shape_;
  at::TensorOptions opt_;
  int64_t halo_;
};

}  // namespace

Tensor halo_exchange(Communicator& sp, const Tensor& x, int64_t halo) {
  TORCH_CHECK(x.dim() >= 2, "halo_exchange: x must be [B, T, ...], got ", x.dim(), " dims");
  TORCH_CHECK(halo >= 0 && halo <= x.size(1), "halo_exchange: a halo of ", halo,
              " tokens needs a slice at least that long; this rank's slice has ", x.size(1),
              " tokens (a window or convolution reaching past the previous rank is not supported)");
  int r = sp.rank(), P = sp.size();
  auto shape = x.sizes().vec();
  shape[1] = halo;
  auto tail = x.detach().narrow(1, x.size(1) - halo, halo).contiguous();
  auto got = at::zeros(shape, x.options());
  {
    CommContext ctx("halo exchange forward: last tokens to the next rank");
    // A recomputation takes the halo its forward received (layers/recompute.h).
    got = received_once([&] {
      sp.send_recv(tail, r + 1 < P ? r + 1 : -1, got, r > 0 ? r - 1 : -1, kTagHaloForward);
      return std::vector<Tensor>{got};
    })[0];
  }
  if (!(x.requires_grad() && at::GradMode::is_enabled())) return got;
  auto node = std::shared_ptr<HaloBackward>(new HaloBackward(&sp, x.sizes().vec(), x.options(), halo),
                                            torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  torch::autograd::set_history(got, node);
  return got;
}

}  // namespace carry::parallel
