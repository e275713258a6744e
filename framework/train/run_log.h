// What rank 0 keeps of a run for watching it: logging.metrics_file (JSON lines) and, beside it,
// TensorBoard event files (framework/io/tfevents.h).
//
// JSONL: one object a line. A step record {"step":S,"time":unix seconds,"elapsed_s":...,"loss":...};
// an eval record {"step":S,"time":...,"eval_loss":...}; a marker {"event":"start"|"resume","step":S,
// "time":...} at the start of every invocation. Written by framework/io/json.h: numbers read back as
// the same doubles, non-finite ones are written as null, strings are escaped as RFC 8259 says.
//
// A resumed run continues from its newest checkpoint, which may be older than the last records
// written (the previous invocation went on after it and then died): start(S) first drops every record
// past step S and any line that is not a complete record (a write cut short), rewriting the file
// atomically, so the file never holds a step twice. TensorBoard: start() deletes this run's earlier
// event files (those this class names "events.out.tfevents.*.carry" in that directory) and writes a
// new one that replays the kept records, then appends as the JSONL grows: the two always agree.
#pragma once

#include "framework/io/tfevents.h"

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace carry {

// One JSON line's fields, in order: a number (NaN/inf written as null) or a string.
struct RunLogField {
  std::string key;
  double number = 0;
  std::string text;
  bool is_text = false;
};
using RunLogRecord = std::vector<RunLogField>;

// Parses one line written by RunLog (a flat JSON object of numbers, null and strings, their escapes
// decoded). Returns false on anything else.
bool parse_run_log_line(const std::string& line, RunLogRecord* out);

class RunLog {
 public:
  // `metrics_file` empty: nothing is written. `active` false (ranks other than 0): nothing is written.
  RunLog(std::string metrics_file, bool tensorboard, bool active);
  ~RunLog();

  struct Start {
    int64_t dropped = 0;     // records dropped past the start step
    double elapsed_s = 0;    // the run's elapsed_s in the last kept step record (0 for a new run)
    std::string tensorboard_file;
  };
  // Begins an invocation at `step` (0: a new run; the step of the checkpoint it resumed from).
  Start start(int64_t step, bool resumed, double wall_time);
  // Appends {"step":step,"time":wall_time, fields...}; TensorBoard gets each numeric field as a scalar
  // "train/<key>" ("eval/<rest>" for keys "eval_<rest>"), except elapsed_s.
  void record(int64_t step, double wall_time, const std::vector<std::pair<std::string, double>>& fields);

  const std::string& metrics_file() const { return path_; }

 private:
  void append_line(const std::string& line);
  void to_tensorboard(int64_t step, double wall_time, const RunLogRecord& fields);
  std::string path_;
  bool tensorboard_, active_;
  std::unique_ptr<EventFileWriter> events_;
};

}  // namespace carry
