// Host-side helpers shared by kernel_decay_fwd.cu and kernel_decay_bwd.cu (private to the kernels).
#pragma once

#include "layers/common/kernel_decay.cuh"

#include "layers/common/kernel_host.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <limits>

namespace carry_decay {

bool poison_enabled();
int forced_segments();  // decay_set_segments' value

// at::empty, filled with NaN when the debug poison is on.
inline at::Tensor alloc(at::IntArrayRef sizes, const at::TensorOptions& opt) {
  return carry_tiles::alloc_poisoned(sizes, opt, poison_enabled());
}
inline at::Tensor dense(const at::Tensor& t) { return carry_tiles::dense16(t); }

struct Dims {
  int B, T, H, DK, DV, N;
  int segments = 0;  // the state recurrence's segments: 0 = decay_set_segments' value or automatic
};
// The segments a launch uses: the call's own choice, else the forced (test) value, else automatic (0).
inline int segments_of(const Dims& d) { return d.segments > 0 ? d.segments : forced_segments(); }

inline Dims check_inputs(const char* who, Decay kind, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& g) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 4, who, ": q must be a CUDA tensor [B,T,H,dk], got ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes(), who, ": k must have q's shape ", q.sizes(), ", got ", k.sizes());
  Dims d{(int)q.size(0), (int)q.size(1), (int)q.size(2), (int)q.size(3), 0, 0};
  TORCH_CHECK(v.dim() == 4 && v.size(0) == d.B && v.size(1) == d.T && v.size(2) == d.H, who,
              ": v must be [", d.B, ",", d.T, ",", d.H, ",dv], got ", v.sizes());
  d.DV = (int)v.size(3);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), who,
              ": q, k, v must share one dtype");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, who,
              ": q, k, v must be bf16 or fp32, got ", q.scalar_type());
  TORCH_CHECK(d.DK == 64 || d.DK == 96 || d.DK == 128, who, ": dk must be 64, 96 or 128, got ", d.DK);
  TORCH_CHECK(d.DV % 64 == 0 && d.DV >= 64 && d.DV <= 256, who, ": dv must be 64, 128, 192 or 256, got ", d.DV);
  TORCH_CHECK(d.T % 64 == 0 && d.T > 0, who, ": T must be a positive multiple of 64, got ", d.T);
  if (kind == Decay::none) {
    TORCH_CHECK(!g.defined(), who, ": linear attention takes no gate");
  } else {
    TORCH_CHECK(g.defined() && g.scalar_type() == at::kFloat && g.is_cuda(), who, ": the gate must be fp32 on CUDA");
    if (kind == Decay::scalar) {
      TORCH_CHECK(g.sizes() == at::IntArrayRef({d.B, d.T, d.H}), who, ": g must be [B,T,H], got ", g.sizes());
    } else {
      TORCH_CHECK(g.sizes() == q.sizes(), who, ": gk must be [B,T,H,dk], got ", g.sizes());
    }
  }
  d.N = d.T / 64;
  return d;
}

}  // namespace carry_decay
