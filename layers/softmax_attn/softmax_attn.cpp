// Causal (optionally sliding-window) softmax attention, family "softmax_attn":
// o_t = Σ_{t−w < s ≤ t} exp(scale·q_t·k_s) v_s / Σ_{t−w < s ≤ t} exp(scale·q_t·k_s), w = window (0: all
// s ≤ t). Stateless: no summary, empty state. Forms: naive = materialized masked T×T scores and softmax;
// chunkwise = per query block of C tokens, the reachable key blocks (softmax_attn_key_blocks) with an
// online softmax: a running row max m (a stabilizer, detached: the result does not depend on it), a
// running sum l and an accumulator, rescaled by exp(m_old − m_new) as blocks arrive. Masking is done on
// the scores (−inf) before exp. MixerOptions::normalize and ::offset are not used. On GPU builds the
// kernel form (layers/kernels/softmax_attn/: FlashAttention-2 style, 64-row blocks) serves CUDA inputs.
#include "layers/softmax_attn/softmax_attn.h"

#include "layers/layout.h"
#ifdef CARRY_WITH_CUDA
#include "layers/kernels/softmax_attn/op.h"
#endif

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

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// True where key position s may not be seen from query position t (s > t, or s ≤ t − window).
Tensor excluded(const Tensor& t, const Tensor& s, int64_t window) {
  auto out = s.unsqueeze(0) > t.unsqueeze(1);
  if (window > 0) out = out.logical_or(s.unsqueeze(0) <= t.unsqueeze(1) - window);
  return out;
}

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
  }

  MixerOutput naive(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, false);
    check_no_state(init);
    auto q = to_bhtd(in.q) * opt.scale_for(in.q.size(3)), k = to_bhtd(in.k), v = to_bhtd(in.v);
    auto pos = at::arange(q.size(2), q.options().dtype(at::kLong));
    auto scores = at::matmul(q, k.transpose(-1, -2)).masked_fill(excluded(pos, pos, opt.window), kNegInf);
    return {from_bhtd(at::matmul(at::softmax(scores, -1), v)), {}};
  }

#ifdef CARRY_WITH_CUDA
  // The kernel form: layers/kernels/softmax_attn/{fwd,bwd}.cu through the autograd op of layers/kernels/softmax_attn/op.cpp.
  bool has_kernel() const override { return true; }
  bool kernel_supports(const MixerInputs& in, const MixerOptions& opt) const override {
    return softmax_attn_kernel_supports(in, opt);
  }
  MixerOutput kernel(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    check(in, opt, /*chunked=*/true);
    check_no_state(init);
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
    check_no_state(init);
    const int64_t C = opt.chunk_size, w = opt.window;
    auto q = split_chunks(to_bhtd(in.q) * opt.scale_for(in.q.size(3)), C);  // [B,H,N,C,dk]
    auto k = split_chunks(to_bhtd(in.k), C), v = split_chunks(to_bhtd(in.v), C);
    auto offsets = at::arange(C, q.options().dtype(at::kLong));
    std::vector<Tensor> outs;
    for (int64_t i = 0; i < q.size(2); ++i) {
      auto qi = q.select(2, i);  // [B,H,C,dk]
      Tensor m, l, acc;          // running max [B,H,C,1], sum [B,H,C,1], numerator [B,H,C,dv]
      for (int64_t j : softmax_attn_key_blocks(i, C, w)) {
        auto scores = at::matmul(qi, k.select(2, j).transpose(-1, -2));  // [B,H,C,C]
        // Only the diagonal block and blocks cut by the window's edge have excluded pairs.
        bool cut = j == i || (w > 0 && j * C <= i * C + C - 1 - w);
        if (cut) scores = scores.masked_fill(excluded(offsets + i * C, offsets + j * C, w), kNegInf);
        auto block_max = std::get<0>(scores.detach().max(-1, /*keepdim=*/true));
        if (!m.defined()) {
          // The diagonal block comes first and every query sees itself: m is finite from here on.
          m = block_max;
          auto p = (scores - m).exp();
          l = p.sum(-1, true);
          acc = at::matmul(p, v.select(2, j));
        } else {
          auto m_new = at::maximum(m, block_max);
          auto rescale = (m - m_new).exp();
          auto p = (scores - m_new).exp();
          l = rescale * l + p.sum(-1, true);
          acc = rescale * acc + at::matmul(p, v.select(2, j));
          m = m_new;
        }
      }
      outs.push_back(acc / l);
    }
    return {from_bhtd(merge_chunks(at::stack(outs, 2))), {}};
  }

 private:
  void check_no_state(const State& init) const {
    TORCH_CHECK(init.empty(), name(), " has no recurrent state: initial_state must be empty, got ",
                init.size(), " entries");
  }
};

CARRY_REGISTER_MIXER(SoftmaxAttention);

}  // namespace
}  // namespace carry
