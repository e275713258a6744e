// Mamba-1 (S6) / H3 diagonal SSM, family "mamba1": per channel d (a head), h_t = exp(Δ_t A) ⊙ h_{t-1}
// + (Δ_t B_t) x_tᵀ, y_t = C_tᵀ h_t, in the contract's names q = C, k = Δ·B, v = x, gk = Δ·A (see
// mamba1.h). State {h [B,D,N,dv]}; transport diagonal, Π_t exp(Δ_t A) per state dimension, [B,D,N].
// Forms: naive = the selective-scan token recurrence; chunkwise, state and summary algebra = GLA's
// DiagonalDecayMixer with scale 1 (the same exact per-chunk algorithm, not a copy). MixerOptions::scale and ::normalize are ignored.
#include "layers/diag_decay/mamba1.h"

#include "layers/layout.h"
#include "layers/diag_decay/gla.h"

namespace carry {

MixerInputs mamba1_inputs(const Tensor& x, const Tensor& dt, const Tensor& A, const Tensor& Bmat,
                          const Tensor& Cmat, bool check_values) {
  check_tensor(x, "mamba1_inputs: 'x'", {-1, -1, -1});
  int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  check_tensor(A, "mamba1_inputs: 'A'", {D, -1});
  int64_t N = A.size(1);
  check_tensor(dt, "mamba1_inputs: 'dt'", {B, T, D});
  check_tensor(Bmat, "mamba1_inputs: 'B'", {B, T, N});
  check_tensor(Cmat, "mamba1_inputs: 'C'", {B, T, N});
  using Named = std::pair<const Tensor*, const char*>;
  for (auto [t, n] : {Named{&dt, "dt"}, Named{&A, "A"}, Named{&Bmat, "B"}, Named{&Cmat, "C"}}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "mamba1_inputs: '", n, "' has dtype ",
                t->scalar_type(), " but 'x' has ", x.scalar_type(), "; all inputs must share one dtype");
    if (check_values) check_finite(*t, std::string("mamba1_inputs: '") + n + "'");
  }
  if (check_values) check_finite(x, "mamba1_inputs: 'x'");
  TORCH_CHECK(!check_values || (dt >= 0).all().item<bool>(),
              "mamba1_inputs: 'dt' is the step size Δ and must be >= 0 everywhere; min is ",
              dt.min().item<double>());
  TORCH_CHECK(!check_values || (A <= 0).all().item<bool>(),
              "mamba1_inputs: 'A' is the continuous-time state matrix and must be <= 0 everywhere "
              "(exp(Δ·A) a decay); max is ",
              A.max().item<double>());
  MixerInputs in;
  auto dt_ = dt.unsqueeze(-1);                 // [B,T,D,1]
  in.q = Cmat.unsqueeze(2).expand({B, T, D, N});
  in.k = dt_ * Bmat.unsqueeze(2);              // Δ_t,d B_t
  in.v = x.unsqueeze(-1);                      // [B,T,D,1]
  in.gk = dt_ * A;                             // Δ_t,d A_d
  return in;
}

namespace {

class Mamba1 final : public DiagonalDecayMixer {
 public:
  std::string name() const override { return "mamba1"; }
  std::vector<std::string> state_names() const override { return {"h"}; }

  // The selective scan: per token, discretize (dA = exp(Δ A), dB x = Δ B x), update, read out with C.
  MixerOutput naive(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, false);
    auto h = initial(in, init);                                // [B,D,N,dv]
    auto Cm = to_bhtd(in.q), dBm = to_bhtd(in.k), x = to_bhtd(in.v), dtA = to_bhtd(in.gk);
    std::vector<Tensor> ys;
    for (int64_t t = 0; t < Cm.size(2); ++t) {
      auto dA = dtA.select(2, t).exp();                        // [B,D,N]
      auto dBx = dBm.select(2, t).unsqueeze(-1) * x.select(2, t).unsqueeze(-2);  // [B,D,N,dv]
      h = dA.unsqueeze(-1) * h + dBx;
      ys.push_back((Cm.select(2, t).unsqueeze(-1) * h).sum(-2));  // Cᵀh: [B,D,dv]
    }
    return {from_bhtd(at::stack(ys, 2)), {h}};
  }

  // y = Cᵀh exactly: no scale.
 protected:
  double output_scale(const MixerInputs&, const MixerOptions&) const override { return 1.0; }
};

CARRY_REGISTER_MIXER(Mamba1);

}  // namespace
}  // namespace carry
