// CUDA device discovery for the GPU paths (compiled only with CARRY_CUDA). Callers outside layers/cuda
// use layers/common/device.h, which also answers on builds without CUDA.
#pragma once

namespace carry::cuda {
// Number of CUDA devices this process can use; 0 when the driver or a device is missing.
int device_count();
// A one-line description of device `index` ("NVIDIA H100 80GB HBM3, sm_90, 79.1 GiB").
const char* device_name(int index);
// PyTorch's caching allocator on device `index`: the peak of allocated bytes, and its reset.
long long peak_allocated_bytes(int index);
void reset_peak_allocated(int index);
// The caching allocator's cudaMalloc calls on device `index` so far, and its retries (a malloc that
// failed, freed the cache and tried again).
void allocator_counts(int index, long long* mallocs, long long* retries);
void synchronize();
}  // namespace carry::cuda
