// Evaluation (evaluator.h): batches of held-out sequences through the model in the slice context of
// this rank, per-position sums of the cross entropy, one all-reduce at the end; the loss curve's
// buckets, its TSV table and its SVG plot.
#include "framework/eval/evaluator.h"

#include "framework/data/synthetic.h"
#include "framework/data/token_file.h"
#include "framework/io/output_file.h"
#include "framework/train/memory_estimate.h"
#include "layers/blocks/precision.h"
#include "parallel/slice_context.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

namespace carry {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The token files as one stream.
struct Stream {
  std::vector<TokenFile> files;
  std::vector<int64_t> starts;
  int64_t total = 0;
  explicit Stream(const std::vector<std::string>& paths) {
    for (const auto& p : paths) {
      starts.push_back(total);
      files.emplace_back(p);
      total += files.back().size();
    }
  }
  void read(int64_t pos, int64_t count, int64_t* out) const {
    for (size_t i = 0; i < files.size() && count > 0; ++i) {
      int64_t begin = starts[i], end = starts[i] + files[i].size();
      if (pos >= end) continue;
      int64_t n = std::min(count, end - pos);
      files[i].read(pos - begin, n, out);
      pos += n, out += n, count -= n;
    }
    TORCH_INTERNAL_ASSERT(count == 0, "eval: token stream read past its end");
  }
};

const Tensor& named(const NamedParameters& params, const std::string& name) {
  for (const auto& [n, t] : params)
    if (n == name) return t;
  static const Tensor none;
  return none;
}

std::string escape_xml(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else if (c == '"') out += "&quot;";
    else out += c;
  }
  return out;
}

}  // namespace

double EvalResult::perplexity() const { return std::exp(loss()); }
double EvalResult::bits_per_token() const { return loss() / std::log(2.0); }
double EvalResult::bits_per_byte() const {
  return byte_targets ? loss_sum / std::log(2.0) / static_cast<double>(byte_targets) : 0;
}

EvalResult evaluate_model(const Model& model, const EvalSpec& spec, parallel::ProcessGroups* groups) {
  at::NoGradGuard no_grad;
  const int dp = groups ? groups->layout.dp : 1, sp = groups ? groups->layout.sp : 1;
  const int dp_rank = groups ? groups->dp_rank : 0, sp_rank = groups ? groups->sp_rank : 0;
  const bool rank0 = !groups || groups->world_info.rank == 0;
  const int64_t T = spec.seq_len, V = model.config().vocab_size();
  int64_t B = spec.batch_size;
  if (T <= 0) throw ConfigError("eval: the sequence length must be positive, got " + std::to_string(T));
  if (B <= 0) throw ConfigError("eval: the batch size must be positive, got " + std::to_string(B));
  if (T % sp != 0)
    throw ConfigError("eval: the sequence length " + std::to_string(T) + " does not split over sp = " + std::to_string(sp) +
                      " ranks (it must be a multiple of sp)");
  const int64_t Tp = T / sp;
  for (const auto& b : model.blocks()) {
    const int64_t C = b.mixer->spec().chunk_size;
    if (Tp % C != 0)
      throw ConfigError("eval: each rank's slice is " + std::to_string(Tp) + " tokens (sequence length " +
                        std::to_string(T) + " / sp " + std::to_string(sp) + "), not a multiple of the chunk size " +
                        std::to_string(C) + " of the " + b.mixer->spec().kind + " layers; pick a sequence length that "
                        "is a multiple of " + std::to_string(C * sp));
  }
  EvalResult r;
  r.task = spec.token_files.empty();
  std::unique_ptr<Stream> stream;
  int64_t N = 0, batches = 0;
  if (!r.task) {
    stream = std::make_unique<Stream>(spec.token_files);
    const int64_t windows = (stream->total - 1) / T;
    if (windows <= 0)
      throw ConfigError("eval: the token files hold " + std::to_string(stream->total) +
                        " tokens, fewer than one sequence of " + std::to_string(T) + " + 1");
    N = spec.max_sequences > 0 ? std::min(windows, spec.max_sequences) : windows;
    // Batches sized to the data: a batch larger than a rank's share of the sequences would only hold
    // padding (and could ask for more memory than the host has).
    B = std::min(B, (N + dp - 1) / dp);
    batches = (N + dp * B - 1) / (dp * B);
  } else {
    if (!spec.data.has_mqar() && !spec.data.has_needle())
      throw ConfigError("eval: no data: give token files, or a run config whose data is an MQAR or needle task");
    batches = spec.batches > 0 ? spec.batches : spec.data.eval_batches();
    N = batches * dp * B;
  }
  const auto device = model.options().device();
  if (device.is_cpu()) {
    // A floor on what one batch needs on the CPU (one block's activations: the residual stream, the
    // mixer's projections and the SwiGLU hidden layer, fp32), against the host's available memory:
    // an impossible --batch-size is refused before anything is allocated.
    const auto& mc = model.config();
    const double floor_bytes = static_cast<double>(B) * static_cast<double>(Tp) * static_cast<double>(mc.d_model()) *
                               4.0 * (6.0 + 2.0 * mc.mlp_ratio());
    const double available = available_memory_bytes();
    if (available > 0 && floor_bytes > available)
      throw ConfigError("eval: a batch of " + std::to_string(B) + " sequences of " + std::to_string(Tp) +
                        " tokens needs at least " + std::to_string(static_cast<long long>(floor_bytes / (1 << 20))) +
                        " MiB on this host, which has " + std::to_string(static_cast<long long>(available / (1 << 20))) +
                        " MiB available; give a smaller --batch-size");
  }
  parallel::ScanMode mode = spec.scan_mode;
  MixerLayerContext slice;
  if (sp > 1) slice = parallel::make_slice_context(groups->sp, mode, /*head_groups=*/1, T);
  slice.serial_states = sp > 1 && mode == parallel::ScanMode::ordered;
  ModelContext context;
  context.slice = slice;
  const NamedParameters params = model.parameters();
  Tensor head = named(params, "lm_head.weight");
  if (!head.defined()) head = named(params, "embedding.weight");
  head = head.detach();

  auto fp64 = at::TensorOptions().dtype(at::kDouble).device(device);
  Tensor pos_loss = at::zeros({Tp}, fp64), pos_count = at::zeros({Tp}, fp64), pos_correct = at::zeros({Tp}, fp64);
  Tensor byte_targets = at::zeros({}, fp64);
  double sequences = 0, sequences_right = 0;
  // Positions a slice at a time through the head: about 2^22 logits.
  const int64_t piece = std::max<int64_t>(1, (int64_t{1} << 22) / std::max<int64_t>(1, B * V));
  const double t0 = now_s();
  const int64_t report_every = std::max<int64_t>(1, (batches + 9) / 10);
  for (int64_t e = 0; e < batches; ++e) {
    Tensor tokens, targets, weight;
    if (r.task) {
      config::DataConfig data = spec.data;
      data.set_seq_len(T);
      auto b = data.has_mqar() ? mqar_batch(mqar_spec(data), spec.seed, e, dp_rank, B, Split::eval)
                               : needle_batch(needle_spec(data), spec.seed, e, dp_rank, B, Split::eval);
      tokens = b.tokens, targets = b.targets, weight = b.loss_mask.to(at::kDouble);
    } else {
      auto window = at::empty({B, T + 1}, at::kLong);
      weight = at::zeros({B, T}, at::kDouble);
      for (int64_t i = 0; i < B; ++i) {
        const int64_t s = (e * dp + dp_rank) * B + i;
        stream->read(s < N ? s * T : 0, T + 1, window[i].data_ptr<int64_t>());
        if (s < N) weight[i].fill_(1.0);
      }
      const int64_t hi = window.max().item<int64_t>();
      if (hi >= V)
        throw ConfigError("eval: the token files hold token id " + std::to_string(hi) + ", outside the model's vocabulary of " +
                          std::to_string(V) + " (tokenized for another model?)");
      tokens = window.narrow(1, 0, T).contiguous();
      targets = window.narrow(1, 1, T).contiguous();
    }
    auto slice_of = [&](const Tensor& x) { return x.narrow(1, sp_rank * Tp, Tp).contiguous().to(device); };
    Tensor tok = slice_of(tokens), tgt = slice_of(targets), w = slice_of(weight);
    Tensor hidden;
    {
      AutocastScope autocast(device.type(), at::kBFloat16, spec.bf16);
      hidden = model.hidden(tok, context);
    }
    if (spec.first_batch && e == 0 && dp_rank == 0 && sp == 1) {
      AutocastScope autocast(device.type(), at::kBFloat16, spec.bf16);
      spec.first_batch(tokens, at::linear(hidden, head).to(at::kCPU));
    }
    auto safe = tgt.clamp_min(0);
    Tensor right_seq = at::zeros({B}, fp64), scored_seq = at::zeros({B}, fp64);
    for (int64_t p0 = 0; p0 < Tp; p0 += piece) {
      const int64_t n = std::min(piece, Tp - p0);
      Tensor logits;
      {
        AutocastScope autocast(device.type(), at::kBFloat16, spec.bf16);
        logits = at::linear(hidden.narrow(1, p0, n), head);
      }
      auto dt = at::promote_types(logits.scalar_type(), at::kFloat);
      auto logp = at::log_softmax(logits.to(dt), -1);
      auto t = safe.narrow(1, p0, n);
      auto ce = -logp.gather(-1, t.unsqueeze(-1)).squeeze(-1).to(at::kDouble);  // [B,n]
      auto wn = w.narrow(1, p0, n);
      auto right = (logits.argmax(-1) == t).to(at::kDouble) * wn;
      pos_loss.narrow(0, p0, n).add_((ce * wn).sum(0));
      pos_count.narrow(0, p0, n).add_(wn.sum(0));
      pos_correct.narrow(0, p0, n).add_(right.sum(0));
      byte_targets.add_(((t < 256).to(at::kDouble) * wn).sum());
      right_seq.add_(right.sum(1));
      scored_seq.add_(wn.sum(1));
    }
    // A sequence is all right when every scored target of all its slices is.
    auto per_seq = at::stack({scored_seq, right_seq}, 1);
    if (sp > 1) groups->sp->all_reduce_sum(per_seq);
    auto host = per_seq.cpu();
    for (int64_t i = 0; i < B; ++i) {
      const double scored = host[i][0].item<double>(), right = host[i][1].item<double>();
      const bool valid = r.task ? scored > 0 : (e * dp + dp_rank) * B + i < N;
      if (sp_rank == 0 && valid) sequences += 1, sequences_right += (scored > 0 && right == scored) ? 1 : 0;
    }
    if (spec.progress && rank0 && ((e + 1) % report_every == 0 || e + 1 == batches) && now_s() - t0 > 2) {
      std::fprintf(spec.progress, "eval: batch %lld/%lld (%lld sequences of %lld tokens on this rank's dp group) | %.1f s\n",
                   static_cast<long long>(e + 1), static_cast<long long>(batches),
                   static_cast<long long>((e + 1) * B), static_cast<long long>(T), now_s() - t0);
      std::fflush(spec.progress);
    }
  }
  // Every position of the whole sequence (this rank's slice in place), summed over all ranks.
  Tensor all = at::zeros({3, T}, fp64);
  all.select(0, 0).narrow(0, sp_rank * Tp, Tp).copy_(pos_loss);
  all.select(0, 1).narrow(0, sp_rank * Tp, Tp).copy_(pos_count);
  all.select(0, 2).narrow(0, sp_rank * Tp, Tp).copy_(pos_correct);
  Tensor totals = at::stack({byte_targets, at::scalar_tensor(sequences, fp64), at::scalar_tensor(sequences_right, fp64)});
  if (groups && groups->world->size() > 1) {
    groups->world->all_reduce_sum(all);
    groups->world->all_reduce_sum(totals);
  }
  all = all.cpu().contiguous();
  totals = totals.cpu();
  for (int k = 0; k < 3; ++k) {
    const double* x = all[k].data_ptr<double>();
    std::vector<double>& out = k == 0 ? r.position_loss : k == 1 ? r.position_count : r.position_correct;
    out.assign(x, x + T);
  }
  double count = 0, correct = 0;
  for (int64_t i = 0; i < T; ++i) r.loss_sum += r.position_loss[i], count += r.position_count[i], correct += r.position_correct[i];
  r.positions = static_cast<int64_t>(std::llround(count));
  r.correct = static_cast<int64_t>(std::llround(correct));
  r.byte_targets = static_cast<int64_t>(std::llround(totals[0].item<double>()));
  r.sequences = static_cast<int64_t>(std::llround(totals[1].item<double>()));
  r.sequences_all_right = static_cast<int64_t>(std::llround(totals[2].item<double>()));
  r.seconds = now_s() - t0;
  if (r.positions == 0) throw ConfigError("eval: no target was scored (the task's loss mask selects nothing)");
  return r;
}

std::vector<CurveRow> loss_curve(const EvalResult& result, int64_t buckets) {
  const int64_t T = static_cast<int64_t>(result.position_loss.size());
  std::set<int64_t> edges = {0, T};  // in positions: bucket j is [edges_j, edges_{j+1})
  if (buckets <= 0) {
    for (int64_t i = 1; i < T; ++i) edges.insert(i);
  } else {
    for (int64_t i = 1; i < buckets; ++i) {
      // context lengths round(T^(i/n)) -> positions one less
      edges.insert(std::clamp<int64_t>(std::llround(std::pow(static_cast<double>(T), static_cast<double>(i) / buckets)) - 1, 0, T));
    }
  }
  std::vector<int64_t> e(edges.begin(), edges.end());
  std::vector<CurveRow> rows;
  for (size_t j = 0; j + 1 < e.size(); ++j) {
    CurveRow row;
    row.first = e[j], row.last = e[j + 1] - 1;
    double loss = 0, right = 0;
    for (int64_t p = row.first; p <= row.last; ++p)
      row.tokens += result.position_count[p], loss += result.position_loss[p], right += result.position_correct[p];
    if (row.tokens <= 0) continue;
    row.loss = loss / row.tokens;
    row.accuracy = right / row.tokens;
    rows.push_back(row);
  }
  return rows;
}

void write_curve_tsv(const std::string& path, const std::vector<CurveRow>& rows) {
  std::string text = "first_position\tlast_position\ttokens\tloss\taccuracy\n";
  char buf[160];
  for (const auto& r : rows) {
    std::snprintf(buf, sizeof buf, "%lld\t%lld\t%.0f\t%.6f\t%.6f\n", static_cast<long long>(r.first),
                  static_cast<long long>(r.last), r.tokens, r.loss, r.accuracy);
    text += buf;
  }
  write_whole_file(path, text, "eval: the loss curve", /*sync=*/false, /*allow_char_device=*/true);
}

void write_curve_svg(const std::string& path, const std::vector<CurveRow>& rows, const std::string& title) {
  const double W = 760, H = 440, left = 70, right = 20, top = 40, bottom = 50;
  const double pw = W - left - right, ph = H - top - bottom;
  double xmin = 0, xmax = 1, ymin = 0, ymax = 1;
  std::vector<std::pair<double, double>> pts;  // (log10 context length, loss)
  for (const auto& r : rows)
    pts.emplace_back(0.5 * (std::log10(static_cast<double>(r.first + 1)) + std::log10(static_cast<double>(r.last + 1))), r.loss);
  if (!pts.empty()) {
    xmin = xmax = pts[0].first, ymin = ymax = pts[0].second;
    for (auto& [x, y] : pts) xmin = std::min(xmin, x), xmax = std::max(xmax, x), ymin = std::min(ymin, y), ymax = std::max(ymax, y);
  }
  xmin = std::floor(xmin), xmax = std::max(std::ceil(xmax), xmin + 1);
  const double pad = std::max(1e-6, 0.05 * (ymax - ymin));
  ymin -= pad, ymax += pad;
  auto X = [&](double x) { return left + (x - xmin) / (xmax - xmin) * pw; };
  auto Y = [&](double y) { return top + (ymax - y) / (ymax - ymin) * ph; };
  std::ostringstream s;
  char buf[256];
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s << "<text x=\"" << W / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">" << escape_xml(title) << "</text>\n";
  std::snprintf(buf, sizeof buf, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"black\"/>\n",
                left, top, pw, ph);
  s << buf;
  for (double x = xmin; x <= xmax + 1e-9; x += 1) {  // decades
    std::snprintf(buf, sizeof buf, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                  "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.0f</text>\n",
                  X(x), top, X(x), top + ph, X(x), top + ph + 16, std::pow(10.0, x));
    s << buf;
  }
  for (int i = 0; i <= 4; ++i) {
    double y = ymin + (ymax - ymin) * i / 4;
    std::snprintf(buf, sizeof buf, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                  "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%.3f</text>\n",
                  left, Y(y), left + pw, Y(y), left - 6, Y(y) + 4, y);
    s << buf;
  }
  s << "<text x=\"" << left + pw / 2 << "\" y=\"" << H - 10
    << "\" text-anchor=\"middle\">context length (tokens read before the prediction, log scale)</text>\n";
  std::snprintf(buf, sizeof buf, "<text x=\"16\" y=\"%.1f\" text-anchor=\"middle\" transform=\"rotate(-90 16 %.1f)\">"
                "loss (nats)</text>\n", top + ph / 2, top + ph / 2);
  s << buf << "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"2\" points=\"";
  for (auto& [x, y] : pts) {
    std::snprintf(buf, sizeof buf, "%.1f,%.1f ", X(x), Y(y));
    s << buf;
  }
  s << "\"/>\n</svg>\n";
  write_whole_file(path, s.str(), "eval: the plot", /*sync=*/false, /*allow_char_device=*/true);
}

}  // namespace carry
