// Log-linear Mamba-2 and Gated DeltaNet composed of their base model's passes or products, one a level
// (level_passes.h states the plan).
#include "layers/log_linear/level_passes.h"

#include "layers/layout.h"
#include "layers/delta_rule/delta_rule.h"
#include "layers/log_linear/fenwick.h"
#include "layers/log_linear/level_walk.h"

#include <torch/csrc/autograd/custom_function.h>

#ifdef CARRY_WITH_CUDA
#include "layers/kernels/log_linear/api.h"
#include "layers/kernels/primitives/host.h"
#endif

#include <algorithm>
#include <functional>
#include <limits>
#include <tuple>

namespace carry {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool bit(int64_t x, int64_t j) { return (x >> j) & 1; }

// bit_width(x) of non-negative integers x below 2^53 (a long tensor), on x's device: the binary exponent
// frexp gives (x = m·2^e, m in [0.5, 1)), exact on every device (a GPU's log2 is not, at powers of two); 0
// for x = 0.
Tensor bit_widths(const Tensor& x) { return std::get<1>(at::frexp(x.to(at::kDouble))).to(at::kLong); }

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
// and the first chunk's reader of an incoming state [B,C,H,dk] → read-out), the levels above the chunk
// (Mamba-2's products or Gated DeltaNet's walk), and the slice's transport of an entry.
struct Base {
  std::function<Tensor(const Tensor& weight)> own_pairs;  // weight [B,H,N,C,C] → o [B,T,H,dv]
  // Or the levels 0..c computed whole by the base (kernels): lam [B,T,H,L] (accumulation dtype) → o [B,T,H,dv].
  std::function<Tensor(const Tensor& lam)> own_levels;
  std::function<Tensor(const Tensor& Z)> first_chunk_read;  // Z [B,H,dk,dv] → [B,C,H,dv]
  std::function<Tensor(const Tensor& S)> transport;  // S [B,H,dk,dv] → the slice's transport applied to S
  // Mamba-2: the levels above the chunk as products (level_passes.h): each level's whole
  // blocks in WholeBlockLevels, the partial blocks at the slice's ends as LevelProducts regions.
  bool products = false;
  // Gated DeltaNet: every level above the chunk in one walk (level_walk.h): the initial
  // state of each level c+1 .. L−1 (undefined: zeros) → the read-outs weighted by λ ([B,T,H,dv], the
  // accumulation dtype) and each level's final state [B,H,dk,dv].
  std::function<std::pair<Tensor, std::vector<Tensor>>(const std::vector<Tensor>& X0)> walk;
};

// A partial block of a level above the chunk of log-linear Mamba-2 as products: the block's first half
// written into one state by a matrix product, its second half reading that state by another (scalar
// decay: a token carries a state by a factor, so no pass over the second half is needed). cum [B,T+1,H] (fp64) holds the
// slice's cumulative log decay, cum[i] = Σ_{u<i} g_u; positions are absolute, the slice starting at p.
struct LevelProducts {
  const MixerInputs& in;
  Tensor cum;
  int64_t p;
  at::ScalarType dt;  // the accumulation dtype (fp32, or fp64 for fp64 inputs)

  Tensor at_(int64_t x) const { return cum.select(1, x - p); }  // [B,H]: cum at absolute boundary x
  Tensor factor(const Tensor& log) const { return log.exp().to(dt); }

  // One region [a, e) of a single block whose second half starts at m (m may lie outside the region),
  // starting from x0 at a (undefined: zeros): the read-out of the tokens [max(a, m), e) weighted by λ
  // at `level` ([B, e − max(a, m), H, dv], undefined when there are none) and the state at e.
  std::pair<Tensor, Tensor> region(int64_t a, int64_t m, int64_t e, const Tensor& x0, int64_t level) const {
    const int64_t B = in.q.size(0), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3);
    const int64_t we = std::max(a, std::min(m, e));  // tokens [a, we) write; the state at we is Y
    Tensor Y;
    if (x0.defined()) Y = x0.to(dt) * factor(at_(we) - at_(a)).view({B, H, 1, 1});
    if (a < we) {
      auto f = factor(at_(we).unsqueeze(1) - cum.narrow(1, a - p + 1, we - a));  // [B,n,H]
      auto kt = (in.k.narrow(1, a - p, we - a) * f.unsqueeze(-1)).to(in.k.scalar_type());
      auto W = at::matmul(kt.permute({0, 2, 3, 1}), in.v.narrow(1, a - p, we - a).transpose(1, 2)).to(dt);
      Y = Y.defined() ? Y + W : W;
    }
    if (!Y.defined()) Y = at::zeros({B, H, dk, dv}, in.q.options().dtype(dt));
    Tensor read;
    if (we < e && we >= m) {
      auto f = factor(cum.narrow(1, we - p + 1, e - we) - at_(we).unsqueeze(1)) *
               in.l.narrow(1, we - p, e - we).select(-1, level).to(dt);  // [B,n,H]
      auto qt = (in.q.narrow(1, we - p, e - we) * f.unsqueeze(-1)).to(in.q.scalar_type());
      read = at::matmul(qt.transpose(1, 2), Y.to(in.q.scalar_type())).transpose(1, 2).to(dt);
    }
    return {read, Y * factor(at_(e) - at_(we)).view({B, H, 1, 1})};
  }
};

// The whole blocks of every level at once, with a hand-written backward (autograd's would re-read the
// activations for each view's gradient). Tensors in [B,H,T,·] layout: q, k [B,H,T,dk] and v [B,H,T,dv] in the
// products' dtype, cum [B,H,T+1] (fp64), lam [B,H,L,T] (the accumulation dtype); `blocks` lists
// (level, start in the slice, number of blocks M, half) for each level. Returns the read-outs
// [B,H,T,dv] in the accumulation dtype, zero outside the listed second halves. For one level and block
// b with middle m_b: Y_b = Σ_{s in the first half} a_s k_s v_sᵀ, a_s = e^{cum[m_b] − cum[s+1]}; r_t =
// w_t Y_bᵀ q_t for t in the second half, w_t = λ_t[level]·e_t, e_t = e^{cum[t+1] − cum[m_b]}.
struct WholeBlockLevels : public torch::autograd::Function<WholeBlockLevels> {
  struct View {  // one level's blocks
    int64_t level, start, M, half;
    // x [B,H,T(+1),d…] → [B,H,M,half,d…]: half i (0 first, 1 second) of each block, from `shift`.
    Tensor half_of(const Tensor& x, int64_t i, int64_t shift = 0) const {
      auto sizes = x.sizes().vec();
      std::vector<int64_t> to{sizes[0], sizes[1], M, 2, half};
      to.insert(to.end(), sizes.begin() + 3, sizes.end());
      return x.narrow(2, start + shift, 2 * M * half).view(to).select(3, i);
    }
    Tensor mid(const Tensor& cum) const { return half_of(cum, 1).select(3, 0).unsqueeze(-1); }  // [B,H,M,1]
    Tensor flat(const Tensor& x) const {  // [B,H,M,half,d] → [B·H·M, half, d]
      return x.reshape({-1, half, x.size(-1)});
    }
  };

  static std::vector<View> views(const std::vector<int64_t>& blocks) {
    std::vector<View> out;
    for (size_t i = 0; i + 3 < blocks.size(); i += 4) out.push_back({blocks[i], blocks[i + 1], blocks[i + 2], blocks[i + 3]});
    return out;
  }

  // The factors of one level: a [B,H,M,half] (first halves), e and w (second halves), accumulation dtype.
  static std::tuple<Tensor, Tensor, Tensor> factors(const View& b, const Tensor& cum, const Tensor& lam,
                                                    at::ScalarType dt) {
    auto m = b.mid(cum);
    auto a = (m - b.half_of(cum, 0, 1)).exp().to(dt);
    auto e = (b.half_of(cum, 1, 1) - m).exp().to(dt);
    return {a, e, b.half_of(lam.select(2, b.level), 1) * e};
  }

#ifdef CARRY_WITH_CUDA
  // The level kernels (layers/kernels/log_linear/api.h) take bf16 CUDA inputs, dk in {64, 128}, dv in {64, 128,
  // 256} and levels whose halves are whole 64-token chunks.
  static bool kernels_take(const Tensor& q, const Tensor& v, const std::vector<View>& vs) {
    if (!q.is_cuda() || q.scalar_type() != at::kBFloat16 || q.size(2) % 64 != 0) return false;
    const int64_t dk = q.size(3), dv = v.size(3);
    if ((dk != 64 && dk != 128) || (dv != 64 && dv != 128 && dv != 256)) return false;
    for (const View& b : vs)
      if (b.half < 64 || b.start % 64 != 0) return false;
    return !vs.empty();
  }
  static std::vector<kernels::log_linear::LevelBlocks> level_blocks(const std::vector<View>& vs) {
    std::vector<kernels::log_linear::LevelBlocks> out;
    for (const View& b : vs) out.push_back({b.level, b.start, b.M});
    return out;
  }
  // [B,H,T,d] → [B·H, T, d], contiguous and 16-byte aligned.
  static Tensor rows(const Tensor& x) {
    return kernels::primitives::dense16(x.reshape({x.size(0) * x.size(1), x.size(2), x.size(3)}));
  }
#endif

  static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cum,
                        const Tensor& lam, const std::vector<int64_t>& blocks) {
    const auto io = q.scalar_type(), dt = lam.scalar_type();
#ifdef CARRY_WITH_CUDA
    if (kernels_take(q, v, views(blocks))) {
      namespace ll = kernels::log_linear;
      const auto levels = level_blocks(views(blocks));
      const int64_t B = q.size(0), H = q.size(1), T = q.size(2), L = lam.size(2);
      auto we = ll::level_weights(cum.reshape({B * H, T + 1}).contiguous(), lam.reshape({B * H, L, T}).contiguous(), levels);
      auto Y = ll::level_sum(rows(k), rows(v), we[0], levels, 0);
      auto o = ll::level_read(rows(q), Y, we[0], levels, 1, false)[0].view({B, H, T, v.size(3)});
      ctx->save_for_backward({q, k, v, cum, lam, we[0], we[1]});
      ctx->saved_data["blocks"] = blocks;
      return o;
    }
#endif
    Tensor o = at::zeros({q.size(0), q.size(1), q.size(2), v.size(3)}, v.options().dtype(dt));
    for (const View& b : views(blocks)) {
      auto [a, e, w] = factors(b, cum, lam, dt);
      auto kt = b.flat((b.half_of(k, 0) * a.unsqueeze(-1)).to(io));
      auto Y = at::bmm(kt.transpose(1, 2), b.flat(b.half_of(v, 0)));             // [BHM, dk, dv]
      auto qt = b.flat((b.half_of(q, 1) * w.unsqueeze(-1)).to(io));
      b.half_of(o, 1).add_(at::bmm(qt, Y).view(b.half_of(o, 1).sizes()));
    }
    ctx->save_for_backward({q, k, v, cum, lam});
    ctx->saved_data["blocks"] = blocks;
    return o;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const Tensor &q = s[0], &k = s[1], &v = s[2], &cum = s[3], &lam = s[4];
    const auto io = q.scalar_type(), dt = lam.scalar_type();
    const auto blocks = ctx->saved_data["blocks"].toIntVector();
    const Tensor d_o = grads[0].to(io).contiguous();
#ifdef CARRY_WITH_CUDA
    if (s.size() == 7) {  // the level kernels' forward
      namespace ll = kernels::log_linear;
      const auto levels = level_blocks(views(blocks));
      const Tensor &wt = s[5], &e = s[6];
      const int64_t B = q.size(0), H = q.size(1), T = q.size(2), L = lam.size(2), BH = B * H;
      const auto qr = rows(q), kr = rows(k), vr = rows(v), dor = rows(d_o);
      auto Y = ll::level_sum(kr, vr, wt, levels, 0);
      auto dY = ll::level_sum(qr, dor, wt, levels, 1);
      auto dq_dw = ll::level_read(dor, Y, wt, levels, 1, true, qr);    // dq = Σ w·(dO Yᵀ), dw = (dO Yᵀ)·q
      auto dk_da = ll::level_read(vr, dY, wt, levels, 0, true, kr);    // dk = Σ a·(v dYᵀ), da = (v dYᵀ)·k
      auto dv = ll::level_read(kr, dY, wt, levels, 0, false)[0];       // dv = Σ a·(k dY)
      // d log w_t = dw·w at t+1 (second halves), d log a_s = da·a at s+1 with a minus (first halves); each
      // block's middle takes the opposite of its block's sum.
      auto X = (dq_dw[1] - dk_da[1]) * wt;  // [BH, n, T]: the two sides do not overlap
      Tensor dcum = at::zeros({BH, T + 1}, cum.options());
      dcum.narrow(1, 1, T).add_(X.sum(1).to(at::kDouble));
      Tensor dlam = at::zeros({BH, L, T}, lam.options());
      for (size_t i = 0; i < levels.size(); ++i) {
        const auto& b = levels[i];
        const int64_t len = b.M << b.level;
        auto block_sum = X.select(1, (int64_t)i).narrow(1, b.start, len).view({BH, b.M, len / b.M}).sum(-1);
        dcum.narrow(1, b.start, len).view({BH, b.M, len / b.M}).select(2, len / b.M / 2).sub_(block_sum.to(at::kDouble));
        dlam.select(1, b.level).add_(dq_dw[1].select(1, (int64_t)i) * e.select(1, (int64_t)i));
      }
      return {dq_dw[0].view(q.sizes()).to(io), dk_da[0].view(k.sizes()).to(io), dv.view(v.sizes()).to(io),
              dcum.view({B, H, T + 1}), dlam.view(lam.sizes()), Tensor()};
    }
#endif
    Tensor dq = at::zeros(q.sizes(), q.options().dtype(dt)), dk = at::zeros(k.sizes(), k.options().dtype(dt));
    Tensor dv = at::zeros(v.sizes(), v.options().dtype(dt)), dcum = at::zeros_like(cum), dlam = at::zeros_like(lam);
    for (const View& b : views(blocks)) {
      auto [a, e, w] = factors(b, cum, lam, dt);
      auto k1 = b.half_of(k, 0), q2 = b.half_of(q, 1);
      auto kt = b.flat((k1 * a.unsqueeze(-1)).to(io)), vf = b.flat(b.half_of(v, 0));
      auto qt = b.flat((q2 * w.unsqueeze(-1)).to(io));
      auto Y = at::bmm(kt.transpose(1, 2), vf);
      auto dr = b.flat(b.half_of(d_o, 1));
      auto dY = at::bmm(qt.transpose(1, 2), dr);                                      // [BHM, dk, dv]
      auto dqt = at::bmm(dr, Y.transpose(1, 2)).view(q2.sizes()).to(dt);               // ∂/∂(w q)
      b.half_of(dq, 1).add_(dqt * w.unsqueeze(-1));
      auto dw = (dqt * q2).sum(-1);                                                    // [B,H,M,half]
      auto dkt = at::bmm(vf, dY.transpose(1, 2)).view(k1.sizes()).to(dt);              // ∂/∂(a k)
      b.half_of(dk, 0).add_(dkt * a.unsqueeze(-1));
      auto da = (dkt * k1).sum(-1);
      b.half_of(dv, 0).add_(at::bmm(kt, dY).view(b.half_of(dv, 0).sizes()));
      b.half_of(dlam.select(2, b.level), 1).add_(dw * e);
      auto dlog_w = (dw * w).to(cum.scalar_type()), dlog_a = (da * a).to(cum.scalar_type());
      b.half_of(dcum, 1, 1).add_(dlog_w);
      b.half_of(dcum, 0, 1).sub_(dlog_a);
      b.mid(dcum).add_((dlog_a.sum(-1) - dlog_w.sum(-1)).unsqueeze(-1));
    }
    return {dq.to(io), dk.to(io), dv.to(io), dcum, dlam, Tensor()};
  }
};

#ifdef CARRY_WITH_CUDA
// Log-linear Mamba-2's levels inside a 64-token chunk on their kernels (layers/kernels/log_linear/api.h):
// q, k, v [B,H,T,·] bf16, g [B,H,T] fp32, lam [B,H,L,T] fp32 → o [B,H,T,dv] fp32, unscaled.
struct ChunkLevels : public torch::autograd::Function<ChunkLevels> {
  static Tensor rows(const Tensor& x) {  // [B,H,T(,d)] → [B·H, T(, d)], contiguous and 16-byte aligned
    auto s = x.sizes().vec();
    s.erase(s.begin());
    s[0] *= x.size(0);
    return kernels::primitives::dense16(x.reshape(s));
  }
  static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                        const Tensor& lam) {
    ctx->save_for_backward({q, k, v, g, lam});
    auto o = kernels::log_linear::chunk_levels_fwd(rows(q), rows(k), rows(v), rows(g), rows(lam));
    return o.view({q.size(0), q.size(1), q.size(2), v.size(3)});
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const Tensor &q = s[0], &k = s[1], &v = s[2], &g = s[3], &lam = s[4];
    auto r = kernels::log_linear::chunk_levels_bwd(rows(q), rows(k), rows(v), rows(g), rows(lam),
                                                   rows(grads[0].to(q.scalar_type())));
    return {r[0].view(q.sizes()).to(q.scalar_type()), r[1].view(k.sizes()).to(k.scalar_type()),
            r[2].view(v.sizes()).to(v.scalar_type()), r[3].view(g.sizes()), r[4].view(lam.sizes())};
  }
};

// Log-linear Gated DeltaNet's chunk pieces on the kernels (layers/kernels/log_linear/api.h): q, k, v [B,T,H,·]
// bf16, g, beta [B,T,H], lam [B,H,7,T] fp32 (the levels inside a chunk) → W, U, K̃, P [B,H,T,·] bf16, gamma
// [B,H,N] and the levels inside the chunk o [B,H,T,dv] (fp32), all unscaled; the hand-written backward.
struct ChunkPiecesFn : public torch::autograd::Function<ChunkPiecesFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                               const Tensor& beta, const Tensor& lam) {
    auto r = kernels::log_linear::chunk_pieces_fwd(q, k, v, g, beta, lam);  // W, U, K̃, P, gamma, o, G, T
    ctx->save_for_backward({q, k, v, beta, lam, r[6], r[7], r[0]});
    return {r[0], r[1], r[2], r[3], r[4], r[5]};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const Tensor &q = s[0], &k = s[1], &v = s[2];
    auto r = kernels::log_linear::chunk_pieces_bwd(q, k, v, s[3], s[4], s[5], s[6], s[7], grads[5], grads[0], grads[1],
                                                   grads[2], grads[3], grads[4]);
    return {r[0].to(q.scalar_type()), r[1].to(k.scalar_type()), r[2].to(v.scalar_type()), r[3],
            r[4].to(s[3].scalar_type()), r[5]};
  }
};

// Whether log-linear Gated DeltaNet's chunk pieces run on the kernels: bf16 CUDA q, k, v, C = 64, dk ∈ {64, 128},
// dv ∈ {64, 128, 256}, and weights for every level inside a chunk.
bool chunk_pieces_on_kernels(const MixerInputs& in, int64_t C) {
  const int64_t dk = in.q.size(3), dv = in.v.size(3);
  return in.q.is_cuda() && in.q.scalar_type() == at::kBFloat16 && in.k.scalar_type() == at::kBFloat16 &&
         in.v.scalar_type() == at::kBFloat16 && C == 64 && (dk == 64 || dk == 128) &&
         (dv == 64 || dv == 128 || dv == 256) && in.l.size(3) >= 7;
}
#endif

MixerOutput by_level_passes(const MixerInputs& in, const State& init, const MixerOptions& opt, const Base& base) {
  const int64_t B = in.q.size(0), T = in.q.size(1), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3);
  const int64_t L = in.l.size(3), J = L - 1, C = opt.chunk_size, N = T / C;
  const int64_t c = bit_width(static_cast<uint64_t>(C)) - 1;  // C = 2^c
  const int64_t p = opt.offset, q_end = p + T;
  const auto dt = in.q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto fo = in.q.options().dtype(dt);
  std::vector<Tensor> S0;
  for (int64_t j = 0; j < J; ++j)
    // No incoming state: undefined entries (zeros that are never added, copied or read).
    S0.push_back(init.empty() ? Tensor() : state_or_zeros(init, j, {B, H, dk, dv}, fo).to(dt));
  const Tensor lam = in.l.to(dt);
  // The products' cumulative log decay, in fp64 (differences of long sums keep their digits).
  // Scanned along its innermost dimension ([B,H,T]: a scan along T of [B,T,H] runs one thread a column on
  // a GPU), then viewed as [B,T+1,H].
  const Tensor cum = base.products
                         ? at::pad(in.g.to(at::kDouble).transpose(1, 2).contiguous().cumsum(-1), {1, 0}).transpose(1, 2)
                         : Tensor();

  // Levels 0..c: pairs inside a chunk, every chunk at once; weight[t, s] = λ_t[level(t, s)], for each t a
  // [levels] × [levels, C] product with the one-hot (exact: one nonzero term; no gather, whose backward
  // adds with atomics on a GPU).
  Tensor o;
  if (base.own_levels) {
    o = base.own_levels(lam);
  } else {
    auto lc = split_chunks(to_bhtd(lam.narrow(-1, 0, c + 1)), C);                     // [B,H,N,C,c+1]
    o = base.own_pairs(at::einsum("bhntl,tls->bhnts", {lc, pair_level_one_hot(C, c + 1, fo)}));
  }

  // The entries with b_j(p) = p, read by the first chunk at its own levels bit_width(t − p) ≤ c.
  {
    Tensor Z;
    for (int64_t j = 0; j < J; ++j)
      if (S0[j].defined() && fenwick_block_start(p, j) == p) Z = Z.defined() ? Z + S0[j] : S0[j];
    if (Z.defined()) {
      auto read = base.first_chunk_read(Z);
      // λ_t[bit_width(t − p)], an exact one-hot product.
      auto hot = at::one_hot(bit_widths(at::arange(C, fo.dtype(at::kLong))), L).to(fo).view({1, C, 1, L});
      auto first = (lam.narrow(1, 0, C) * hot).sum(-1).unsqueeze(-1) * read;
      o = T > C ? at::cat({o.narrow(1, 0, C) + first, o.narrow(1, C, T - C)}, 1) : o + first;
    }
  }

  // Levels c+1 .. L−1: Mamba-2's products a level (blocks cut at multiples of 2^level), or Gated DeltaNet's
  // one walk for all.
  std::vector<Tensor> from_pass(J);
  std::vector<int64_t> whole_blocks;  // products: (level, start, count, half) of the levels' whole blocks
  // The pass's final state is its last block's first half; where that block is p's, it also carries the
  // injected entries, which the state keeps where fenwick_merge_target puts them (an unset entry read like
  // a source here can stay in its own entry): move those the bookkeeping puts elsewhere.
  auto final_entry_of = [&](int64_t level, const Tensor& last_state, const std::vector<bool>& injected,
                            bool same_block) {
    const int64_t j = level - 1;
    Tensor fix;
    for (int64_t i = 0; i < J; ++i) {
      const bool in_pass = same_block && injected[i], belongs = fenwick_merge_target(p, q_end, i) == j;
      if (in_pass == belongs || !S0[i].defined()) continue;
      Tensor t = in_pass ? -S0[i] : S0[i];
      fix = fix.defined() ? fix + t : t;
    }
    from_pass[j] = fix.defined() ? last_state.to(dt) + base.transport(fix) : last_state;
  };
  struct WalkLevel {  // walk: what each level needs after the walk
    int64_t level;
    std::vector<bool> injected;
    bool final_entry, same_block;
  };
  std::vector<WalkLevel> walk_levels;
  std::vector<Tensor> walk_x0;
  for (int64_t level = c + 1; level < L; ++level) {
    const int64_t block = int64_t{1} << level, half = block >> 1;
    const int64_t first_reader = bit(p, level - 1) ? p : ((p >> level) << level) + half;
    const bool readers = first_reader < q_end, final_entry = level - 1 < J && bit(q_end, level - 1);
    if (!readers && !final_entry && !base.walk) continue;
    // The incoming entries whose source position b_j(p) lies in the first half of p's block.
    Tensor X0;
    std::vector<bool> injected(J, false);
    for (int64_t j = 0; j < J; ++j)
      if ((fenwick_block_start(p, j) >> (level - 1)) == ((p >> level) << 1)) {
        injected[j] = true;
        if (S0[j].defined()) X0 = X0.defined() ? X0 + S0[j] : S0[j];
      }
    std::vector<Tensor> outs;
    Tensor last_state;
    const int64_t first_end = std::min(q_end, ((p >> level) + 1) << level);
    const int64_t whole = (q_end - first_end) / block;
    const int64_t rest_start = first_end + whole * block;
    if (base.walk) {
      walk_x0.push_back(X0);
      walk_levels.push_back({level, injected, final_entry, first_end == q_end});
      continue;
    }
    if (base.products) {
      // Whole blocks (p's own when p starts it and no incoming entry joins it) go to WholeBlockLevels; the
      // partial blocks at the ends are regions here.
      const bool first_whole = first_end - p == block && !X0.defined();
      const int64_t whole_start = first_whole ? p : first_end, count = whole + (first_whole ? 1 : 0);
      if (count > 0) whole_blocks.insert(whole_blocks.end(), {level, whole_start - p, count, half});
      const LevelProducts lp{in, cum, p, dt};
      // The read-outs along the slice: (length, tensor or undefined where nothing reads); zeros are made
      // only when a partial block reads.
      std::vector<std::pair<int64_t, Tensor>> spans;
      bool read = false;
      auto piece = [&](int64_t a, int64_t e, const Tensor& x0) {  // a region inside one block
        const int64_t m = ((a >> level) << level) + half;
        auto [r, state] = lp.region(a, m, e, x0, level);
        last_state = state;
        const int64_t rs = std::max(a, m);
        read = read || r.defined();
        if (rs > a || !r.defined()) spans.emplace_back(std::min(rs, e) - a, Tensor());
        if (r.defined()) spans.emplace_back(e - rs, r);
      };
      if (!first_whole) piece(p, first_end, X0);
      if (count > 0) spans.emplace_back(count * block, Tensor());
      if (rest_start < q_end) piece(rest_start, q_end, Tensor());
      if (read) {
        for (auto& [len, t] : spans) outs.push_back(t.defined() ? t : at::zeros({B, len, H, dv}, fo));
        o = o + (outs.size() == 1 ? outs[0] : at::cat(outs, 1));
      }
    }
    if (final_entry) final_entry_of(level, last_state, injected, first_end == q_end);
  }
  if (base.walk && !walk_levels.empty()) {
    auto [read, finals] = base.walk(walk_x0);
    o = o + read;
    for (size_t i = 0; i < walk_levels.size(); ++i)
      if (walk_levels[i].final_entry)
        final_entry_of(walk_levels[i].level, finals[i], walk_levels[i].injected, walk_levels[i].same_block);
  }

  if (!whole_blocks.empty()) {
    auto bhtd = [](const Tensor& x) { return x.transpose(1, 2).contiguous(); };
    auto lam_h = lam.permute({0, 2, 3, 1}).contiguous();  // [B,H,L,T]
    o = o + WholeBlockLevels::apply(bhtd(in.q), bhtd(in.k), bhtd(in.v), cum.transpose(1, 2), lam_h, whole_blocks)
                .transpose(1, 2);
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
      if (S0[i].defined() && fenwick_merge_target(p, q_end, i) == j) s = s.defined() ? s + S0[i] : S0[i];
    final_state[j] = s.defined() ? base.transport(s) : at::zeros({B, H, dk, dv}, fo);
  }
  return {(o * opt.scale_for(dk)).to(in.q.scalar_type()), final_state};
}

}  // namespace

MixerOutput loglinear_mamba2_by_level_products(const MixerInputs& in, const State& init, const MixerOptions& opt) {
  const int64_t C = opt.chunk_size;
  const auto dt = in.q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto io = in.q.scalar_type();  // the products' operands
  Base base;
  base.products = true;
#ifdef CARRY_WITH_CUDA
  const int64_t dk = in.q.size(3), dv = in.v.size(3);
  if (in.q.is_cuda() && io == at::kBFloat16 && in.v.scalar_type() == io && C == 64 && (dk == 64 || dk == 128) &&
      (dv == 64 || dv == 128 || dv == 256)) {
    base.own_levels = [&](const Tensor& lam) {
      auto bhtd = [](const Tensor& x) { return x.transpose(1, 2).contiguous(); };
      return ChunkLevels::apply(bhtd(in.q), bhtd(in.k), bhtd(in.v), bhtd(in.g.to(at::kFloat)),
                                lam.permute({0, 2, 3, 1}).contiguous())
          .transpose(1, 2);
    };
  }
#endif
  base.own_pairs = [&](const Tensor& weight) {
    auto qc = split_chunks(to_bhtd(in.q), C), kc = split_chunks(to_bhtd(in.k), C);
    auto vc = split_chunks(to_bhtd(in.v.to(io)), C);
    auto G = split_chunks(to_bhtd(in.g.to(dt)), C).cumsum(-1);  // [B,H,N,C]
    auto causal = causal_mask(C, false, weight.options());
    auto decay = (G.unsqueeze(-1) - G.unsqueeze(-2))
                     .masked_fill(causal.logical_not(), -std::numeric_limits<double>::infinity())
                     .exp();
    auto A = (at::matmul(qc, kc.transpose(-1, -2)).to(dt) * decay * weight).to(io);
    return from_bhtd(merge_chunks(at::matmul(A, vc).to(dt)));
  };
  base.first_chunk_read = [&](const Tensor& Z) {
    auto q1 = in.q.narrow(1, 0, C).to(dt), g1 = in.g.narrow(1, 0, C).to(dt).cumsum(1);
    return at::einsum("bthd,bhde->bthe", {q1 * g1.exp().unsqueeze(-1), Z});
  };
  const Tensor rho = in.g.to(dt).sum(1).exp().unsqueeze(-1).unsqueeze(-1);  // [B,H,1,1]: the slice's decay
  base.transport = [rho](const Tensor& S) { return rho * S; };
  return by_level_passes(in, init, opt, base);
}

MixerOutput loglinear_gdn_by_level_passes(const MixerInputs& in, const State& init, const MixerOptions& opt,
                                          const DeltaPass& pass) {
  const int64_t B = in.q.size(0), T = in.q.size(1), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3),
                C = opt.chunk_size, N = T / C, BH = B * H, L = in.l.size(3);
  const int64_t c = bit_width(static_cast<uint64_t>(C)) - 1;
  const auto dt = in.q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const bool walk_levels = L - 1 > c;
  // The walk's operands W, U, K̃ in [B·H, T, ·] (the kernels' bf16 for bf16 inputs), gamma [B·H, N], and the
  // query state P (also the first chunk's reader of an incoming state): [B,H,T,dk] from the kernels, [B·H,T,dk]
  // from ATen.
  Tensor W, U, Kt, P, gamma;
  Base base;
  DeltaChunkPieces pieces;
#ifdef CARRY_WITH_CUDA
  Tensor own;  // the levels inside the chunk, [B,H,T,dv] fp32, unscaled
  if (chunk_pieces_on_kernels(in, C)) {
    auto lam_own = in.l.narrow(3, 0, 7).to(at::kFloat).permute({0, 2, 3, 1}).contiguous();  // [B,H,7,T]
    auto r = ChunkPiecesFn::apply(in.q, in.k, in.v, in.g.to(at::kFloat), in.beta, lam_own);
    W = r[0].view({BH, T, dk}), U = r[1].view({BH, T, dv}), Kt = r[2].view({BH, T, dk}), P = r[3];
    gamma = r[4].view({BH, N});
    own = r[5];
    base.own_levels = [&](const Tensor&) { return own.transpose(1, 2); };
    base.first_chunk_read = [&, dt](const Tensor& Z) {
      return at::matmul(P.narrow(2, 0, C).to(dt), Z).transpose(1, 2);  // [B,C,H,dv]
    };
  }
#endif
  if (!P.defined()) {
    // The delta rule's chunk pieces (layers/delta_rule/delta_rule.h), every chunk at once: [B,T,H,...] →
    // [B·H,N,C,...], the chunks in the second dimension.
    auto chunked = [&](const Tensor& x) {
      auto y = x.to(dt).transpose(1, 2);  // [B,H,T,...]
      auto sizes = y.sizes().vec();
      std::vector<int64_t> to{BH, N, C};
      to.insert(to.end(), sizes.begin() + 3, sizes.end());
      return y.reshape(to);
    };
    pieces = delta_rule_chunk(chunked(in.q), chunked(in.k), walk_levels ? chunked(in.v) : Tensor(), chunked(in.beta),
                              chunked(in.g), 1.0,
                              walk_levels ? ChunkParts::walk : init.empty() ? ChunkParts::mixing : ChunkParts::reads);
    base.own_pairs = [&](const Tensor& weight) {  // weight [B,H,N,C,C]
      auto M = pieces.mixing.reshape({B, H, N, C, C}) * weight;
      auto vc = split_chunks(to_bhtd(in.v.to(dt)), C);
      return from_bhtd(merge_chunks(at::matmul(M, vc)));
    };
    base.first_chunk_read = [&](const Tensor& Z) {  // the first chunk's query_state [B,H,C,dk] reads Z
      auto Pc = pieces.query_state.select(1, 0).reshape({B, H, C, dk});
      return at::matmul(Pc, Z).transpose(1, 2);  // [B,C,H,dv]
    };
    if (walk_levels) {
      // The kernels take the pieces in bf16 (the delta rule's kernels' operand type) for bf16 inputs.
      const auto io = in.q.scalar_type() == at::kBFloat16 ? at::kBFloat16 : dt;
      auto rows = [&](const Tensor& x) { return x.reshape({BH, T, x.size(-1)}).to(io); };
      W = rows(pieces.w), U = rows(pieces.u), Kt = rows(pieces.k_out), P = rows(pieces.query_state);
      gamma = pieces.gate_last.to(dt);
    }
  }
  if (walk_levels) {
    base.walk = [&](const std::vector<Tensor>& X0) {
      const int64_t J = L - 1 - c;
      auto lam = in.l.narrow(3, c + 1, J).to(dt).permute({0, 2, 3, 1}).reshape({BH, J, T});
      Tensor x0;
      if (std::any_of(X0.begin(), X0.end(), [](const Tensor& x) { return x.defined(); })) {
        std::vector<Tensor> e;
        for (const Tensor& x : X0)
          e.push_back(x.defined() ? x.to(dt).reshape({BH, dk, dv}) : at::zeros({BH, dk, dv}, in.q.options().dtype(dt)));
        x0 = at::stack(e);
      }
      auto [o, finals] = level_walk(W, U, Kt, P.reshape({BH, T, dk}), gamma, lam, x0, LevelWalkPlace{opt.offset, C, c + 1});
      std::vector<Tensor> last;
      for (int64_t j = 0; j < J; ++j) last.push_back(finals.select(0, j).reshape({B, H, dk, dv}));
      return std::make_pair(o.reshape({B, H, T, dv}).transpose(1, 2), last);
    };
  }
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
