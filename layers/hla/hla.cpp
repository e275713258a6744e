// Higher-order linear attention, families "hla2" and "ahla" (recurrences, states and transports in
// hla.h). Forms: naive = the token recurrence, literally; chunkwise = per chunk, in order, C×C masked
// products of the chunk plus terms from the incoming state, then the chunk's state update.
//
// The decayed combine is derived from the recurrence, not taken from the HLA paper (§4.3 as printed
// does not reproduce its recurrence). Running hla2 over a slice B from a state X, with Γ_t = Π_{r≤t} γ_r
// inside B: C_{t−1} = Γ_{t−1} C_X + C⁰_{t−1}, so G gains Σ_t (ρ/Γ_t) Γ_{t−1} k_t k_tᵀ C_X = S̃ C_X with
// S̃ = Σ_t (ρ/γ_t) k_t k_tᵀ: ρ/γ_t = Γ_{t−1}·(ρ/Γ_t) is every gate of the slice except t's own (not the
// decay from t to the end, ρ/Γ_t, which S itself carries), computed as exp(b_T − g_t) ≤ 1. For ahla,
// P_t = Γ_t P_X + P⁰_t gives E gains Σ_t (ρ/Γ_t) Γ_t k_t q_tᵀ P_X = ρ R̄ P_X with R̄ undecayed, so
// R̄_AB = R̄_A + R̄_B. Summaries accumulate the transport chunk by chunk with the same compose rules
// (S̃ ← ρ_c S̃ + ρ S̃_c, R̄ ← R̄ + R̄_c, ρ ← ρ ρ_c).
// Decay factors are exp of differences of chunk-local cumulative log gates (b_t = Σ_{r≤t} g_r restarted
// every chunk, b_0 = 0), masked to -inf before exp; never a division.
//
// Chunkwise, one trick for both families: the normalizer states are the value states with v ≡ 1
// (m is C with v=1, h is G with v=1; m_K is P with v=1, n is E with v=1). So each chunk works on
// v' = [v, 1] and on the concatenated states C' = [C, m], G' = [G, h] (P' = [P, m_K], E' = [E, n]); the
// last output column is the denominator. Per chunk, with Q, K [C,dk], A = Q Kᵀ, D[t,s] = exp(b_t − b_s)
// (s ≤ t), D⁻[t,s] = exp(b_{t−1} − b_s) (s < t), Γ_t = exp(b_t), Γ⁻_t = exp(b_{t−1}), e_t = exp(b_C − b_t):
//   hla2:  R  = Γ⊙(Q S) + (D⊙A) K                  rows q_tᵀ S_t
//          W  = Γ⁻⊙(K C') + (D⁻⊙Aᵀ) v'             rows k_tᵀ C'_{t−1}
//          Y  = Γ⊙(R C') + (D⊙R Qᵀ) v' − Γ⊙(Q G') − (D⊙A) W   rows q_tᵀ (S_t C'_t − G'_t)
//          S ← ρS + Kᵀ(e⊙K),  G' ← ρG' + Kᵀ(e⊙W),  C' ← ρC' + Qᵀ(e⊙v')
//   ahla:  Y  = Γ⊙(Q P') + (D⊙A) v'                rows q_tᵀ P'_t
//          Z  = Γ⊙(Q E') + (D⊙A) Y                 rows q_tᵀ E'_t
//          E' ← ρE' + Kᵀ(e⊙Y),  P' ← ρP' + Kᵀ(e⊙v')
// Without g every decay factor is exactly 1 (masks only, no exp).
#include "layers/hla/hla.h"

#include "layers/hla/decay_passes.h"
#include "layers/layout.h"
#ifdef CARRY_WITH_CUDA
#include "layers/kernels/decay/op.h"
#include "layers/kernels/hla/hla2_op.h"
#endif

#include <limits>

namespace carry {
namespace {

// Decay factors of one chunk, shaped to broadcast against [B,H,C,C] and [B,H,C,D] tensors.
struct ChunkDecay {
  Tensor D;            // [.,.,C,C] exp(b_t − b_s) for s ≤ t, else 0
  Tensor D_prev;       // [.,.,C,C] exp(b_{t−1} − b_s) for s < t, else 0
  Tensor Gamma;        // [.,.,C,1] exp(b_t): decay of the incoming state up to t
  Tensor Gamma_prev;   // [.,.,C,1] exp(b_{t−1})
  Tensor to_end;       // [.,.,C,1] exp(b_C − b_t): from t to the chunk's end
  Tensor all_but;      // [.,.,C,1] exp(b_C − g_t) = ρ/γ_t: every gate of the chunk but t's own
  Tensor rho;          // [.,.,1,1] exp(b_C)
};

// `g` is the chunk's log gate [B,H,C], or undefined for no decay.
ChunkDecay chunk_decay(const Tensor& g, int64_t C, const at::TensorOptions& opt) {
  ChunkDecay d;
  if (!g.defined()) {
    auto one = at::ones({1, 1, C, 1}, opt);
    d.D = at::ones({C, C}, opt).tril();
    d.D_prev = at::ones({C, C}, opt).tril(-1);
    d.Gamma = d.Gamma_prev = d.to_end = d.all_but = one;
    d.rho = at::ones({1, 1, 1, 1}, opt);
    return d;
  }
  const double ninf = -std::numeric_limits<double>::infinity();
  auto mask = causal_mask(C, false, opt), strict = causal_mask(C, true, opt);
  auto b = g.cumsum(-1);                                                // b_t, t = 1..C
  auto b_prev = at::cat({at::zeros_like(b.narrow(-1, 0, 1)), b.narrow(-1, 0, C - 1)}, -1);  // b_{t−1}
  auto b_end = b.narrow(-1, C - 1, 1);                                  // b_C  [B,H,1]
  d.D = at::exp((b.unsqueeze(-1) - b.unsqueeze(-2)).masked_fill(mask.logical_not(), ninf));
  d.D_prev = at::exp((b_prev.unsqueeze(-1) - b.unsqueeze(-2)).masked_fill(strict.logical_not(), ninf));
  d.Gamma = at::exp(b).unsqueeze(-1);
  d.Gamma_prev = at::exp(b_prev).unsqueeze(-1);
  d.to_end = at::exp(b_end - b).unsqueeze(-1);
  d.all_but = at::exp(b_end - g).unsqueeze(-1);
  d.rho = at::exp(b_end).unsqueeze(-1);
  return d;
}

// [..., D] -> [..., D+1] with a trailing 1 (v' = [v, 1]).
Tensor append_one(const Tensor& v) {
  auto s = v.sizes().vec();
  s.back() = 1;
  return at::cat({v, at::ones(s, v.options())}, -1);
}

// [B,H,dk,dv] and [B,H,dk] -> [B,H,dk,dv+1]; and back.
Tensor with_norm(const Tensor& value, const Tensor& norm) { return at::cat({value, norm.unsqueeze(-1)}, -1); }
std::pair<Tensor, Tensor> split(const Tensor& joined) {
  int64_t dv = joined.size(-1) - 1;
  return {joined.narrow(-1, 0, dv), joined.select(-1, dv)};
}

// o = s·Y[..., :dv], or with normalize s·Y[..., :dv] / (s·Y[..., dv] + eps).
Tensor readout(const Tensor& y, const MixerOptions& opt, double scale) {
  int64_t dv = y.size(-1) - 1;
  auto o = y.narrow(-1, 0, dv) * scale;
  if (opt.normalize) o = o / (y.narrow(-1, dv, 1) * scale + opt.eps);
  return o;
}

// ρ [B,H] as [B,H,1,1] / [B,H,1].
Tensor as4(const Tensor& rho) { return rho.unsqueeze(-1).unsqueeze(-1); }
Tensor as3(const Tensor& rho) { return rho.unsqueeze(-1); }

Tensor matvec(const Tensor& M, const Tensor& x) { return at::matmul(M, x.unsqueeze(-1)).squeeze(-1); }
Tensor outer_product(const Tensor& a, const Tensor& b) { return a.unsqueeze(-1) * b.unsqueeze(-2); }

// The common parts of both families: g optional, the per-chunk loop's inputs.
class HlaBase : public Mixer {
 public:
  std::vector<std::string> input_names() const override { return {"q", "k", "v"}; }
  std::vector<std::string> optional_input_names() const override { return {"g"}; }

 protected:
  struct Dims {
    int64_t B, T, H, dk, dv;
  };
  static Dims dims(const MixerInputs& in) {
    return {in.q.size(0), in.q.size(1), in.q.size(2), in.q.size(3), in.v.size(3)};
  }
  // Per-token decay γ_t = exp(g_t) as [B,H] (undefined when there is no g).
  static Tensor token_gamma(const Tensor& g_bht, int64_t t) {
    return g_bht.defined() ? at::exp(g_bht.select(2, t)) : Tensor();
  }
  void check_summary(const Summary& s, const std::string& what) const {
    TORCH_CHECK(s.transport.size() == 2 && s.state.size() == state_names().size(), name(), ": ", what,
                " must hold 2 transport tensors (rho, ", name() == kHla2Family ? "S_tilde" : "R_bar",
                ") and ", state_names().size(), " state tensors; got ", s.transport.size(), " and ",
                s.state.size());
  }
#ifdef CARRY_WITH_CUDA
 public:
  // The kernel form (decay_passes.h): the decay class's kernels, pass after pass.
  bool has_kernel() const override { return true; }
  bool kernel_supports(const MixerInputs& in, const MixerOptions& opt) const override {
    if (!in.q.defined() || !in.v.defined() || !in.q.is_cuda() || in.q.dim() != 4 || in.v.dim() != 4) return false;
    const auto dt = in.q.scalar_type();
    const int64_t dk = in.q.size(3), dv = in.v.size(3);
    const bool dk_ok = name() == kHla2Family ? (dk == 64 || dk == 128) : (dk == 64 || dk == 96 || dk == 128);
    return (dt == at::kBFloat16 || dt == at::kFloat) && dk_ok && dv % 64 == 0 && dv + kNormalizerColumns <= 256 &&
           opt.chunk_size == 64;
  }

 protected:
  void check_kernel_supports(const MixerInputs& in, const MixerOptions& opt) const {
    TORCH_CHECK(kernel_supports(in, opt), name(), ": the kernel form takes CUDA tensors in bf16 or fp32, dk in ",
                name() == kHla2Family ? "{64, 128}" : "{64, 96, 128}", ", dv in {64, 128, 192} and chunk_size 64; got q ",
                shape_str(in.q.sizes()), " ", in.q.scalar_type(), " on ", in.q.device(), ", v ",
                shape_str(in.v.sizes()), ", chunk_size ", opt.chunk_size);
  }
#endif
  void check_state(const State& x) const {
    TORCH_CHECK(x.size() == state_names().size(), name(), ": a state must hold ",
                state_names().size(), " tensors (", c10::Join(", ", state_names()), "), got ", x.size());
  }
};

// γ·X, or X when there is no decay.
Tensor decay(const Tensor& gamma, const Tensor& x) {
  if (!gamma.defined()) return x;
  auto g = gamma;
  while (g.dim() < x.dim()) g = g.unsqueeze(-1);
  return g * x;
}

// The slices' transports from the inputs in one look (what the kernel path's summaries carry), in fp32
// (fp64 for fp64 inputs): ρ = exp(Σ g) [B,H]; hla2's S̃ = Σ_t exp(Σ g − g_t) k_t k_tᵀ, ahla's R̄ = Σ_t k_t q_tᵀ.
at::ScalarType wide(const Tensor& q) { return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }
std::vector<Tensor> hla2_transport(const MixerInputs& in) {
  const auto dt = wide(in.q);
  Tensor k = in.k.to(dt);
  if (!in.g.defined())
    return {at::ones({k.size(0), k.size(2)}, k.options()), at::einsum("bthi,bthj->bhij", {k, k})};
  Tensor g = in.g.to(dt), total = g.sum(1);
  Tensor w = at::exp(total.unsqueeze(1) - g);
  return {at::exp(total), at::einsum("bth,bthi,bthj->bhij", {w, k, k})};
}
std::vector<Tensor> ahla_transport(const MixerInputs& in) {
  const auto dt = wide(in.q);
  Tensor k = in.k.to(dt), q = in.q.to(dt);
  Tensor rho = in.g.defined() ? at::exp(in.g.to(dt).sum(1)) : at::ones({k.size(0), k.size(2)}, k.options());
  return {rho, at::einsum("bthi,bthj->bhij", {k, q})};
}

class Hla2 final : public HlaBase {
 public:
  std::string name() const override { return kHla2Family; }
  std::vector<std::string> state_names() const override { return {"S", "C", "m", "G", "h"}; }

  State zero_state(const MixerInputs& in, const MixerOptions&) const override {
    auto [B, T, H, dk, dv] = dims(in);
    auto o = in.q.options();
    return {at::zeros({B, H, dk, dk}, o), at::zeros({B, H, dk, dv}, o), at::zeros({B, H, dk}, o),
            at::zeros({B, H, dk, dv}, o), at::zeros({B, H, dk}, o)};
  }

  MixerOutput naive(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, false);
    auto st = initial(in, init);
    Tensor S = st[0], C = st[1], m = st[2], G = st[3], h = st[4];
    double scale = opt.scale_for(in.q.size(3));
    auto q = to_bhtd(in.q), k = to_bhtd(in.k), v = to_bhtd(in.v);
    Tensor g = in.g.defined() ? to_bhtd(in.g) : Tensor();
    std::vector<Tensor> outs;
    for (int64_t t = 0; t < q.size(2); ++t) {
      auto qt = q.select(2, t), kt = k.select(2, t), vt = v.select(2, t);
      auto gamma = token_gamma(g, t);
      auto kk = outer_product(kt, kt);
      auto C_prev = C, m_prev = m;
      S = decay(gamma, S) + kk;
      C = decay(gamma, C) + outer_product(qt, vt);
      m = decay(gamma, m) + qt;
      G = decay(gamma, G) + at::matmul(kk, C_prev);
      h = decay(gamma, h) + matvec(kk, m_prev);
      auto qs = (qt * scale).unsqueeze(-2);                                  // [B,H,1,dk]
      auto o = at::matmul(qs, at::matmul(S, C) - G).squeeze(-2);
      if (opt.normalize) o = o / (at::matmul(qs, (matvec(S, m) - h).unsqueeze(-1)).squeeze(-1) + opt.eps);
      outs.push_back(o);
    }
    return {from_bhtd(at::stack(outs, 2)), {S, C, m, G, h}};
  }

  MixerOutput chunkwise(const MixerInputs& in, const State& init,
                        const MixerOptions& opt) const override {
    check(in, opt, true);
    auto r = run(in, initial(in, init), opt, /*outputs=*/true);
    return {r.o, r.state};
  }

#ifdef CARRY_WITH_CUDA
  MixerOutput kernel(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, true);
    check_kernel_supports(in, opt);
    if (hla2_joint_kernel_supports(in, opt)) return hla2_joint_kernel_form(in, init, opt);
    // Passes 1 and 4 as one when their values [k, W] fit one kernel pass (256 columns).
    const int64_t joint = in.q.size(3) + in.v.size(3) + (opt.normalize ? kNormalizerColumns : 0);
    return hla2_by_decay_passes(in, init, opt, decay_kernel_pass(opt.serial_states), joint <= 256);
  }
#endif

  Summary summarize(const MixerInputs& in, const MixerOptions& opt) const override {
    check(in, opt, true);
    if (resolve_form(in, opt) == Form::kernel) return {hla2_transport(in), kernel(in, {}, opt).final_state};
    auto r = run(in, initial(in, {}), opt, /*outputs=*/false);
    return {{r.rho, r.S_tilde}, r.state};
  }
  // transport zero (ρ = 0, S̃ = 0): the map to `s` whatever comes in.
  std::optional<Summary> fixed_summary(const MixerInputs& in, const State& s) const override {
    check_state(s);
    auto [B, T, H, dk, dv] = dims(in);
    auto o = s[0].options();
    return Summary{{at::zeros({B, H}, o), at::zeros({B, H, dk, dk}, o)}, s};
  }

  // first = A, second = B: the state part is B's map applied to A's state.
  Summary compose(const Summary& a, const Summary& b) const override {
    check_summary(a, "the first summary");
    check_summary(b, "the second summary");
    const Tensor &rho_a = a.transport[0], &rho_b = b.transport[0];
    auto S_tilde = as4(rho_b) * a.transport[1] + as4(rho_a) * b.transport[1];
    return {{rho_a * rho_b, S_tilde}, apply(b, a.state)};
  }

  State apply(const Summary& s, const State& x) const override {
    check_summary(s, "the summary");
    check_state(x);
    auto rho4 = as4(s.transport[0]), rho3 = as3(s.transport[0]);
    const Tensor& S_tilde = s.transport[1];
    return {rho4 * x[0] + s.state[0],
            rho4 * x[1] + s.state[1],
            rho3 * x[2] + s.state[2],
            rho4 * x[3] + s.state[3] + at::matmul(S_tilde, x[1]),
            rho3 * x[4] + s.state[4] + matvec(S_tilde, x[2])};
  }

 private:
  State initial(const MixerInputs& in, const State& init) const {
    auto [B, T, H, dk, dv] = dims(in);
    auto o = in.q.options();
    return {state_or_zeros(init, 0, {B, H, dk, dk}, o), state_or_zeros(init, 1, {B, H, dk, dv}, o),
            state_or_zeros(init, 2, {B, H, dk}, o), state_or_zeros(init, 3, {B, H, dk, dv}, o),
            state_or_zeros(init, 4, {B, H, dk}, o)};
  }

  struct Run {
    Tensor o;
    State state;
    Tensor rho, S_tilde;  // the transport of the whole slice
  };

  Run run(const MixerInputs& in, const State& init, const MixerOptions& opt, bool outputs) const {
    auto [B, T, H, dk, dv] = dims(in);
    int64_t C = opt.chunk_size;
    double scale = opt.scale_for(dk);
    auto q = split_chunks(to_bhtd(in.q), C), k = split_chunks(to_bhtd(in.k), C);
    auto v = split_chunks(append_one(to_bhtd(in.v)), C);
    Tensor g = in.g.defined() ? split_chunks(to_bhtd(in.g), C) : Tensor();
    Tensor S = init[0], Cv = with_norm(init[1], init[2]), Gv = with_norm(init[3], init[4]);  // C' = [C,m], G' = [G,h]
    Tensor rho = at::ones({B, H, 1, 1}, in.q.options()), S_tilde = at::zeros({B, H, dk, dk}, in.q.options());
    std::vector<Tensor> outs;
    for (int64_t n = 0; n < q.size(2); ++n) {
      auto Q = q.select(2, n), K = k.select(2, n), V = v.select(2, n);  // [B,H,C,·]
      auto d = chunk_decay(g.defined() ? g.select(2, n) : Tensor(), C, in.q.options());
      auto Kt = K.transpose(-1, -2);
      auto A = at::matmul(Q, Kt);                                          // A[t,s] = q_t·k_s
      auto W = d.Gamma_prev * at::matmul(K, Cv) + at::matmul(d.D_prev * A.transpose(-1, -2), V);
      if (outputs) {
        auto DA = d.D * A;
        auto R = d.Gamma * at::matmul(Q, S) + at::matmul(DA, K);          // rows q_tᵀ S_t
        auto SC = d.Gamma * at::matmul(R, Cv) + at::matmul(d.D * at::matmul(R, Q.transpose(-1, -2)), V);
        auto Gq = d.Gamma * at::matmul(Q, Gv) + at::matmul(DA, W);
        outs.push_back(readout(SC - Gq, opt, scale));
      }
      // Transport of the slice so far, then of this chunk: S̃ ← ρ_c S̃ + ρ S̃_c, ρ ← ρ ρ_c.
      S_tilde = d.rho * S_tilde + rho * at::matmul(Kt, d.all_but * K);
      rho = rho * d.rho;
      S = d.rho * S + at::matmul(Kt, d.to_end * K);
      Gv = d.rho * Gv + at::matmul(Kt, d.to_end * W);
      Cv = d.rho * Cv + at::matmul(Q.transpose(-1, -2), d.to_end * V);
    }
    Run r;
    if (outputs) r.o = from_bhtd(merge_chunks(at::stack(outs, 2)));
    auto [Cm, m] = split(Cv);
    auto [Gm, h] = split(Gv);
    r.state = {S, Cm, m, Gm, h};
    r.rho = rho.squeeze(-1).squeeze(-1);
    r.S_tilde = S_tilde;
    return r;
  }
};

class Ahla final : public HlaBase {
 public:
  std::string name() const override { return kAhlaFamily; }
  std::vector<std::string> state_names() const override { return {"P", "m_K", "E", "n"}; }

  State zero_state(const MixerInputs& in, const MixerOptions&) const override {
    auto [B, T, H, dk, dv] = dims(in);
    auto o = in.q.options();
    return {at::zeros({B, H, dk, dv}, o), at::zeros({B, H, dk}, o), at::zeros({B, H, dk, dv}, o),
            at::zeros({B, H, dk}, o)};
  }

  MixerOutput naive(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, false);
    auto st = initial(in, init);
    Tensor P = st[0], mK = st[1], E = st[2], n = st[3];
    double scale = opt.scale_for(in.q.size(3));
    auto q = to_bhtd(in.q), k = to_bhtd(in.k), v = to_bhtd(in.v);
    Tensor g = in.g.defined() ? to_bhtd(in.g) : Tensor();
    std::vector<Tensor> outs;
    for (int64_t t = 0; t < q.size(2); ++t) {
      auto qt = q.select(2, t), kt = k.select(2, t), vt = v.select(2, t);
      auto gamma = token_gamma(g, t);
      P = decay(gamma, P) + outer_product(kt, vt);
      mK = decay(gamma, mK) + kt;
      auto qP = at::matmul(qt.unsqueeze(-2), P).squeeze(-2);                  // q_tᵀ P_t  [B,H,dv]
      E = decay(gamma, E) + outer_product(kt, qP);
      n = decay(gamma, n) + kt * (qt * mK).sum(-1, true);
      auto qs = qt * scale;
      auto o = at::matmul(qs.unsqueeze(-2), E).squeeze(-2);
      if (opt.normalize) o = o / ((qs * n).sum(-1, true) + opt.eps);
      outs.push_back(o);
    }
    return {from_bhtd(at::stack(outs, 2)), {P, mK, E, n}};
  }

  MixerOutput chunkwise(const MixerInputs& in, const State& init,
                        const MixerOptions& opt) const override {
    check(in, opt, true);
    auto r = run(in, initial(in, init), opt, /*outputs=*/true);
    return {r.o, r.state};
  }

#ifdef CARRY_WITH_CUDA
  MixerOutput kernel(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, true);
    check_kernel_supports(in, opt);
    return ahla_by_decay_passes(in, init, opt, decay_kernel_pass(opt.serial_states));
  }
#endif

  Summary summarize(const MixerInputs& in, const MixerOptions& opt) const override {
    check(in, opt, true);
    if (resolve_form(in, opt) == Form::kernel) return {ahla_transport(in), kernel(in, {}, opt).final_state};
    auto r = run(in, initial(in, {}), opt, /*outputs=*/false);
    return {{r.rho, r.R_bar}, r.state};
  }
  // transport zero (ρ = 0, R̄ = 0): the map to `s` whatever comes in.
  std::optional<Summary> fixed_summary(const MixerInputs& in, const State& s) const override {
    check_state(s);
    auto [B, T, H, dk, dv] = dims(in);
    auto o = s[0].options();
    return Summary{{at::zeros({B, H}, o), at::zeros({B, H, dk, dk}, o)}, s};
  }

  Summary compose(const Summary& a, const Summary& b) const override {
    check_summary(a, "the first summary");
    check_summary(b, "the second summary");
    return {{a.transport[0] * b.transport[0], a.transport[1] + b.transport[1]}, apply(b, a.state)};
  }

  State apply(const Summary& s, const State& x) const override {
    check_summary(s, "the summary");
    check_state(x);
    auto rho4 = as4(s.transport[0]), rho3 = as3(s.transport[0]);
    const Tensor& R_bar = s.transport[1];
    return {rho4 * x[0] + s.state[0],
            rho3 * x[1] + s.state[1],
            rho4 * (x[2] + at::matmul(R_bar, x[0])) + s.state[2],
            rho3 * (x[3] + matvec(R_bar, x[1])) + s.state[3]};
  }

 private:
  State initial(const MixerInputs& in, const State& init) const {
    auto [B, T, H, dk, dv] = dims(in);
    auto o = in.q.options();
    return {state_or_zeros(init, 0, {B, H, dk, dv}, o), state_or_zeros(init, 1, {B, H, dk}, o),
            state_or_zeros(init, 2, {B, H, dk, dv}, o), state_or_zeros(init, 3, {B, H, dk}, o)};
  }

  struct Run {
    Tensor o;
    State state;
    Tensor rho, R_bar;
  };

  Run run(const MixerInputs& in, const State& init, const MixerOptions& opt, bool outputs) const {
    auto [B, T, H, dk, dv] = dims(in);
    int64_t C = opt.chunk_size;
    double scale = opt.scale_for(dk);
    auto q = split_chunks(to_bhtd(in.q), C), k = split_chunks(to_bhtd(in.k), C);
    auto v = split_chunks(append_one(to_bhtd(in.v)), C);
    Tensor g = in.g.defined() ? split_chunks(to_bhtd(in.g), C) : Tensor();
    Tensor Pv = with_norm(init[0], init[1]), Ev = with_norm(init[2], init[3]);  // P' = [P,m_K], E' = [E,n]
    Tensor rho = at::ones({B, H, 1, 1}, in.q.options()), R_bar = at::zeros({B, H, dk, dk}, in.q.options());
    std::vector<Tensor> outs;
    for (int64_t c = 0; c < q.size(2); ++c) {
      auto Q = q.select(2, c), K = k.select(2, c), V = v.select(2, c);  // [B,H,C,·]
      auto d = chunk_decay(g.defined() ? g.select(2, c) : Tensor(), C, in.q.options());
      auto Kt = K.transpose(-1, -2);
      auto DA = d.D * at::matmul(Q, Kt);
      auto Y = d.Gamma * at::matmul(Q, Pv) + at::matmul(DA, V);          // rows q_tᵀ P'_t
      if (outputs) {
        auto Z = d.Gamma * at::matmul(Q, Ev) + at::matmul(DA, Y);        // rows q_tᵀ E'_t
        outs.push_back(readout(Z, opt, scale));
      }
      R_bar = R_bar + at::matmul(Kt, Q);
      rho = rho * d.rho;
      Ev = d.rho * Ev + at::matmul(Kt, d.to_end * Y);
      Pv = d.rho * Pv + at::matmul(Kt, d.to_end * V);
    }
    Run r;
    if (outputs) r.o = from_bhtd(merge_chunks(at::stack(outs, 2)));
    auto [P, mK] = split(Pv);
    auto [E, n] = split(Ev);
    r.state = {P, mK, E, n};
    r.rho = rho.squeeze(-1).squeeze(-1);
    r.R_bar = R_bar;
    return r;
  }
};

CARRY_REGISTER_MIXER(Hla2);
CARRY_REGISTER_MIXER(Ahla);

}  // namespace
}  // namespace carry
