// The message of an exception as a command prints it: a c10::Error (TORCH_CHECK) without the C++
// backtrace that its what() carries ("Exception raised from ... frame #0 ..."), anything else as
// what(), trailing white space dropped.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace carry {

inline std::string error_text(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::string text = c10_error ? c10_error->what_without_backtrace() : e.what();
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return text;
}

}  // namespace carry
