// Pins MKL's reproducibility mode and ATen's CPU capability before any operation (see the header).
#include "layers/core/cpu_determinism.h"
#include "layers/core/knobs.h"

#include <dlfcn.h>

#include <cstdlib>
#include <string>

namespace carry {
namespace {
// MKL reads MKL_CBWR at its first call and ATen reads ATEN_CPU_CAPABILITY at its first dispatch; both
// come after static initialization, so setting them here takes effect. MKL_CBWR is always replaced
// (bitwise results are carry's promise, whatever the environment says); an ATEN_CPU_CAPABILITY the
// user set wins (it changes results across machines, not within one).
struct PinCpuMath {
  PinCpuMath() {
    const char* choice = knob_value("CARRY_CPU_MATH");
    if (choice && std::string(choice) == "native") return;  // the user gives up bitwise results
    setenv("MKL_CBWR", "COMPATIBLE", /*overwrite=*/1);
    setenv("ATEN_CPU_CAPABILITY", "avx2", /*overwrite=*/0);
  }
} pin_cpu_math;

const char* env_or_unset(const char* name) {
  const char* v = knob_value(name);
  return v ? v : "unset";
}
}  // namespace

std::string cpu_math_mode() {
  return std::string("MKL_CBWR=") + env_or_unset("MKL_CBWR") +
         ", ATEN_CPU_CAPABILITY=" + env_or_unset("ATEN_CPU_CAPABILITY");
}

int mkl_cbwr_branch() {
  // libtorch links MKL statically and exports its service layer; MKL_CBWR_BRANCH selects the branch.
  using Get = int (*)(int);
  auto get = reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, "mkl_serv_cbwr_get"));
  return get ? get(/*MKL_CBWR_BRANCH=*/1) : -1;
}
}  // namespace carry
