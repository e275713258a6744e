// What fwd.cu and bwd.cu share (private to the folder): the block schedule (which key
// blocks a query block meets and in which order, and the reverse), the window mask, the launchers'
// input checks and the debug poison.
//
// The schedule is the one decision that makes the kernels cut-invariant: blocks are 64 rows from the
// tensors' start, and every bound below is the block index plus an offset that depends only on the
// window (clamped to the tensor's ends). A run on a suffix of the sequence whose first 64-row block is
// a halo of ≥ w − 1 keys therefore meets, for each of its own rows, the same blocks in the same order.
#pragma once

#include "layers/kernels/primitives/host.h"
#include "layers/kernels/primitives/tiles.cuh"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

namespace carry::kernels::softmax_attn {

constexpr int kBlock = carry::kernels::primitives::kChunk;  // rows of a query block and of a key block
static_assert(kBlock == 64, "the kernels tile 64 rows a block");
// Scores are kept in base-2 units, scale·log2(e)·q·k, so that every exponential is one exp2f.
constexpr double kLog2e = 1.4426950408889634;

// ---- the block schedule -------------------------------------------------------------------------
// Query t sees key s iff 0 ≤ t − s < window (window 0: every s ≤ t). Query block i meets key blocks
// i, i−1, ..., first_key_block(i) (the diagonal block first: every query sees itself, so the running
// max is finite from the first block on); key block j meets query blocks j, j+1, ..., last_query_block(j).

// The earliest key block that query block i reaches: the block of key i·64 − w + 1, the first key its
// first query sees.
__host__ __device__ __forceinline__ int first_key_block(int i, int window) {
  if (window == 0) return 0;
  const int s = i * kBlock - window + 1;
  return s > 0 ? s / kBlock : 0;
}
// The last query block (of n) that reaches key block j: the block of query j·64 + 63 + w − 1, the last
// query that sees its last key.
__host__ __device__ __forceinline__ int last_query_block(int j, int window, int n) {
  if (window == 0) return n - 1;
  const int t = j * kBlock + kBlock - 1 + window - 1;
  return t / kBlock < n - 1 ? t / kBlock : n - 1;
}
// Whether some (query, key) pair of query block i and key block j ≤ i is hidden: the diagonal block
// (keys after the query) and the blocks the window's far edge crosses. Others need no mask.
__device__ __forceinline__ bool block_masked(int i, int j, int window) {
  return i == j || (window > 0 && (i - j) * kBlock + kBlock - 1 >= window);
}
// Whether a query sees a key `dist` = t − s positions before it.
__device__ __forceinline__ bool visible(int dist, int window) {
  return dist >= 0 && (window == 0 || dist < window);
}

// ---- host side ----------------------------------------------------------------------------------
bool poison_enabled();

// at::empty, filled with NaN when the debug poison is on.
inline at::Tensor alloc(at::IntArrayRef sizes, const at::TensorOptions& opt) {
  return carry::kernels::primitives::alloc_poisoned(sizes, opt, poison_enabled());
}

constexpr size_t al128(size_t x) { return (x + 127) & ~size_t(127); }


struct Dims {
  int B, T, H, DK, DV, N;
  int window;  // clamped to T: a window of T or more hides nothing that causality does not (same as 0)
};

inline Dims check_inputs(const char* who, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         int64_t window) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 4, who, ": q must be a CUDA tensor [B,T,H,dk], got ", q.sizes(), " on ",
              q.device());
  TORCH_CHECK(k.sizes() == q.sizes() && k.device() == q.device(), who, ": k must have q's shape ", q.sizes(),
              " and device, got ", k.sizes(), " on ", k.device());
  TORCH_CHECK(v.dim() == 4 && v.size(0) == q.size(0) && v.size(1) == q.size(1) && v.size(2) == q.size(2) &&
                  v.device() == q.device(),
              who, ": v must be [", q.size(0), ",", q.size(1), ",", q.size(2), ",dv] on q's device, got ", v.sizes(),
              " on ", v.device());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), who,
              ": q, k, v must share one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, who,
              ": q, k, v must be bf16 or fp32, got ", q.scalar_type());
  TORCH_CHECK(q.size(3) == v.size(3) && (q.size(3) == 64 || q.size(3) == 128), who,
              ": dk and dv must be equal and 64 or 128, got dk=", q.size(3), " dv=", v.size(3));
  TORCH_CHECK(q.size(1) > 0 && q.size(1) % kBlock == 0, who, ": T must be a positive multiple of 64, got ",
              q.size(1));
  TORCH_CHECK(q.size(0) > 0 && q.size(2) > 0, who, ": B and H must be positive, got B=", q.size(0), " H=",
              q.size(2));
  TORCH_CHECK(window >= 0, who, ": window must be >= 0 (0 = full causal), got ", window);
  Dims d{(int)q.size(0), (int)q.size(1), (int)q.size(2), (int)q.size(3), (int)v.size(3), 0, 0};
  d.N = d.T / kBlock;
  d.window = (int)std::min<int64_t>(window, d.T);
  return d;
}

}  // namespace carry::kernels::softmax_attn
