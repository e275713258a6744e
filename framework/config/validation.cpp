// Config validation (see validation.h and config.h): bounds that keep every product the validation and
// the trainer form within int64, finite floats, the model's mixers and their options, and the run's
// rules by section (data, parallel layout, tokens a step, the per-kind rules on how the sequence is
// cut, optimizer, checkpoint, logging); the cluster's hosts; the launch's world size.
#include "framework/config/validation.h"

#include "framework/config/defaults.h"
#include "layers/layer_kind.h"
#include "layers/layout.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <regex>
#include <set>
#include <tuple>

namespace carry {

namespace pb = google::protobuf;
using pb::FieldDescriptor;
using pb::Message;

namespace config_internal {

namespace {

// Upper bounds that keep every product the validation and the trainer form within int64 (and refuse
// values no run could use): a chunk of at most 2^16 tokens, at most 2^20 ranks, 2^40 tokens a sequence.
constexpr int64_t kMaxChunkSize = int64_t{1} << 16;
constexpr int64_t kMaxRanks = int64_t{1} << 20;
constexpr int64_t kMaxSeqLen = int64_t{1} << 40;
// Model shapes: every weight's element count stays far inside int64 (vocab x d_model <= 2^52), token
// ids fit the 32 bits of a token file, and a model can be listed before it is allocated (layers).
constexpr int64_t kMaxVocab = int64_t{1} << 32;
constexpr int64_t kMaxWidth = int64_t{1} << 20;   // d_model, head_dim_k, head_dim_v
constexpr int64_t kMaxHeads = int64_t{1} << 16;
constexpr int64_t kMaxLayers = 4096;
constexpr double kMaxMlpRatio = 1024;
constexpr int64_t kMaxConvSize = 4096;
constexpr int64_t kMaxNumFeatures = 65536;  // Performer's random features (the family's dk)
constexpr int64_t kMaxNumHouseholder = 16;  // Gated DeltaProduct's steps a token
// The most level weights any registered kind accepts (log-linear attention's Fenwick levels).
int64_t max_levels() {
  int64_t most = 0;
  for (const auto& k : layer_kind_names()) most = std::max(most, layer_kind(k).max_levels);
  return most;
}

// *out = a*b; false when that overflows int64.
bool mul_ok(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

// Every float and double field of `m` (recursively, repeated ones element by element) must be finite:
// inf or nan in a hyperparameter would train to NaN parameters. `skip` names a top-level field
// checked elsewhere.
void check_finite(const Message& m, const std::string& prefix, Errors& e, const FieldDescriptor* skip = nullptr) {
  auto* r = m.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  r->ListFields(m, &fields);
  for (auto* f : fields) {
    if (f == skip) continue;
    std::string path = prefix + f->name();
    int n = f->is_repeated() ? r->FieldSize(m, f) : 1;
    for (int i = 0; i < n; ++i) {
      std::string at = f->is_repeated() ? path + "[" + std::to_string(i) + "]" : path;
      double v = 0;
      switch (f->cpp_type()) {
        case FieldDescriptor::CPPTYPE_DOUBLE:
          v = f->is_repeated() ? r->GetRepeatedDouble(m, f, i) : r->GetDouble(m, f);
          break;
        case FieldDescriptor::CPPTYPE_FLOAT:
          v = f->is_repeated() ? r->GetRepeatedFloat(m, f, i) : r->GetFloat(m, f);
          break;
        case FieldDescriptor::CPPTYPE_MESSAGE:
          if (!f->is_map())
            check_finite(f->is_repeated() ? r->GetRepeatedMessage(m, f, i) : r->GetMessage(m, f), at + ".", e);
          continue;
        default:
          continue;
      }
      if (!std::isfinite(v)) e.add(at, "must be a finite number, got ", v);
    }
  }
}

// The kinds whose registry entry (layers/layer_kind.h) sets `flag`.
std::set<std::string> kinds_where(bool LayerKind::*flag) {
  std::set<std::string> out;
  for (auto& n : layer_kind_names())
    if (layer_kind(n).*flag) out.insert(n);
  return out;
}

// The kinds whose decay is `d`.
std::set<std::string> kinds_with_decay(Decay d) {
  std::set<std::string> out;
  for (auto& n : layer_kind_names())
    if (layer_kind(n).decay == d) out.insert(n);
  return out;
}

bool is_known_kind(const std::string& kind) { return find_layer_kind(kind) != nullptr; }


std::vector<std::string> distinct_kinds(const ModelConfig& model) {
  std::vector<std::string> kinds;
  for (auto& k : model.mixers())
    if (std::find(kinds.begin(), kinds.end(), k) == kinds.end()) kinds.push_back(k);
  return kinds;
}

std::string path_of_option(const ModelConfig& m, const std::string& kind, const std::string& field) {
  auto* f = config::MixerOptions::descriptor()->FindFieldByName(field);
  int found = -1;
  for (int i = 0; i < m.mixer_options_size(); ++i) {
    auto& o = m.mixer_options(i);
    if ((!o.has_kind() || o.kind() == kind) && o.GetReflection()->HasField(o, f) &&
        (found < 0 || o.has_kind()))
      found = i;
  }
  return found < 0 ? "model.mixer_options" : "model.mixer_options[" + std::to_string(found) + "]." + field;
}

// ---- check_run, section by section (each appends its errors in the order check_run reports them) ----

// A sequence length in [1, 2^40]: sums and small products of values up to it fit in int64.
bool seq_len_ok(int64_t T) { return T > 0 && T <= kMaxSeqLen; }

// Segments a rank holds when parallel.segments is sp times a power of two; else 0.
int64_t rank_segments(const config::ParallelConfig& par) {
  const int64_t sp = par.sp();
  return sp >= 1 && par.segments() > 0 && par.segments() % sp == 0 &&
                 ((par.segments() / sp) & (par.segments() / sp - 1)) == 0
             ? par.segments() / sp
             : 0;
}

// Whether dp and sp are >= 1 and dp*sp is at most kMaxRanks.
bool ranks_ok(const config::ParallelConfig& par) {
  int64_t ranks = 0;
  return par.dp() >= 1 && par.sp() >= 1 && mul_ok(par.dp(), par.sp(), &ranks) && ranks <= kMaxRanks;
}

void check_name(const RunConfig& c, Errors& e) {
  static const std::regex name_re("[A-Za-z0-9._-]+");
  if (!std::regex_match(c.name(), name_re))
    e.add("name", "must be non-empty and use only letters, digits, '.', '_' and '-' (it names directories), got '",
          c.name(), "'");
}

// Document resets (data.token_files.eod_token): an id of the model's vocabulary, and the scan mode the
// log-linear layers need for them under sequence parallelism.
void check_eod_token(const RunConfig& c, Errors& e) {
  auto& m = c.model();
  auto& t = c.data().token_files();
  if (t.eod_token() < -1 || (m.vocab_size() > 0 && t.eod_token() >= m.vocab_size()))
    e.add("data.token_files.eod_token", "must be -1 (no document resets) or an id below model.vocab_size (",
          m.vocab_size(), "), got ", t.eod_token());
  if (t.eod_token() >= 0 && c.parallel().sp() > 1 && c.parallel().scan_mode() != config::ParallelConfig::ORDERED)
    for (const auto& k : m.mixers())
      if (is_known_kind(k) && layer_kind(k).levels) {
        e.add("data.token_files.eod_token", "document resets in the log-linear layer '", k, "' under sequence "
              "parallelism need parallel.scan_mode: ORDERED (its summaries hold the slice's positions, which "
              "do not reset at a document start); got sp = ", c.parallel().sp(), " with ",
              config::ParallelConfig::ScanMode_Name(c.parallel().scan_mode()));
        break;
      }
}

void check_token_files(const RunConfig& c, Errors& e) {
  auto& t = c.data().token_files();
  if (t.paths().empty() && t.sources().empty())
    e.add("data.token_files.paths", "at least one token file is needed (or data.token_files.sources)");
  if (!t.paths().empty() && !t.sources().empty())
    e.add("data.token_files", "give either paths (one source) or sources (a blend), not both");
  for (int i = 0; i < t.paths_size(); ++i)
    if (t.paths(i).empty()) e.add("data.token_files.paths[" + std::to_string(i) + "]", "is empty");
  for (int s = 0; s < t.sources_size(); ++s) {
    const std::string at = "data.token_files.sources[" + std::to_string(s) + "]";
    auto& src = t.sources(s);
    if (src.paths().empty()) e.add(at + ".paths", "at least one token file is needed");
    for (int i = 0; i < src.paths_size(); ++i)
      if (src.paths(i).empty()) e.add(at + ".paths[" + std::to_string(i) + "]", "is empty");
    if (std::isfinite(src.weight()) && !(src.weight() > 0))
      e.add(at + ".weight", "must be positive, got ", src.weight());
  }
  for (int i = 0; i < t.eval_paths_size(); ++i)
    if (t.eval_paths(i).empty()) e.add("data.token_files.eval_paths[" + std::to_string(i) + "]", "is empty");
  if (c.logging().eval_every_steps() > 0 && t.eval_paths().empty())
    e.add("logging.eval_every_steps", "evaluation needs data.token_files.eval_paths");
  check_eod_token(c, e);
}

void check_mqar(const RunConfig& c, Errors& e) {
  auto& m = c.model();
  auto& q = c.data().mqar();
  const int64_t T = c.data().seq_len();
  const bool T_ok = seq_len_ok(T);
  int64_t V = q.vocab_size(), N = q.num_kv_pairs(), Q = q.num_queries();
  if (N <= 0) e.add("data.mqar.num_kv_pairs", "must be positive, got ", N);
  else if (T_ok && N > T) e.add("data.mqar.num_kv_pairs", "must not exceed data.seq_len (", T, "), got ", N);
  if (Q <= 0) e.add("data.mqar.num_queries", "must be positive, got ", Q);
  else if (T_ok && Q > T) e.add("data.mqar.num_queries", "must not exceed data.seq_len (", T, "), got ", Q);
  if (q.min_kv_pairs() < 0 || (N > 0 && q.min_kv_pairs() > N))
    e.add("data.mqar.min_kv_pairs", "must be 0 (every sequence holds num_kv_pairs) or in [1, num_kv_pairs = ", N,
          "], got ", q.min_kv_pairs());
  if (V < 3) e.add("data.mqar.vocab_size", "must be at least 3 (pad, one key, one value), got ", V);
  else if ((V - 1) / 2 < N)
    e.add("data.mqar.vocab_size", V, " gives ", (V - 1) / 2, " key tokens, fewer than num_kv_pairs (", N, ")");
  if (V > m.vocab_size())
    e.add("data.mqar.vocab_size", V, " exceeds model.vocab_size (", m.vocab_size(), ")");
  if (N > 0 && Q > 0 && T_ok && N <= T && Q <= T && 2 * (N + Q) > T)
    e.add("data.mqar", "2*(num_kv_pairs + num_queries) = ", 2 * (N + Q), " tokens do not fit in data.seq_len (",
          T, ")");
}

void check_needle(const RunConfig& c, Errors& e) {
  auto& m = c.model();
  auto& n = c.data().needle();
  const int64_t T = c.data().seq_len();
  const bool T_ok = seq_len_ok(T);
  int64_t V = n.vocab_size(), L = n.value_len(), D = n.num_distractors();
  if (L <= 0) e.add("data.needle.value_len", "must be positive, got ", L);
  else if (T_ok && L > T) e.add("data.needle.value_len", "must not exceed data.seq_len (", T, "), got ", L);
  if (D < 0) e.add("data.needle.num_distractors", "must be >= 0, got ", D);
  else if (T_ok && D > T) e.add("data.needle.num_distractors", "must not exceed data.seq_len (", T, "), got ", D);
  if (V < 7) e.add("data.needle.vocab_size", "must be at least 7, got ", V);
  else if (D >= 0 && D <= kMaxSeqLen && (V - 3) / 4 < D + 1)
    e.add("data.needle.vocab_size", V, " gives ", (V - 3) / 4, " key tokens, fewer than the ", D + 1,
          " needles (1 + num_distractors)");
  if (V > m.vocab_size())
    e.add("data.needle.vocab_size", V, " exceeds model.vocab_size (", m.vocab_size(), ")");
  int64_t needle_tokens = 0;
  if (L > 0 && D >= 0 && T_ok && L <= T && D <= T && mul_ok(D + 2, L + 2, &needle_tokens) &&
      needle_tokens > T)
    e.add("data.needle", "the needles and the query take (num_distractors + 2)*(value_len + 2) = ",
          needle_tokens, " tokens, more than data.seq_len (", T, ")");
}

// The sequence shape, then the data source.
void check_data(const RunConfig& c, Errors& e) {
  auto& d = c.data();
  int64_t T = d.seq_len();
  if (T <= 0 || T > kMaxSeqLen) e.add("data.seq_len", "must lie in [1, 2^40 = ", kMaxSeqLen, "], got ", T);
  if (d.batch_size() <= 0 || d.batch_size() > kMaxSeqLen)
    e.add("data.batch_size", "must lie in [1, 2^40 = ", kMaxSeqLen, "], got ", d.batch_size());
  if (d.eval_batches() < 0) e.add("data.eval_batches", "must be >= 0, got ", d.eval_batches());
  switch (d.source_case()) {
    case DataConfig::SOURCE_NOT_SET:
      e.add("data", "no data source: set one of token_files { paths: ... }, mqar { ... }, needle { ... }");
      break;
    case DataConfig::kTokenFiles: check_token_files(c, e); break;
    case DataConfig::kMqar: check_mqar(c, e); break;
    case DataConfig::kNeedle: check_needle(c, e); break;
  }
}

void check_recompute(const config::ParallelConfig& par, Errors& e) {
  if (par.recompute_keep_last() < 0)
    e.add("parallel.recompute_keep_last", "expected 0 or more layers that keep their activations under "
          "parallel.recompute; got " + std::to_string(par.recompute_keep_last()));
  if (par.has_recompute_overlap() && par.recompute_overlap() && !par.recompute())
    e.add("parallel.recompute_overlap", "true needs parallel.recompute: true (it overlaps the recomputation with the "
          "backward); got recompute: false");
  if (par.recompute_keeps_mixer() && !par.recompute())
    e.add("parallel.recompute_keeps_mixer", "true needs parallel.recompute: true (it chooses what the recomputation "
          "keeps); got recompute: false");
}

void check_segments(const config::ParallelConfig& par, Errors& e) {
  const int64_t sp = par.sp();
  const bool ordered = par.scan_mode() == config::ParallelConfig::ORDERED;
  if (par.segments() < 0) e.add("parallel.segments", "must be >= 0 (0: sp), got ", par.segments());
  else if (par.segments() > 0 && !ordered)
    e.add("parallel.segments", "needs parallel.scan_mode: ORDERED (segments make the ordered chain reproducible "
          "across layouts); got ", config::ParallelConfig::ScanMode_Name(par.scan_mode()));
  else if (par.segments() > 0 && sp >= 1 && rank_segments(par) == 0)
    e.add("parallel.segments", "must be sp times a power of two (each rank holds a power of two of them), got ",
          par.segments(), " with sp = ", sp);
}

void check_ranks(const config::ParallelConfig& par, Errors& e) {
  const int64_t sp = par.sp();
  if (par.dp() < 1 || sp < 1) return;
  int64_t ranks = 0;
  bool fits = mul_ok(par.dp(), sp, &ranks);
  if (!fits || ranks > kMaxRanks)
    e.add("parallel", "dp*sp must be at most 2^20 = ", kMaxRanks, " ranks, got dp = ", par.dp(), ", sp = ", sp,
          fits ? " (dp*sp = " + std::to_string(ranks) + ")" : std::string(" (dp*sp overflows int64)"));
}

// The layout (dp, sp, segments), the scan and what recomputation keeps.
void check_parallel(const config::ParallelConfig& par, Errors& e) {
  const int64_t sp = par.sp();
  if (par.dp() < 1) e.add("parallel.dp", "must be >= 1, got ", par.dp());
  if (sp < 1) e.add("parallel.sp", "must be >= 1, got ", sp);
  if (par.has_serial_states() && par.serial_states() && sp > 1 && par.scan_mode() != config::ParallelConfig::ORDERED)
    e.add("parallel.serial_states", "true at sp > 1 needs parallel.scan_mode: ORDERED (the tree and allgather "
          "scans summarize slices with the ATen forms); got sp = ", sp, " with ",
          config::ParallelConfig::ScanMode_Name(par.scan_mode()));
  check_recompute(par, e);
  check_segments(par, e);
  if (par.deferred_head_gradient_mib() < 0 || par.deferred_head_gradient_mib() > (int64_t{1} << 20))
    e.add("parallel.deferred_head_gradient_mib", "expected 0 (off) to 1048576 MiB of logit gradients a rank after "
          "the first holds for its head's gradient; got " + std::to_string(par.deferred_head_gradient_mib()));
  if (par.loss_chunk_tokens() < 0)
    e.add("parallel.loss_chunk_tokens", "must be >= 0 (0: the default for the form that runs), got ", par.loss_chunk_tokens());
  check_ranks(par, e);
}

// optimizer.grad_accum_steps, and the tokens a step takes over all dp replicas (the trainer counts them
// in int64).
void check_step_tokens(const RunConfig& c, Errors& e) {
  auto& d = c.data();
  auto& par = c.parallel();
  const int64_t T = d.seq_len();
  int64_t step_tokens = 0;
  const int64_t accum = c.optimizer().grad_accum_steps();
  const bool accum_ok = accum >= 1 && accum <= kMaxSeqLen;
  if (!accum_ok) e.add("optimizer.grad_accum_steps", "must lie in [1, 2^40 = ", kMaxSeqLen, "], got ", accum);
  if (seq_len_ok(T) && d.batch_size() > 0 && d.batch_size() <= kMaxSeqLen && ranks_ok(par) && accum_ok &&
      (!mul_ok(T, d.batch_size(), &step_tokens) || !mul_ok(step_tokens, par.dp(), &step_tokens) ||
       !mul_ok(step_tokens, accum, &step_tokens)))
    e.add("data.batch_size", "data.seq_len*data.batch_size*parallel.dp*optimizer.grad_accum_steps (tokens a step) "
          "must fit in int64, got ", T, "*", d.batch_size(), "*", par.dp(), "*", accum);
}

// parallel.cuda_graph: what the captured step holds (one rank, one micro-batch, fixed inputs).
void check_cuda_graph(const RunConfig& c, Errors& e) {
  auto& par = c.parallel();
  if (!par.cuda_graph()) return;
  std::vector<std::string> not_ok;
  if (par.dp() != 1 || par.sp() != 1)
    not_ok.push_back("dp = " + std::to_string(par.dp()) + ", sp = " + std::to_string(par.sp()) + " (needs one rank)");
  if (par.segments() > 1) not_ok.push_back("parallel.segments = " + std::to_string(par.segments()));
  if (c.optimizer().grad_accum_steps() > 1)
    not_ok.push_back("optimizer.grad_accum_steps = " + std::to_string(c.optimizer().grad_accum_steps()));
  if (c.data().has_token_files() && c.data().token_files().eod_token() >= 0)
    not_ok.push_back("data.token_files.eod_token = " + std::to_string(c.data().token_files().eod_token()) +
                     " (packed documents: their starts change the kernels each step)");
  if (!not_ok.empty())
    e.add("parallel.cuda_graph", "true captures one rank's step of one micro-batch without packed documents; "
          "this run has ", join(not_ok, "; "));
}

// One mixer kind's rules on the pieces the sequence is cut into (`pieces` of T / pieces tokens): a
// window or a convolution's halo must come from the previous piece, a chunked form must tile a piece,
// and log-linear levels must cover the sequence.
void check_kind_cut(const ModelConfig& m, const std::string& k, int64_t T, int64_t pieces, bool segmented,
                    Errors& e) {
  const char* pieces_name = segmented ? "parallel.segments" : "sp";
  const int64_t per_rank = T / pieces;
  int64_t layer = std::find(m.mixers().begin(), m.mixers().end(), k) - m.mixers().begin();
  auto o = layer_mixer(m, layer).options;
  if (layer_kind(k).window) {
    if (o.window() == 0 && pieces > 1)
      e.add(segmented ? "parallel.segments" : "parallel.sp", "softmax_attn layers with window 0 (full causal "
            "attention) cannot be ", segmented ? "cut into segments" : "sequence-parallel", " (", pieces_name,
            " = ", pieces, "); give them a window: mixer_options { kind: \"softmax_attn\" window: ... }");
    if (o.window() > 0 && pieces > 1 && o.window() > per_rank)
      e.add(path_of_option(m, k, "window"), "window ", o.window(), " exceeds the ", per_rank, " tokens each of the ",
            pieces, segmented ? " segments holds (the halo comes from the previous segment only)"
                              : " sp ranks holds (the halo comes from the previous rank only)");
  } else if (o.chunk_size() > 0 && o.chunk_size() <= kMaxChunkSize && T % (o.chunk_size() * pieces) != 0) {
    e.add("data.seq_len", "must be a multiple of chunk_size*", segmented ? "segments" : "sp", " = ",
          o.chunk_size(), "*", pieces, " = ", o.chunk_size() * pieces, " (", k, " layers), got ", T);
  }
  if (o.conv_size() > 1 && pieces > 1 && o.conv_size() - 1 > per_rank)
    e.add(path_of_option(m, k, "conv_size"), "conv_size ", o.conv_size(), " needs a halo of ", o.conv_size() - 1,
          " tokens, more than the ", per_rank, segmented ? " each segment holds" : " each sp rank holds");
  if (layer_kind(k).levels && o.levels() > 0 && o.levels() < layer_kind(k).levels_needed(T))
    e.add(path_of_option(m, k, "levels"), k, " over data.seq_len = ", T, " needs levels >= ",
          layer_kind(k).levels_needed(T), " (or 0 for as many as needed), got ", o.levels());
}

// The per-kind rules for every mixer kind of the model, against the pieces the sequence is cut into:
// sp slices, or the ordered segments.
void check_sequence_cut(const RunConfig& c, Errors& e) {
  auto& par = c.parallel();
  const int64_t T = c.data().seq_len(), sp = par.sp();
  const bool sp_ok = sp >= 1 && sp <= kMaxRanks;
  if (!seq_len_ok(T) || !sp_ok) return;
  const bool ordered = par.scan_mode() == config::ParallelConfig::ORDERED;
  const bool segmented = ordered && rank_segments(par) > 0 && par.segments() <= kMaxRanks;
  const int64_t pieces = segmented ? par.segments() : sp;
  for (auto& k : distinct_kinds(c.model()))
    if (is_known_kind(k)) check_kind_cut(c.model(), k, T, pieces, segmented, e);
}

void check_optimizer(const config::OptimizerConfig& o, Errors& e) {
  // (Non-finite values were reported by check_finite; these checks are for finite ones.)
  auto finite_and = [](double v, bool ok) { return !std::isfinite(v) || ok; };
  if (!finite_and(o.lr(), o.lr() > 0)) e.add("optimizer.lr", "must be positive, got ", o.lr());
  if (!finite_and(o.beta1(), o.beta1() >= 0 && o.beta1() < 1))
    e.add("optimizer.beta1", "must lie in [0, 1), got ", o.beta1());
  if (!finite_and(o.beta2(), o.beta2() >= 0 && o.beta2() < 1))
    e.add("optimizer.beta2", "must lie in [0, 1), got ", o.beta2());
  if (!finite_and(o.eps(), o.eps() > 0)) e.add("optimizer.eps", "must be positive, got ", o.eps());
  if (!finite_and(o.weight_decay(), o.weight_decay() >= 0))
    e.add("optimizer.weight_decay", "must be >= 0, got ", o.weight_decay());
  if (!finite_and(o.grad_clip(), o.grad_clip() >= 0))
    e.add("optimizer.grad_clip", "must be >= 0 (0 = no clipping), got ", o.grad_clip());
  if (o.total_steps() <= 0) e.add("optimizer.total_steps", "must be positive, got ", o.total_steps());
  if (o.warmup_steps() < 0) e.add("optimizer.warmup_steps", "must be >= 0, got ", o.warmup_steps());
  else if (o.total_steps() > 0 && o.warmup_steps() > o.total_steps())
    e.add("optimizer.warmup_steps", "must not exceed total_steps (", o.total_steps(), "), got ", o.warmup_steps());
  if (!finite_and(o.min_lr_ratio(), o.min_lr_ratio() >= 0 && o.min_lr_ratio() <= 1))
    e.add("optimizer.min_lr_ratio", "must lie in [0, 1], got ", o.min_lr_ratio());
  if (!finite_and(o.decay_fraction(), o.decay_fraction() > 0 && o.decay_fraction() <= 1))
    e.add("optimizer.decay_fraction", "must lie in (0, 1] (the share of total_steps the WSD decay takes), got ",
          o.decay_fraction());
  else if (o.schedule() == config::OptimizerConfig::WSD && std::isfinite(o.decay_fraction()) && o.total_steps() > 0 &&
           o.warmup_steps() >= 0 && o.warmup_steps() <= o.total_steps()) {
    const int64_t decay = std::llround(o.decay_fraction() * static_cast<double>(o.total_steps()));
    if (decay < 1)
      e.add("optimizer.decay_fraction", "leaves the WSD decay no step: round(", o.decay_fraction(), " x total_steps ",
            o.total_steps(), ") = 0; give at least 1 / total_steps");
    else if (o.warmup_steps() + decay > o.total_steps())
      e.add("optimizer.decay_fraction", "makes a WSD decay of ", decay, " steps (round(", o.decay_fraction(),
            " x total_steps ", o.total_steps(), ")), which overlaps the ", o.warmup_steps(),
            " warmup steps: warmup_steps + decay steps must not exceed total_steps");
  }
}

void check_checkpoint(const config::CheckpointConfig& k, Errors& e) {
  if (k.every_steps() < 0) e.add("checkpoint.every_steps", "must be >= 0 (0 = only at the end), got ", k.every_steps());
  if (k.keep_last() < 0) e.add("checkpoint.keep_last", "must be >= 0 (0 = keep all), got ", k.keep_last());
  if (k.every_steps() > 0 && k.dir().empty())
    e.add("checkpoint.dir", "is needed when checkpoint.every_steps > 0 (", k.every_steps(), ")");
  if (k.resume() == config::CheckpointConfig::REQUIRED && k.dir().empty())
    e.add("checkpoint.resume", "REQUIRED needs a checkpoint.dir to resume from");
}

void check_logging(const config::LoggingConfig& l, Errors& e) {
  if (l.every_steps() < 1) e.add("logging.every_steps", "must be >= 1, got ", l.every_steps());
  if (l.eval_every_steps() < 0) e.add("logging.eval_every_steps", "must be >= 0 (0 = never), got ", l.eval_every_steps());
}

}  // namespace

void check_model(const ModelConfig& m, const std::string& p, Errors& e) {
  auto in_range = [&](const char* name, int64_t v, int64_t max) {
    if (v <= 0 || v > max) e.add(p + name, "must lie in [1, ", max, "], got ", v);
  };
  in_range("vocab_size", m.vocab_size(), kMaxVocab);
  in_range("d_model", m.d_model(), kMaxWidth);
  in_range("n_layers", m.n_layers(), kMaxLayers);
  in_range("n_heads", m.n_heads(), kMaxHeads);
  if (m.has_n_v_heads()) {
    in_range("n_v_heads", m.n_v_heads(), kMaxHeads);
    if (m.n_v_heads() > 0 && m.n_heads() > 0 && m.n_v_heads() % m.n_heads() != 0)
      e.add(p + "n_v_heads", "must be a multiple of n_heads (", m.n_heads(), "), got ", m.n_v_heads());
    if (m.n_v_heads() != m.n_heads()) {
      const auto ok = kinds_where(&LayerKind::grouped_values);
      for (const auto& k : m.mixers())
        if (is_known_kind(k) && !ok.count(k)) {
          e.add(p + "n_v_heads", "grouped value heads (n_v_heads ", m.n_v_heads(), " != n_heads ", m.n_heads(),
                ") apply to ", join(std::vector<std::string>(ok.begin(), ok.end())), " layers only, but the model has ",
                k, " layers");
          break;
        }
    }
  }
  if (m.has_head_dim_k()) in_range("head_dim_k", m.head_dim_k(), kMaxWidth);
  if (m.has_head_dim_v()) in_range("head_dim_v", m.head_dim_v(), kMaxWidth);
  if ((!m.has_head_dim_k() || !m.has_head_dim_v()) && m.n_heads() > 0 && m.d_model() > 0 &&
      m.d_model() % m.n_heads() != 0)
    e.add(p + "n_heads", "must divide d_model (", m.d_model(), "), got ", m.n_heads(),
          " (or set head_dim_k and head_dim_v)");
  check_finite(m, p, e);  // non-finite values are reported there, once
  if (std::isfinite(m.mlp_ratio()) && !(m.mlp_ratio() > 0 && m.mlp_ratio() <= kMaxMlpRatio))
    e.add(p + "mlp_ratio", "must lie in (0, ", kMaxMlpRatio, "], got ", m.mlp_ratio());
  if (m.feed_forward() != "swiglu" && m.feed_forward() != "rwkv7_channel_mix")
    e.add(p + "feed_forward", "must be \"swiglu\" or \"rwkv7_channel_mix\", got \"", m.feed_forward(), "\"");
  if (m.norm() != "rms_norm" && m.norm() != "layer_norm")
    e.add(p + "norm", "must be \"rms_norm\" or \"layer_norm\", got \"", m.norm(), "\"");
  if (std::isfinite(m.norm_eps()) && !(m.norm_eps() > 0))
    e.add(p + "norm_eps", "must be positive, got ", m.norm_eps());
  if (std::isfinite(m.init_std()) && !(m.init_std() > 0))
    e.add(p + "init_std", "must be positive, got ", m.init_std());
  if (m.mixers().empty())
    e.add(p + "mixers", "at least one mixer kind is needed (e.g. mixers: \"gla\"); known kinds: ",
          join(known_mixer_kinds(), ", "));
  for (int i = 0; i < m.mixers_size(); ++i)
    if (!is_known_kind(m.mixers(i)))
      e.add(p + "mixers[" + std::to_string(i) + "]", "unknown mixer kind '", m.mixers(i), "'; known kinds: ",
            join(known_mixer_kinds(), ", "));
  auto kinds = distinct_kinds(m);
  std::map<std::string, int> seen;  // kind ("" = general) -> entry index
  for (int i = 0; i < m.mixer_options_size(); ++i) {
    auto& o = m.mixer_options(i);
    std::string q = p + "mixer_options[" + std::to_string(i) + "]";
    std::string kind = o.kind();
    if (o.has_kind() && std::find(kinds.begin(), kinds.end(), kind) == kinds.end())
      e.add(q + ".kind", "'", kind, "' is not one of the model's mixers (", join(kinds, ", "), ")");
    if (seen.count(kind)) {
      // The first repeat is the error; the entries after it are not walked (a file of many repeats
      // stays one line and linear time).
      const int rest = m.mixer_options_size() - i - 1;
      e.add(q + (o.has_kind() ? ".kind" : ""), "a second entry for ",
            o.has_kind() ? "'" + kind + "'" : std::string("all layers (no kind)"), " (the first is mixer_options[",
            seen[kind], "])", rest > 0 ? "; " + std::to_string(rest) + " more entries follow it, not checked" : "");
      break;
    }
    seen[kind] = i;
    std::vector<std::string> applies = o.has_kind() ? std::vector<std::string>{kind} : kinds;
    auto only_for = [&](bool set, const char* name, const std::set<std::string>& ok) {
      if (!set) return;
      for (auto& k : applies)
        if (!ok.count(k)) {
          e.add(q + "." + name, "only ", join(std::vector<std::string>(ok.begin(), ok.end())), " use", ok.size() == 1 ? "s" : "",
                " '", name, "', but this entry applies to ", k, " layers",
                o.has_kind() ? "" : " (give the entry a kind)");
          return;
        }
    };
    if (o.has_chunk_size() && (o.chunk_size() <= 0 || o.chunk_size() > kMaxChunkSize))
      e.add(q + ".chunk_size", "must lie in [1, ", kMaxChunkSize, "], got ", o.chunk_size());
    if (o.has_window() && (o.window() < 0 || o.window() > kMaxSeqLen))
      e.add(q + ".window", "must lie in [0, ", kMaxSeqLen, "] (0 = full causal), got ", o.window());
    if (o.has_conv_size() && (o.conv_size() < 0 || o.conv_size() > kMaxConvSize))
      e.add(q + ".conv_size", "must lie in [0, ", kMaxConvSize, "] (0 = none), got ", o.conv_size());
    if (o.has_levels() && (o.levels() < 0 || o.levels() > max_levels()))
      e.add(q + ".levels", "must lie in [0, ", max_levels(), "] (0 = as needed), got ", o.levels());
    only_for(o.has_window(), "window", kinds_where(&LayerKind::window));
    if (o.has_global_tokens() && (o.global_tokens() < 0 || o.global_tokens() > kMaxSeqLen))
      e.add(q + ".global_tokens", "must lie in [0, ", kMaxSeqLen, "] (0 = none), got ", o.global_tokens());
    if (o.has_stride() && (o.stride() < 0 || o.stride() > kMaxSeqLen))
      e.add(q + ".stride", "must lie in [0, ", kMaxSeqLen, "] (0 = none), got ", o.stride());
    only_for(o.has_global_tokens(), "global_tokens", kinds_where(&LayerKind::window));
    only_for(o.has_stride(), "stride", kinds_where(&LayerKind::window));
    if (o.conv_size() > 0)
      for (auto& k : applies)
        if (is_known_kind(k) && layer_kind(k).time_mix) {
          e.add(q + ".conv_size", k, " layers have no short convolutions (their token shift reads the token before "
                "each); expected 0 or unset, got ", o.conv_size(), o.has_kind() ? "" : " in an entry for all layers (give the entry a kind)");
          break;
        }
    only_for(o.has_levels(), "levels", kinds_where(&LayerKind::levels));
    only_for(o.has_normalize(), "normalize", kinds_where(&LayerKind::normalize));
    if (o.has_feature_map() && o.feature_map() != "elu" && o.feature_map() != "performer")
      e.add(q + ".feature_map", "must be \"elu\" or \"performer\", got \"", o.feature_map(), "\"");
    if (o.has_num_features() && (o.num_features() <= 0 || o.num_features() > kMaxNumFeatures))
      e.add(q + ".num_features", "must lie in [1, ", kMaxNumFeatures, "], got ", o.num_features());
    if (o.has_feature_seed() && o.feature_seed() < 0)
      e.add(q + ".feature_seed", "must be >= 0, got ", o.feature_seed());
    only_for(o.has_feature_map(), "feature_map", kinds_where(&LayerKind::feature_map));
    only_for(o.has_num_features(), "num_features", kinds_where(&LayerKind::feature_map));
    only_for(o.has_feature_seed(), "feature_seed", kinds_where(&LayerKind::feature_map));
    if (o.has_num_householder() && (o.num_householder() < 1 || o.num_householder() > kMaxNumHouseholder))
      e.add(q + ".num_householder", "must lie in [1, ", kMaxNumHouseholder, "], got ", o.num_householder());
    only_for(o.has_num_householder(), "num_householder", kinds_where(&LayerKind::householder));
    if (o.has_lower_bound() && std::isfinite(o.lower_bound()) && !(o.lower_bound() <= 0 && o.lower_bound() >= -1e3))
      e.add(q + ".lower_bound", "must lie in [-1000, 0] (0 = the softplus gate), got ", o.lower_bound());
    only_for(o.has_lower_bound(), "lower_bound", kinds_with_decay(Decay::kda));
    for (auto [name, has, width] : {std::tuple<const char*, bool, int64_t>{"decay_low_rank_dim", o.has_decay_low_rank_dim(), o.decay_low_rank_dim()},
                                    {"a_low_rank_dim", o.has_a_low_rank_dim(), o.a_low_rank_dim()},
                                    {"v_low_rank_dim", o.has_v_low_rank_dim(), o.v_low_rank_dim()},
                                    {"gate_low_rank_dim", o.has_gate_low_rank_dim(), o.gate_low_rank_dim()}}) {
      if (has && (width < 0 || width > kMaxWidth))
        e.add(q + "." + name, "must lie in [0, ", kMaxWidth, "] (0 = RWKV7Attention's default), got ", width);
      only_for(has, name, kinds_where(&LayerKind::time_mix));
    }
  }
  for (auto& k : kinds) {
    if (!is_known_kind(k) || !layer_kind(k).window) continue;
    auto o = layer_mixer(m, std::find(m.mixers().begin(), m.mixers().end(), k) - m.mixers().begin()).options;
    for (const char* f : {"global_tokens", "stride"}) {
      const int64_t n = std::string(f) == "stride" ? o.stride() : o.global_tokens();
      if (n > 0 && o.window() <= 0)
        e.add(path_of_option(m, k, f), f, " ", n, " goes with a sliding window, but ", k, " layers have window ",
              o.window(), " (full causal attention already reads every earlier token); give them a window > 0");
    }
  }
  for (auto& k : kinds) {
    if (!is_known_kind(k) || !layer_kind(k).power_of_two_chunk) continue;
    auto C = layer_mixer(m, std::find(m.mixers().begin(), m.mixers().end(), k) - m.mixers().begin()).options.chunk_size();
    if (C > 0 && (C & (C - 1)) != 0)
      e.add(p + "mixer_options", k, " needs a power-of-two chunk_size, got ", C);
  }
}

void check_run(const RunConfig& c, Errors& e) {
  check_name(c, e);
  check_model(c.model(), "model.", e);
  check_finite(c, "", e, RunConfig::descriptor()->FindFieldByName("model"));  // the model: in check_model
  check_data(c, e);
  check_parallel(c.parallel(), e);
  check_step_tokens(c, e);
  check_cuda_graph(c, e);
  check_sequence_cut(c, e);
  check_optimizer(c.optimizer(), e);
  check_checkpoint(c.checkpoint(), e);
  check_logging(c.logging(), e);
}

void check_cluster(const ClusterConfig& c, Errors& e) {
  static const std::regex env_re("[A-Za-z_][A-Za-z0-9_]*");
  if (c.hosts().empty()) e.add("hosts", "at least one host is needed: hosts { name: \"node0\" gpus: 8 }");
  std::map<std::string, int> seen;
  for (int i = 0; i < c.hosts_size(); ++i) {
    auto& h = c.hosts(i);
    std::string q = "hosts[" + std::to_string(i) + "]";
    if (h.name().empty()) e.add(q + ".name", "is empty");
    else if (seen.count(h.name())) e.add(q + ".name", "'", h.name(), "' is listed twice (also hosts[", seen[h.name()], "])");
    else seen[h.name()] = i;
    if (h.gpus() < 1) e.add(q + ".gpus", "must be >= 1, got ", h.gpus());
  }
  if (c.network_interface().find_first_of(" \t") != std::string::npos)
    e.add("network_interface", "must be one interface name, got '", c.network_interface(), "'");
  for (auto& kv : c.env())
    if (!std::regex_match(kv.first, env_re)) e.add("env", "'", kv.first, "' is not an environment variable name");
}

std::string more_errors_line(size_t more) {
  if (!more) return "";
  return "... and " + std::to_string(more) + " more error" + (more == 1 ? "" : "s") + ", not listed (the first " +
         std::to_string(Errors::kMaxListed) + " are above; fix them and run again)";
}

}  // namespace config_internal

using config_internal::check_cluster;
using config_internal::check_model;
using config_internal::check_run;
using config_internal::Errors;
using config_internal::FieldError;
using config_internal::fill_defaults;

namespace {

std::vector<std::string> to_strings(const Errors& errors) {
  std::vector<std::string> out;
  for (auto& err : errors.list) out.push_back(err.path + ": " + err.message);
  if (errors.more) out.push_back(config_internal::more_errors_line(errors.more));
  return out;
}

}  // namespace

std::vector<std::string> run_config_errors(const RunConfig& config) {
  RunConfig filled = config;
  fill_defaults(filled);
  Errors e;
  check_run(filled, e);
  return to_strings(e);
}

std::vector<std::string> model_config_errors(const ModelConfig& model) {
  Errors e;
  check_model(model, "model.", e);
  return to_strings(e);
}

std::vector<std::string> cluster_config_errors(const ClusterConfig& cluster) {
  Errors e;
  check_cluster(cluster, e);
  return to_strings(e);
}

void validate_layout(const RunConfig& config, int64_t world_size) {
  int64_t dp = config.parallel().dp(), sp = config.parallel().sp();
  if (world_size < 1) throw ConfigError("the launch has " + std::to_string(world_size) + " ranks");
  int64_t ranks = 0;
  if (__builtin_mul_overflow(dp, sp, &ranks))
    throw ConfigError("parallel: dp*sp overflows int64 (dp = " + std::to_string(dp) + ", sp = " + std::to_string(sp) +
                      "); the launch has " + std::to_string(world_size) + " ranks");
  if (ranks != world_size)
    throw ConfigError("parallel: dp*sp = " + std::to_string(ranks) + " but the launch has " +
                      std::to_string(world_size) + " ranks (dp = " + std::to_string(dp) + ", sp = " +
                      std::to_string(sp) + ")");
}

}  // namespace carry
