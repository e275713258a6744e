// Leaves and gradients of a mixer run (see mixer_grads.h).
#include "layers/mixer_grads.h"

#include <torch/csrc/autograd/autograd.h>

namespace carry {

std::vector<Tensor> MixerLeaves::all() const {
  std::vector<Tensor> v;
  for (const auto& n : MixerInputs::names())
    if (in.get(n).defined()) v.push_back(in.get(n));
  for (const auto& t : state) v.push_back(t);
  return v;
}

MixerLeaves make_mixer_leaves(const MixerInputs& in, const State& state,
                              const std::function<Tensor(const Tensor&)>& make_leaf) {
  auto leaf = [&](const Tensor& t) {
    return make_leaf ? make_leaf(t) : t.detach().clone().requires_grad_(true);
  };
  MixerLeaves l;
  for (const auto& n : MixerInputs::names())
    if (in.get(n).defined()) l.in.get(n) = leaf(in.get(n));
  for (const auto& t : state) l.state.push_back(leaf(t));
  return l;
}

std::vector<Tensor> leaf_grads(const std::vector<Tensor>& outputs, const std::vector<Tensor>& leaves,
                               const std::vector<Tensor>& cotangents) {
  TORCH_INTERNAL_ASSERT(cotangents.empty() || cotangents.size() == outputs.size(), "leaf_grads: ",
                        outputs.size(), " outputs but ", cotangents.size(), " cotangents");
  bool any = false;
  for (const auto& o : outputs) any = any || (o.defined() && o.requires_grad());
  std::vector<Tensor> g(leaves.size());
  if (any && !leaves.empty())
    g = torch::autograd::grad(outputs, leaves, cotangents, /*retain_graph=*/false, /*create_graph=*/false,
                              /*allow_unused=*/true);
  for (size_t i = 0; i < leaves.size(); ++i)
    g[i] = g[i].defined() ? g[i].detach() : at::zeros_like(leaves[i]).detach();
  return g;
}

}  // namespace carry
