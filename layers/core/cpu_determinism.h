// Bitwise-reproducible CPU math. The `ordered` scan promises outputs bit-identical to the serial run,
// so no CPU kernel may round differently depending on where a tensor happens to sit in memory or on
// which CPU runs it. libtorch's matrix products go to MKL, whose default code path depends on the CPU
// and, on AVX-512 machines, on the alignment of the operands. carry pins MKL's conditional numerical
// reproducibility to COMPATIBLE (one code path on every x86 CPU, independent of alignment) and ATen's
// vectorized kernels to AVX2 (unless the user set ATEN_CPU_CAPABILITY), before the first operation;
// an MKL_CBWR in the environment is replaced. Every carry program does this at start (a static
// initializer in this file); `cpu_math_mode()` reports what is in force. CARRY_CPU_MATH=native leaves
// both to MKL and ATen (the user gives up bitwise `ordered` results on CPUs where they differ).
#pragma once

#include <string>

namespace carry {
// "MKL_CBWR=COMPATIBLE, ATEN_CPU_CAPABILITY=avx2" (what the process runs with; "unset" where unset).
std::string cpu_math_mode();
// MKL's reproducibility branch in force (MKL's own code, e.g. 3 for COMPATIBLE), or -1 when MKL's
// service functions are not in this process.
int mkl_cbwr_branch();
}  // namespace carry
