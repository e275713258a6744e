#include "framework/cli/args.h"

#include <sstream>
#include <stdexcept>

namespace carry {

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) out.push_back(x);
  return out;
}

int64_t parse_positive_int(const std::string& flag, const std::string& v) {
  try {
    size_t used = 0;
    int64_t x = std::stoll(v, &used);
    if (used == v.size() && x > 0) return x;
  } catch (...) {
  }
  throw std::invalid_argument(flag + " expects a positive integer, got '" + v + "'");
}

}  // namespace carry
