// Shared validation and layout helpers of the mixer families (see layout.h).
#include "layers/layout.h"

#include <sstream>

namespace carry {

std::string shape_str(at::IntArrayRef shape) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << "]";
  return s.str();
}

void check_tensor(const Tensor& t, const std::string& name, std::vector<int64_t> shape) {
  TORCH_CHECK(t.defined(), name, " is missing");
  bool ok = t.dim() == static_cast<int64_t>(shape.size());
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] < 0 || t.size(i) == shape[i];
  if (!ok) {
    std::ostringstream want;
    want << "[";
    for (size_t i = 0; i < shape.size(); ++i)
      want << (i ? ", " : "") << (shape[i] < 0 ? std::string("*") : std::to_string(shape[i]));
    want << "]";
    TORCH_CHECK(false, name, " must have shape ", want.str(), ", got ", shape_str(t.sizes()));
  }
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), name, " must be a floating-point tensor, got ",
              t.scalar_type());
}

void check_finite(const Tensor& t, const std::string& name) {
  TORCH_CHECK(at::isfinite(t).all().item<bool>(), name, " has NaN or infinite values");
}

void check_log_gate(const Tensor& t, const std::string& name) {
  check_finite(t, name + " (a log gate)");
  TORCH_CHECK((t <= 0).all().item<bool>(), name,
              " is a log decay and must be <= 0 everywhere (a decay factor above 1); max is ",
              t.max().item<double>());
}

Tensor to_bhtd(const Tensor& x) { return x.dim() == 3 ? x.transpose(1, 2) : x.transpose(1, 2); }
Tensor from_bhtd(const Tensor& x) { return x.transpose(1, 2); }

Tensor split_chunks(const Tensor& x, int64_t chunk_size) {
  auto s = x.sizes().vec();
  TORCH_INTERNAL_ASSERT(s.size() >= 3 && s[2] % chunk_size == 0);
  std::vector<int64_t> out{s[0], s[1], s[2] / chunk_size, chunk_size};
  out.insert(out.end(), s.begin() + 3, s.end());
  return x.reshape(out);
}

Tensor merge_chunks(const Tensor& x) {
  auto s = x.sizes().vec();
  std::vector<int64_t> out{s[0], s[1], s[2] * s[3]};
  out.insert(out.end(), s.begin() + 4, s.end());
  return x.reshape(out);
}

Tensor causal_mask(int64_t size, bool strict, const at::TensorOptions& opt) {
  return at::ones({size, size}, opt.dtype(at::kBool)).tril(strict ? -1 : 0);
}

Tensor state_or_zeros(const State& s, size_t i, at::IntArrayRef shape, const at::TensorOptions& opt) {
  if (i < s.size() && s[i].defined()) {
    TORCH_CHECK(s[i].sizes() == shape, "initial_state entry ", i, " must have shape ",
                shape_str(shape), ", got ", shape_str(s[i].sizes()));
    return s[i];
  }
  return at::zeros(shape, opt);
}

}  // namespace carry
