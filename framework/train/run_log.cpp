// The run's metrics (see run_log.h): JSON lines appended one at a time, the resume clean-up, and the
// TensorBoard mirror.
#include "framework/train/run_log.h"

#include "framework/io/json.h"
#include "framework/io/output_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>

namespace carry {

namespace {

void make_parent_dirs(const std::string& path) {
  for (size_t i = 1; i < path.size(); ++i)
    if (path[i] == '/') ::mkdir(path.substr(0, i).c_str(), 0755);
}

std::string directory_of(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

const RunLogField* find(const RunLogRecord& r, const std::string& key) {
  for (auto& f : r)
    if (f.key == key) return &f;
  return nullptr;
}

constexpr const char* kEventPrefix = "events.out.tfevents.";
constexpr const char* kEventSuffix = ".carry";

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

bool parse_run_log_line(const std::string& line, RunLogRecord* out) {
  out->clear();
  size_t i = 0;
  auto skip = [&] {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r')) ++i;
  };
  auto string_at = [&](std::string* s) { return json_parse_string(line, &i, s); };
  skip();
  if (i >= line.size() || line[i] != '{') return false;
  ++i;
  skip();
  if (i < line.size() && line[i] == '}') return i + 1 == line.size() || line.find_first_not_of(" \t\r", i + 1) == std::string::npos;
  while (true) {
    skip();
    RunLogField f;
    if (!string_at(&f.key)) return false;
    skip();
    if (i >= line.size() || line[i] != ':') return false;
    ++i;
    skip();
    if (i < line.size() && line[i] == '"') {
      if (!string_at(&f.text)) return false;
      f.is_text = true;
    } else if (line.compare(i, 4, "null") == 0) {
      f.number = std::nan("");
      i += 4;
    } else {
      const char* begin = line.c_str() + i;
      char* end = nullptr;
      f.number = std::strtod(begin, &end);
      if (end == begin) return false;
      i += static_cast<size_t>(end - begin);
    }
    out->push_back(std::move(f));
    skip();
    if (i < line.size() && line[i] == ',') {
      ++i;
      continue;
    }
    if (i < line.size() && line[i] == '}') {
      ++i;
      skip();
      return i == line.size();
    }
    return false;
  }
}

RunLog::RunLog(std::string metrics_file, bool tensorboard, bool active)
    : path_(std::move(metrics_file)), tensorboard_(tensorboard), active_(active && !path_.empty()) {}

RunLog::~RunLog() = default;

RunLog::Start RunLog::start(int64_t step, bool resumed, double wall_time) {
  Start result;
  if (!active_) return result;
  make_parent_dirs(path_);
  // 1. The records up to `step`; everything after it (and any broken line) goes; a new run (not
  //    resumed) starts the file afresh.
  std::vector<std::string> kept_lines;
  std::vector<RunLogRecord> kept;
  bool rewrite = false;
  // Only a regular file holds earlier records: a device (/dev/null, /dev/full) or a pipe is written to,
  // never read back (/dev/full reads as endless zeros).
  struct stat st {};
  const bool regular = ::stat(path_.c_str(), &st) == 0 && S_ISREG(st.st_mode);
  if (regular) {
    std::ifstream in(path_);
    std::string line;
    while (std::getline(in, line)) {
      RunLogRecord r;
      const RunLogField* s = nullptr;
      if (!resumed || !parse_run_log_line(line, &r) || !(s = find(r, "step")) || s->is_text || !(s->number <= step)) {
        ++result.dropped;
        rewrite = true;
        continue;
      }
      if (auto* e = find(r, "elapsed_s"); e && !e->is_text && std::isfinite(e->number)) result.elapsed_s = e->number;
      kept_lines.push_back(line);
      kept.push_back(std::move(r));
    }
  }
  if (rewrite) {
    const std::string temp = path_ + ".tmp." + std::to_string(::getpid());
    {
      std::string text;
      for (auto& l : kept_lines) text += l + '\n';
      const int fd = open_for_writing(temp, O_WRONLY | O_CREAT | O_TRUNC, "logging.metrics_file");
      std::FILE* out = ::fdopen(fd, "w");
      const bool ok = out && std::fwrite(text.data(), 1, text.size(), out) == text.size();
      if (!out) ::close(fd);
      if (!(out && std::fclose(out) == 0 && ok))
        throw std::runtime_error("logging.metrics_file: cannot write '" + temp + "'");
    }
    if (std::rename(temp.c_str(), path_.c_str()) != 0)
      throw std::runtime_error("logging.metrics_file: cannot replace '" + path_ + "': " + std::strerror(errno));
  }
  // 2. TensorBoard: this run's earlier event files go; a new one replays the kept records.
  if (tensorboard_) {
    const std::string dir = directory_of(path_);
    if (DIR* d = ::opendir(dir.c_str())) {
      while (auto* e = ::readdir(d)) {
        std::string name = e->d_name;
        if (name.rfind(kEventPrefix, 0) == 0 && ends_with(name, kEventSuffix)) ::unlink((dir + "/" + name).c_str());
      }
      ::closedir(d);
    }
    char host[256] = "host";
    ::gethostname(host, sizeof host - 1);
    host[sizeof host - 1] = 0;
    char stamp[32];
    std::snprintf(stamp, sizeof stamp, "%lld", static_cast<long long>(wall_time));
    result.tensorboard_file = dir + "/" + kEventPrefix + stamp + "." + host + kEventSuffix;
    events_ = std::make_unique<EventFileWriter>(result.tensorboard_file, wall_time);
    for (auto& r : kept) {
      auto* t = find(r, "time");
      to_tensorboard(static_cast<int64_t>(find(r, "step")->number), t && !t->is_text ? t->number : wall_time, r);
    }
  }
  // 3. The marker.
  JsonWriter m;
  m.begin_object().member("event", resumed ? "resume" : "start").member("step", step);
  m.key("time").fixed_value(wall_time, 3);  // unix time to the millisecond
  if (result.dropped > 0) m.member("dropped_records", result.dropped);
  m.end_object();
  append_line(m.str());
  return result;
}

void RunLog::record(int64_t step, double wall_time, const std::vector<std::pair<std::string, double>>& fields) {
  if (!active_) return;
  JsonWriter js;
  js.begin_object().member("step", step);
  js.key("time").fixed_value(wall_time, 3);
  RunLogRecord r;
  for (auto& [key, value] : fields) {
    js.member(key, value);  // the shortest decimal that reads back as the value; null when not finite
    RunLogField f;
    f.key = key;
    f.number = value;
    r.push_back(f);
  }
  js.end_object();
  append_line(js.str());
  to_tensorboard(step, wall_time, r);
}

void RunLog::append_line(const std::string& line) {
  // Checked: a full disk or a failed write stops the run with the reason (framework/io/output_file.h).
  append_to_file(path_, line + "\n", "logging.metrics_file");
}

void RunLog::to_tensorboard(int64_t step, double wall_time, const RunLogRecord& fields) {
  if (!events_) return;
  std::vector<std::pair<std::string, double>> scalars;
  for (auto& f : fields) {
    if (f.is_text || f.key == "step" || f.key == "time" || f.key == "elapsed_s" || f.key == "event") continue;
    if (!std::isfinite(f.number)) continue;
    scalars.emplace_back(f.key.rfind("eval_", 0) == 0 ? "eval/" + f.key.substr(5) : "train/" + f.key, f.number);
  }
  if (find(fields, "event")) return;  // markers are not scalars
  if (!scalars.empty()) events_->add_scalars(step, wall_time, scalars);
}

}  // namespace carry
