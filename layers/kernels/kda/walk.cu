// Launchers of KDA's state walks (api.h; the kernels in walk.cuh).
#include "layers/kernels/kda/api.h"
#include "layers/kernels/kda/walk.cuh"
#include "layers/kernels/primitives/host.h"

#include <atomic>
#include <string>

namespace carry::kernels::kda {
namespace {

using primitives::alloc_poisoned;
using primitives::allow_smem;
std::atomic<bool> g_poison{false};

void check_input(const at::Tensor& t, const char* name, std::vector<int64_t> shape) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kFloat && t.is_contiguous(), "kda walk: ", name,
              " must be a contiguous fp32 CUDA tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), "kda walk: ", name, " must be ", at::IntArrayRef(shape),
              ", got ", t.sizes());
}

// 16 columns a block where 32 would leave more than half the SMs without one.
int tile_width(int64_t DV, int64_t blocks32) {
  return DV % 32 != 0 || 2 * blocks32 < primitives::sm_count() ? 16 : 32;
}

template <int DK, int BV>
void launch_fwd(const at::Tensor& w, const at::Tensor& u, const at::Tensor& k_out, const at::Tensor& decay,
                const at::Tensor& s0, at::Tensor& states, at::Tensor& v_new, at::Tensor& s_final) {
  const int B = (int)w.size(0), H = (int)w.size(1), N = (int)w.size(2), DV = (int)u.size(4);
  constexpr size_t smem = walk::fwd_smem<DK, BV>();
  allow_smem(walk::fwd_kernel<DK, BV>, smem);
  walk::fwd_kernel<DK, BV><<<dim3(DV / BV, H, B), walk::kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
      w.data_ptr<float>(), u.data_ptr<float>(), k_out.data_ptr<float>(), decay.data_ptr<float>(),
      s0.data_ptr<float>(), states.data_ptr<float>(), v_new.data_ptr<float>(), s_final.data_ptr<float>(), H, N, DV);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int DK, int BV>
void launch_bwd(const at::Tensor& q_s, const at::Tensor& d_o, const at::Tensor& w, const at::Tensor& k_out,
                const at::Tensor& decay, const at::Tensor& dv_pre, const at::Tensor& d_final, at::Tensor& out_grads,
                at::Tensor& dv, at::Tensor& ds0) {
  const int B = (int)w.size(0), H = (int)w.size(1), N = (int)w.size(2), DV = (int)d_o.size(4);
  constexpr size_t smem = walk::bwd_smem<DK, BV>();
  allow_smem(walk::bwd_kernel<DK, BV>, smem);
  walk::bwd_kernel<DK, BV><<<dim3(DV / BV, H, B), walk::kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
      q_s.data_ptr<float>(), d_o.data_ptr<float>(), w.data_ptr<float>(), k_out.data_ptr<float>(),
      decay.data_ptr<float>(), dv_pre.data_ptr<float>(), d_final.data_ptr<float>(), out_grads.data_ptr<float>(),
      dv.data_ptr<float>(), ds0.data_ptr<float>(), H, N, DV);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The (DK, BV) instance for f(integral constants).
template <class F>
void dispatch(int64_t DK, int BV, F&& f) {
  if (DK == 64 && BV == 16) return f(std::integral_constant<int, 64>{}, std::integral_constant<int, 16>{});
  if (DK == 64) return f(std::integral_constant<int, 64>{}, std::integral_constant<int, 32>{});
  if (BV == 16) return f(std::integral_constant<int, 128>{}, std::integral_constant<int, 16>{});
  return f(std::integral_constant<int, 128>{}, std::integral_constant<int, 32>{});
}

void check_dims(int64_t DK, int64_t DV, int64_t C) {
  TORCH_CHECK(DK == 64 || DK == 128, "kda walk: dk must be 64 or 128, got ", DK);
  TORCH_CHECK(DV % 16 == 0 && DV > 0 && DV <= 256, "kda walk: dv must be a multiple of 16 up to 256, got ", DV);
  TORCH_CHECK(C == walk::kChunk, "kda walk: chunks must have ", walk::kChunk, " tokens, got ", C);
}

}  // namespace

void set_poison(bool on) { g_poison.store(on); }

std::vector<at::Tensor> walk_fwd(const at::Tensor& w, const at::Tensor& u, const at::Tensor& k_out,
                                 const at::Tensor& decay, const at::Tensor& s0) {
  TORCH_CHECK(w.dim() == 5 && u.dim() == 5, "kda walk: w and u must be [B,H,N,C,·]");
  const int64_t B = w.size(0), H = w.size(1), N = w.size(2), C = w.size(3), DK = w.size(4), DV = u.size(4);
  check_dims(DK, DV, C);
  check_input(w, "w", {B, H, N, C, DK});
  check_input(u, "u", {B, H, N, C, DV});
  check_input(k_out, "k_out", {B, H, N, C, DK});
  check_input(decay, "decay", {B, H, N, DK});
  check_input(s0, "s0", {B, H, DK, DV});
  const bool poison = g_poison.load();
  const auto opt = w.options();
  at::Tensor states = alloc_poisoned({B, H, N, DK, DV}, opt, poison), v_new = alloc_poisoned({B, H, N, C, DV}, opt, poison),
             s_final = alloc_poisoned({B, H, DK, DV}, opt, poison);
  if (N == 0) {
    s_final.copy_(s0);
    return {states, v_new, s_final};
  }
  dispatch(DK, tile_width(DV, DV / 32 * H * B), [&](auto dk, auto bv) {
    launch_fwd<decltype(dk)::value, decltype(bv)::value>(w, u, k_out, decay, s0, states, v_new, s_final);
  });
  return {states, v_new, s_final};
}

std::vector<at::Tensor> walk_bwd(const at::Tensor& q_s, const at::Tensor& d_o, const at::Tensor& w,
                                 const at::Tensor& k_out, const at::Tensor& decay, const at::Tensor& dv_pre,
                                 const at::Tensor& d_final) {
  TORCH_CHECK(w.dim() == 5 && d_o.dim() == 5, "kda walk: w and d_o must be [B,H,N,C,·]");
  const int64_t B = w.size(0), H = w.size(1), N = w.size(2), C = w.size(3), DK = w.size(4), DV = d_o.size(4);
  check_dims(DK, DV, C);
  check_input(q_s, "q_s", {B, H, N, C, DK});
  check_input(d_o, "d_o", {B, H, N, C, DV});
  check_input(w, "w", {B, H, N, C, DK});
  check_input(k_out, "k_out", {B, H, N, C, DK});
  check_input(decay, "decay", {B, H, N, DK});
  check_input(dv_pre, "dv_pre", {B, H, N, C, DV});
  check_input(d_final, "d_final", {B, H, DK, DV});
  const bool poison = g_poison.load();
  const auto opt = w.options();
  at::Tensor out_grads = alloc_poisoned({B, H, N, DK, DV}, opt, poison), dv = alloc_poisoned({B, H, N, C, DV}, opt, poison),
             ds0 = alloc_poisoned({B, H, DK, DV}, opt, poison);
  if (N == 0) {
    ds0.copy_(d_final);
    return {out_grads, dv, ds0};
  }
  dispatch(DK, tile_width(DV, DV / 32 * H * B), [&](auto dk, auto bv) {
    launch_bwd<decltype(dk)::value, decltype(bv)::value>(q_s, d_o, w, k_out, decay, dv_pre, d_final, out_grads, dv,
                                                         ds0);
  });
  return {out_grads, dv, ds0};
}

}  // namespace carry::kernels::kda
