// `--set field.path=value` assignments, internal to framework/config: field paths such as
// "model.mixer_options[1].window" and the path an assignment sets. apply_override itself is declared
// in config.h.
#pragma once

#include <string>
#include <vector>

namespace carry::config_internal {

// One name of a field path, with the [i] that follows it if any.
struct Segment {
  std::string name;
  int index = -1;          // -1: no [i]; an index past INT_MAX is held as INT_MAX (out of any list's range)
  std::string index_text;  // the index as written ("" without [i])
};

// The names of a path joined by dots, each with an optional [i]. Throws ConfigError when `path` is not
// of that form.
std::vector<Segment> parse_path(const std::string& path);

// The field path of an assignment "path=value", trimmed (the whole text when there is no '=').
std::string override_path(const std::string& assignment);

}  // namespace carry::config_internal
