// Launchers of the fused kernels without per-chunk states (fused.cuh): linear attention, and the
// scalar decay with the decay (G = true).
#include "layers/kernels/decay/fused_op.h"
#include "layers/kernels/decay/fused_launch.h"

#include "layers/kernels/primitives/host.h"
#include "layers/kernels/decay/fused.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

namespace carry::kernels::decay::fused {
namespace {

std::atomic<int> g_mode{-1}, g_segments{0};  // linear_attn_fused_set
std::atomic<int> g_decay_mode{-1};            // scalar_decay_fused_set

// Shared memory of each kernel (bytes), without (0) and with (1) the decay: the launches below and their
// attributes.
constexpr int kSumSmem[2] = {49152, 49152 + kGateBytes}, kFusedSmem[2] = {2 * 40960 + 16384, 2 * 40960 + 16384 + kGateBytes},
              kSumFullSmem[2] = {65536, 65536 + kGateBytes}, kDqSmem[2] = {2 * 49152 + 32768, 2 * 65536 + 32768 + kGateBytes},
              kDkdvSmem[2] = {2 * 65536 + 32768, 2 * 65536 + 32768 + kGateBytes};

// Each kernel's shared memory, asked of the runtime once a device (carry::kernels::primitives::allow_smem).
template <bool G>
void set_attributes() {
  carry::kernels::primitives::allow_smem(seg_sum<G>, kSumSmem[G]);
  carry::kernels::primitives::allow_smem(fused<G>, kFusedSmem[G]);
  carry::kernels::primitives::allow_smem(seg_sum_full<G>, kSumFullSmem[G]);
  carry::kernels::primitives::allow_smem(bwd_dq<G>, kDqSmem[G]);
  carry::kernels::primitives::allow_smem(bwd_dkdv<G>, kDkdvSmem[G]);
}

bf16* P(const at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); }
float* F(const at::Tensor& t) { return t.data_ptr<float>(); }

}  // namespace

bool fused_enabled() { return g_mode.load() != 0; }
int fused_forced_segments() { return g_segments.load(); }
bool decay_fused_enabled() { return g_decay_mode.load() != 0; }

std::vector<at::Tensor> launch_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& s0,
                                   float scale, int ns, const at::Tensor& gb) {
  const bool G = gb.defined();
  c10::cuda::CUDAGuard guard(q.device());  // the tensors' device, whichever is current (the other launchers' rule)
  G ? set_attributes<true>() : set_attributes<false>();
  const int B = (int)q.size(0), T = (int)q.size(1), H = (int)q.size(2), BH = B * H;
  TORCH_CHECK((T / 64) % ns == 0, "linear_attn (fused kernels): ", ns, " segments do not divide ", T / 64, " chunks");
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor o = at::empty_like(v), Sfin = at::empty({B, H, 128, 128}, f32), Sin = at::empty({ns, B, H, 128, 128}, f32);
  at::Tensor gam = G ? at::empty({ns, B, H}, f32) : at::Tensor();
  const float* g = G ? gb.data_ptr<float>() : nullptr;
  float* Gam = G ? F(gam) : nullptr;
  auto st = at::cuda::getCurrentCUDAStream();
  if (G) seg_sum<true><<<dim3(2, ns, BH), 128, kSumSmem[1], st>>>(P(k), P(v), F(Sin), T, B, H, 128, ns, g, Gam);
  else seg_sum<false><<<dim3(2, ns, BH), 128, kSumSmem[0], st>>>(P(k), P(v), F(Sin), T, B, H, 128, ns);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const long states = (long)BH * 128 * 128;
  seg_scan<<<(unsigned)((states + 255) / 256), 256, 0, st>>>(F(Sin), F(s0), F(Sfin), BH, 128, ns, Gam);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (G) fused<true><<<dim3(2, ns, BH), 128, kFusedSmem[1], st>>>(P(q), P(k), P(v), F(Sin), P(o), scale, T, B, H, 128, ns, g);
  else fused<false><<<dim3(2, ns, BH), 128, kFusedSmem[0], st>>>(P(q), P(k), P(v), F(Sin), P(o), scale, T, B, H, 128, ns);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {o, Sfin, Sin, gam};
}

std::vector<at::Tensor> launch_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& Sin,
                                   const at::Tensor& d_o, const at::Tensor& dSfin, float scale, const at::Tensor& gb,
                                   const at::Tensor& gam) {
  const bool G = gb.defined();
  c10::cuda::CUDAGuard guard(q.device());  // the tensors' device, whichever is current (the other launchers' rule)
  G ? set_attributes<true>() : set_attributes<false>();
  const int B = (int)q.size(0), T = (int)q.size(1), H = (int)q.size(2), BH = B * H, ns = (int)Sin.size(0);
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  at::Tensor dS0 = at::empty({B, H, 128, 128}, dSfin.options()), Dout = at::empty_like(Sin);
  // the per-token sums for the decay's gradient, added onto zero by two warps each
  at::Tensor dgq = G ? at::zeros({B, T, H}, dSfin.options()) : at::Tensor(), dgk = G ? at::zeros_like(dgq) : at::Tensor();
  const float* g = G ? gb.data_ptr<float>() : nullptr;
  const float* Gam = G ? gam.data_ptr<float>() : nullptr;
  auto st = at::cuda::getCurrentCUDAStream();
  if (G) seg_sum_full<true><<<dim3(ns, BH), 256, kSumFullSmem[1], st>>>(P(q), P(d_o), F(Dout), T, B, H, ns, g);
  else seg_sum_full<false><<<dim3(ns, BH), 256, kSumFullSmem[0], st>>>(P(q), P(d_o), F(Dout), T, B, H, ns);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const long states = (long)BH * 128 * 128;
  seg_scan_rev<<<(unsigned)((states + 255) / 256), 256, 0, st>>>(F(Dout), F(dSfin), F(dS0), scale, BH, ns, Gam);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (G)
    bwd_dq<true><<<dim3(ns, BH), 256, kDqSmem[1], st>>>(P(k), P(v), P(d_o), F(Sin), P(dq), scale, T, B, H, ns, P(q), g,
                                                        F(dgq));
  else bwd_dq<false><<<dim3(ns, BH), 256, kDqSmem[0], st>>>(P(k), P(v), P(d_o), F(Sin), P(dq), scale, T, B, H, ns);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (G)
    bwd_dkdv<true><<<dim3(ns, BH), 256, kDkdvSmem[1], st>>>(P(q), P(k), P(v), P(d_o), F(Dout), P(dk), P(dv), scale, T, B,
                                                            H, ns, g, F(dgk));
  else
    bwd_dkdv<false><<<dim3(ns, BH), 256, kDkdvSmem[0], st>>>(P(q), P(k), P(v), P(d_o), F(Dout), P(dk), P(dv), scale, T,
                                                             B, H, ns);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dq, dk, dv, dS0, dgq, dgk};
}

}  // namespace carry::kernels::decay::fused

namespace carry {

void linear_attn_fused_set(int mode, int segments) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "linear_attn_fused_set: expected -1, 0 or 1, got ", mode);
  TORCH_CHECK(segments >= 0, "linear_attn_fused_set: expected segments >= 0, got ", segments);
  carry::kernels::decay::fused::g_mode.store(mode);
  carry::kernels::decay::fused::g_segments.store(segments);
}

void scalar_decay_fused_set(int mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "scalar_decay_fused_set: expected -1, 0 or 1, got ", mode);
  carry::kernels::decay::fused::g_decay_mode.store(mode);
}

int linear_attn_fused_segments(int64_t B, int64_t H, int64_t N) {
  const int64_t per_sm = std::max<int64_t>(1, carry::kernels::primitives::sm_count() / std::max<int64_t>(1, B * H));
  int ns = 1;
  while (ns * 2 <= per_sm && ns * 2 <= 32) ns *= 2;
  while (ns > 1 && N % ns) ns /= 2;
  return ns;
}

}  // namespace carry
