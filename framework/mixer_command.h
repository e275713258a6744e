// `carry mixer`: runs one mixer family (naive or chunkwise form) on tensors read by name from a
// safetensors file and writes o and the final state, and, when output gradients are given, the
// gradient of every input and of the initial state (autograd of Σ o⊙do + Σ final_state⊙dfinal_state).
// Generic over the registry: what a family reads comes from its input_names, optional_input_names and
// state_names. `carry mixer --help` prints the flags and the tensor names.
#pragma once

namespace carry {

// argv[0] is the command's name ("mixer"), the flags follow (main passes argc-1, argv+1). Returns the
// exit code: 0 done, 1 runtime error (files, tensors), 2 usage error (flags); every message goes to
// stderr prefixed "carry mixer: ". Safe to call in-process (tests do).
int run_mixer_command(int argc, char** argv);

}  // namespace carry
