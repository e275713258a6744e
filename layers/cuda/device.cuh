// CUDA device discovery for the GPU paths (compiled only with CARRY_CUDA). Callers outside layers/cuda
// use layers/device.h, which also answers on builds without CUDA.
#pragma once

namespace carry::cuda {
// Number of CUDA devices this process can use; 0 when the driver or a device is missing.
int device_count();
// A one-line description of device `index` ("NVIDIA H100 80GB HBM3, sm_90, 79.1 GiB").
const char* device_name(int index);
}  // namespace carry::cuda
