// Sampling and the generation loop (generate.h).
#include "framework/infer/generate.h"

#include "framework/data/synthetic.h"
#include "framework/infer/recurrent_decoder.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

namespace carry {
namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

int64_t sample_token(const Tensor& logits, const SamplingOptions& opt, int64_t draw) {
  TORCH_CHECK(logits.dim() == 1 && logits.numel() > 0, "sample: logits must be [V], got ", logits.sizes());
  TORCH_CHECK(std::isfinite(opt.temperature) && opt.temperature >= 0, "sample: temperature must be >= 0, got ",
              opt.temperature);
  TORCH_CHECK(opt.top_k >= 0, "sample: top_k must be >= 0 (0 = off), got ", opt.top_k);
  TORCH_CHECK(opt.top_p > 0 && opt.top_p <= 1, "sample: top_p must lie in (0, 1], got ", opt.top_p);
  auto host = logits.detach().to(at::kCPU).to(at::kDouble).contiguous();
  const double* x = host.data_ptr<double>();
  const int64_t V = host.numel();
  for (int64_t i = 0; i < V; ++i)
    TORCH_CHECK(!std::isnan(x[i]), "sample: the logits hold NaN (token ", i, ")");
  if (opt.temperature == 0) return std::max_element(x, x + V) - x;  // the first maximum

  // Most likely first; ties in token order, so the choice depends only on the values.
  std::vector<int64_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x[a] > x[b]; });
  int64_t keep = opt.top_k > 0 ? std::min(opt.top_k, V) : V;
  const double top = x[order[0]];
  std::vector<double> p(keep);
  double sum = 0;
  for (int64_t i = 0; i < keep; ++i) sum += p[i] = std::exp((x[order[i]] - top) / opt.temperature);
  if (opt.top_p < 1) {
    double cumulative = 0;
    int64_t n = 0;
    while (n < keep) {
      cumulative += p[n++] / sum;
      if (cumulative >= opt.top_p) break;
    }
    keep = n;
    sum = std::accumulate(p.begin(), p.begin() + keep, 0.0);
  }
  CounterRng rng(opt.seed, {0x67656e6572617465ULL /* "generate" */, static_cast<uint64_t>(draw)});
  const double u = static_cast<double>(rng.next() >> 11) * 0x1.0p-53 * sum;  // uniform in [0, sum)
  double cumulative = 0;
  for (int64_t i = 0; i < keep; ++i) {
    cumulative += p[i];
    if (u < cumulative) return order[i];
  }
  return order[keep - 1];
}

Generation generate(const Model& model, const std::vector<int64_t>& prompt, const GenerationOptions& opt) {
  TORCH_CHECK(!prompt.empty(), "generate: the prompt needs at least one token");
  TORCH_CHECK(opt.max_new_tokens >= 0, "generate: max_new_tokens must be >= 0, got ", opt.max_new_tokens);
  at::NoGradGuard no_grad;
  Generation g;
  g.prompt_length = static_cast<int64_t>(prompt.size());
  RecurrentDecoder decoder(model, g.prompt_length + std::max<int64_t>(opt.max_new_tokens, 1));
  const auto device = model.options().device();
  double t0 = now_s();
  auto tokens = at::tensor(prompt, at::TensorOptions().dtype(at::kLong)).view({1, -1}).to(device);
  Tensor last = decoder.feed(tokens).select(1, g.prompt_length - 1).select(0, 0);  // [V]
  g.prefill_seconds = now_s() - t0;
  std::vector<Tensor> kept;
  t0 = now_s();
  for (int64_t i = 0; i < opt.max_new_tokens; ++i) {
    if (opt.keep_logits) kept.push_back(last.to(at::kCPU).to(at::kFloat));
    const int64_t token = sample_token(last, opt.sampling, i);
    g.tokens.push_back(token);
    if (opt.on_token) opt.on_token(token, i);
    if (token == opt.stop_token || i + 1 == opt.max_new_tokens) break;
    auto next = at::full({1, 1}, token, at::TensorOptions().dtype(at::kLong).device(device));
    last = decoder.feed(next).select(1, 0).select(0, 0);
  }
  g.decode_seconds = now_s() - t0;
  if (opt.keep_logits)
    g.logits = kept.empty() ? at::empty({0, model.config().vocab_size()}, at::kFloat) : at::stack(kept);
  return g;
}

}  // namespace carry
