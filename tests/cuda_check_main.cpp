// carry_cuda_check: built on machines with nvcc but no GPU, from every CUDA source of carry (kernels,
// launchers, the NCCL backend) and carry's CPU objects, so that their compile and link errors show in CI.
// Run as a test, it reports the CUDA devices it sees (none on such a machine) and exits 0.
#include "layers/core/cuda_device.h"
#include "parallel/process_group.h"

#include <cstdio>

int main() {
  int n = carry::cuda::device_count();
  std::printf("carry_cuda_check: CUDA code compiled and linked; %d CUDA device(s) visible; NCCL backend %s\n", n,
              carry::parallel::nccl_available() ? "compiled in" : "missing");
  return carry::parallel::nccl_available() ? 0 : 1;
}
