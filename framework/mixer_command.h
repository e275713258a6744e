// `carry mixer`: runs one mixer family (naive or chunkwise form) on tensors read by name from a
// safetensors file and writes o and the final state, and, when output gradients are given, the
// gradient of every input and of the initial state (autograd of Σ o⊙do + Σ final_state⊙dfinal_state).
// Generic over the registry: what a family reads comes from its input_names, optional_input_names and
// state_names. `carry mixer --help` prints the flags and the tensor names.
#pragma once

#include "layers/mixer.h"

#include <string>
#include <vector>

namespace carry {

// argv[0] is the command's name ("mixer"), the flags follow (main passes argc-1, argv+1). Returns the
// exit code: 0 done, 1 runtime error (files, tensors), 2 usage error (flags); every message goes to
// stderr prefixed "carry mixer: ". Safe to call in-process (tests do).
int run_mixer_command(int argc, char** argv);

// Names of the entries of a state of `entries` tensors in files (initial_state.<name>, ...): the
// family's state_names(); for a state with one entry per level (one name, more entries, as in
// log-linear attention) <name>.0, <name>.1, ...; otherwise 0, 1, ...
std::vector<std::string> state_entry_names(const Mixer& m, size_t entries);

}  // namespace carry
