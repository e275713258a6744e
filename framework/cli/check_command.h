// `carry check`: the mixer library's self-check on an embedded default. For every registered family:
// chunkwise vs naive in fp64 (outputs, final state, gradients of every input and the initial state),
// a sequence cut into pieces with the state passed along vs the whole, the composed state summary vs
// the final state, and the chunkwise form's forward+backward throughput in fp32. Prints one row per
// family as it finishes; exits 1 if any error is above its bound.
#pragma once

namespace carry {
int run_check_command(int argc, char** argv);  // argv[0] is "check"
}  // namespace carry
