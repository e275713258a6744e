// safetensors files (the published format): an 8-byte little-endian u64 N, N bytes of UTF-8 JSON
// {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ..., "__metadata__": {str: str}} padded
// with spaces, then the byte buffer (offsets relative to its start; tensors little-endian, C order).
// The reader validates everything and names the file, the tensor and what was expected vs found; the
// writer produces the same bytes as the reference writer (tensors ordered by descending dtype, then
// name; compact JSON; header padded to a multiple of 8 with spaces) and replaces the file atomically.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>

namespace carry {

// Dtypes: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL. Tensors come back on the CPU.
std::map<std::string, at::Tensor> load_safetensors(
    const std::string& path, std::map<std::string, std::string>* metadata = nullptr);

// Writes `path` through a temporary file in the same directory, renamed when complete. Tensors may be
// on any device and non-contiguous; `__metadata__` is written only when `metadata` is not empty.
void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace carry
