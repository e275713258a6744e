// RWKV-7's channel mix (channel_mix.h states it).
#include "layers/rwkv7/channel_mix.h"

#include "layers/layout.h"
#include "layers/rwkv7/time_mix.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace carry {

Rwkv7ChannelMix::Rwkv7ChannelMix(int64_t d, int64_t hidden, int64_t layer, int64_t n_layers, ParameterInit& init) {
  TORCH_CHECK(d > 0 && hidden > 0, "rwkv7 channel mix: d_model and the hidden width must be positive, got ", d,
              " and ", hidden);
  const double r = 1.0 - static_cast<double>(layer) / static_cast<double>(std::max<int64_t>(n_layers, 1));
  const Tensor ddd = at::arange(d, at::kDouble) / static_cast<double>(d);
  x_k = init.leaf((1.0 - at::pow(ddd, std::pow(r, 4))).to(at::kFloat));
  key = rwkv7_orthogonal(init, hidden, d, 1.0);
  value = init.full({d, hidden}, 0.0);
}

Tensor Rwkv7ChannelMix::forward(const Tensor& x, const MixerLayerContext& ctx) const {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == key.size(1), "rwkv7 channel mix: x must be [B, T, ", key.size(1),
              "], got ", shape_str(x.sizes()));
  auto h = at::relu(at::linear(x + rwkv7_token_shift(x, ctx) * x_k, key));
  return at::linear(h * h, value);
}

NamedParameters Rwkv7ChannelMix::parameters() const {
  return {{"x_k", x_k}, {"key.weight", key}, {"value.weight", value}};
}

}  // namespace carry
