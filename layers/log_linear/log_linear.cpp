// Log-linear attention over Mamba-2 ("loglinear_mamba2") and Gated DeltaNet ("loglinear_gdn").
//
// Recurrence (absolute positions, level(t,s) = bit_width(t xor s), see fenwick.h), per head:
//   o_t = scale · Σ_{s≤t} λ_t[level(t,s)] q_tᵀ Φ(t,s) w_s,   Φ(t,s) = A_t ⋯ A_{s+1} (Φ(t,t) = I),
//   Mamba-2:        A_r = exp(g_r) (a scalar),            w_s = k_s v_sᵀ;
//   Gated DeltaNet: A_r = exp(g_r) (I − β_r k_r k_rᵀ),    w_s = β_s k_s v_sᵀ.
// State at a boundary p: one S_j [B,H,dk,dv] per bit j = 0..L−2, S_j = Σ_{s in block j} Φ(p−1,s) w_s.
// A token t ≥ p reads S_j as λ_t[bit_width(t xor b_j(p))] q_tᵀ (A_t ⋯ A_p) S_j; moving the boundary
// merges blocks Fenwick-style (fenwick_merge_target), and every entry takes the same transport.
//
// Forms:
//   naive     — the token recurrence over the block states (transport every entry through token t,
//               read, then merge p -> p+1 and put w_t into its entry);
//   chunkwise — per chunk (chunk_size C a power of two, chunks at multiples of C in absolute
//               position) the base model's chunk pieces (ChunkPieces below): o = (M ⊙ Λ) V + Σ_j
//               (λ_t[level of entry j] P_t) S_j (Gated DeltaNet pieces from layers/delta_rule/delta_rule.h); then every entry is transported by the chunk's A, the
//               blocks merge to the boundary a+C and the chunk's own contribution joins the entry
//               msb((a+C) xor a). Gate cumulative sums restart at every chunk, the states go chunk to
//               chunk in order, and level weights are picked by exact one-hot products (no gather, whose
//               backward would add with atomics on GPU).
// The state-summary algebra: summarize runs the chunkwise form from the zero state and multiplies the
// chunks' transports; compose and apply transport, merge and add (log_linear.h gives the layout).
#include "layers/log_linear/log_linear.h"

#include "layers/core/fused_switch.h"
#include "layers/layout.h"
#include "layers/delta_rule/delta_rule.h"
#include "layers/log_linear/fenwick.h"
#include "layers/log_linear/level_passes.h"
#ifdef CARRY_WITH_CUDA
#include "layers/kernels/delta_rule/op.h"
#endif

#include <limits>

namespace carry {

std::pair<int64_t, int64_t> log_linear_summary_span(const Summary& summary) {
  TORCH_CHECK(summary.transport.size() == 3,
              "a log-linear summary's transport is {A, p, q} (3 tensors), got ",
              summary.transport.size(), " tensors");
  return {summary.transport[1].item<int64_t>(), summary.transport[2].item<int64_t>()};
}

namespace {

enum class Base { mamba2, gated_deltanet };

constexpr double kInf = std::numeric_limits<double>::infinity();

// A chunk's pieces in the base model, chunk-local (positions 0..C-1, Φ over the chunk's own tokens),
// with the scale already in q.
struct ChunkPieces {
  Tensor mixing;        // M [B,H,C,C]: M[t,s] = q_tᵀ Φ(t,s) k_s (·β_s), so o_intra = (M ⊙ Λ) V
  Tensor query;         // P [B,H,C,dk]: row t = q_tᵀ A_t ⋯ A_0, the reader of a state at the chunk start
  Tensor transport;     // A_{C-1} ⋯ A_0: [B,H] (Mamba-2) or [B,H,dk,dk] (Gated DeltaNet)
  Tensor contribution;  // [B,H,dk,dv]: Σ_s Φ(C-1,s) w_s
};

// exp(G_t − G_s) where `mask` holds, 0 elsewhere (masked before the exp).
Tensor pair_decay(const Tensor& G, const Tensor& mask) {
  return (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(mask.logical_not(), -kInf).exp();
}

// Mamba-2 (SSD): q, k [B,H,C,dk], v [B,H,C,dv], g [B,H,C].
ChunkPieces mamba2_chunk(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                         const Tensor& mask) {
  auto G = g.cumsum(-1);
  auto last = G.narrow(-1, G.size(-1) - 1, 1);  // [B,H,1]
  ChunkPieces c;
  c.mixing = at::matmul(q, k.transpose(-1, -2)) * pair_decay(G, mask);
  c.query = q * G.exp().unsqueeze(-1);
  c.transport = last.squeeze(-1).exp();
  auto kd = k * (last - G).exp().unsqueeze(-1);
  c.contribution = at::matmul(kd.transpose(-1, -2), v);
  return c;
}

// Gated DeltaNet: the delta rule's chunk pieces (layers/delta_rule/delta_rule.h, WY/UT form); q carries the scale.
ChunkPieces gated_delta_chunk(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                              const Tensor& beta) {
  auto d = delta_rule_chunk(q, k, v, beta, g, /*scale=*/1.0);
  return {d.mixing, d.query_state, d.transport, d.state};
}

// One-hot [rows, cols, L] of integer levels `idx` [rows, cols], in the options' dtype and device.
Tensor level_one_hot(const std::vector<int64_t>& idx, int64_t rows, int64_t cols, int64_t L,
                     const at::TensorOptions& opt) {
  auto t = at::tensor(idx, at::TensorOptions().dtype(at::kLong)).reshape({rows, cols});
  return at::one_hot(t, L).to(opt);
}

// w[..., t, c] = λ[..., t, level(t, c)] for λ [B,H,C,L] and a one-hot [C, cols, L]: an exact product
// (one nonzero term per sum).
Tensor pick_levels(const Tensor& lam, const Tensor& one_hot) {
  return (lam.unsqueeze(-2) * one_hot).sum(-1);
}

class LogLinear : public Mixer {
 public:
  explicit LogLinear(Base base) : base_(base) {}

  std::string name() const override {
    return base_ == Base::mamba2 ? "loglinear_mamba2" : "loglinear_gdn";
  }
  // Summaries hold the slice's Fenwick blocks, which are positions: they do not restart at a document.
  bool summary_resets_at_documents() const override { return false; }
  std::vector<std::string> input_names() const override {
    if (base_ == Base::mamba2) return {"q", "k", "v", "g", "l"};
    return {"q", "k", "v", "g", "beta", "l"};
  }
  // The tuple holds L−1 entries S_j, one per bit j of the boundary position (L = l.size(3)).
  std::vector<std::string> state_names() const override { return {"S"}; }

  State zero_state(const MixerInputs& in, const MixerOptions&) const override {
    TORCH_CHECK(in.l.defined() && in.l.dim() == 4 && in.l.size(3) >= 1, name(),
                ": zero_state needs 'l' [B, T, H, L] to know the number of levels");
    int64_t B = in.q.size(0), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3);
    State s;
    for (int64_t j = 0; j + 1 < in.l.size(3); ++j) s.push_back(at::zeros({B, H, dk, dv}, in.q.options()));
    return s;
  }

  void check(const MixerInputs& in, const MixerOptions& opt, bool chunked) const override {
    Mixer::check(in, opt, chunked);
    int64_t T = in.q.size(1), L = in.l.size(3);
    TORCH_CHECK(opt.offset >= 0, name(), ": offset (absolute position of the first token) must be "
                "non-negative, got ", opt.offset);
    int64_t end = opt.offset + T, need = fenwick_levels_needed(end);
    TORCH_CHECK(L >= need, name(), ": 'l' has L=", L, " level weights, but positions [", opt.offset,
                ", ", end, ") and the state at ", end, " need L >= ", need, " (levels 0..",
                bit_width(end > 0 ? end - 1 : 0), ", state entries for bits 0..", need - 2, ")");
    if (chunked) {
      int64_t C = opt.chunk_size;
      TORCH_CHECK((C & (C - 1)) == 0, name(), ": chunk_size must be a power of two, got ", C);
      TORCH_CHECK(opt.offset % C == 0, name(), ": offset must be a multiple of chunk_size=", C,
                  " in the chunkwise form (chunks start at multiples of C), got ", opt.offset);
    }
  }

  MixerOutput naive(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, false);
    auto S = initial(in, init);
    int64_t T = in.q.size(1), J = static_cast<int64_t>(S.size());
    auto q = to_bhtd(in.q) * opt.scale_for(in.q.size(3)), k = to_bhtd(in.k), v = to_bhtd(in.v);
    auto g = to_bhtd(in.g), lam = to_bhtd(in.l);
    Tensor beta = base_ == Base::gated_deltanet ? to_bhtd(in.beta) : Tensor();
    std::vector<Tensor> outs;
    for (int64_t t = 0; t < T; ++t) {
      int64_t pos = opt.offset + t;
      auto qt = q.select(2, t).unsqueeze(-2), kt = k.select(2, t), vt = v.select(2, t);
      auto gt = g.select(2, t).unsqueeze(-1).unsqueeze(-1), lt = lam.select(2, t);
      auto weight = [&](int64_t level) { return lt.select(-1, level).unsqueeze(-1); };  // [B,H,1]
      auto write = kt.unsqueeze(-1) * vt.unsqueeze(-2);
      Tensor bt;
      if (base_ == Base::gated_deltanet) {
        bt = beta.select(2, t).unsqueeze(-1).unsqueeze(-1);
        write = bt * write;
      }
      for (auto& s : S) {
        if (base_ == Base::mamba2) {
          s = gt.exp() * s;
        } else {
          auto ks = at::matmul(kt.unsqueeze(-2), s);  // kᵀS [B,H,1,dv]
          s = gt.exp() * (s - bt * kt.unsqueeze(-1) * ks);
        }
      }
      auto o = weight(0) * at::matmul(qt, write).squeeze(-2);
      for (int64_t j = 0; j < J; ++j)
        o = o + weight(fenwick_entry_level(pos, j, pos)) * at::matmul(qt, S[j]).squeeze(-2);
      outs.push_back(o);
      S = merge(S, pos, pos + 1);
      int64_t e = fenwick_token_entry(pos + 1, pos);
      S[e] = S[e] + write;
    }
    return {from_bhtd(at::stack(outs, 2)), S};
  }

  MixerOutput chunkwise(const MixerInputs& in, const State& init,
                        const MixerOptions& opt) const override {
    return run_chunks(in, init, opt, nullptr);
  }

#ifdef CARRY_WITH_CUDA
  // The kernel forms (level_passes.h): Mamba-2's levels above the chunk as matrix products (cuBLAS);
  // Gated DeltaNet every level above the chunk in one walk (level_walk.h, its kernels for bf16).
  // Gated DeltaNet's walk is a Hopper kernel (wgmma): on another GPU only the Mamba-2 base has a kernel form.
  bool has_kernel() const override { return base_ == Base::mamba2 || gpu_runs_hopper_kernels(); }
  bool kernel_supports(const MixerInputs& in, const MixerOptions& opt) const override {
    if (!has_kernel() || !in.q.defined() || !in.v.defined() || !in.q.is_cuda() || in.q.dim() != 4 || in.v.dim() != 4)
      return false;
    const auto dt = in.q.scalar_type();
    const int64_t dk = in.q.size(3), dv = in.v.size(3);
    if (dt != at::kBFloat16 && dt != at::kFloat) return false;
    if (base_ == Base::mamba2) return true;  // matrix products: any width, any chunk
    return (dk == 64 || dk == 128) && (dv == 64 || dv == 128 || dv == 256) && opt.chunk_size == 64;
  }
  MixerOutput kernel(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, true);
    TORCH_CHECK(kernel_supports(in, opt), name(), ": the kernel form takes CUDA tensors in bf16 or fp32",
                base_ == Base::mamba2 ? "" : ", dk in {64, 128}, dv in {64, 128, 256} and chunk_size 64 on a Hopper GPU",
                "; got q ", shape_str(in.q.sizes()), " ", in.q.scalar_type(), " on ", in.q.device(), ", v ",
                shape_str(in.v.sizes()), ", chunk_size ", opt.chunk_size);
    if (base_ == Base::mamba2)
      return loglinear_mamba2_by_level_products(in, init.empty() ? State{} : initial(in, init), opt);
    const bool serial = opt.serial_states;
    const DeltaPass pass = [serial](const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                    const Tensor& beta, const Tensor& s0) {
      MixerInputs x;
      x.q = q, x.k = k, x.v = v, x.g = g, x.beta = beta;
      MixerOptions o;
      o.scale = 1.0;
      o.serial_states = serial;
      auto r = delta_rule_kernel_forward(x, s0, o);
      return std::make_pair(r.o, r.final_state.at(0));
    };
    return loglinear_gdn_by_level_passes(in, init.empty() ? State{} : initial(in, init), opt, pass);
  }
#endif

  Summary summarize(const MixerInputs& in, const MixerOptions& opt) const override {
    auto position = [&](int64_t p) { return at::full({1}, p, in.q.options().dtype(at::kLong)); };
    const auto span = std::make_pair(position(opt.offset), position(opt.offset + in.q.size(1)));
    if (base_ == Base::mamba2 && resolve_form(in, opt) == Form::kernel) {  // the transport in one look
      // (Gated DeltaNet's dense transport needs the chunk products: the chunkwise form below)
      check(in, opt, true);
      Tensor A = in.g.to(in.q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat).sum(1).exp();
      return {{A, span.first, span.second}, kernel(in, {}, opt).final_state};
    }
    Tensor A;
    auto out = run_chunks(in, {}, opt, &A);
    return {{A, span.first, span.second}, out.final_state};
  }

  Summary compose(const Summary& first, const Summary& second) const override {
    auto [p1, q1] = log_linear_summary_span(first);
    auto [p2, q2] = log_linear_summary_span(second);
    TORCH_CHECK(q1 == p2, name(), ": compose needs adjacent summaries (the first ending where the "
                "second starts), got [", p1, ", ", q1, ") then [", p2, ", ", q2, ")");
    TORCH_CHECK(first.state.size() == second.state.size(), name(), ": compose needs summaries with "
                "the same number of state entries (L-1), got ", first.state.size(), " and ",
                second.state.size());
    const Tensor &a1 = first.transport[0], &a2 = second.transport[0];
    Tensor a = base_ == Base::mamba2 ? a2 * a1 : at::matmul(a2, a1);
    auto state = advance(first.state, a2, q1, q2);
    for (size_t j = 0; j < state.size(); ++j) state[j] = state[j] + second.state[j];
    return {{a, first.transport[1], second.transport[2]}, state};
  }

  State apply(const Summary& summary, const State& state) const override {
    auto [p, q] = log_linear_summary_span(summary);
    if (state.empty()) return summary.state;
    TORCH_CHECK(state.size() == summary.state.size(), name(), ": apply needs a state with ",
                summary.state.size(), " entries (L-1, as in the summary), got ", state.size());
    auto out = advance(state, summary.transport[0], p, q);
    for (size_t j = 0; j < out.size(); ++j) out[j] = out[j] + summary.state[j];
    return out;
  }

 private:
  Base base_;

  std::vector<Tensor> initial(const MixerInputs& in, const State& init) const {
    int64_t B = in.q.size(0), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3);
    int64_t J = in.l.size(3) - 1;
    TORCH_CHECK(init.empty() || static_cast<int64_t>(init.size()) == J, name(),
                ": initial_state must have L-1=", J, " entries (one per bit of the boundary "
                "position, L from 'l'), got ", init.size());
    std::vector<Tensor> s;
    for (int64_t j = 0; j < J; ++j) s.push_back(state_or_zeros(init, j, {B, H, dk, dv}, in.q.options()));
    return s;
  }

  // The entries of the state at p moved to the boundary q (no transport); sums in ascending j.
  static std::vector<Tensor> merge(const std::vector<Tensor>& S, int64_t p, int64_t q) {
    std::vector<Tensor> out(S.size());
    for (size_t j = 0; j < S.size(); ++j) {
      int64_t to = fenwick_merge_target(p, q, static_cast<int64_t>(j));
      TORCH_CHECK(to < static_cast<int64_t>(S.size()), "log-linear: the state at ", q, " needs entry ",
                  to, " but has only ", S.size(), " (L-1); give 'l' more levels");
      out[to] = out[to].defined() ? out[to] + S[j] : S[j];
    }
    for (auto& t : out)
      if (!t.defined()) t = at::zeros_like(S[0]);
    return out;
  }

  // The base transport A applied to a state entry.
  Tensor transport(const Tensor& A, const Tensor& S) const {
    if (base_ == Base::mamba2) return A.unsqueeze(-1).unsqueeze(-1) * S;
    return at::matmul(A, S);
  }

  // Every entry of the state at p transported by A, then merged to the boundary q.
  std::vector<Tensor> advance(const std::vector<Tensor>& S, const Tensor& A, int64_t p, int64_t q) const {
    std::vector<Tensor> moved;
    for (auto& s : S) moved.push_back(transport(A, s));
    return merge(moved, p, q);
  }

  MixerOutput run_chunks(const MixerInputs& in, const State& init, const MixerOptions& opt,
                         Tensor* slice_transport) const {
    check(in, opt, true);
    auto S = initial(in, init);
    int64_t B = in.q.size(0), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3);
    int64_t L = in.l.size(3), J = L - 1, C = opt.chunk_size, N = in.q.size(1) / C;
    auto fopt = in.q.options();
    auto q = split_chunks(to_bhtd(in.q) * opt.scale_for(dk), C);
    auto k = split_chunks(to_bhtd(in.k), C), v = split_chunks(to_bhtd(in.v), C);
    auto g = split_chunks(to_bhtd(in.g), C), lam = split_chunks(to_bhtd(in.l), C);
    Tensor beta = base_ == Base::gated_deltanet ? split_chunks(to_bhtd(in.beta), C) : Tensor();
    auto mask = causal_mask(C, false, fopt);
    // Levels inside a chunk: chunks start at multiples of C, so level(t,s) = bit_width(t xor s) in
    // chunk-local positions (above the diagonal M is zero; level 0 is as good as any there).
    std::vector<int64_t> pair_levels(C * C, 0);
    for (int64_t t = 0; t < C; ++t)
      for (int64_t s = 0; s <= t; ++s) pair_levels[t * C + s] = fenwick_level(t, s);
    auto pair_hot = level_one_hot(pair_levels, C, C, L, fopt);

    std::vector<Tensor> outs;
    for (int64_t n = 0; n < N; ++n) {
      int64_t a = opt.offset + n * C;
      auto qc = q.select(2, n), kc = k.select(2, n), vc = v.select(2, n), gc = g.select(2, n);
      auto piece = base_ == Base::mamba2
                       ? mamba2_chunk(qc, kc, vc, gc, mask)
                       : gated_delta_chunk(qc, kc, vc, gc, beta.select(2, n));
      auto lc = lam.select(2, n);  // [B,H,C,L]
      auto o = at::matmul(piece.mixing * pick_levels(lc, pair_hot), vc);
      // The incoming entries, each read at its level by every token of the chunk.
      std::vector<int64_t> entry_levels(C * J);
      for (int64_t t = 0; t < C; ++t)
        for (int64_t j = 0; j < J; ++j) entry_levels[t * J + j] = fenwick_entry_level(a, j, a + t);
      auto w = pick_levels(lc, level_one_hot(entry_levels, C, J, L, fopt));  // [B,H,C,J]
      auto reader = (piece.query.unsqueeze(-2) * w.unsqueeze(-1)).reshape({B, H, C, J * dk});
      o = o + at::matmul(reader, at::stack(S, 2).reshape({B, H, J * dk, dv}));
      outs.push_back(o);
      S = advance(S, piece.transport, a, a + C);
      int64_t e = fenwick_token_entry(a + C, a);
      S[e] = S[e] + piece.contribution;
      if (slice_transport) {
        Tensor& A = *slice_transport;
        if (!A.defined()) A = piece.transport;
        else A = base_ == Base::mamba2 ? piece.transport * A : at::matmul(piece.transport, A);
      }
    }
    return {from_bhtd(merge_chunks(at::stack(outs, 2))), S};
  }
};

class LogLinearMamba2 final : public LogLinear {
 public:
  LogLinearMamba2() : LogLinear(Base::mamba2) {}
};

class LogLinearGatedDeltaNet final : public LogLinear {
 public:
  LogLinearGatedDeltaNet() : LogLinear(Base::gated_deltanet) {}
};

CARRY_REGISTER_MIXER(LogLinearMamba2);
CARRY_REGISTER_MIXER(LogLinearGatedDeltaNet);

}  // namespace
}  // namespace carry
