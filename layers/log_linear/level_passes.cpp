// Log-linear Mamba-2 composed of one decay pass a level (level_passes.h states the plan).
#include "layers/log_linear/level_passes.h"

#include "layers/layout.h"
#include "layers/delta_rule/delta_rule.h"
#include "layers/log_linear/fenwick.h"

#include <functional>
#include <limits>

namespace carry {
namespace {

bool bit(int64_t x, int64_t j) { return (x >> j) & 1; }

// [1, T, 1, 1] of the positions [p, p+T) whose bit j is set (or clear), in `o`'s dtype, made on `o`'s
// device (no copy from the host, which would wait for the stream).
Tensor position_mask(int64_t p, int64_t T, int64_t j, bool set, const at::TensorOptions& o) {
  auto pos = at::arange(p, p + T, o.dtype(at::kLong));
  auto b = at::bitwise_and(at::bitwise_right_shift(pos, j), 1);
  return (set ? b : 1 - b).to(o).view({1, T, 1, 1});
}

// bit_width(x) of non-negative integers x below 2^52 (a long tensor), on x's device: floor(log2 x) + 1,
// exact in double; 0 for x = 0.
Tensor bit_widths(const Tensor& x) {
  auto d = x.to(at::kDouble);
  return at::where(x > 0, at::floor(at::log2(d.clamp_min(1))) + 1, at::zeros_like(d)).to(at::kLong);
}

// One-hot [C, levels, C] of the pair levels inside a chunk: [t, l, s] = 1 where s ≤ t and
// bit_width(t xor s) = l, on `o`'s device and in its dtype.
Tensor pair_level_one_hot(int64_t C, int64_t levels, const at::TensorOptions& o) {
  auto i = at::arange(C, o.dtype(at::kLong));
  auto t = i.view({C, 1}), s = i.view({1, C});
  auto level = bit_widths(at::bitwise_xor(t, s));                             // [C, C]
  auto hot = at::one_hot(level, levels).to(o) * (s <= t).to(o).unsqueeze(-1);  // [C, C, levels]
  return hot.permute({0, 2, 1}).contiguous();                                  // [C, levels, C]
}

// What differs between the bases: the chunk's own pairs (mixing [B,H,N,C,C], without the level weights,
// and the first chunk's reader of an incoming state [B,C,H,dk] → read-out), one level's pass over a
// piece (the keys or values of second halves zeroed), and the slice's transport of an entry.
struct Base {
  std::function<Tensor(const Tensor& weight)> own_pairs;  // weight [B,H,N,C,C] → o [B,T,H,dv]
  std::function<Tensor(const Tensor& Z)> first_chunk_read;  // Z [B,H,dk,dv] → [B,C,H,dv]
  std::function<std::pair<Tensor, Tensor>(const MixerInputs& piece, const Tensor& source, const Tensor& x0)> pass;
  std::function<Tensor(const Tensor& S)> transport;  // S [B,H,dk,dv] → the slice's transport applied to S
};

MixerOutput by_level_passes(const MixerInputs& in, const State& init, const MixerOptions& opt, const Base& base) {
  const int64_t B = in.q.size(0), T = in.q.size(1), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3);
  const int64_t L = in.l.size(3), J = L - 1, C = opt.chunk_size, N = T / C;
  const int64_t c = bit_width(static_cast<uint64_t>(C)) - 1;  // C = 2^c
  const int64_t p = opt.offset, q_end = p + T;
  const auto dt = in.q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto fo = in.q.options().dtype(dt);
  std::vector<Tensor> S0;
  for (int64_t j = 0; j < J; ++j)
    S0.push_back(state_or_zeros(init, j, {B, H, dk, dv}, fo).to(dt));
  const Tensor lam = in.l.to(dt);

  // Levels 0..c: pairs inside a chunk, every chunk at once; weight[t, s] = λ_t[level(t, s)], for each t a
  // [levels] × [levels, C] product with the one-hot (exact: one nonzero term; no gather, whose backward
  // adds with atomics on a GPU).
  auto lc = split_chunks(to_bhtd(lam.narrow(-1, 0, c + 1)), C);                       // [B,H,N,C,c+1]
  Tensor o = base.own_pairs(at::einsum("bhntl,tls->bhnts", {lc, pair_level_one_hot(C, c + 1, fo)}));

  // The entries with b_j(p) = p, read by the first chunk at its own levels bit_width(t − p) ≤ c.
  {
    Tensor Z;
    for (int64_t j = 0; j < J; ++j)
      if (fenwick_block_start(p, j) == p) Z = Z.defined() ? Z + S0[j] : S0[j];
    if (Z.defined()) {
      auto read = base.first_chunk_read(Z);
      // λ_t[bit_width(t − p)], an exact one-hot product.
      auto hot = at::one_hot(bit_widths(at::arange(C, fo.dtype(at::kLong))), L).to(fo).view({1, C, 1, L});
      auto first = (lam.narrow(1, 0, C) * hot).sum(-1).unsqueeze(-1) * read;
      o = T > C ? at::cat({o.narrow(1, 0, C) + first, o.narrow(1, C, T - C)}, 1) : o + first;
    }
  }

  // Levels c+1 .. L−1: one pass a level over the slice cut at multiples of 2^level.
  std::vector<Tensor> from_pass(J);
  for (int64_t level = c + 1; level < L; ++level) {
    const int64_t block = int64_t{1} << level, half = block >> 1;
    const int64_t first_reader = bit(p, level - 1) ? p : ((p >> level) << level) + half;
    const bool readers = first_reader < q_end, final_entry = level - 1 < J && bit(q_end, level - 1);
    if (!readers && !final_entry) continue;
    const Tensor source = position_mask(p, T, level - 1, false, in.q.options());
    // The incoming entries whose source position b_j(p) lies in the first half of p's block.
    Tensor X0;
    std::vector<bool> injected(J, false);
    for (int64_t j = 0; j < J; ++j)
      if ((fenwick_block_start(p, j) >> (level - 1)) == ((p >> level) << 1)) {
        injected[j] = true;
        X0 = X0.defined() ? X0 + S0[j] : S0[j];
      }
    if (!X0.defined()) X0 = at::zeros({B, H, dk, dv}, fo);
    std::vector<Tensor> outs;
    Tensor last_state;
    auto run = [&](int64_t a, int64_t len, int64_t pieces, const Tensor& x0) {
      // `pieces` whole blocks of len / pieces tokens side by side in the batch (each from x0's zeros),
      // or one piece.
      auto cut = [&](const Tensor& x) {
        auto s = x.narrow(1, a - p, len);
        if (pieces == 1) return s;
        auto sizes = s.sizes().vec();
        sizes[0] = B * pieces;
        sizes[1] = len / pieces;
        return s.reshape(sizes);
      };
      MixerInputs piece;
      for (const auto& n : MixerInputs::names())
        if (in.get(n).defined() && n != "l") piece.get(n) = cut(in.get(n));
      auto r = base.pass(piece, cut(source.expand({B, T, 1, 1})), x0);
      auto y = r.first;
      if (pieces > 1) y = y.reshape({B, len, H, dv});
      outs.push_back(y);
      last_state = pieces == 1 ? r.second : r.second.view({B, pieces, H, dk, dv}).select(1, pieces - 1);
    };
    const int64_t first_end = std::min(q_end, ((p >> level) + 1) << level);
    run(p, first_end - p, 1, X0);
    const int64_t whole = (q_end - first_end) / block;
    if (whole > 0) run(first_end, whole * block, whole, at::zeros({B * whole, H, dk, dv}, fo));
    const int64_t rest_start = first_end + whole * block;
    if (rest_start < q_end) run(rest_start, q_end - rest_start, 1, at::zeros({B, H, dk, dv}, fo));
    if (readers) {
      Tensor y = outs.size() == 1 ? outs[0] : at::cat(outs, 1);
      auto w = lam.select(-1, level).unsqueeze(-1) * position_mask(p, T, level - 1, true, fo);
      o = o + w * y.to(dt);
    }
    if (final_entry) {
      // The pass's final state is its last block's first half; where that block is p's, it also carries
      // the injected entries, which the state keeps where fenwick_merge_target puts them (an unset entry
      // read like a source here can stay in its own entry): move those the bookkeeping puts elsewhere.
      const int64_t j = level - 1;
      const bool same_block = first_end == q_end;
      Tensor fix;
      for (int64_t i = 0; i < J; ++i) {
        const bool in_pass = same_block && injected[i], belongs = fenwick_merge_target(p, q_end, i) == j;
        if (in_pass == belongs) continue;
        Tensor t = in_pass ? -S0[i] : S0[i];
        fix = fix.defined() ? fix + t : t;
      }
      from_pass[j] = fix.defined() ? last_state.to(dt) + base.transport(fix) : last_state;
    }
  }

  // The final state at q: set bits ≥ c from the passes; every other entry the incoming entries that
  // merge into it, carried by the slice's decay rho.
  State final_state(J);
  for (int64_t j = 0; j < J; ++j) {
    if (bit(q_end, j)) {
      TORCH_INTERNAL_ASSERT(j >= c && from_pass[j].defined(), "log-linear: entry ", j, " of the state at ", q_end,
                            " has no pass");
      final_state[j] = from_pass[j].to(dt);
      continue;
    }
    Tensor s;
    for (int64_t i = 0; i < J; ++i)
      if (fenwick_merge_target(p, q_end, i) == j) s = s.defined() ? s + S0[i] : S0[i];
    final_state[j] = s.defined() ? base.transport(s) : at::zeros({B, H, dk, dv}, fo);
  }
  return {(o * opt.scale_for(dk)).to(in.q.scalar_type()), final_state};
}

}  // namespace

MixerOutput loglinear_mamba2_by_level_passes(const MixerInputs& in, const State& init, const MixerOptions& opt,
                                             const DecayPass& pass) {
  const int64_t T = in.q.size(1), C = opt.chunk_size;
  const auto dt = in.q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  Base base;
  base.own_pairs = [&](const Tensor& weight) {
    auto qc = split_chunks(to_bhtd(in.q.to(dt)), C), kc = split_chunks(to_bhtd(in.k.to(dt)), C);
    auto vc = split_chunks(to_bhtd(in.v.to(dt)), C);
    auto G = split_chunks(to_bhtd(in.g.to(dt)), C).cumsum(-1);  // [B,H,N,C]
    auto causal = causal_mask(C, false, weight.options());
    auto decay = (G.unsqueeze(-1) - G.unsqueeze(-2))
                     .masked_fill(causal.logical_not(), -std::numeric_limits<double>::infinity())
                     .exp();
    return from_bhtd(merge_chunks(at::matmul(at::matmul(qc, kc.transpose(-1, -2)) * decay * weight, vc)));
  };
  base.first_chunk_read = [&](const Tensor& Z) {
    auto q1 = in.q.narrow(1, 0, C).to(dt), g1 = in.g.narrow(1, 0, C).to(dt).cumsum(1);
    return at::einsum("bthd,bhde->bthe", {q1 * g1.exp().unsqueeze(-1), Z});
  };
  base.pass = [&](const MixerInputs& piece, const Tensor& source, const Tensor& x0) {
    return pass(piece.q, piece.k * source.to(piece.k.scalar_type()), piece.v, piece.g, x0);
  };
  const Tensor rho = in.g.to(dt).sum(1).exp().unsqueeze(-1).unsqueeze(-1);  // [B,H,1,1]: the slice's decay
  base.transport = [rho](const Tensor& S) { return rho * S; };
  (void)T;
  return by_level_passes(in, init, opt, base);
}

MixerOutput loglinear_gdn_by_level_passes(const MixerInputs& in, const State& init, const MixerOptions& opt,
                                          const DeltaPass& pass) {
  const int64_t B = in.q.size(0), T = in.q.size(1), H = in.q.size(2), dk = in.q.size(3), C = opt.chunk_size,
                N = T / C;
  const auto dt = in.q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // The delta rule's chunk pieces (layers/delta_rule/delta_rule.h), every chunk at once: the chunks
  // folded into the batch.
  auto folded = [&](const Tensor& x) {  // [B,T,H,...] → [B·N,H,C,...]
    auto y = x.to(dt);
    auto sizes = y.sizes().vec();
    std::vector<int64_t> to{B, N, C, H};
    for (size_t i = 3; i < sizes.size(); ++i) to.push_back(sizes[i]);
    y = y.reshape(to).transpose(2, 3);  // [B,N,H,C,...]
    to.erase(to.begin());
    to[0] = B * N;
    std::swap(to[1], to[2]);
    return y.reshape(to);
  };
  const DeltaChunkPieces pieces =
      delta_rule_chunk(folded(in.q), folded(in.k), folded(in.v), folded(in.beta), folded(in.g), 1.0);
  Base base;
  base.own_pairs = [&](const Tensor& weight) {  // weight [B,H,N,C,C]
    auto M = pieces.mixing.reshape({B, N, H, C, C}).permute({0, 2, 1, 3, 4}) * weight;  // [B,H,N,C,C]
    auto vc = split_chunks(to_bhtd(in.v.to(dt)), C);
    return from_bhtd(merge_chunks(at::matmul(M, vc)));
  };
  base.first_chunk_read = [&](const Tensor& Z) {  // the first chunk's query_state [B,H,C,dk] reads Z
    auto P = pieces.query_state.reshape({B, N, H, C, dk}).select(1, 0);
    return at::matmul(P, Z).transpose(1, 2);  // [B,C,H,dv]
  };
  base.pass = [&](const MixerInputs& piece, const Tensor& source, const Tensor& x0) {
    return pass(piece.q, piece.k, piece.v * source.to(piece.v.scalar_type()), piece.g, piece.beta, x0);
  };
  // The slice's transport A (dk×dk), from a pass that writes nothing, from the identity: only where an
  // incoming state has entries to carry.
  Tensor A;
  if (!init.empty()) {
    auto eye = at::eye(dk, in.q.options().dtype(dt)).expand({B, H, dk, dk}).contiguous();
    A = pass(in.q, in.k, at::zeros({B, T, H, dk}, in.v.options()), in.g, in.beta, eye).second.to(dt);
  }
  base.transport = [A](const Tensor& S) { return A.defined() ? at::matmul(A, S) : at::zeros_like(S); };
  return by_level_passes(in, init, opt, base);
}

DeltaPass chunkwise_delta_pass(int64_t chunk_size) {
  return [chunk_size](const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                      const Tensor& x0) {
    MixerInputs in;
    in.q = q, in.k = k, in.v = v, in.g = g, in.beta = beta;
    return chunkwise_scale_one("gated_deltanet", in, x0, chunk_size);
  };
}

}  // namespace carry
