// `carry eval MODEL ...`: loss, perplexity, bits per token and per byte, accuracy and the loss curve
// over positions of a trained model on token files or on its run's MQAR / needle task, on dp × sp
// ranks as in training (mpirun -np dp·sp; framework/eval/evaluator.h). `carry eval --help` lists the
// flags.
#pragma once

namespace carry {

// argv[0] is "eval". finalize_mpi = false leaves MPI running (tests call it more than once).
int run_eval_command(int argc, char** argv, bool finalize_mpi = true);

}  // namespace carry
