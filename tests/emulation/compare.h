// Comparisons shared by the emulation tests: a kernel's outputs against a reference in double.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

namespace carry_emu {

// max |x − ref| / max |ref|; NaN counts as an error of infinity.
template <class T>
double rel_err(const std::vector<T>& x, const std::vector<double>& ref) {
  double e = 0, m = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double xi = (double)x[i], d = std::fabs(xi - ref[i]);
    m = std::max(m, std::fabs(ref[i]));
    e = std::isnan(d) ? INFINITY : std::max(e, d);
    if (std::isinf(e)) break;
  }
  return e / m;
}

}  // namespace carry_emu
