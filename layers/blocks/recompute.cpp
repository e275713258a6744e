// Activation recomputation (see recompute.h): a custom autograd node that holds x, the parameters and
// f, and in backward recomputes f(x) with autograd and differentiates it.
#include "layers/blocks/recompute.h"

#include "layers/core/side_stream.h"
#include "layers/blocks/precision.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace carry {

namespace {

using torch::autograd::variable_list;

// What the forward of one recomputed layer received, in order (received_once).
struct MessageLog {
  std::vector<std::vector<Tensor>> received;
  size_t next = 0;    // the next one the recomputation takes
  bool replay = false;
};
thread_local MessageLog* t_log = nullptr;
thread_local int t_recomputing = 0;  // depth of recompute_in_backward's recomputations on this thread

// While alive, recomputing_in_backward() is true on this thread.
class RecomputingScope {
 public:
  RecomputingScope() { ++t_recomputing; }
  ~RecomputingScope() { --t_recomputing; }
  RecomputingScope(const RecomputingScope&) = delete;
  RecomputingScope& operator=(const RecomputingScope&) = delete;
};

// a + b's graph without its values (graph_only_add): the backward hands the gradient to both, as
// AddBackward does (the engine casts it to each input's dtype).
struct GraphOnlyAdd : public torch::autograd::Function<GraphOnlyAdd> {
  static variable_list forward(torch::autograd::AutogradContext*, const Tensor& a, const Tensor& b) {
    return {at::empty(a.sizes(), a.options().dtype(at::promote_types(a.scalar_type(), b.scalar_type())))};
  }
  static variable_list backward(torch::autograd::AutogradContext*, variable_list grads) {
    return {grads[0], grads[0]};
  }
};

// While alive, received_once on this thread records into (or replays from) `log`.
class LogScope {
 public:
  LogScope(MessageLog* log, bool replay) : saved_(t_log) {
    log->replay = replay;
    t_log = log;
  }
  ~LogScope() { t_log = saved_; }
  LogScope(const LogScope&) = delete;
  LogScope& operator=(const LogScope&) = delete;

 private:
  MessageLog* saved_;
};

// The gradient of y (for the incoming gy) with respect to each of `inputs` that requires one, in
// `inputs`' order; undefined for the others (and for all when none does).
variable_list grads_wrt(const Tensor& y, const Tensor& gy, const std::vector<Tensor>& inputs) {
  variable_list out(inputs.size());
  std::vector<Tensor> wrt;
  std::vector<size_t> slot;
  for (size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].requires_grad()) wrt.push_back(inputs[i]), slot.push_back(i);
  if (wrt.empty()) return out;
  auto g = torch::autograd::grad({y}, wrt, {gy.to(y.scalar_type())}, /*retain_graph=*/false,
                                 /*create_graph=*/false, /*allow_unused=*/true);
  for (size_t j = 0; j < g.size(); ++j) out[slot[j]] = g[j];
  return out;
}

class RecomputeBackward final : public torch::autograd::Node {
 public:
  RecomputeBackward(std::function<Tensor(const Tensor&)> f, Tensor x, std::vector<Tensor> parameters,
                    AutocastState autocast, at::TensorOptions y_options, std::vector<int64_t> y_sizes,
                    MessageLog log, std::weak_ptr<RecomputeBackward> previous)
      : f_(std::move(f)), x_(std::move(x)), parameters_(std::move(parameters)), autocast_(autocast),
        y_options_(y_options), y_sizes_(std::move(y_sizes)), log_(std::move(log)), previous_(std::move(previous)) {}

  std::string name() const override { return "carry::RecomputeBackward"; }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(f_, "recompute: backward called twice (the layer's inputs are released after the first)");
    Tensor gy = grads.at(0);
    // Every rank must recompute (collectives inside f): an absent gradient counts as zeros.
    if (!gy.defined()) gy = at::zeros(y_sizes_, y_options_);

    // This layer's recomputation: run ahead on a side stream by the layer above (overlap), or now.
    Recomputed r = ahead_.y.defined() ? std::move(ahead_) : recompute();
    ahead_ = Recomputed{};
    // Overlap: the layer below recomputes on the other side stream while this one differentiates.
    if (auto below = previous_.lock()) below->recompute_ahead(r.slot == 0 ? 1 : 0);

    // Differentiate with respect to x (when it needs a gradient) and the parameters that do: output
    // slot 0 is x, 1 + i parameter i. A graph recomputed on a side stream runs its backward there (each
    // node on its forward's stream); the caller's stream then waits for it and the gradients it made.
    std::vector<Tensor> inputs{r.x};
    inputs.insert(inputs.end(), parameters_.begin(), parameters_.end());
    const SideStream side(r.x, r.slot);
    variable_list out;
    side.run([&] { out = grads_wrt(r.y, gy, inputs); });
    side.join();
    for (const auto& g : out) side.used_on_current(g);
    f_ = nullptr, x_ = Tensor(), parameters_.clear(), log_ = MessageLog{};
    return out;
  }

 private:
  struct Recomputed {
    Tensor x, y;    // the layer's input as a leaf, and f(x) with its graph
    int slot = -1;  // the side stream it ran on (-1: the caller's)
  };

  // f(x) with autograd on, under the forward's autocast (the backward runs without it, as the backward of
  // a layer that kept its activations does) and with the forward's messages replayed.
  Recomputed recompute() {
    at::AutoGradMode grad_on(true);
    Recomputed r;
    r.x = x_.detach().requires_grad_(x_.requires_grad());
    {
      AutocastStateScope autocast(autocast_);
      LogScope replay(&log_, /*replay=*/true);
      RecomputingScope recomputing;
      r.y = f_(r.x);
    }
    TORCH_CHECK(log_.next == log_.received.size(), "recompute: the recomputation took ", log_.next,
                " of the ", log_.received.size(), " messages the forward received");
    return r;
  }

  // Recomputes this layer before its backward is called, on side stream `slot` of its device (in place
  // where there is none), so that the GPU runs it beside the backward of the layer above.
  void recompute_ahead(int slot) {
    if (!f_ || ahead_.y.defined()) return;
    const SideStream side(x_, slot);
    side.run([&] { ahead_ = recompute(); });
    ahead_.slot = side.active() ? slot : -1;
  }

  std::function<Tensor(const Tensor&)> f_;
  Tensor x_;
  std::vector<Tensor> parameters_;
  AutocastState autocast_;
  at::TensorOptions y_options_;
  std::vector<int64_t> y_sizes_;
  MessageLog log_;
  // overlap: the recomputed layer created just before this one (the one its gradient flows to)
  std::weak_ptr<RecomputeBackward> previous_;
  Recomputed ahead_;  // this layer's recomputation, run ahead by the layer above
};

// The last node recompute_in_backward made with overlap on this thread (the next one links to it).
thread_local std::weak_ptr<RecomputeBackward> t_last_overlapped;

// The recomputation's stand-in for a stashed core: its inputs are the recomputed core inputs, its
// output the kept core output; the backward runs the kept graph from that output to its leaves.
class StashedCoreBackward final : public torch::autograd::Node {
 public:
  explicit StashedCoreBackward(std::shared_ptr<MixerCoreStash> stash) : stash_(std::move(stash)) {}
  std::string name() const override { return "carry::StashedCoreBackward"; }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(stash_ && stash_->o.defined(), "recompute: the kept mixer core was differentiated twice");
    const Tensor& go = grads.at(0);
    variable_list out = go.defined() && stash_->o.requires_grad() ? grads_wrt(stash_->o, go, stash_->leaves)
                                                                  : variable_list(stash_->leaves.size());
    *stash_ = MixerCoreStash{};
    stash_.reset();
    return out;
  }

 private:
  std::shared_ptr<MixerCoreStash> stash_;
};

}  // namespace

MixerOutput stashed_mixer_core(const std::shared_ptr<MixerCoreStash>& stash, const Mixer& mixer,
                               const MixerInputs& in, const MixerOptions& options) {
  TORCH_CHECK(stash, "recompute: no stash for the mixer core");
  auto& st = *stash;
  if (!st.o.defined()) {
    // The forward pass: the core with its own graph over leaf copies of its inputs.
    at::AutoGradMode grad_on(true);
    MixerInputs leaf;
    for (const auto& name : MixerInputs::names()) {
      const Tensor& t = in.get(name);
      if (!t.defined()) continue;
      Tensor l = t.detach();
      if (l.is_floating_point()) l.requires_grad_(true);
      leaf.get(name) = l;
      st.names.push_back(name);
      st.leaves.push_back(l);
    }
    MixerOutput out = mixer.forward(leaf, {}, options);
    st.o = out.o;
    for (auto& s : out.final_state) st.final_state.push_back(s.defined() ? s.detach() : s);
    return {out.o.detach(), st.final_state};
  }
  // The recomputation: the kept output, attached to the recomputed inputs.
  variable_list inputs;
  for (const auto& name : st.names) {
    const Tensor& t = in.get(name);
    TORCH_CHECK(t.defined() && t.sizes() == st.leaves[inputs.size()].sizes(), "recompute: the mixer core's input '",
                name, "' was recomputed with another shape");
    inputs.push_back(t);
  }
  auto node = std::shared_ptr<StashedCoreBackward>(new StashedCoreBackward(stash), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  Tensor o = st.o.detach();
  torch::autograd::set_history(o, node);
  return {o, st.final_state};
}

Tensor recompute_in_backward(std::function<Tensor(const Tensor&)> f, const Tensor& x,
                             const std::vector<Tensor>& parameters, bool overlap) {
  bool any = x.requires_grad();
  for (auto& p : parameters) any = any || p.requires_grad();
  if (!at::GradMode::is_enabled() || !any) return f(x);

  Tensor y;
  MessageLog log;
  {
    at::NoGradGuard no_grad;
    LogScope record(&log, /*replay=*/false);
    y = f(x.detach());
  }
  // The layer below is the node whose output this layer reads. Only that one: a model run again on the
  // same thread (the next segment of ordered segments, the next micro-batch) starts a chain of its own.
  std::weak_ptr<RecomputeBackward> below;
  if (auto previous = t_last_overlapped.lock(); overlap && previous && x.grad_fn().get() == previous.get())
    below = previous;
  auto node = std::shared_ptr<RecomputeBackward>(
      new RecomputeBackward(std::move(f), x.detach().requires_grad_(x.requires_grad()), parameters,
                            AutocastState::current(), y.options(), y.sizes().vec(), std::move(log), below),
      torch::autograd::deleteNode);
  t_last_overlapped = overlap ? node : std::weak_ptr<RecomputeBackward>();
  variable_list inputs{x};
  inputs.insert(inputs.end(), parameters.begin(), parameters.end());
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  torch::autograd::set_history(y, node);
  return y;
}

bool recomputing_in_backward() { return t_recomputing > 0; }

Tensor graph_only_add(const Tensor& a, const Tensor& b, bool values) {
  if (values || !at::GradMode::is_enabled() || !(a.requires_grad() || b.requires_grad())) return a + b;
  TORCH_CHECK(a.sizes() == b.sizes(), "graph_only_add: a and b must have one shape, got ", a.sizes(), " and ", b.sizes());
  return GraphOnlyAdd::apply(a, b)[0];
}

std::vector<Tensor> received_once(const std::function<std::vector<Tensor>()>& exchange) {
  if (!t_log) return exchange();
  if (t_log->replay) {
    TORCH_CHECK(t_log->next < t_log->received.size(), "recompute: the recomputation asks for message ",
                t_log->next + 1, " but the forward received ", t_log->received.size());
    std::vector<Tensor> got;
    for (auto& t : t_log->received[t_log->next]) got.push_back(t.defined() ? t.detach() : t);
    ++t_log->next;
    return got;
  }
  auto got = exchange();
  t_log->received.push_back(got);
  return got;
}

}  // namespace carry
