// Small command-line helpers shared by the commands: comma lists and positive integers, with the
// flag named in the error.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace carry {
// "a,b,c" -> {"a", "b", "c"}.
std::vector<std::string> split_list(const std::string& s);
// A positive integer, or std::invalid_argument naming the flag and the value found.
int64_t parse_positive_int(const std::string& flag, const std::string& v);
}  // namespace carry
