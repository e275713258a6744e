// The decay pass in ATen (decay_pass.h): the scalar-decay family's chunkwise form with scale 1.
#include "layers/decay_pass.h"

namespace carry {

std::pair<Tensor, Tensor> chunkwise_scale_one(const std::string& family, const MixerInputs& in, const Tensor& x0,
                                              int64_t chunk_size, double scale) {
  MixerOptions opt;
  opt.scale = scale;
  opt.chunk_size = chunk_size;
  opt.form = Form::chunkwise;
  auto r = get_mixer(family).forward(in, {x0}, opt);
  return {r.o, r.final_state.at(0)};
}

DecayPass chunkwise_decay_pass(int64_t chunk_size) {
  return [chunk_size](const Tensor& c, const Tensor& a, const Tensor& b, const Tensor& g, const Tensor& x0,
                      double scale) {
    MixerInputs in;
    in.q = c, in.k = a, in.v = b;
    in.g = g.defined() ? g : at::zeros({c.size(0), c.size(1), c.size(2)}, c.options());
    return chunkwise_scale_one("scalar_decay", in, x0, chunk_size, scale);
  };
}

}  // namespace carry
