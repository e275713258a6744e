// Performer's FAVOR+ features (performer.h): the seeded orthogonal random features and the stabilized
// positive feature map.
#include "layers/linear_attn/performer.h"

#include "layers/blocks/precision.h"
#include "layers/layout.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace carry {

namespace {

// log(x) for x in (0, 1] from additions, multiplications and divisions: x = 2^e·f with f in [√½, √2),
// log f = 2·atanh(s), s = (f − 1)/(f + 1), |s| < 0.172, summed to 16 terms (the 17th is below 1e-26).
double plain_log(double x) {
  int e = 0;
  double f = std::frexp(x, &e);  // exact: f in [0.5, 1)
  if (f < 0.70710678118654752) f *= 2, e -= 1;
  const double s = (f - 1) / (f + 1), s2 = s * s;
  double term = s, sum = 0;
  for (int k = 0; k < 16; ++k) sum += term / (2 * k + 1), term *= s2;
  return 2 * sum + e * 0.69314718055994531;
}

// Standard Gaussians from a splitmix64 stream, by the polar method (pairs; the second one kept).
class GaussianStream {
 public:
  explicit GaussianStream(uint64_t seed) : state_(seed) {}
  double next() {
    if (has_spare_) return has_spare_ = false, spare_;
    double u, v, s;
    do {
      u = 2 * uniform() - 1, v = 2 * uniform() - 1;
      s = u * u + v * v;
    } while (s >= 1 || s == 0);
    const double f = std::sqrt(-2 * plain_log(s) / s);
    spare_ = v * f, has_spare_ = true;
    return u * f;
  }

 private:
  // In [0, 1), 53 random bits.
  double uniform() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<double>(z >> 11) * 0x1.0p-53;
  }
  uint64_t state_;
  double spare_ = 0;
  bool has_spare_ = false;
};

}  // namespace

Tensor performer_random_features(int64_t m, int64_t d, uint64_t seed) {
  TORCH_CHECK(m > 0 && d > 0, "performer features: num_features and the key width must be positive, got ", m,
              " and ", d);
  GaussianStream gauss(seed);
  std::vector<double> w(static_cast<size_t>(m * d));
  // Block by block: d Gaussian rows, orthonormalized by modified Gram–Schmidt (two passes), the rows the
  // block needs kept.
  std::vector<double> block(static_cast<size_t>(d * d));
  for (int64_t first = 0; first < m; first += d) {
    for (auto& x : block) x = gauss.next();
    for (int64_t i = 0; i < d; ++i) {
      double* r = &block[i * d];
      for (int pass = 0; pass < 2; ++pass)
        for (int64_t j = 0; j < i; ++j) {
          const double* e = &block[j * d];
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += r[c] * e[c];
          for (int64_t c = 0; c < d; ++c) r[c] -= dot * e[c];
        }
      double n2 = 0;
      for (int64_t c = 0; c < d; ++c) n2 += r[c] * r[c];
      // A d×d Gaussian matrix is singular with probability 0; a row this close to the others' span is not
      // drawn by any seed in practice.
      TORCH_INTERNAL_ASSERT(n2 > 1e-20, "performer features: a degenerate Gaussian block (seed ", seed, ")");
      const double inv = 1 / std::sqrt(n2);
      for (int64_t c = 0; c < d; ++c) r[c] *= inv;
    }
    const int64_t rows = std::min(d, m - first);
    std::copy(block.begin(), block.begin() + rows * d, w.begin() + first * d);
  }
  // Each row to the norm of an independent Gaussian d-vector (chi with d degrees of freedom).
  for (int64_t i = 0; i < m; ++i) {
    double n2 = 0;
    for (int64_t c = 0; c < d; ++c) {
      const double g = gauss.next();
      n2 += g * g;
    }
    const double norm = std::sqrt(n2);
    for (int64_t c = 0; c < d; ++c) w[i * d + c] *= norm;
  }
  return at::tensor(w, at::TensorOptions().dtype(at::kDouble)).view({m, d});
}

uint64_t performer_layer_seed(uint64_t feature_seed, int64_t layer) {
  return feature_seed ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(layer + 1));
}

double performer_key_shift(const Tensor& omega) {
  TORCH_CHECK(omega.dim() == 2, "performer features must be [num_features, dim], got ", shape_str(omega.sizes()));
  const double top = omega.to(at::kDouble).pow(2).sum(-1).max().item<double>() / 2;
  return std::max(0.0, top - kPerformerKeyHeadroom);
}

Tensor performer_feature_map(const Tensor& x, const Tensor& omega, bool is_query, double key_shift) {
  TORCH_CHECK(omega.dim() == 2 && x.dim() >= 1 && omega.size(1) == x.size(-1), "performer feature map: features must "
              "be [num_features, ", x.size(-1), "] for inputs of width ", x.size(-1), ", got ", shape_str(omega.sizes()));
  // exp in bf16 would keep 8 bits of every feature: compute at fp32 at least, with autocast off.
  FullPrecisionScope full;
  const auto dt = at::promote_types(x.scalar_type(), at::kFloat);
  const Tensor xf = x.to(dt);
  const Tensor w = omega.to(xf.options());
  Tensor e = at::matmul(xf, w.t()) - xf.pow(2).sum(-1, /*keepdim=*/true) / 2;  // ω_jᵀx − ‖x‖²/2
  e = is_query ? e - std::get<0>(e.max(-1, /*keepdim=*/true)) : e - key_shift;
  return at::exp(e) / std::sqrt(static_cast<double>(omega.size(0)));
}

}  // namespace carry
