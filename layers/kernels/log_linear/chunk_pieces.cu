// Log-linear Gated DeltaNet's chunk pieces (api.h, chunk_pieces_fwd and chunk_pieces_bwd): the delta rule's
// chunk preparation (layers/kernels/delta_rule, gdn_prep: G, T, W, U) and the kernels of chunk_pieces.cuh.
#include "layers/kernels/log_linear/api.h"

#include "layers/kernels/delta_rule/api.h"
#include "layers/kernels/log_linear/chunk_pieces.cuh"
#include "layers/kernels/primitives/host.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace carry::kernels::log_linear {
namespace {

namespace pr = carry::kernels::primitives;
namespace cp = carry::kernels::log_linear::pieces;
using pr::bf16;

struct Dims {
  int B, T, H, DK, DV, N;
};

Dims check(const char* who, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
           const at::Tensor& lam) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 4 && q.scalar_type() == at::kBFloat16, who,
              ": q must be a bf16 CUDA tensor [B,T,H,dk], got ", q.sizes(), " ", q.scalar_type());
  TORCH_CHECK(k.sizes() == q.sizes() && k.scalar_type() == at::kBFloat16, who, ": k must be bf16 of q's shape ",
              q.sizes(), ", got ", k.sizes());
  const Dims d{(int)q.size(0), (int)q.size(1), (int)q.size(2), (int)q.size(3), (int)v.size(-1), (int)(q.size(1) / 64)};
  TORCH_CHECK(v.dim() == 4 && v.size(0) == d.B && v.size(1) == d.T && v.size(2) == d.H && v.scalar_type() == at::kBFloat16,
              who, ": v must be bf16 [", d.B, ",", d.T, ",", d.H, ",dv], got ", v.sizes());
  TORCH_CHECK(d.DK == 64 || d.DK == 128, who, ": dk must be 64 or 128, got ", d.DK);
  TORCH_CHECK(d.DV == 64 || d.DV == 128 || d.DV == 256, who, ": dv must be 64, 128 or 256, got ", d.DV);
  TORCH_CHECK(d.T % 64 == 0 && d.T > 0, who, ": T must be a positive multiple of 64, got ", d.T);
  TORCH_CHECK(beta.sizes() == at::IntArrayRef({d.B, d.T, d.H}), who, ": beta must be [", d.B, ",", d.T, ",", d.H,
              "], got ", beta.sizes());
  TORCH_CHECK(lam.sizes() == at::IntArrayRef({d.B, d.H, cp::kLevels, d.T}), who, ": lam must be [", d.B, ",", d.H,
              ",", cp::kLevels, ",", d.T, "], got ", lam.sizes());
  return d;
}

const bf16* bf(const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); }
bf16* bf_out(at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); }

template <int DK, int DV>
void launch_fwd(const Dims& d, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& G,
                const at::Tensor& beta, const at::Tensor& Tm, const at::Tensor& W, const at::Tensor& lam, at::Tensor& P,
                at::Tensor& Kt, at::Tensor& gamma, at::Tensor& o) {
  auto kern = cp::fwd_kernel<DK, DV>;
  constexpr size_t bytes = cp::FwdSmem<DK>::bytes;
  pr::allow_smem(kern, bytes);
  kern<<<dim3(d.N, d.H, d.B), cp::NT, bytes, at::cuda::getCurrentCUDAStream()>>>(
      bf(q), bf(k), bf(v), G.data_ptr<float>(), beta.data_ptr<float>(), bf(Tm), bf(W), lam.data_ptr<float>(), bf_out(P),
      bf_out(Kt), gamma.data_ptr<float>(), o.data_ptr<float>(), d.T, d.H);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int DK, int DV>
void launch_bwd(const Dims& d, const std::vector<const at::Tensor*>& in, std::vector<at::Tensor>& out) {
  auto kern = cp::bwd_kernel<DK, DV>;
  constexpr size_t bytes = cp::BwdSmem<DK>::bytes;
  pr::allow_smem(kern, bytes);
  const auto& x = in;
  kern<<<dim3(d.N, d.H, d.B), cp::NT, bytes, at::cuda::getCurrentCUDAStream()>>>(
      bf(*x[0]), bf(*x[1]), bf(*x[2]), x[3]->data_ptr<float>(), x[4]->data_ptr<float>(), bf(*x[5]), bf(*x[6]),
      x[7]->data_ptr<float>(), bf(*x[8]), bf(*x[9]), bf(*x[10]), bf(*x[11]), bf(*x[12]), x[13]->data_ptr<float>(),
      out[0].data_ptr<float>(), out[1].data_ptr<float>(), out[2].data_ptr<float>(), out[3].data_ptr<float>(),
      out[4].data_ptr<float>(), out[5].data_ptr<float>(), d.T, d.H);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class F>
void dispatch(const char* who, const Dims& d, F&& f) {
#define CARRY_LL_CASE(dk, dv)                        \
  if (d.DK == dk && d.DV == dv) {                    \
    f(std::integral_constant<int, dk>{}, std::integral_constant<int, dv>{}); \
    return;                                          \
  }
  CARRY_LL_CASE(64, 64) CARRY_LL_CASE(64, 128) CARRY_LL_CASE(64, 256)
  CARRY_LL_CASE(128, 64) CARRY_LL_CASE(128, 128) CARRY_LL_CASE(128, 256)
#undef CARRY_LL_CASE
  TORCH_CHECK(false, who, ": unsupported dk=", d.DK, " dv=", d.DV);
}

// A [B,H,T,·] bf16 gradient, contiguous (zeros where undefined).
at::Tensor grad_or_zeros(const at::Tensor& g, at::IntArrayRef sizes, const at::TensorOptions& o) {
  return g.defined() ? pr::dense16(g.to(at::kBFloat16).reshape(sizes)) : at::zeros(sizes, o.dtype(at::kBFloat16));
}

}  // namespace

std::vector<at::Tensor> chunk_pieces_fwd(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                         const at::Tensor& g_, const at::Tensor& beta_, const at::Tensor& lam_) {
  const char* who = "chunk_pieces_fwd";
  const Dims d = check(who, q_, k_, v_, beta_, lam_);
  c10::cuda::CUDAGuard guard(q_.device());
  auto q = pr::dense16(q_), k = pr::dense16(k_), v = pr::dense16(v_);
  auto g = g_.to(at::kFloat).contiguous(), beta = beta_.to(at::kFloat).contiguous();
  auto lam = lam_.to(at::kFloat).contiguous();
  auto prep = carry::kernels::delta_rule::gdn_prep(k, v, g, beta);  // G, T, W, U
  const at::Tensor &G = prep[0], &Tm = prep[1], &W = prep[2], &U = prep[3];
  const bool poison = carry::kernels::delta_rule::gdn_poison_enabled();
  auto io = q.options(), f32 = q.options().dtype(at::kFloat);
  at::Tensor P = pr::alloc_poisoned({d.B, d.H, d.T, d.DK}, io, poison);
  at::Tensor Kt = pr::alloc_poisoned({d.B, d.H, d.T, d.DK}, io, poison);
  at::Tensor gamma = pr::alloc_poisoned({d.B, d.H, d.N}, f32, poison);
  at::Tensor o = pr::alloc_poisoned({d.B, d.H, d.T, d.DV}, f32, poison);
  dispatch(who, d, [&](auto dk, auto dv) {
    launch_fwd<decltype(dk)::value, decltype(dv)::value>(d, q, k, v, G, beta, Tm, W, lam, P, Kt, gamma, o);
  });
  return {W, U, Kt, P, gamma, o, G, Tm};
}

std::vector<at::Tensor> chunk_pieces_bwd(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                         const at::Tensor& beta_, const at::Tensor& lam_, const at::Tensor& G,
                                         const at::Tensor& Tm, const at::Tensor& W, const at::Tensor& dO,
                                         const at::Tensor& dW, const at::Tensor& dU, const at::Tensor& dKt,
                                         const at::Tensor& dP, const at::Tensor& dgamma) {
  const char* who = "chunk_pieces_bwd";
  const Dims d = check(who, q_, k_, v_, beta_, lam_);
  c10::cuda::CUDAGuard guard(q_.device());
  auto q = pr::dense16(q_), k = pr::dense16(k_), v = pr::dense16(v_);
  auto beta = beta_.to(at::kFloat).contiguous(), lam = lam_.to(at::kFloat).contiguous();
  auto Gc = G.contiguous(), T = pr::dense16(Tm), Wc = pr::dense16(W);
  auto o = q.options();
  auto gdO = grad_or_zeros(dO, {d.B, d.H, d.T, d.DV}, o), gdU = grad_or_zeros(dU, {d.B, d.H, d.T, d.DV}, o);
  auto gdW = grad_or_zeros(dW, {d.B, d.H, d.T, d.DK}, o), gdKt = grad_or_zeros(dKt, {d.B, d.H, d.T, d.DK}, o);
  auto gdP = grad_or_zeros(dP, {d.B, d.H, d.T, d.DK}, o);
  auto gdg = dgamma.defined() ? dgamma.to(at::kFloat).reshape({d.B, d.H, d.N}).contiguous()
                              : at::zeros({d.B, d.H, d.N}, o.dtype(at::kFloat));
  const bool poison = carry::kernels::delta_rule::gdn_poison_enabled();
  auto f32 = o.dtype(at::kFloat);
  std::vector<at::Tensor> out{pr::alloc_poisoned({d.B, d.T, d.H, d.DK}, f32, poison),
                              pr::alloc_poisoned({d.B, d.T, d.H, d.DK}, f32, poison),
                              pr::alloc_poisoned({d.B, d.T, d.H, d.DV}, f32, poison),
                              pr::alloc_poisoned({d.B, d.T, d.H}, f32, poison),
                              pr::alloc_poisoned({d.B, d.T, d.H}, f32, poison),
                              pr::alloc_poisoned({d.B, d.H, cp::kLevels, d.T}, f32, poison)};
  const std::vector<const at::Tensor*> in{&q, &k, &v, &Gc, &beta, &T, &Wc, &lam, &gdO, &gdW, &gdU, &gdKt, &gdP, &gdg};
  dispatch(who, d, [&](auto dk, auto dv) { launch_bwd<decltype(dk)::value, decltype(dv)::value>(d, in, out); });
  return out;
}

}  // namespace carry::kernels::log_linear
