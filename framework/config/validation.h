// Validating configs, internal to framework/config: the semantic checks of a run, model and cluster
// config, each error a field path and what is wrong with it (config.cpp adds where the field was
// written). The public entry points (run_config_errors, validate_layout, ...) are declared in config.h.
#pragma once

#include "framework/config/config.h"
#include "framework/printable.h"

#include <sstream>
#include <string>
#include <vector>

namespace carry::config_internal {

struct FieldError {
  std::string path;
  std::string message;
};

// The errors of one config: the first kMaxListed are kept, the rest only counted (`more`), so that a
// file of many bad entries gives a message of bounded size, found in time linear in the file (each
// listed error is located in the text on its own).
class Errors {
 public:
  static constexpr size_t kMaxListed = 20;
  template <class... Args>
  void add(const std::string& path, const Args&... args) {
    if (list.size() >= kMaxListed) {
      ++more;
      return;
    }
    std::ostringstream os;
    (os << ... << args);
    list.push_back({path, printable(os.str())});  // values echoed from a file: no raw control bytes
  }
  std::vector<FieldError> list;
  size_t more = 0;
};

// The line that ends a list of errors when `more` were not listed ("" when none).
std::string more_errors_line(size_t more);

// Each appends a config's errors to `e`, in a fixed order. `p` prefixes the model's field paths
// ("model." within a run, "" for a preset file on its own).
void check_model(const ModelConfig& m, const std::string& p, Errors& e);
void check_run(const RunConfig& c, Errors& e);
void check_cluster(const ClusterConfig& c, Errors& e);

}  // namespace carry::config_internal
