// CUDA stream memory operations (cuStreamWaitValue32 / cuStreamWriteValue32), taken from the driver
// through the runtime so that nothing links against libcuda: a stream waits for a 32-bit flag without
// holding an SM, and writes one after the work before it. For the copy-engine paths between two GPUs of
// one host (parallel/peer_sum.h, the NCCL backend's neighbour links). Include only where CUDA's
// headers are (cudaTypedefs.h).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <string>

namespace carry::parallel {

struct StreamOps {
  PFN_cuStreamWaitValue32_v11070 wait = nullptr;
  PFN_cuStreamWriteValue32_v11070 write = nullptr;
};

// Fills `ops`; "" or why the driver gives none.
inline std::string load_stream_ops(StreamOps& ops) {
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", reinterpret_cast<void**>(&ops.wait), 12000,
                                       cudaEnableDefault, &q) != cudaSuccess || q != cudaDriverEntryPointSuccess ||
      cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", reinterpret_cast<void**>(&ops.write), 12000,
                                       cudaEnableDefault, &q) != cudaSuccess || q != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return "the driver gives no cuStreamWaitValue32 / cuStreamWriteValue32";
  }
  return "";
}

}  // namespace carry::parallel
