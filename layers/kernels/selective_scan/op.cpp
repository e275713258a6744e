// The selective-scan kernels as a torch autograd Function (see op.h). Compiled with the CUDA sources
// (CARRY_CUDA builds and the compile-and-link check).
#include "layers/kernels/selective_scan/op.h"

#include "layers/kernels/selective_scan/api.h"

#include <torch/csrc/autograd/custom_function.h>

namespace carry {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct SelectiveScanOp : public torch::autograd::Function<SelectiveScanOp> {
  static variable_list forward(AutogradContext* ctx, const Tensor& u, const Tensor& delta, const Tensor& A,
                               const Tensor& B, const Tensor& C, const Tensor& h0, int64_t segments) {
    auto out = carry::kernels::selective_scan::selective_scan_fwd(u, delta, A, B, C, h0, static_cast<int>(segments));
    ctx->save_for_backward({u, delta, A, B, C, out[2]});
    return {out[0], out[1]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const Tensor &u = s[0], &delta = s[1], &A = s[2], &B = s[3], &C = s[4], &h_in = s[5];
    const int64_t Bs = u.size(0), D = u.size(2), N = A.size(1);
    Tensor dy = grads[0].defined() ? grads[0].to(u.scalar_type()).contiguous() : at::zeros_like(u);
    Tensor dh = grads[1].defined() ? grads[1].to(at::kFloat).contiguous()
                                   : at::zeros({Bs, D, N}, u.options().dtype(at::kFloat));
    auto d = carry::kernels::selective_scan::selective_scan_bwd(u, delta, A, B, C, h_in, dy, dh);
    return {d[0], d[1], d[2], d[3], d[4], d[5], Tensor()};
  }
};

}  // namespace

bool selective_scan_kernel_supports(const Tensor& u, const Tensor& delta, const Tensor& A, const Tensor& B,
                                    const Tensor& C) {
  if (!u.defined() || !delta.defined() || !A.defined() || !B.defined() || !C.defined()) return false;
  if (!u.is_cuda() || u.dim() != 3 || A.dim() != 2 || B.dim() != 3 || C.dim() != 3) return false;
  const auto dt = u.scalar_type();
  const int64_t N = A.size(1);
  return (dt == at::kBFloat16 || dt == at::kFloat) && delta.scalar_type() == dt && B.scalar_type() == dt &&
         C.scalar_type() == dt && at::isFloatingType(A.scalar_type()) && (N == 4 || N == 8 || N == 16) &&
         u.size(1) >= 1 && delta.sizes() == u.sizes() && A.size(0) == u.size(2) && B.size(0) == u.size(0) &&
         B.size(1) == u.size(1) && B.size(2) == N && C.sizes() == B.sizes();
}

std::pair<Tensor, Tensor> selective_scan_kernel(const Tensor& u, const Tensor& delta, const Tensor& A,
                                                const Tensor& B, const Tensor& C, const Tensor& initial_state,
                                                bool serial_states) {
  TORCH_CHECK(selective_scan_kernel_supports(u, delta, A, B, C),
              "selective_scan: the kernel takes CUDA tensors u, delta [B,T,D] and B, C [B,T,N] in one dtype (bf16 "
              "or fp32), A [D,N], N in {4, 8, 16}; got u ", u.sizes(), " ", u.scalar_type(), " on ", u.device(),
              ", delta ", delta.sizes(), " ", delta.scalar_type(), ", A ", A.sizes(), ", B ", B.sizes(), " ",
              B.scalar_type(), ", C ", C.sizes(), " ", C.scalar_type());
  const int64_t Bs = u.size(0), D = u.size(2), N = A.size(1);
  Tensor h0 = initial_state.defined() ? initial_state.to(at::kFloat).contiguous()
                                      : at::zeros({Bs, D, N}, u.options().dtype(at::kFloat));
  auto out = SelectiveScanOp::apply(u.contiguous(), delta.contiguous(), A.to(at::kFloat).contiguous(),
                                    B.contiguous(), C.contiguous(), h0, int64_t{serial_states ? 1 : 0});
  return {out[0], out[1]};
}

}  // namespace carry
