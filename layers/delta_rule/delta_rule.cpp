// DeltaNet ("deltanet"), Gated DeltaNet ("gated_deltanet"), Kimi Delta Attention ("kda", its chunk in
// layers/kda/kda.h) and RWKV-7's diagonal-plus-rank-one update ("rwkv7", its chunk in layers/rwkv7/rwkv7.h):
//   S_t = γ_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,  o_t = scale · S_tᵀ q_t,  γ_t = exp(g_t) (≡ 1
// for DeltaNet); KDA decays each key dimension: S_t = (I − β_t k_t k_tᵀ) Diag(e^{gk_t}) S_{t−1} + β_t k_t v_tᵀ;
// RWKV-7: S_t = (Diag(e^{gk_t}) + b_t a_tᵀ) S_{t−1} + k_t v_tᵀ. State {S} [B,H,dk,dv]; transport {A} [B,H,dk,dk], A = Π_t γ_t (I − β_t k_t k_tᵀ) (later
// token on the left), dense. Forms: naive = the token recurrence; chunkwise = the WY/UT form of
// Yang et al. (DeltaNet) with the gated extension of Gated DeltaNet: per chunk the pieces of
// delta_rule_chunk (gate cumulative sums restart at every chunk), o = M·V + P·S_in and
// S_out = A_chunk·S_in + B_chunk: the pieces of every chunk at once, the state carried chunk to chunk in
// order. summarize chains the same
// chunk transports in order. Everything runs in the input dtype promoted to at least fp32, so dense
// transport chains and states are never formed below fp32.
#include "layers/delta_rule/delta_rule.h"

#include "layers/core/fused_switch.h"
#include "layers/kda/kda.h"
#include "layers/kda/kernel_form.h"
#include "layers/rwkv7/kernel_form.h"
#include "layers/rwkv7/rwkv7.h"
#include "layers/layout.h"
#ifdef CARRY_WITH_CUDA
#include "layers/kernels/delta_rule/op.h"
#endif

#include <limits>

namespace carry {

namespace {

// States, transports and the chunk algebra are computed in this dtype: the input's, fp32 at least.
at::ScalarType compute_dtype(const Tensor& x) {
  return at::promote_types(x.scalar_type(), at::kFloat);
}

}  // namespace

DeltaChunkPieces delta_rule_chunk(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& beta, const Tensor& g, double scale, ChunkParts parts) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes(), "delta_rule_chunk: q and k must be [B,H,C,dk] "
              "of one shape, got ", shape_str(q.sizes()), " and ", shape_str(k.sizes()));
  int64_t B = q.size(0), H = q.size(1), C = q.size(2), dk = q.size(3);
  TORCH_CHECK(((parts == ChunkParts::reads || parts == ChunkParts::mixing) && !v.defined()) ||
                  (v.dim() == 4 && v.size(0) == B && v.size(1) == H && v.size(2) == C),
              "delta_rule_chunk: v must be [", B, ", ", H, ", ", C, ", dv], got ", shape_str(v.sizes()));
  TORCH_CHECK(beta.sizes() == at::IntArrayRef({B, H, C}), "delta_rule_chunk: beta must be [", B, ", ",
              H, ", ", C, "], got ", shape_str(beta.sizes()));
  TORCH_CHECK(!g.defined() || g.sizes() == beta.sizes(), "delta_rule_chunk: g must be [", B, ", ", H,
              ", ", C, "] or undefined, got ", shape_str(g.sizes()));
  auto opt = q.options();

  // Gate cumulative sums within this chunk (zero for DeltaNet) and Γ[t,s] = e^{G_t − G_s} on s ≤ t,
  // masked to −inf above the diagonal before the exp (no inf, no NaN, also in gradients).
  Tensor G = g.defined() ? g.cumsum(-1) : at::zeros_like(beta);                     // [B,H,C]
  auto causal = causal_mask(C, /*strict=*/false, opt);
  auto decay = (G.unsqueeze(-1) - G.unsqueeze(-2))
                   .masked_fill(causal.logical_not(), -std::numeric_limits<double>::infinity())
                   .exp();                                                          // [B,H,C,C]
  auto gate_in = G.exp().unsqueeze(-1);                                             // e^{G_t} [B,H,C,1]
  auto G_last = G.select(-1, C - 1);                                                // [B,H]
  auto gate_out = (G_last.unsqueeze(-1) - G).exp().unsqueeze(-1);                   // e^{G_C − G_s}

  // T = (I + L)⁻¹, L = strictly-lower(diag(β) K Kᵀ ⊙ Γ): a unit lower-triangular solve.
  auto beta_k = k * beta.unsqueeze(-1);
  auto L = (at::matmul(beta_k, k.transpose(-1, -2)) * decay).tril(-1);
  auto eye_c = at::eye(C, opt);
  auto T = at::linalg_solve_triangular(eye_c + L, eye_c.expand_as(L), /*upper=*/false,
                                       /*left=*/true, /*unitriangular=*/true);
  auto T_beta = T * beta.unsqueeze(-2);                                             // T·diag(β)
  auto qk = at::matmul(q, k.transpose(-1, -2)) * decay * scale;                     // causal, [C,C]

  DeltaChunkPieces p;
  p.mixing = at::matmul(qk, T_beta);
  if (parts == ChunkParts::mixing) return p;
  auto W = at::matmul(T, beta_k * gate_in);                                         // [B,H,C,dk]
  p.query_state = q * gate_in * scale - at::matmul(qk, W);
  if (parts == ChunkParts::reads) return p;
  auto k_out = k * gate_out;                                                        // K̃ [B,H,C,dk]
  if (parts == ChunkParts::walk) {
    p.w = W;
    p.u = at::matmul(T_beta, v);
    p.k_out = k_out;
    p.gate_last = G_last.exp();
    return p;
  }
  p.transport = at::exp(G_last).unsqueeze(-1).unsqueeze(-1) * at::eye(dk, opt) -
                at::matmul(k_out.transpose(-1, -2), W);
  p.value_state = at::matmul(k_out.transpose(-1, -2), T_beta);
  p.state = at::matmul(p.value_state, v);
  return p;
}

DeltaChunkPieces delta_rule_chunk(const MixerInputs& in, int64_t chunk, const MixerOptions& opt) {
  get_mixer(in.g.defined() ? "gated_deltanet" : "deltanet").check(in, opt, /*chunked=*/true);
  int64_t C = opt.chunk_size, N = in.q.size(1) / C;
  TORCH_CHECK(chunk >= 0 && chunk < N, "delta_rule_chunk: chunk index ", chunk, " out of range [0, ",
              N, ") for T=", in.q.size(1), " and chunk_size=", C);
  auto c = in.slice(chunk * C, C);
  auto dt = compute_dtype(in.q);
  auto bhtd = [&](const Tensor& x) { return x.defined() ? to_bhtd(x).to(dt) : x; };
  return delta_rule_chunk(bhtd(c.q), bhtd(c.k), bhtd(c.v), bhtd(c.beta), bhtd(c.g),
                          opt.scale_for(in.q.size(3)));
}

namespace {

// The families differ in their gate: none (DeltaNet), g a scalar a head (Gated DeltaNet), gk a decay a key
// dimension (KDA), or gk with the rank-one part b aᵀ in place of −β k kᵀ (RWKV-7, layers/rwkv7/rwkv7.h).
enum class Gate { none, scalar, diag, dplr };

class DeltaRule : public Mixer {
 public:
  explicit DeltaRule(Gate gate) : gate_(gate), gated_(gate == Gate::scalar) {}

  std::string name() const override {
    return gate_ == Gate::dplr ? kRwkv7Family : gate_ == Gate::diag ? "kda" : gated_ ? "gated_deltanet" : "deltanet";
  }
  std::vector<std::string> input_names() const override {
    if (gate_ == Gate::dplr) return {"q", "k", "v", "gk", "a", "b"};
    if (gate_ == Gate::diag) return {"q", "k", "v", "gk", "beta"};
    if (gated_) return {"q", "k", "v", "g", "beta"};
    return {"q", "k", "v", "beta"};
  }
  std::vector<std::string> state_names() const override { return {"S"}; }

  State zero_state(const MixerInputs& in, const MixerOptions&) const override {
    return {at::zeros(state_shape(in), in.q.options().dtype(compute_dtype(in.q)))};
  }

  void check(const MixerInputs& in, const MixerOptions& opt, bool chunked) const override {
    Mixer::check(in, opt, chunked);  // shapes, dtypes (and with check_values: finite β, g <= 0)
    if (!opt.check_values || gate_ == Gate::dplr) return;
    const Tensor& beta = in.beta;
    bool ok = ((beta >= kDeltaBetaMin) & (beta <= kDeltaBetaMax)).all().item<bool>();
    TORCH_CHECK(ok, name(), ": 'beta' (the delta-rule write strength) must lie in [", kDeltaBetaMin,
                ", ", kDeltaBetaMax, "] everywhere; found values in [", beta.min().item<double>(), ", ",
                beta.max().item<double>(), "]");
  }

  MixerOutput naive(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, /*chunked=*/false);
    auto dt = compute_dtype(in.q);
    auto S = initial(in, init);
    auto q = to_bhtd(in.q).to(dt) * opt.scale_for(in.q.size(3));
    auto k = to_bhtd(in.k).to(dt), v = to_bhtd(in.v).to(dt);
    Tensor gamma = gated_ ? to_bhtd(in.g).to(dt).exp() : Tensor();
    const bool diag = gate_ == Gate::diag || gate_ == Gate::dplr;
    Tensor alpha = diag ? to_bhtd(in.gk).to(dt).exp() : Tensor();  // [B,H,T,dk]
    std::vector<Tensor> outs;
    if (gate_ == Gate::dplr) {  // S = Diag(w) S + b (aᵀ S) + k vᵀ
      auto a = to_bhtd(in.a).to(dt), b = to_bhtd(in.b).to(dt);
      for (int64_t t = 0; t < q.size(2); ++t) {
        auto read = at::matmul(a.select(2, t).unsqueeze(-2), S);  // aᵀ S_{t−1} [B,H,1,dv]
        S = alpha.select(2, t).unsqueeze(-1) * S + b.select(2, t).unsqueeze(-1) * read +
            k.select(2, t).unsqueeze(-1) * v.select(2, t).unsqueeze(-2);
        outs.push_back(at::matmul(q.select(2, t).unsqueeze(-2), S).squeeze(-2));
      }
      return {from_bhtd(at::stack(outs, 2)).to(in.q.scalar_type()), {S}};
    }
    auto beta = to_bhtd(in.beta).to(dt);
    for (int64_t t = 0; t < q.size(2); ++t) {
      auto kt = k.select(2, t).unsqueeze(-1), vt = v.select(2, t).unsqueeze(-2);  // [B,H,dk,1], [B,H,1,dv]
      auto bt = beta.select(2, t).unsqueeze(-1).unsqueeze(-1);
      if (alpha.defined()) S = alpha.select(2, t).unsqueeze(-1) * S;  // KDA: Diag(α_t) first
      // (I − β k kᵀ) S = S − β k (kᵀ S)
      S = S - bt * kt * at::matmul(kt.transpose(-1, -2), S);
      if (gated_) S = gamma.select(2, t).unsqueeze(-1).unsqueeze(-1) * S;
      S = S + bt * kt * vt;
      outs.push_back(at::matmul(q.select(2, t).unsqueeze(-2), S).squeeze(-2));
    }
    return {from_bhtd(at::stack(outs, 2)).to(in.q.scalar_type()), {S}};
  }

#ifdef CARRY_WITH_CUDA
  // The kernel forms: DeltaNet and Gated DeltaNet through layers/kernels/delta_rule/{fwd,bwd}.cu and the
  // autograd op of layers/kernels/delta_rule/op.cpp, Hopper's kernels (wgmma: on another GPU those layers
  // have no kernel form, fused_switch.h). KDA's and RWKV-7's kernel forms (layers/kda/kernel_form.h,
  // layers/rwkv7/kernel_form.h: their state walks run on any GPU) are reached through kernel() but not
  // chosen by has_kernel() until their GPU tests (KdaKernelForm.*, Rwkv7KernelForm.*) have passed on a GPU.
  bool has_kernel() const override {
    return (gate_ == Gate::none || gate_ == Gate::scalar) && gpu_runs_hopper_kernels();
  }
  bool kernel_supports(const MixerInputs& in, const MixerOptions& opt) const override {
    if (gate_ == Gate::diag) return kda_kernel_supports(in, opt);
    if (gate_ == Gate::dplr) return rwkv7_kernel_supports(in, opt);
    return has_kernel() && delta_rule_kernel_supports(in, opt);
  }
  MixerOutput kernel(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, /*chunked=*/true);
    if (gate_ == Gate::diag || gate_ == Gate::dplr) {
      TORCH_CHECK(kernel_supports(in, opt), name(), ": the kernel form takes CUDA tensors in bf16 or fp32, dk in "
                  "{64, 128}, dv a multiple of 16 up to 256 and chunk_size 64; got q ", shape_str(in.q.sizes()), " ",
                  in.q.scalar_type(), " on ", in.q.device(), ", v ", shape_str(in.v.sizes()), ", chunk_size ",
                  opt.chunk_size);
      return gate_ == Gate::diag ? kda_kernel_form(in, init.empty() ? Tensor() : init[0], opt)
                                 : rwkv7_kernel_form(in, init.empty() ? Tensor() : init[0], opt);
    }
    TORCH_CHECK(kernel_supports(in, opt), name(), ": the kernel form takes CUDA tensors in bf16 or "
                "fp32, dk in {64, 128}, dv in {64, 128, 256} and chunk_size 64, on a Hopper GPU; got q ", shape_str(in.q.sizes()),
                " ", in.q.scalar_type(), " on ", in.q.device(), ", v ", shape_str(in.v.sizes()),
                ", chunk_size ", opt.chunk_size);
    return delta_rule_kernel_forward(in, init.empty() ? Tensor() : init[0], opt);
  }
#endif

  MixerOutput chunkwise(const MixerInputs& in, const State& init,
                        const MixerOptions& opt) const override {
    check(in, opt, /*chunked=*/true);
    auto S = initial(in, init);
    auto c = chunks(in, opt);
    // Every chunk's pieces at once (they do not depend on the state), then the state chunk to chunk in
    // order (one product and one sum a chunk), then every chunk's output at once.
    const int64_t N = c.q.size(2);
    DeltaChunkPieces p = pieces(c, opt);
    std::vector<Tensor> incoming;
    incoming.reserve(N);
    for (int64_t n = 0; n < N; ++n) {
      incoming.push_back(S);
      S = at::matmul(p.transport.select(2, n), S) + p.state.select(2, n);
    }
    Tensor o = at::matmul(p.mixing, c.v) + at::matmul(p.query_state, at::stack(incoming, 2));  // [B,H,N,C,dv]
    return {from_bhtd(merge_chunks(o)).to(in.q.scalar_type()), {S}};
  }

  // transport {A} [B,H,dk,dk], state {B}: B is the slice run from the zero state, A the slice run from
  // the identity with v = 0 (then every write is zero and S_out = A·I). Both through forward, so on CUDA
  // the kernel form computes them (two passes at kernel speed instead of a chain of small ATen products
  // a chunk; the tree and allgather scans summarize with it).
  Summary summarize(const MixerInputs& in, const MixerOptions& opt) const override {
    check(in, opt, /*chunked=*/true);
    const MixerOptions plain = plain_options(opt);
    Tensor A = identity_run(in, plain).final_state[0];
    Tensor S = forward(in, {}, plain).final_state[0];
    return {{A}, {S}};
  }

  // The one-pass scans (ranks between the ends): the run from the identity with v = 0 gives, besides
  // the transport A (its final state), every token's output row q̃_t = scale·(A_{≤t})ᵀq_t (A_{≤t} the
  // transport up to the state token t reads), and the output is linear in S_in through them:
  // forward(in, S_in).o_t = forward(in, 0).o_t + S_inᵀq̃_t. So such a rank runs the slice twice from
  // the start (from zero, from the identity), both at once, instead of summarizing twice and running
  // again after the scan.
  bool has_state_output(const MixerInputs&, const MixerOptions&) const override { return true; }
  std::vector<Tensor> transport(const MixerInputs& in, const MixerOptions& opt) const override {
    return state_readout(in, opt).transport;
  }
  Tensor state_output(const MixerInputs& in, const State& s_in, const MixerOptions& opt) const override {
    return state_readout(in, opt).share(s_in);
  }
  StateReadout state_readout(const MixerInputs& in, const MixerOptions& opt) const override {
    check(in, opt, /*chunked=*/true);
    MixerOutput id = identity_run(in, plain_options(opt));
    Tensor rows = id.o;  // [B,T,H,dk]: q̃
    return {{id.final_state[0]}, [rows](const State& s_in) {
              TORCH_CHECK(s_in.size() == 1 && s_in[0].defined() && s_in[0].dim() == 4 &&
                              s_in[0].size(2) == rows.size(3),
                          "delta rule: S_in's share expects a state {S [B,H,dk,dv]} with dk = ", rows.size(3));
              return state_product(rows, s_in[0]);
            }};
  }

  // transport zero: S_out = s whatever comes in.
  std::optional<Summary> fixed_summary(const MixerInputs& in, const State& s) const override {
    TORCH_CHECK(s.size() == 1 && s[0].defined() && s[0].dim() == 4, name(), ": fixed_summary expects a state {S}");
    const int64_t dk = s[0].size(2);
    return Summary{{at::zeros({s[0].size(0), s[0].size(1), dk, dk}, s[0].options())}, {s[0]}};
  }

  Summary compose(const Summary& first, const Summary& second) const override {
    check_summary(first, "first");
    check_summary(second, "second");
    const Tensor &A1 = first.transport[0], &A2 = second.transport[0];
    return {{at::matmul(A2, A1)}, {at::matmul(A2, first.state[0]) + second.state[0]}};
  }

  State apply(const Summary& summary, const State& state) const override {
    check_summary(summary, "summary");
    TORCH_CHECK(state.size() == 1 && state[0].defined() &&
                    state[0].sizes() == summary.state[0].sizes(),
                name(), ": apply expects a state {S} of shape ", shape_str(summary.state[0].sizes()));
    return {at::matmul(summary.transport[0], state[0]) + summary.state[0]};
  }

 private:
  Gate gate_;
  bool gated_;  // the scalar gate g

  // The options of a run that is not the caller's forward: the slice as one piece (document starts are
  // the scan's), no hooks, values checked once by the caller.
  static MixerOptions plain_options(const MixerOptions& opt) {
    MixerOptions plain = opt;
    plain.document_starts = Tensor();
    plain.document_offsets.clear();
    plain.check_values = false;
    plain.on_final_state = nullptr;
    plain.on_initial_state_grad = nullptr;
    return plain;
  }
  // The slice run from the identity state [B,H,dk,dk] with v = 0: its final state is the slice's
  // transport, its output q̃ (see state_readout).
  MixerOutput identity_run(const MixerInputs& in, const MixerOptions& plain) const {
    const int64_t B = in.q.size(0), T = in.q.size(1), H = in.q.size(2), dk = in.q.size(3);
    MixerInputs writes_nothing = in;
    writes_nothing.v = at::zeros({B, T, H, dk}, in.v.options());
    Tensor eye = at::eye(dk, in.q.options().dtype(compute_dtype(in.q))).expand({B, H, dk, dk}).contiguous();
    return forward(writes_nothing, {eye}, plain);
  }

  // Chunked [B,H,N,C,·] views of the inputs in the compute dtype; g undefined for DeltaNet, KDA's and
  // RWKV-7's gk in g; a and b for RWKV-7 only, beta for the others.
  struct Chunks {
    Tensor q, k, v, beta, g, a, b;
  };
  Chunks chunks(const MixerInputs& in, const MixerOptions& opt) const {
    auto dt = compute_dtype(in.q);
    int64_t C = opt.chunk_size;
    auto split = [&](const Tensor& x) { return x.defined() ? split_chunks(to_bhtd(x).to(dt), C) : Tensor(); };
    const bool diag = gate_ == Gate::diag || gate_ == Gate::dplr;
    return {split(in.q), split(in.k), split(in.v), split(in.beta),
            gated_ ? split(in.g) : diag ? split(in.gk) : Tensor(),
            gate_ == Gate::dplr ? split(in.a) : Tensor(), gate_ == Gate::dplr ? split(in.b) : Tensor()};
  }
  // The pieces of every chunk, [B,H,N,·]: the chunk functions see the N chunks of a head as N more heads.
  DeltaChunkPieces pieces(const Chunks& c, const MixerOptions& opt) const {
    const int64_t H = c.q.size(1), N = c.q.size(2);
    auto heads = [&](const Tensor& x) {  // [B,H,N,C,·] -> [B,H·N,C,·]
      if (!x.defined()) return x;
      auto s = x.sizes().vec();
      s.erase(s.begin() + 1, s.begin() + 3);
      s.insert(s.begin() + 1, H * N);
      return x.reshape(s);
    };
    const double scale = opt.scale_for(c.q.size(-1));
    DeltaChunkPieces p =
        gate_ == Gate::dplr ? dplr_chunk(heads(c.q), heads(c.k), heads(c.v), heads(c.a), heads(c.b), heads(c.g), scale)
        : gate_ == Gate::diag ? kda_chunk(heads(c.q), heads(c.k), heads(c.v), heads(c.beta), heads(c.g), scale)
                              : delta_rule_chunk(heads(c.q), heads(c.k), heads(c.v), heads(c.beta), heads(c.g), scale);
    auto chunked = [&](Tensor& x) {  // [B,H·N,·] -> [B,H,N,·]
      if (!x.defined()) return;
      auto s = x.sizes().vec();
      s.erase(s.begin() + 1);
      s.insert(s.begin() + 1, {H, N});
      x = x.reshape(s);
    };
    for (Tensor* x : {&p.mixing, &p.query_state, &p.transport, &p.state, &p.value_state}) chunked(*x);
    return p;
  }

  std::vector<int64_t> state_shape(const MixerInputs& in) const {
    return {in.q.size(0), in.q.size(2), in.q.size(3), in.v.size(3)};
  }
  Tensor initial(const MixerInputs& in, const State& init) const {
    auto dt = compute_dtype(in.q);
    auto S = state_or_zeros(init, 0, state_shape(in), in.q.options().dtype(dt));
    TORCH_CHECK(S.scalar_type() == dt, name(), ": initial_state S has dtype ", S.scalar_type(),
                " but inputs of dtype ", in.q.scalar_type(), " carry their state in ", dt);
    return S;
  }
  void check_summary(const Summary& s, const char* what) const {
    TORCH_CHECK(s.transport.size() == 1 && s.state.size() == 1 && s.transport[0].defined() &&
                    s.state[0].defined() && s.transport[0].dim() == 4 &&
                    s.transport[0].size(-1) == s.transport[0].size(-2) &&
                    s.transport[0].size(-1) == s.state[0].size(-2),
                name(), ": ", what, " must be a summary with transport {A [B,H,dk,dk]} and state "
                "{S [B,H,dk,dv]}");
  }
};

struct DeltaNet final : DeltaRule {
  DeltaNet() : DeltaRule(Gate::none) {}
};
struct GatedDeltaNet final : DeltaRule {
  GatedDeltaNet() : DeltaRule(Gate::scalar) {}
};
struct Kda final : DeltaRule {
  Kda() : DeltaRule(Gate::diag) {}
};
struct Rwkv7 final : DeltaRule {
  Rwkv7() : DeltaRule(Gate::dplr) {}
};

CARRY_REGISTER_MIXER(DeltaNet);
CARRY_REGISTER_MIXER(GatedDeltaNet);
CARRY_REGISTER_MIXER(Kda);
CARRY_REGISTER_MIXER(Rwkv7);

}  // namespace
}  // namespace carry
