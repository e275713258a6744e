// Halo exchange with its gradient (see halo.h): one send_recv shift to the right in the forward, one
// to the left in the backward, so neither direction can deadlock.
#include "parallel/halo.h"

#include "layers/blocks/recompute.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace carry::parallel {

namespace {

constexpr int kTagHaloForward = 7101;
constexpr int kTagHaloBackward = 7102;

// tail: null, or where the gradient of x's last `halo` tokens goes instead of the returned gradient
// (owned_gradient; AddTail adds it), on ranks with a next rank.
class HaloBackward final : public torch::autograd::Node {
 public:
  HaloBackward(Communicator* sp, std::vector<int64_t> x_shape, at::TensorOptions opt, int64_t halo,
               std::shared_ptr<Tensor> tail)
      : sp_(sp), x_shape_(std::move(x_shape)), opt_(opt), halo_(halo), tail_(std::move(tail)) {}
  std::string name() const override { return "carry::parallel::HaloBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    int r = sp_->rank(), P = sp_->size();
    auto d_halo = grads[0].defined() ? grads[0].contiguous()
                                     : at::zeros(halo_shape(), opt_);
    auto d_tail = at::zeros(r + 1 < P ? halo_shape() : std::vector<int64_t>{0}, opt_);
    {
      CommContext ctx("halo exchange backward: halo gradient to the previous rank");
      sp_->send_recv(d_halo, r > 0 ? r - 1 : -1, d_tail, r + 1 < P ? r + 1 : -1, kTagHaloBackward);
    }
    if (r + 1 >= P) return {Tensor()};  // nothing comes from a next rank: no gradient
    if (tail_) {
      *tail_ = d_tail;
      return {Tensor()};
    }
    auto dx = at::zeros(x_shape_, opt_);
    dx.narrow(1, x_shape_[1] - halo_, halo_).copy_(d_tail);
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
  std::shared_ptr<Tensor> tail_;
};

// A pre-hook on x's grad_fn (input `index`, x's gradient once every use of x has given its part):
// adds the tail gradient HaloBackward left, in place, on the last `halo` tokens. HaloBackward keeps
// its edge to x's grad_fn, so the engine runs it first.
class AddTail final : public torch::autograd::FunctionPreHook {
 public:
  AddTail(uint32_t index, std::shared_ptr<Tensor> tail, std::vector<int64_t> shape, at::TensorOptions opt,
          int64_t halo)
      : index_(index), tail_(std::move(tail)), shape_(std::move(shape)), opt_(opt), halo_(halo) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (!tail_->defined()) return grads;
    torch::autograd::variable_list out = grads;
    Tensor d_tail = std::move(*tail_);
    *tail_ = Tensor();
    Tensor& g = out[index_];
    if (!g.defined()) g = at::zeros(shape_, opt_);
    g.narrow(1, shape_[1] - halo_, halo_).add_(d_tail.to(g.scalar_type()));
    return out;
  }

 private:
  uint32_t index_;
  std::shared_ptr<Tensor> tail_;
  std::vector<int64_t> shape_;
  at::TensorOptions opt_;
  int64_t halo_;
};

}  // namespace

Tensor halo_exchange(Communicator& sp, const Tensor& x, int64_t halo, bool owned_gradient) {
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
    // A recomputation takes the halo its forward received (layers/blocks/recompute.h).
    got = received_once([&] {
      sp.send_recv(tail, r + 1 < P ? r + 1 : -1, got, r > 0 ? r - 1 : -1, kTagHaloForward);
      return std::vector<Tensor>{got};
    })[0];
  }
  if (!(x.requires_grad() && at::GradMode::is_enabled())) return got;
  std::shared_ptr<Tensor> tail_grad;
  if (owned_gradient && r + 1 < P && halo > 0) {
    tail_grad = std::make_shared<Tensor>();
    auto edge = torch::autograd::impl::gradient_edge(x);
    edge.function->add_tensor_pre_hook(
        std::make_unique<AddTail>(edge.input_nr, tail_grad, x.sizes().vec(), x.options(), halo));
  }
  auto node = std::shared_ptr<HaloBackward>(new HaloBackward(&sp, x.sizes().vec(), x.options(), halo, tail_grad),
                                            torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  torch::autograd::set_history(got, node);
  return got;
}

}  // namespace carry::parallel
