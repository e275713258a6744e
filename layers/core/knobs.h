// Every environment variable carry reads, in one registry: its name, default, audience and a one-line
// doc. `carry env` prints it (docs/environment.md mirrors it), a training run lists the ones set in its
// first log lines and its checkpoints' manifests, and tests/repo/knobs_test.py fails when the sources
// read a variable that is not here (or this lists one nothing reads). The normal way to change what a
// run computes is its config; these change how it runs or what it prints.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace carry {

enum class KnobAudience {
  user,         // settings of normal runs
  diagnostics,  // extra output: timings, traces, checks
  launcher,     // read by the launcher scripts, not by the carry program
  mpi,          // set by mpirun or the system, read by carry
};

struct Knob {
  const char* name;
  const char* default_value;  // what applies when the variable is unset
  KnobAudience audience;
  const char* doc;            // one line
};

// The registry, grouped by audience, in the order `carry env` prints it.
const std::vector<Knob>& knobs();
// The knob of that name, or nullptr.
const Knob* find_knob(const std::string& name);
// The one way carry reads its environment: the variable's value, or nullptr when it is unset. `name`
// must be in the registry (an internal error otherwise), so every variable read is one `carry env` lists.
const char* knob_value(const char* name);
const char* knob_audience_name(KnobAudience a);
// The registered variables of the carry program (not the launcher's or MPI's) set in this process's
// environment, as (name, value), in registry order: what a run records.
std::vector<std::pair<std::string, std::string>> knobs_set();
// knobs_set() as one line, "NAME=value NAME=value" ("" when none is set).
std::string knobs_set_text();

}  // namespace carry
