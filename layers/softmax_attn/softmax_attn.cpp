// Causal softmax attention, family "softmax_attn": full, sliding-window, and the window with Longformer's
// global tokens and the Sparse Transformer's summary columns (the mask and its citations: softmax_attn.h).
// Stateless, but for the keys before the slice that the sparse patterns read, which arrive as the initial
// state. Forms: naive = materialized masked T×T scores and one softmax; chunkwise = per query block of C
// tokens, the reachable key blocks (softmax_attn_key_blocks), then the pattern keys before them and the
// keys before the slice, with an online softmax: a running row max m (a stabilizer, detached: the result
// does not depend on it), a running sum l and an accumulator, rescaled by exp(m_old − m_new) as key sets
// arrive; one normalizer over the union (a log-sum-exp merge, not one softmax per part). Masking is done
// on the scores (−inf) before exp. Backward: autograd. MixerOptions::normalize is not used. On GPU builds
// the kernel form (layers/kernels/softmax_attn/: FlashAttention-2 style, 64-row blocks) serves CUDA inputs
// with the window alone; the sparse patterns run the chunkwise form there.
#include "layers/softmax_attn/softmax_attn.h"

#include "layers/layout.h"
#ifdef CARRY_WITH_CUDA
#include "layers/kernels/softmax_attn/op.h"
#endif

#include <algorithm>
#include <limits>

namespace carry {

std::vector<int64_t> softmax_attn_key_blocks(int64_t query_block, int64_t chunk_size,
                                             int64_t window) {
  TORCH_INTERNAL_ASSERT(query_block >= 0 && chunk_size > 0 && window >= 0);
  const int64_t first_query = query_block * chunk_size;
  std::vector<int64_t> blocks;
  for (int64_t j = query_block; j >= 0; --j) {
    // Block j's last key is outside every query's window: so are all earlier blocks.
    if (window > 0 && (j + 1) * chunk_size - 1 <= first_query - window) break;
    blocks.push_back(j);
  }
  return blocks;
}

bool softmax_attn_pattern_key(int64_t position, int64_t global_tokens, int64_t stride) {
  return position < global_tokens || (stride > 0 && position % stride == stride - 1);
}

namespace {

// The pattern keys of the document starting at `doc` among positions [lo, hi), in order.
void pattern_keys(int64_t doc, int64_t lo, int64_t hi, int64_t G, int64_t S, std::vector<int64_t>& out) {
  lo = std::max(lo, doc);
  for (int64_t p = lo; p < std::min(hi, doc + G); ++p) out.push_back(p);
  if (S <= 0) return;
  // Summary columns at or after the global tokens: doc + S−1 + k·S.
  const int64_t from = std::max(lo, doc + G);
  int64_t p = doc + S - 1;
  if (p < from) p += (from - p + S - 1) / S * S;
  for (; p < hi; p += S) out.push_back(p);
}

}  // namespace

SoftmaxAttnRelayPlan softmax_attn_relay_plan(const Tensor& starts, int64_t batch, int64_t sequence_length,
                                             int64_t rank, int64_t length, int64_t halo, int64_t global_tokens,
                                             int64_t stride) {
  const int64_t B = batch, N = sequence_length, T = length, G = global_tokens, S = stride;
  TORCH_CHECK(B > 0 && T > 0 && N % T == 0 && rank >= 0 && rank < N / T && halo >= 0 && G >= 0 && S >= 0,
              "softmax_attn relay plan: bad layout (batch ", B, ", sequence ", N, ", slice ", T, ", rank ", rank,
              ", halo ", halo, ")");
  TORCH_CHECK(halo <= T, "softmax_attn: a window halo of ", halo, " tokens needs slices at least that long; this "
              "rank's slice has ", T, " tokens (a window reaching past the previous rank is not supported)");
  Tensor flags;
  if (starts.defined()) {
    TORCH_CHECK(starts.dim() == 2 && starts.size(0) == B && starts.size(1) == N && starts.scalar_type() == at::kBool,
                "softmax_attn relay plan: document starts must be [", B, ", ", N, "] bool, got ",
                shape_str(starts.sizes()), " ", starts.scalar_type());
    flags = starts.cpu().contiguous();
  }
  const bool* f = flags.defined() ? flags.data_ptr<bool>() : nullptr;
  auto doc_start = [&](int64_t b, int64_t p) {  // the latest document start at or before p (0 if none)
    if (!f) return int64_t{0};
    for (int64_t u = p; u > 0; --u)
      if (f[b * N + u]) return u;
    return int64_t{0};
  };
  const int64_t P = N / T;
  auto extended_start = [&](int64_t r) { return r * T - (r > 0 ? halo : 0); };
  // The memory of rank r for sequence b: the pattern keys of the document in progress at its extended
  // start E that lie before E.
  auto memory = [&](int64_t r, int64_t b) {
    std::vector<int64_t> m;
    const int64_t E = extended_start(r);
    if (E > 0) pattern_keys(doc_start(b, E), 0, E, G, S, m);
    return m;
  };
  auto padded = [](const std::vector<std::vector<int64_t>>& lists) {
    size_t n = 0;
    for (auto& l : lists) n = std::max(n, l.size());
    return static_cast<int64_t>(n);
  };
  std::vector<std::vector<int64_t>> mine(B);
  for (int64_t b = 0; b < B; ++b) mine[b] = memory(rank, b);
  SoftmaxAttnRelayPlan plan;
  plan.memory_rows = padded(mine);
  plan.halo_rows = rank > 0 ? halo : 0;
  plan.valid = at::zeros({B, plan.memory_rows}, at::kBool);
  auto valid = plan.valid.accessor<bool, 2>();
  for (int64_t b = 0; b < B; ++b)
    for (size_t m = 0; m < mine[b].size(); ++m) valid[b][m] = true;
  if (rank + 1 >= P) return plan;
  const int64_t E = extended_start(rank), own = rank * T;
  // Row of position p in cat(incoming message, own rows): own rows, halo rows, or this rank's memory.
  auto row_of = [&](int64_t b, int64_t p) -> int64_t {
    if (p >= own) return plan.memory_rows + plan.halo_rows + (p - own);
    if (p >= E) return plan.memory_rows + (p - E);
    auto it = std::lower_bound(mine[b].begin(), mine[b].end(), p);
    TORCH_INTERNAL_ASSERT(it != mine[b].end() && *it == p, "softmax_attn relay plan: position ", p,
                          " is not in rank ", rank, "'s memory");
    return it - mine[b].begin();
  };
  std::vector<std::vector<int64_t>> next(B);
  for (int64_t b = 0; b < B; ++b) next[b] = memory(rank + 1, b);
  const int64_t rows_memory = padded(next), next_start = (rank + 1) * T;
  plan.index = at::full({B, rows_memory + halo}, -1, at::kLong);
  auto index = plan.index.accessor<int64_t, 2>();
  for (int64_t b = 0; b < B; ++b) {
    for (size_t m = 0; m < next[b].size(); ++m) index[b][m] = row_of(b, next[b][m]);
    for (int64_t j = 0; j < halo; ++j) index[b][rows_memory + j] = row_of(b, next_start - halo + j);
  }
  return plan;
}

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

bool sparse(const MixerOptions& opt) { return opt.global_tokens > 0 || opt.stride > 0; }

// True where key row s may not be seen from query row t: s > t, or s outside t's window and not a
// pattern key (rows at document positions opt.offset + row).
Tensor excluded(const Tensor& t, const Tensor& s, const MixerOptions& opt) {
  auto out = s.unsqueeze(0) > t.unsqueeze(1);
  if (opt.window == 0) return out;
  auto outside = s.unsqueeze(0) <= t.unsqueeze(1) - opt.window;
  if (sparse(opt)) {
    auto p = s + opt.offset;
    auto key = p < opt.global_tokens;
    if (opt.stride > 0) key = key.logical_or(p.remainder(opt.stride) == opt.stride - 1);
    outside = outside.logical_and(key.logical_not().unsqueeze(0));
  }
  return out.logical_or(outside);
}

// The keys before the slice (the initial state), in [B,H,M,D]; `pad` [B,1,1,M] true on padding rows.
struct Memory {
  Tensor k, v, pad;
};

class SoftmaxAttention final : public Mixer {
 public:
  std::string name() const override { return "softmax_attn"; }
  std::vector<std::string> input_names() const override { return {"q", "k", "v"}; }
  std::vector<std::string> state_names() const override { return {}; }
  State zero_state(const MixerInputs&, const MixerOptions&) const override { return {}; }
  bool has_summary() const override { return false; }

  void check(const MixerInputs& in, const MixerOptions& opt, bool chunked) const override {
    Mixer::check(in, opt, chunked);
    TORCH_CHECK(opt.window >= 0, name(), ": window must be >= 0 (0 = full causal), got ", opt.window);
    TORCH_CHECK(opt.global_tokens >= 0 && opt.stride >= 0, name(), ": global_tokens and stride must be >= 0 "
                "(0 = none), got ", opt.global_tokens, " and ", opt.stride);
    TORCH_CHECK(!sparse(opt) || opt.window > 0, name(), ": global_tokens (", opt.global_tokens, ") and stride (",
                opt.stride, ") go with a sliding window; with window 0 every earlier key is attended already");
    TORCH_CHECK(opt.offset >= 0, name(), ": offset must be >= 0, got ", opt.offset);
  }

  MixerOutput naive(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, false);
    Memory mem = memory(in, init, opt);
    auto q = to_bhtd(in.q) * opt.scale_for(in.q.size(3)), k = to_bhtd(in.k), v = to_bhtd(in.v);
    auto pos = at::arange(q.size(2), q.options().dtype(at::kLong));
    auto scores = at::matmul(q, k.transpose(-1, -2)).masked_fill(excluded(pos, pos, opt), kNegInf);
    if (mem.k.defined()) {
      auto before = at::matmul(q, mem.k.transpose(-1, -2)).masked_fill(mem.pad, kNegInf);
      scores = at::cat({before, scores}, -1);
      v = at::cat({mem.v, v}, 2);
    }
    return {from_bhtd(at::matmul(at::softmax(scores, -1), v)), {}};
  }

#ifdef CARRY_WITH_CUDA
  // The kernel form: layers/kernels/softmax_attn/{fwd,bwd}.cu through the autograd op of layers/kernels/softmax_attn/op.cpp.
  // Its mask is the window alone: the sparse patterns are not its inputs.
  bool has_kernel() const override { return true; }
  bool kernel_supports(const MixerInputs& in, const MixerOptions& opt) const override {
    return !sparse(opt) && softmax_attn_kernel_supports(in, opt);
  }
  MixerOutput kernel(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, /*chunked=*/true);
    TORCH_CHECK(!sparse(opt), name(), ": the kernel form computes the window alone; global_tokens (",
                opt.global_tokens, ") and stride (", opt.stride, ") run in the chunkwise form (form: automatic)");
    TORCH_CHECK(init.empty(), name(), ": the kernel form takes no initial state, got ", init.size(), " entries");
    TORCH_CHECK(softmax_attn_kernel_supports(in, opt), name(), ": the kernel form takes CUDA tensors q, k, v of one "
                "dtype, bf16 or fp32, with dk = dv in {64, 128} and T a multiple of 64; got q ", shape_str(in.q.sizes()),
                " ", in.q.scalar_type(), " on ", in.q.device(), ", v ", shape_str(in.v.sizes()), " ",
                in.v.scalar_type());
    return {softmax_attn_kernel_forward(in, opt), {}};
  }
#endif

  MixerOutput chunkwise(const MixerInputs& in, const State& init,
                        const MixerOptions& opt) const override {
    check(in, opt, true);
    if (sparse(opt)) return patterns_by_blocks(in, init, opt);
    memory(in, init, opt);  // without the patterns: no initial state (checked)
    const int64_t C = opt.chunk_size, w = opt.window, T = in.q.size(1);
    auto qf = to_bhtd(in.q) * opt.scale_for(in.q.size(3)), kf = to_bhtd(in.k), vf = to_bhtd(in.v);  // [B,H,T,d]
    auto q = split_chunks(qf, C), k = split_chunks(kf, C), v = split_chunks(vf, C);             // [B,H,N,C,d]
    auto offsets = at::arange(C, q.options().dtype(at::kLong));
    std::vector<Tensor> outs;
    for (int64_t i = 0; i < q.size(2); ++i) {
      auto qi = q.select(2, i);  // [B,H,C,dk]
      Tensor m, l, acc;          // running max [B,H,C,1], sum [B,H,C,1], numerator [B,H,C,dv]
      auto absorb = [&](const Tensor& scores, const Tensor& values) {
        auto block_max = std::get<0>(scores.detach().max(-1, /*keepdim=*/true));
        if (!m.defined()) {
          // The diagonal block comes first and every query sees itself: m is finite from here on.
          m = block_max;
          auto p = (scores - m).exp();
          l = p.sum(-1, true);
          acc = at::matmul(p, values);
          return;
        }
        auto m_new = at::maximum(m, block_max);
        auto rescale = (m - m_new).exp();
        auto p = (scores - m_new).exp();
        l = rescale * l + p.sum(-1, true);
        acc = rescale * acc + at::matmul(p, values);
        m = m_new;
      };
      const auto blocks = softmax_attn_key_blocks(i, C, w);
      for (int64_t j : blocks) {
        auto scores = at::matmul(qi, k.select(2, j).transpose(-1, -2));  // [B,H,C,C]
        // Only the diagonal block and blocks cut by the window's edge have excluded pairs.
        bool cut = j == i || (w > 0 && j * C <= i * C + C - 1 - w);
        if (cut) scores = scores.masked_fill(excluded(offsets + i * C, offsets + j * C, opt), kNegInf);
        absorb(scores, v.select(2, j));
      }
      outs.push_back(acc / l);
    }
    return {from_bhtd(merge_chunks(at::stack(outs, 2))), {}};
  }

 private:
  // The chunkwise form with the sparse patterns: query blocks of R rows (the window rounded up to whole
  // chunks), each scored at once against the keys its window reaches, [a − w + 1, a + R), masked, and
  // the pattern keys before them and the keys before the slice, in one softmax a row. Few large products
  // instead of a chunk's small ones (on a GPU the small ones ran at under 1,000 tokens/s for a 125M
  // hybrid): the block's scores are R × (R + w + pattern keys), the memory of R + w keys a query row.
  MixerOutput patterns_by_blocks(const MixerInputs& in, const State& init, const MixerOptions& opt) const {
    Memory mem = memory(in, init, opt);
    const int64_t C = opt.chunk_size, w = opt.window, T = in.q.size(1);
    const int64_t R = std::max<int64_t>(C, (w + C - 1) / C * C);
    auto qf = to_bhtd(in.q) * opt.scale_for(in.q.size(3)), kf = to_bhtd(in.k), vf = to_bhtd(in.v);  // [B,H,T,d]
    auto rows = [&](int64_t a, int64_t n) { return at::arange(a, a + n, qf.options().dtype(at::kLong)); };
    const int64_t global_end = std::clamp<int64_t>(opt.global_tokens - opt.offset, 0, T);
    std::vector<int64_t> summary_rows;  // the slice's summary rows at or after global_end (global ones count once)
    if (opt.stride > 0) {
      const int64_t S = opt.stride;
      for (int64_t r = ((S - 1 - opt.offset) % S + S) % S; r < T; r += S)
        if (r >= global_end) summary_rows.push_back(r);
    }
    const Tensor summary_index = at::tensor(summary_rows, at::kLong).to(kf.device());
    std::vector<Tensor> outs;
    for (int64_t a = 0; a < T; a += R) {
      const int64_t n = std::min(R, T - a), lo = std::max<int64_t>(0, a - w + 1);
      auto qi = qf.narrow(2, a, n);  // [B,H,n,dk]
      std::vector<Tensor> scores{at::matmul(qi, kf.narrow(2, lo, a + n - lo).transpose(-1, -2))
                                     .masked_fill(excluded(rows(a, n), rows(lo, a + n - lo), opt), kNegInf)};
      std::vector<Tensor> values{vf.narrow(2, lo, a + n - lo)};
      // Pattern keys before the window range: outside every window of the block, seen by all its queries.
      const int64_t n_global = std::min(global_end, lo);
      if (n_global > 0) {
        scores.push_back(at::matmul(qi, kf.narrow(2, 0, n_global).transpose(-1, -2)));
        values.push_back(vf.narrow(2, 0, n_global));
      }
      const int64_t n_summary = std::lower_bound(summary_rows.begin(), summary_rows.end(), lo) - summary_rows.begin();
      if (n_summary > 0) {
        auto idx = summary_index.narrow(0, 0, n_summary);
        scores.push_back(at::matmul(qi, kf.index_select(2, idx).transpose(-1, -2)));
        values.push_back(vf.index_select(2, idx));
      }
      if (mem.k.defined() && mem.k.size(2) > 0) {
        scores.push_back(at::matmul(qi, mem.k.transpose(-1, -2)).masked_fill(mem.pad, kNegInf));
        values.push_back(mem.v);
      }
      outs.push_back(at::matmul(at::softmax(at::cat(scores, -1), -1), at::cat(values, 2)));
    }
    return {from_bhtd(at::cat(outs, 2)), {}};
  }

  // The initial state as keys before the slice (softmax_attn.h), checked.
  Memory memory(const MixerInputs& in, const State& init, const MixerOptions& opt) const {
    if (init.empty()) return {};
    TORCH_CHECK(sparse(opt), name(), " has no recurrent state: without global_tokens or stride the initial state "
                "must be empty, got ", init.size(), " entries");
    TORCH_CHECK(init.size() == 3, name(), ": the initial state of the sparse patterns is {k [B,M,H,dk], v [B,M,H,dv], "
                "valid [B,M]} (the keys before the slice), got ", init.size(), " entries");
    const int64_t B = in.q.size(0), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3), M = init[0].size(1);
    check_tensor(init[0], name() + ": initial state 'k'", {B, -1, H, dk});
    check_tensor(init[1], name() + ": initial state 'v'", {B, M, H, dv});
    check_tensor(init[2], name() + ": initial state 'valid'", {B, M});
    return {to_bhtd(init[0].to(in.q.scalar_type())), to_bhtd(init[1].to(in.v.scalar_type())),
            (init[2] == 0).view({B, 1, 1, M})};
  }
};

CARRY_REGISTER_MIXER(SoftmaxAttention);

}  // namespace
}  // namespace carry
