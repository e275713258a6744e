// CUDA device discovery for the GPU paths (compiled only with CARRY_CUDA). Callers outside the CUDA sources
// use layers/core/device.h, which also answers on builds without CUDA.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>

namespace carry::cuda {
// Number of CUDA devices this process can use; 0 when the driver or a device is missing.
int device_count();
// A one-line description of device `index` ("NVIDIA H100 80GB HBM3, sm_90, 79.1 GiB").
const char* device_name(int index);
// Device `index`'s compute capability as major·10 + minor (90 for Hopper); 0 when it cannot be read.
int compute_capability(int index);
// PyTorch's caching allocator on device `index`: the peak of allocated bytes, and its reset.
long long peak_allocated_bytes(int index);
void reset_peak_allocated(int index);
// The caching allocator's cudaMalloc calls on device `index` so far, and its retries (a malloc that
// failed, freed the cache and tried again).
void allocator_counts(int index, long long* mallocs, long long* retries);
void synchronize();
// The calling thread's current device.
void make_current(int index);
// Times `reps` calls of f on the current stream the way triton.testing.do_bench (FLA's and the anchors'
// timer) does: before each call the L2 cache is flushed (a 256 MB buffer zeroed on the stream), CUDA
// events are recorded around the call, the host does not wait between calls. Writes each call's
// milliseconds to ms[0 .. reps).
void event_times_ms(void (*call)(void*), void* ctx, int reps, double* ms);
// layers/core/side_stream.h: side stream `slot` (0 or 1) of device `device`, taken once from the pool.
// side_stream_run: the side stream waits for the current one, then call(ctx) runs with it current;
// side_stream_join: the current stream waits for the side one.
void side_stream_run(int device, int slot, void (*call)(void*), void* ctx);
void side_stream_join(int device, int slot);
// The caching allocator's recordStream of t's memory on the current stream of t's device.
void record_on_current_stream(const at::Tensor& t);
// A timing event recorded on the current stream of `device` (a cudaEvent_t, destroyed with the last
// copy of the pointer), and the milliseconds between two, waiting for the later one.
std::shared_ptr<void> record_event(int device);
double event_elapsed_ms(void* a, void* b);
}  // namespace carry::cuda
