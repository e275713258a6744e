// The selective scan's definition for its tests: the token recurrence in ATen ops (differentiable, any
// device and dtype) and realistic random inputs.
#pragma once

#include <ATen/ATen.h>

#include <utility>
#include <vector>

namespace carry::testing::selective_scan {

struct ScanInputs {
  at::Tensor u, delta, A, B, C, h0;  // [Bs,T,D], [Bs,T,D], [D,N], [Bs,T,N], [Bs,T,N], [Bs,D,N]
};

// u, B, C standard normal; Δ = softplus(N(0,1) − 1) (about 0.05 to 2, never zero); A = −exp(N(0, 0.5²))
// (decays of 0.2 to 5 nats a unit of Δ); h0 N(0, 0.5²). fp64 on the CPU.
inline ScanInputs scan_inputs(int64_t Bs, int64_t T, int64_t D, int64_t N, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto o = at::TensorOptions().dtype(at::kDouble);
  ScanInputs in;
  in.u = at::randn({Bs, T, D}, gen, o);
  in.delta = at::softplus(at::randn({Bs, T, D}, gen, o) - 1);
  in.A = -at::exp(at::randn({D, N}, gen, o) * 0.5);
  in.B = at::randn({Bs, T, N}, gen, o);
  in.C = at::randn({Bs, T, N}, gen, o);
  in.h0 = at::randn({Bs, D, N}, gen, o) * 0.5;
  return in;
}

// h_t = exp(Δ_t A) ⊙ h_{t−1} + B_t u_t, y_t = Σ_n C_t h_t, token by token from h0: {y [Bs,T,D], h_T [Bs,D,N]}.
inline std::pair<at::Tensor, at::Tensor> token_recurrence(const at::Tensor& u, const at::Tensor& delta,
                                                          const at::Tensor& A, const at::Tensor& B,
                                                          const at::Tensor& C, const at::Tensor& h0) {
  at::Tensor h = h0;
  std::vector<at::Tensor> ys;
  for (int64_t t = 0; t < u.size(1); ++t) {
    h = at::exp(delta.select(1, t).unsqueeze(-1) * A) * h + B.select(1, t).unsqueeze(1) * u.select(1, t).unsqueeze(-1);
    ys.push_back((h * C.select(1, t).unsqueeze(1)).sum(-1));
  }
  return {at::stack(ys, 1), h};
}

}  // namespace carry::testing::selective_scan
