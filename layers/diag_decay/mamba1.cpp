// Mamba-1 (S6) / H3 diagonal SSM, family "mamba1": per channel d (a head), h_t = exp(Δ_t A) ⊙ h_{t-1}
// + B_t (Δ_t x_t)ᵀ, y_t = C_tᵀ h_t, in the contract's names q = C and k = B (one head shared by all
// channels), v = Δ⊙x, g = Δ, decay_rate = A (see mamba1.h). State {h [B,D,N,dv]}; transport diagonal,
// Π_t exp(Δ_t A) per state dimension, [B,D,N]. Forms: naive = the selective-scan token recurrence on the
// compact tensors; chunkwise, the state output and the summary = GLA's diag_decay_chunkwise with scale 1
// on the dense view (q, k expanded to D heads, gk = Δ·A), the same exact per-chunk algorithm, not a
// copy; kernel (CUDA builds) = the selective-scan kernels on the compact tensors; compose and apply are
// DiagonalDecayMixer's. MixerOptions::scale and ::normalize are ignored.
#include "layers/diag_decay/mamba1.h"

#include "layers/layout.h"
#include "layers/diag_decay/gla.h"
#ifdef CARRY_WITH_CUDA
#include "layers/kernels/selective_scan/op.h"
#endif
#include "layers/blocks/precision.h"

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
  in.q = Cmat.unsqueeze(2);              // [B,T,1,N]: one head, every channel's
  in.k = Bmat.unsqueeze(2);              // [B,T,1,N]
  in.v = (dt * x).unsqueeze(-1);         // [B,T,D,1]: Δ_t,d x_t,d
  in.g = dt;                             // [B,T,D]
  in.decay_rate = A;                     // [D,N]: gk = Δ_t,d A_d
  return in;
}

namespace {

class Mamba1 final : public DiagonalDecayMixer {
 public:
  std::string name() const override { return "mamba1"; }
  std::vector<std::string> input_names() const override { return {"q", "k", "v", "g", "decay_rate"}; }
  bool broadcasts_heads(const std::string& n) const override { return n == "q" || n == "k"; }
  std::vector<std::string> state_names() const override { return {"h"}; }

  // The selective scan on the compact tensors: per token, discretize (dA = exp(Δ A)), update with
  // B (Δ x)ᵀ, read out with C.
  MixerOutput naive(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, false);
    auto h = initial(in, init);                                   // [B,D,N,dv]
    std::vector<Tensor> ys;
    for (int64_t t = 0; t < in.v.size(1); ++t) {
      auto dA = (in.g.select(1, t).unsqueeze(-1) * in.decay_rate).exp();             // [B,D,N]
      auto dBx = in.k.select(1, t).unsqueeze(-1) * in.v.select(1, t).unsqueeze(-2);  // [B,D,N,dv]
      h = dA.unsqueeze(-1) * h + dBx;
      ys.push_back((in.q.select(1, t).unsqueeze(-1) * h).sum(-2));                   // Cᵀh: [B,D,dv]
    }
    return {at::stack(ys, 1), {h}};
  }

  MixerOutput chunkwise(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, true);
    const Dense d = dense(in);
    auto r = diag_decay_chunkwise(d.q, d.k, in.v, d.gk, initial(in, init), opt.chunk_size, 1.0);
    return {r.o, {r.S}};
  }

  Summary summarize(const MixerInputs& raw, const MixerOptions& opt) const override {
    const MixerInputs in = full_precision(raw);
    check(in, opt, true);
    const Dense d = dense(in);
    auto r = diag_decay_chunkwise(d.q, d.k, in.v, d.gk, initial(in, {}), opt.chunk_size, 1.0);
    return {{r.transport}, {r.S}};
  }

  Tensor state_output(const MixerInputs& in, const State& s_in, const MixerOptions&) const override {
    const Dense d = dense(in);
    return decayed_state_readout(d.q, d.gk, s_in.at(0), 1.0);
  }

  // Π_t exp(Δ_t A) = exp((Σ_t Δ_t) A), [B,D,N].
  std::vector<Tensor> transport(const MixerInputs& in, const MixerOptions&) const override {
    return {at::exp(in.g.sum(1).unsqueeze(-1) * in.decay_rate)};
  }

#ifdef CARRY_WITH_CUDA
  // The kernel form: the selective-scan kernels (layers/kernels/selective_scan/) on the compact tensors,
  // u = Δ⊙x [B,T,D], Δ [B,T,D], A [D,N], B and C [B,T,N]. Δ goes in the dtype of x (the kernels read u,
  // Δ, B and C in one dtype; an fp32 Δ beside bf16 x is rounded to bf16).
  bool has_kernel() const override { return true; }
  bool kernel_supports(const MixerInputs& in, const MixerOptions&) const override {
    if (!in.v.defined() || !in.g.defined() || !in.q.defined() || !in.k.defined() || !in.decay_rate.defined() ||
        in.v.dim() != 4 || in.v.size(3) != 1 || in.q.dim() != 4 || in.q.size(2) != 1 || in.k.dim() != 4 ||
        in.k.size(2) != 1)
      return false;
    const auto dt = in.v.scalar_type();
    const int64_t N = in.q.size(3);
    for (const Tensor* t : {&in.q, &in.k, &in.v, &in.g, &in.decay_rate})
      if (!t->is_cuda() || t->device() != in.v.device()) return false;
    return (dt == at::kBFloat16 || dt == at::kFloat) && (N == 4 || N == 8 || N == 16);
  }
  MixerOutput kernel(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, /*chunked=*/false);  // the kernels take any T
    TORCH_CHECK(kernel_supports(in, opt), name(), ": the kernel form takes CUDA tensors in bf16 or fp32 with N in {4, 8, 16} ",
                "states a channel; got v ", shape_str(in.v.sizes()), " ", in.v.scalar_type(), " on ", in.v.device(),
                ", q ", shape_str(in.q.sizes()));
    const auto dt = in.v.scalar_type();
    const Tensor h0 = init.empty() ? Tensor() : init.at(0).squeeze(-1);
    auto [y, h] = selective_scan_kernel(in.v.squeeze(-1), in.g.to(dt), in.decay_rate, in.k.squeeze(2).to(dt),
                                        in.q.squeeze(2).to(dt), h0, opt.serial_states);
    return {y.unsqueeze(-1), {h.unsqueeze(-1)}};
  }
#endif

 protected:
  // y = Cᵀh exactly: no scale.
  double output_scale(const MixerInputs&, const MixerOptions&) const override { return 1.0; }

 private:
  // GLA's view of the compact inputs: q and k on every channel, gk = Δ·A.
  struct Dense {
    Tensor q, k, gk;  // [B,T,D,N]
  };
  static Dense dense(const MixerInputs& in) {
    const int64_t B = in.v.size(0), T = in.v.size(1), D = in.v.size(2), N = in.q.size(3);
    return {in.q.expand({B, T, D, N}), in.k.expand({B, T, D, N}), in.g.unsqueeze(-1) * in.decay_rate};
  }
};

CARRY_REGISTER_MIXER(Mamba1);

}  // namespace
}  // namespace carry
