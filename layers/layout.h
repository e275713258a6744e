// Helpers shared by the mixer families: input validation with messages that name the tensor, and the
// layout changes of the chunkwise forms ([B,T,H,D] <-> [B,H,T,D] <-> [B,H,N,C,D]). Nothing here
// depends on a family.
#pragma once

#include "layers/mixer.h"

#include <sstream>
#include <string>
#include <vector>

namespace carry {

// "[2, 64, 4, 16]"
std::string shape_str(at::IntArrayRef shape);

// The parts with `sep` between them: join({"a", "b"}) = "a, b"; any streamable element type.
template <class T>
std::string join(const std::vector<T>& parts, const std::string& sep = ", ") {
  std::ostringstream s;
  for (size_t i = 0; i < parts.size(); ++i) s << (i ? sep : "") << parts[i];
  return s.str();
}

// Throws unless `t` is defined with exactly the given shape (-1 matches any size) and a floating dtype.
void check_tensor(const Tensor& t, const std::string& name, std::vector<int64_t> shape);
// Throws if `t` has a NaN or infinite element.
void check_finite(const Tensor& t, const std::string& name);
// Throws if any element of a log gate is > 0 (a decay factor above 1) or not finite.
void check_log_gate(const Tensor& t, const std::string& name);

// [B,T,H,D] -> [B,H,T,D] (and back); [B,T,H] -> [B,H,T].
Tensor to_bhtd(const Tensor& x);
Tensor from_bhtd(const Tensor& x);
// [B,H,T,...] -> [B,H,T/C,C,...].
Tensor split_chunks(const Tensor& x, int64_t chunk_size);
// [B,H,N,C,...] -> [B,H,N*C,...].
Tensor merge_chunks(const Tensor& x);

// Lower-triangular boolean mask [C,C]; `strict` excludes the diagonal.
Tensor causal_mask(int64_t size, bool strict, const at::TensorOptions& opt);

// The state of a tuple entry, or zeros when the caller gave none (checks the shape when given).
Tensor state_or_zeros(const State& s, size_t i, at::IntArrayRef shape, const at::TensorOptions& opt);

}  // namespace carry
