// Launchers of linear attention's fused kernels (kernel_fused.cuh).
#include "layers/linear_attn/kernel_fused.h"
#include "layers/linear_attn/kernel_fused_launch.h"

#include "layers/linear_attn/kernel_fused.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

namespace carry_la {
namespace {

std::atomic<int> g_mode{-1}, g_segments{0};  // linear_attn_fused_set

int sm_count() {
  int dev = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

// Shared memory of each kernel (bytes): the launches below and their attributes.
constexpr int kSumSmem = 49152, kFusedSmem = 2 * 40960 + 16384, kSumFullSmem = 65536, kDqSmem = 2 * 49152 + 32768,
              kDkdvSmem = 2 * 65536 + 32768;

void set_attributes() {
  static const bool done = [] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(seg_sum, cudaFuncAttributeMaxDynamicSharedMemorySize, kSumSmem));
    C10_CUDA_CHECK(cudaFuncSetAttribute(fused, cudaFuncAttributeMaxDynamicSharedMemorySize, kFusedSmem));
    C10_CUDA_CHECK(cudaFuncSetAttribute(seg_sum_full, cudaFuncAttributeMaxDynamicSharedMemorySize, kSumFullSmem));
    C10_CUDA_CHECK(cudaFuncSetAttribute(bwd_dq, cudaFuncAttributeMaxDynamicSharedMemorySize, kDqSmem));
    C10_CUDA_CHECK(cudaFuncSetAttribute(bwd_dkdv, cudaFuncAttributeMaxDynamicSharedMemorySize, kDkdvSmem));
    return true;
  }();
  (void)done;
}

bf16* P(const at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); }
float* F(const at::Tensor& t) { return t.data_ptr<float>(); }

}  // namespace

bool fused_enabled() {
  static const bool env = [] {
    const char* e = std::getenv("CARRY_LA_FUSED");
    return !(e && e[0] == '0');
  }();
  const int m = g_mode.load();
  return m < 0 ? env : m == 1;
}
int fused_forced_segments() { return g_segments.load(); }

std::vector<at::Tensor> launch_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& s0,
                                   float scale, int ns) {
  set_attributes();
  const int B = (int)q.size(0), T = (int)q.size(1), H = (int)q.size(2), BH = B * H;
  TORCH_CHECK((T / 64) % ns == 0, "linear_attn (fused kernels): ", ns, " segments do not divide ", T / 64, " chunks");
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor o = at::empty_like(v), Sfin = at::empty({B, H, 128, 128}, f32), Sin = at::empty({ns, B, H, 128, 128}, f32);
  auto st = at::cuda::getCurrentCUDAStream();
  seg_sum<<<dim3(2, ns, BH), 128, kSumSmem, st>>>(P(k), P(v), F(Sin), T, B, H, 128, ns);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const long states = (long)BH * 128 * 128;
  seg_scan<<<(unsigned)((states + 255) / 256), 256, 0, st>>>(F(Sin), F(s0), F(Sfin), BH, 128, ns);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  fused<<<dim3(2, ns, BH), 128, kFusedSmem, st>>>(P(q), P(k), P(v), F(Sin), P(o), scale, T, B, H, 128, ns);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {o, Sfin, Sin};
}

std::vector<at::Tensor> launch_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& Sin,
                                   const at::Tensor& d_o, const at::Tensor& dSfin, float scale) {
  set_attributes();
  const int B = (int)q.size(0), T = (int)q.size(1), H = (int)q.size(2), BH = B * H, ns = (int)Sin.size(0);
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  at::Tensor dS0 = at::empty({B, H, 128, 128}, dSfin.options()), Dout = at::empty_like(Sin);
  auto st = at::cuda::getCurrentCUDAStream();
  seg_sum_full<<<dim3(ns, BH), 256, kSumFullSmem, st>>>(P(q), P(d_o), F(Dout), T, B, H, ns);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const long states = (long)BH * 128 * 128;
  seg_scan_rev<<<(unsigned)((states + 255) / 256), 256, 0, st>>>(F(Dout), F(dSfin), F(dS0), scale, BH, ns);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  bwd_dq<<<dim3(ns, BH), 256, kDqSmem, st>>>(P(k), P(v), P(d_o), F(Sin), P(dq), scale, T, B, H, ns);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  bwd_dkdv<<<dim3(ns, BH), 256, kDkdvSmem, st>>>(P(q), P(k), P(v), P(d_o), F(Dout), P(dk), P(dv), scale, T, B, H, ns);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dq, dk, dv, dS0};
}

}  // namespace carry_la

namespace carry {

void linear_attn_fused_set(int mode, int segments) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "linear_attn_fused_set: expected -1, 0 or 1, got ", mode);
  TORCH_CHECK(segments >= 0, "linear_attn_fused_set: expected segments >= 0, got ", segments);
  carry_la::g_mode.store(mode);
  carry_la::g_segments.store(segments);
}

int linear_attn_fused_segments(int64_t B, int64_t H, int64_t N) {
  const int64_t per_sm = std::max<int64_t>(1, carry_la::sm_count() / std::max<int64_t>(1, B * H));
  int ns = 1;
  while (ns * 2 <= per_sm && ns * 2 <= 32) ns *= 2;
  while (ns > 1 && N % ns) ns /= 2;
  return ns;
}

}  // namespace carry
