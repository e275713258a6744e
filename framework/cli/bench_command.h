// `carry bench kernels`: the kernel forms timed on the GPU. For each shape (B = 1; H, dk, dv; T) and
// family: forward ms, forward+backward ms (median of --reps after warm-ups), tokens/s of the
// forward+backward, and the achieved GB/s and TFLOP/s against the floors counted in bench_command.cpp.
#pragma once

namespace carry {
int run_bench_command(int argc, char** argv);  // argv[0] is "bench"
}  // namespace carry
