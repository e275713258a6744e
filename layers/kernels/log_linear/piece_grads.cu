// Log-linear Gated DeltaNet's walk-piece gradients over every level's state (api.h, level_read_grads and
// level_write_sum): launchers of piece_grads.cuh.
#include "layers/kernels/log_linear/api.h"

#include "layers/kernels/log_linear/piece_grads.cuh"
#include "layers/kernels/primitives/host.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace carry::kernels::log_linear {
namespace {

namespace pr = carry::kernels::primitives;
namespace gr = carry::kernels::log_linear::grads;
using pr::bf16;

const bf16* bf(const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); }

}  // namespace

std::vector<at::Tensor> level_read_grads(const at::Tensor& St_, const at::Tensor& dO_, const at::Tensor& P_,
                                         const at::Tensor& lam_, int64_t offset, int64_t first_level) {
  const char* who = "level_read_grads";
  TORCH_CHECK(St_.dim() == 5 && St_.is_cuda() && St_.scalar_type() == at::kBFloat16, who,
              ": the states must be bf16 CUDA [BH,N,J,dv,dk], got ", St_.sizes());
  const int64_t BH = St_.size(0), N = St_.size(1), J = St_.size(2), DV = St_.size(3), DK = St_.size(4), T = N * 64;
  TORCH_CHECK((DK == 64 || DK == 128) && (DV == 64 || DV == 128 || DV == 256), who,
              ": dk must be 64 or 128 and dv 64, 128 or 256, got ", DK, " and ", DV);
  TORCH_CHECK(dO_.sizes() == at::IntArrayRef({BH, T, DV}) && P_.sizes() == at::IntArrayRef({BH, T, DK}) &&
                  lam_.sizes() == at::IntArrayRef({BH, J, T}),
              who, ": dO, P and lam must be [", BH, ",", T, ",", DV, "], [", BH, ",", T, ",", DK, "] and [", BH, ",",
              J, ",", T, "], got ", dO_.sizes(), ", ", P_.sizes(), " and ", lam_.sizes());
  TORCH_CHECK(offset % 64 == 0 && first_level >= 7, who, ": the offset must be a multiple of 64 and the first level ",
              "at least 7, got ", offset, " and ", first_level);
  c10::cuda::CUDAGuard guard(St_.device());
  auto St = pr::dense16(St_), dO = pr::dense16(dO_.to(at::kBFloat16)), P = pr::dense16(P_.to(at::kBFloat16));
  auto lam = lam_.to(at::kFloat).contiguous();
  auto f32 = St.options().dtype(at::kFloat);
  auto dP = at::empty({BH, T, DK}, f32), dlam = at::empty({BH, J, T}, f32);
  auto launch = [&](auto kernel, size_t bytes) {
    pr::allow_smem(kernel, bytes);
    kernel<<<dim3(N, BH), gr::NT, bytes, at::cuda::getCurrentCUDAStream()>>>(
        bf(St), bf(dO), bf(P), lam.data_ptr<float>(), dP.data_ptr<float>(), dlam.data_ptr<float>(), (int)T, (int)J,
        (long)offset, (int)first_level);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
#define CARRY_LL_CASE(dk, dv) \
  if (DK == dk && DV == dv) launch(gr::read_grads_kernel<dk, dv>, gr::ReadSmem<dk, dv>::bytes);
  CARRY_LL_CASE(64, 64) CARRY_LL_CASE(64, 128) CARRY_LL_CASE(64, 256)
  CARRY_LL_CASE(128, 64) CARRY_LL_CASE(128, 128) CARRY_LL_CASE(128, 256)
#undef CARRY_LL_CASE
  return {dP, dlam};
}

at::Tensor level_write_sum(const at::Tensor& dSt_, int64_t offset, int64_t first_level) {
  const char* who = "level_write_sum";
  TORCH_CHECK(dSt_.dim() == 5 && dSt_.is_cuda() && dSt_.scalar_type() == at::kBFloat16, who,
              ": the state gradients must be bf16 CUDA [BH,N,J,dv,dk], got ", dSt_.sizes());
  const int64_t BH = dSt_.size(0), N = dSt_.size(1), J = dSt_.size(2), E = dSt_.size(3) * dSt_.size(4);
  TORCH_CHECK(E % (8 * gr::NT) == 0, who, ": dv·dk must be a multiple of ", 8 * gr::NT, ", got ", E);
  c10::cuda::CUDAGuard guard(dSt_.device());
  auto dSt = pr::dense16(dSt_);
  auto D = at::empty({BH, N, dSt.size(3), dSt.size(4)}, dSt.options());
  gr::write_sum_kernel<<<dim3(E / (8 * gr::NT), N, BH), gr::NT, 0, at::cuda::getCurrentCUDAStream()>>>(
      bf(dSt), reinterpret_cast<bf16*>(D.data_ptr()), (int)N, (int)J, (long)E, (long)offset, (int)first_level);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return D;
}

}  // namespace carry::kernels::log_linear
