// Tests of layers/log_linear/fenwick.* and layers/log_linear/log_linear.* beyond the generic mixer contract: the level
// function and the Fenwick block decomposition and merge against brute force; log-linear Mamba-2
// against its materialized T×T masked mixing and log-linear Gated DeltaNet against the definition's
// double sum, both across a boundary whose block states come from running the prefix; λ ≡ 1 equals the
// plain Mamba-2 / Gated DeltaNet token recurrence; states reached from zero keep unset bits zero; and
// the errors for a bad chunk size, offset, level count, state or summary pair.
#include "layers/log_linear/fenwick.h"
#include "layers/log_linear/log_linear.h"
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>

namespace carry::testing {
namespace {

// Most significant set bit, by scanning (independent of bit_width); -1 for 0.
int64_t msb_scan(int64_t x) {
  for (int64_t i = 62; i >= 0; --i)
    if ((x >> i) & 1) return i;
  return -1;
}

bool bit_set(int64_t p, int64_t j) { return (p >> j) & 1; }

TEST(Fenwick, LevelMatchesDefinition) {
  for (int64_t t = 0; t < 600; ++t)
    for (int64_t s = 0; s <= t; ++s) {
      int64_t want = s == t ? 0 : 1 + msb_scan(t ^ s);
      ASSERT_EQ(fenwick_level(t, s), want) << "t=" << t << " s=" << s;
    }
  // Equivalently: the smallest ℓ such that t and s lie in one aligned block of size 2^ℓ.
  for (int64_t t = 0; t < 300; ++t)
    for (int64_t s = 0; s <= t; ++s) {
      int64_t l = 0;
      while ((t >> l) != (s >> l)) ++l;
      ASSERT_EQ(fenwick_level(t, s), l);
    }
  EXPECT_EQ(fenwick_levels_needed(576), 11);  // tokens 0..575 reach level 10; the state at 576, bit 9
  EXPECT_EQ(fenwick_levels_needed(512), 11);  // tokens reach level 9; the state at 512 needs bit 9
}

// The blocks of [0,p): one per set bit j of p, [b_j(p), b_j(p)+2^j), partitioning [0,p); each token s
// lies in block msb(p xor s); for t >= p every member of a block has the level fenwick_entry_level.
TEST(Fenwick, BlockDecompositionAgainstBruteForce) {
  for (int64_t p = 0; p <= 256; ++p) {
    std::vector<int64_t> owner(p, -1);
    for (int64_t j = 0; j < 10; ++j) {
      if (!bit_set(p, j)) continue;
      int64_t b = fenwick_block_start(p, j);
      ASSERT_EQ(b, p - (p & ((int64_t{2} << j) - 1))) << "p=" << p << " j=" << j;
      ASSERT_LE(b + (int64_t{1} << j), p);
      for (int64_t s = b; s < b + (int64_t{1} << j); ++s) {
        ASSERT_EQ(owner[s], -1) << "two blocks hold s=" << s << " at p=" << p;
        owner[s] = j;
      }
    }
    for (int64_t s = 0; s < p; ++s) {
      ASSERT_NE(owner[s], -1) << "no block holds s=" << s << " at p=" << p;
      ASSERT_EQ(fenwick_token_entry(p, s), owner[s]);
      for (int64_t t = p; t < p + 300; ++t)
        ASSERT_EQ(fenwick_level(t, s), fenwick_entry_level(p, owner[s], t))
            << "p=" << p << " s=" << s << " t=" << t;
    }
  }
}

// Moving the boundary p -> q: each block of [0,p) lies inside the block of [0,q) that
// fenwick_merge_target names (brute force over its members), for all p < q <= 256.
TEST(Fenwick, MergeAgainstBruteForce) {
  for (int64_t q = 1; q <= 256; ++q)
    for (int64_t p = 0; p < q; ++p)
      for (int64_t j = 0; j < 10; ++j) {
        if (!bit_set(p, j)) continue;
        int64_t to = fenwick_merge_target(p, q, j);
        ASSERT_TRUE(bit_set(q, to)) << "p=" << p << " q=" << q << " j=" << j << " -> " << to;
        int64_t b = fenwick_block_start(p, j), bq = fenwick_block_start(q, to);
        for (int64_t s = b; s < b + (int64_t{1} << j); ++s) {
          ASSERT_TRUE(bq <= s && s < bq + (int64_t{1} << to)) << "p=" << p << " q=" << q << " s=" << s;
          ASSERT_EQ(fenwick_token_entry(q, s), to);
        }
      }
}

// Entries of unset bits (zero in a reachable state, but any value in a given state) merge consistently
// too: p -> q -> r equals p -> r, and the level at which a later token reads an entry never changes.
// Tokens of [p, q) land where [0, r) puts them.
TEST(Fenwick, MergeIsTransitiveAndKeepsLevels) {
  const int64_t J = 9;
  for (int64_t r = 0; r <= 128; ++r)
    for (int64_t q = 0; q <= r; ++q)
      for (int64_t p = 0; p <= q; ++p) {
        for (int64_t j = 0; j < J; ++j) {
          int64_t jq = fenwick_merge_target(p, q, j);
          ASSERT_LT(jq, J);
          ASSERT_EQ(fenwick_merge_target(q, r, jq), fenwick_merge_target(p, r, j))
              << "p=" << p << " q=" << q << " r=" << r << " j=" << j;
          if (r == q)
            for (int64_t t = q; t < q + 140; ++t)
              ASSERT_EQ(fenwick_entry_level(q, jq, t), fenwick_entry_level(p, j, t))
                  << "p=" << p << " q=" << q << " j=" << j << " t=" << t;
        }
        for (int64_t s = p; s < q; ++s)
          ASSERT_EQ(fenwick_merge_target(q, r, fenwick_token_entry(q, s)), fenwick_token_entry(r, s));
      }
}

// ---- Reference forms written from the definition ----

// Log-linear Mamba-2 from position 0 as a materialized masked T×T mixing:
// M[t,s] = scale λ_t[level(t,s)] (q_t·k_s) exp(G_t − G_s) for s <= t, G the cumulative sum of g.
Tensor materialized_mamba2(const MixerInputs& in, double scale) {
  int64_t T = in.q.size(1);
  auto q = in.q.transpose(1, 2), k = in.k.transpose(1, 2), v = in.v.transpose(1, 2);  // [B,H,T,D]
  auto G = in.g.transpose(1, 2).cumsum(-1);                                          // [B,H,T]
  auto lam = in.l.transpose(1, 2);                                                   // [B,H,T,L]
  auto causal = at::ones({T, T}, at::kBool).tril();
  auto decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(causal.logical_not(), -INFINITY).exp();
  auto level = at::zeros({T, T}, at::kLong);
  auto acc = level.accessor<int64_t, 2>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s <= t; ++s) acc[t][s] = s == t ? 0 : 1 + msb_scan(t ^ s);
  auto weight = at::gather(lam, -1, level.expand({q.size(0), q.size(1), T, T}));
  auto M = scale * at::matmul(q, k.transpose(-1, -2)) * decay * weight;
  return at::matmul(M, v).transpose(1, 2);
}

// Log-linear Gated DeltaNet from position 0 by the definition's double sum:
// o_t = scale Σ_{s<=t} λ_t[level(t,s)] q_tᵀ A_t⋯A_{s+1} β_s k_s v_sᵀ, A_r = γ_r (I − β_r k_r k_rᵀ).
Tensor definition_gdn(const MixerInputs& in, double scale) {
  int64_t T = in.q.size(1);
  std::vector<Tensor> outs;
  for (int64_t t = 0; t < T; ++t) {
    auto r = in.q.select(1, t) * scale;  // q_tᵀ A_t⋯A_{s+1}, [B,H,dk]
    auto o = at::zeros_like(in.v.select(1, t));
    for (int64_t s = t; s >= 0; --s) {
      auto ks = in.k.select(1, s), bs = in.beta.select(1, s).unsqueeze(-1);
      int64_t level = s == t ? 0 : 1 + msb_scan(t ^ s);
      auto lw = in.l.select(1, t).select(-1, level).unsqueeze(-1);
      o = o + lw * bs * (r * ks).sum(-1, true) * in.v.select(1, s);
      // r <- r A_s
      r = in.g.select(1, s).exp().unsqueeze(-1) * (r - bs * (r * ks).sum(-1, true) * ks);
    }
    outs.push_back(o);
  }
  return at::stack(outs, 1);
}

// Runs the prefix [0, P) from the zero state, then the slice [P, P+T) from that state, by `form`.
Tensor run_after_prefix(const Mixer& m, const MixerInputs& in, int64_t P, MixerOptions opt, Form form) {
  int64_t T = in.q.size(1) - P;
  opt.offset = 0;
  auto prefix = m.naive(in.slice(0, P), {}, opt);
  opt.offset = P;
  auto sl = in.slice(P, T);
  return (form == Form::naive ? m.naive(sl, prefix.final_state, opt)
                              : m.chunkwise(sl, prefix.final_state, opt)).o;
}

TEST(LogLinearMamba2, NaiveEqualsMaterializedMaskedForm) {
  const Mixer& m = get_mixer("loglinear_mamba2");
  Shape s;
  s.T = 320;
  auto in = random_inputs(m, s, at::kDouble, 31);
  MixerOptions opt;
  auto ref = materialized_mamba2(in, opt.scale_for(s.dk));
  double e0 = rel_err(m.naive(in, {}, opt).o, ref);
  // Across a boundary at an unaligned P (naive) and at an aligned P (chunkwise, C = 16, 32, 64).
  double e1 = rel_err(run_after_prefix(m, in, 200, opt, Form::naive), ref.narrow(1, 200, 120));
  double e2 = 0;
  for (int64_t C : {16, 32, 64}) {
    opt.chunk_size = C;
    e2 = std::max(e2, rel_err(run_after_prefix(m, in, 192, opt, Form::chunkwise), ref.narrow(1, 192, 128)));
  }
  std::cout << "[ errors   ] loglinear_mamba2 vs materialized T×T: whole " << e0 << ", after prefix "
            << e1 << ", chunkwise after prefix " << e2 << "\n";
  EXPECT_LE(e0, 1e-12);
  EXPECT_LE(e1, 1e-12);
  EXPECT_LE(e2, 1e-12);
}

TEST(LogLinearGatedDeltaNet, NaiveAndChunkwiseEqualDefinition) {
  const Mixer& m = get_mixer("loglinear_gdn");
  Shape s;
  s.T = 160;
  auto in = random_inputs(m, s, at::kDouble, 41);
  MixerOptions opt;
  auto ref = definition_gdn(in, opt.scale_for(s.dk));
  double e0 = rel_err(m.naive(in, {}, opt).o, ref);
  double e1 = rel_err(run_after_prefix(m, in, 75, opt, Form::naive), ref.narrow(1, 75, 85));
  double e2 = 0;
  for (int64_t C : {16, 32}) {
    opt.chunk_size = C;
    e2 = std::max(e2, rel_err(run_after_prefix(m, in, 96, opt, Form::chunkwise), ref.narrow(1, 96, 64)));
    e2 = std::max(e2, rel_err(m.chunkwise(in, {}, opt).o, ref));
  }
  std::cout << "[ errors   ] loglinear_gdn vs definition: whole " << e0 << ", after prefix " << e1
            << ", chunkwise " << e2 << "\n";
  EXPECT_LE(e0, 1e-12);
  EXPECT_LE(e1, 1e-12);
  EXPECT_LE(e2, 1e-12);
}

// The plain base model's token recurrence S_t = A_t S_{t-1} + w_t, o_t = scale q_tᵀ S_t, from S.
std::pair<Tensor, Tensor> plain_recurrence(const MixerInputs& in, Tensor S, double scale, bool delta) {
  std::vector<Tensor> outs;
  for (int64_t t = 0; t < in.q.size(1); ++t) {
    auto k = in.k.select(1, t), v = in.v.select(1, t), q = in.q.select(1, t) * scale;  // [B,H,D]
    auto gamma = in.g.select(1, t).exp().unsqueeze(-1).unsqueeze(-1);
    auto kv = k.unsqueeze(-1) * v.unsqueeze(-2);
    if (delta) {
      auto b = in.beta.select(1, t).unsqueeze(-1).unsqueeze(-1);
      auto kS = at::matmul(k.unsqueeze(-2), S);
      S = gamma * (S - b * k.unsqueeze(-1) * kS) + b * kv;
    } else {
      S = gamma * S + kv;
    }
    outs.push_back(at::matmul(q.unsqueeze(-2), S).squeeze(-2));
  }
  return {at::stack(outs, 1), S};
}

// With λ ≡ 1 every level weighs the same: the output is the base model's, from the sum of the entries
// of the initial state (every entry, set bit of the boundary or not), and the entries of the final
// state sum to the base model's final state.
TEST(LogLinear, UnitLevelWeightsEqualBaseModel) {
  for (std::string family : {"loglinear_mamba2", "loglinear_gdn"}) {
    const Mixer& m = get_mixer(family);
    Shape s;
    s.T = 128;
    s.offset = 448;
    auto in = random_inputs(m, s, at::kDouble, 51);
    in.l = at::ones_like(in.l);
    MixerOptions opt;
    opt.offset = s.offset;
    opt.chunk_size = 16;
    auto st = random_state(m, in, opt, 52);
    auto [o, S] = plain_recurrence(in, at::stack(st, 0).sum(0), opt.scale_for(s.dk), family == "loglinear_gdn");
    double e = 0;
    for (Form form : {Form::naive, Form::chunkwise}) {
      auto r = form == Form::naive ? m.naive(in, st, opt) : m.chunkwise(in, st, opt);
      e = std::max({e, rel_err(r.o, o), rel_err(at::stack(r.final_state, 0).sum(0), S)});
    }
    std::cout << "[ errors   ] " << family << " λ≡1 vs base recurrence " << e << "\n";
    EXPECT_LE(e, 1e-12);
  }
}

// From the zero state, the state at q has nonzero entries exactly at the set bits of q (here
// 576 = 2^9 + 2^6; for N = 2^n tokens per rank, rank r starts at r·N and holds the set bits of r·N).
TEST(LogLinear, ReachedStatesHoldSetBitsOnly) {
  for (std::string family : {"loglinear_mamba2", "loglinear_gdn"}) {
    const Mixer& m = get_mixer(family);
    Shape s;
    s.T = 576;
    auto in = random_inputs(m, s, at::kDouble, 61);
    MixerOptions opt;
    opt.chunk_size = 32;
    for (int64_t P : {0, 256, 448}) {  // from 0, or from a state at P reached from zero
      opt.offset = 0;
      State st = P ? m.chunkwise(in.slice(0, P), {}, opt).final_state : State{};
      opt.offset = P;
      auto out = m.chunkwise(in.slice(P, 576 - P), st, opt).final_state;
      for (int64_t j = 0; j < static_cast<int64_t>(out.size()); ++j) {
        bool nonzero = out[j].abs().max().item<double>() > 0;
        EXPECT_EQ(nonzero, bit_set(576, j)) << family << " from " << P << " entry " << j;
      }
    }
  }
}

TEST(LogLinear, BadOptionsAreRefusedClearly) {
  for (std::string family : {"loglinear_mamba2", "loglinear_gdn"}) {
    const Mixer& m = get_mixer(family);
    Shape s;
    s.T = 96;
    s.offset = 64;
    auto in = random_inputs(m, s, at::kDouble, 71);
    MixerOptions opt;
    opt.offset = 64;
    opt.chunk_size = 24;
    expect_error([&] { m.chunkwise(in, {}, opt); }, "chunk_size must be a power of two");
    opt.chunk_size = 16;
    opt.offset = 72;
    expect_error([&] { m.chunkwise(in, {}, opt); }, "offset must be a multiple of chunk_size");
    opt.offset = -16;
    expect_error([&] { m.naive(in, {}, opt); }, "offset");
    // Positions [64, 160) and the state at 160 need L = 9; give 8, and give too few for a larger offset.
    opt.offset = 64;
    auto few = in;
    few.l = in.l.narrow(3, 0, 8);
    expect_error([&] { m.chunkwise(few, {}, opt); }, "'l' has L=8 level weights");
    expect_error([&] { m.naive(few, {}, opt); }, "need L >= 9");
    opt.offset = 1024;
    expect_error([&] { m.chunkwise(in, {}, opt); }, "need L >= 12");
    opt.offset = 64;
    // A state with the wrong number of entries.
    auto st = m.zero_state(in, opt);
    st.pop_back();
    expect_error([&] { m.chunkwise(in, st, opt); }, "initial_state must have L-1=");
    // Summaries that are not adjacent.
    auto a = m.summarize(in.slice(0, 32), opt);
    opt.offset = 64 + 48;
    auto b = m.summarize(in.slice(48, 48), opt);
    expect_error([&] { m.compose(a, b); }, "adjacent");
    expect_error([&] { m.compose(b, a); }, "adjacent");
  }
}

}  // namespace
}  // namespace carry::testing
