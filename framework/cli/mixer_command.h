// `carry mixer`: runs one mixer family (naive or chunkwise form) on tensors read by name from a
// safetensors file and writes o and the final state, and, when output gradients are given, the
// gradient of every input and of the initial state (autograd of Σ o⊙do + Σ final_state⊙dfinal_state).
// Generic over the registry: what a family reads comes from its input_names, optional_input_names and
// state_names. With --sp-mode ordered|tree|allgather, run under mpirun, the chunkwise form runs
// sequence-parallel over the MPI ranks (one slice of T each) and rank 0 writes the same tensors as a
// serial run. `carry mixer --help` prints the flags and the tensor names.
#pragma once

#include "layers/mixer.h"

#include <string>
#include <vector>

namespace carry {

struct MixerCommandOptions {
  // After a --sp-mode run (which initializes MPI if nobody has), call parallel::finalize_mpi(): the
  // `carry` binary ends MPI with the command. Tests that run several commands in one MPI job (their
  // main initializes and finalizes MPI) pass false.
  bool finalize_mpi = true;
  // When set, receives the error line as printed ("carry mixer: ..."), or "" on success. Under
  // --sp-mode every rank receives it (the same line), though only rank 0 prints it.
  std::string* error = nullptr;
};

// argv[0] is the command's name ("mixer"), the flags follow (main passes argc-1, argv+1). Returns the
// exit code: 0 done, 1 runtime error (files, tensors), 2 usage or layout error (flags, T not a
// multiple of P·chunk_size under --sp-mode); every message goes to stderr prefixed "carry mixer: ".
// Without --sp-mode MPI is never touched and the call is safe in-process (tests do). With --sp-mode
// the call is collective over MPI_COMM_WORLD (every rank calls it with the same flags); every rank
// returns the same exit code, only rank 0 prints and writes.
int run_mixer_command(int argc, char** argv, const MixerCommandOptions& options = {});

// Names of the entries of a state of `entries` tensors in files (initial_state.<name>, ...): the
// family's state_names(); for a state with one entry per level (one name, more entries, as in
// log-linear attention) <name>.0, <name>.1, ...; otherwise 0, 1, ...
std::vector<std::string> state_entry_names(const Mixer& m, size_t entries);

}  // namespace carry
