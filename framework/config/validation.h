// Validating configs, internal to framework/config: the semantic checks of a run, model and cluster
// config, each error a field path and what is wrong with it (config.cpp adds where the field was
// written). The public entry points (run_config_errors, validate_layout, ...) are declared in config.h.
#pragma once

#include "framework/config/config.h"

#include <sstream>
#include <string>
#include <vector>

namespace carry::config_internal {

struct FieldError {
  std::string path;
  std::string message;
};

class Errors {
 public:
  template <class... Args>
  void add(const std::string& path, const Args&... args) {
    std::ostringstream os;
    (os << ... << args);
    list.push_back({path, os.str()});
  }
  std::vector<FieldError> list;
};

// Each appends a config's errors to `e`, in a fixed order. `p` prefixes the model's field paths
// ("model." within a run, "" for a preset file on its own).
void check_model(const ModelConfig& m, const std::string& p, Errors& e);
void check_run(const RunConfig& c, Errors& e);
void check_cluster(const ClusterConfig& c, Errors& e);

}  // namespace carry::config_internal
