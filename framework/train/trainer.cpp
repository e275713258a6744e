// The training loop (see trainer.h): batches, the sequence-parallel model context, the global masked
// loss, the gradient all-reduce, AdamW, logging, evaluation and checkpoints.
#include "framework/train/trainer.h"

#include "framework/io/checkpoint.h"
#include "framework/io/model_source.h"
#include "framework/io/output_file.h"
#include "framework/printable.h"
#include "framework/train/memory_estimate.h"
#include "framework/train/run_log.h"
#include "framework/train/step_trace.h"
#include "framework/data/synthetic.h"
#include "framework/data/token_dataset.h"
#include "framework/data/token_file.h"
#include "layers/core/device.h"
#include "layers/core/fused_switch.h"
#include "layers/core/knobs.h"
#include "layers/blocks/precision.h"
#include "parallel/slice_context.h"
#include "parallel/state_scan.h"

#ifdef CARRY_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

namespace carry {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Resident set size of this process in MiB (Linux /proc/self/statm), 0 if unreadable.
double rss_mib() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  long pages_total = 0, pages_resident = 0;
  int got = std::fscanf(f, "%ld %ld", &pages_total, &pages_resident);
  std::fclose(f);
  if (got != 2) return 0;
  return static_cast<double>(pages_resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
}

parallel::ScanMode scan_mode_of(config::ParallelConfig::ScanMode m) {
  switch (m) {
    case config::ParallelConfig::TREE: return parallel::ScanMode::tree;
    case config::ParallelConfig::ALLGATHER: return parallel::ScanMode::allgather;
    default: return parallel::ScanMode::ordered;
  }
}

std::string gib(double bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

// The stop signals (see Trainer::run): the first sets the flag, a second one ends the process.
volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void on_stop_signal(int signo) {
  if (g_stop_signal != 0) {
    std::signal(signo, SIG_DFL);
    std::raise(signo);
    return;
  }
  g_stop_signal = signo;
}

// Installs on_stop_signal for SIGTERM, SIGINT and SIGUSR1 for its lifetime, then restores the
// previous handlers.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < kSignals.size(); ++i) ::sigaction(kSignals[i], &sa, &previous_[i]);
  }
  ~StopSignals() {
    for (size_t i = 0; i < kSignals.size(); ++i) ::sigaction(kSignals[i], &previous_[i], nullptr);
    g_stop_signal = 0;
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  static constexpr std::array<int, 3> kSignals{SIGTERM, SIGINT, SIGUSR1};
  std::array<struct sigaction, 3> previous_{};
};

// A value for a message: NaN without a sign, else as printed by %g.
std::string number_text(double x) {
  if (std::isnan(x)) return "NaN";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

// Seconds since the Unix epoch (the metrics' timestamps).
double wall_clock_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// "45s", "12m05s", "3h07m", "2d04h".
std::string duration_text(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const long long s = std::llround(seconds);
  char buf[32];
  if (s < 60) std::snprintf(buf, sizeof buf, "%llds", s);
  else if (s < 3600) std::snprintf(buf, sizeof buf, "%lldm%02llds", s / 60, s % 60);
  else if (s < 86400) std::snprintf(buf, sizeof buf, "%lldh%02lldm", s / 3600, s % 3600 / 60);
  else std::snprintf(buf, sizeof buf, "%lldd%02lldh", s / 86400, s % 86400 / 3600);
  return buf;
}

}  // namespace

Trainer::Trainer(const RunConfig& config, std::shared_ptr<parallel::ProcessGroups> groups,
                 TrainerOptions options)
    : config_(config), groups_(std::move(groups)), options_(options) {
  const auto& par = config_.parallel();
  set_fused_ops(config_.fused_ops());  // process-wide: the fused CUDA ops or their ATen forms
  if (groups_) {
    TORCH_CHECK(groups_->layout.dp == par.dp() && groups_->layout.sp == par.sp(),
                "trainer: the process groups are dp=", groups_->layout.dp, " sp=", groups_->layout.sp,
                " but the config's parallel section says dp=", par.dp(), " sp=", par.sp());
    dp_ = groups_->layout.dp, sp_ = groups_->layout.sp;
    dp_rank_ = groups_->dp_rank, sp_rank_ = groups_->sp_rank;
  } else {
    TORCH_CHECK(par.dp() == 1 && par.sp() == 1, "trainer: without process groups the config must say "
                "parallel { dp: 1 sp: 1 }, got dp=", par.dp(), " sp=", par.sp());
  }
  if (!options_.force_cpu && cuda_device_count() > 0) {
    // One GPU per rank: the communicators were made for device local_rank (Backend::nccl).
    int local = groups_ ? groups_->world_info.local_rank : 0;
    device_ = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(local % cuda_device_count()));
    // And the main thread's current device, which everything that names none uses (rank 1 was
    // recording its phase marks on device 0's stream).
    cuda_make_current(device_.index());
  }
  bf16_ = config_.precision() == RunConfig::BF16;
  TORCH_CHECK(!bf16_ || options_.dtype == at::kFloat, "trainer: precision BF16 keeps fp32 master weights; "
              "the trainer was asked for ", options_.dtype, " parameters");
  // The memory the model needs, counted on the meta device (shapes only) before anything is allocated:
  // parameters, gradients and AdamW's two moments, per rank. On the CPU it must fit what the host has
  // available for all its ranks; a GPU's own out-of-memory error is clear enough.
  const auto& mc = config_.model();
  const std::string model_fields = "model.vocab_size = " + std::to_string(mc.vocab_size()) + ", d_model = " +
                                   std::to_string(mc.d_model()) + ", n_layers = " + std::to_string(mc.n_layers());
  double model_bytes = 0;
  {
    Model shapes = build_model(mc, config_.seed(), at::TensorOptions().dtype(options_.dtype).device(at::kMeta));
    model_bytes = 4.0 * static_cast<double>(shapes.num_parameters()) * static_cast<double>(c10::elementSize(options_.dtype));
    const int ranks_here = groups_ ? groups_->world_info.local_size : 1;
    const double available = available_memory_bytes();
    TORCH_CHECK(!device_.is_cpu() || available < 0 || model_bytes * ranks_here <= available, "trainer: the model (",
                model_fields, ") has ", shapes.num_parameters(), " parameters: with their gradients and AdamW state they "
                "take ", gib(model_bytes), " a rank, ", gib(model_bytes * ranks_here), " for the ", ranks_here,
                " rank(s) on this host, more than its ", gib(available), " of available memory; lower model.d_model, "
                "model.n_layers or model.vocab_size, or run fewer ranks a host");
  }
  try {
    model_ = build_model(mc, config_.seed(), at::TensorOptions().dtype(options_.dtype).device(device_));
    optimizer_ = std::make_unique<AdamW>(model_.parameters(), config_.optimizer());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "trainer: cannot allocate the model (", model_fields, "; ", gib(model_bytes),
                " a rank with gradients and AdamW state) on ", device_.str(), ": ", e.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    TORCH_CHECK(false, "trainer: cannot allocate the model (", model_fields, "; ", gib(model_bytes),
                " a rank with gradients and AdamW state) on ", device_.str(), ": out of memory");
  }
  if (config_.data().has_token_files()) open_token_data();
  context_.recompute = config_.parallel().recompute();
  context_.recompute_keeps_mixer = config_.parallel().recompute_keeps_mixer();
  context_.recompute_keep_last = config_.parallel().recompute_keep_last();
  context_.recompute_overlap = recompute_overlap_applies(config_);
  context_.loss_chunk_tokens = config_.parallel().loss_chunk_tokens();
  // Collective: every rank of the sp group agrees on the layout here, once.
  const int64_t segments = par.segments() > 0 ? par.segments() : sp_;
  if (par.scan_mode() == config::ParallelConfig::ORDERED && segments > 1) {
    segments_ = std::make_shared<parallel::SegmentCommunicator>(sp_ > 1 ? groups_->sp : nullptr,
                                                                static_cast<int>(segments / sp_), device_);
    context_.slice = parallel::make_segment_context(segments_, /*head_groups=*/1, config_.data().seq_len());
  } else if (sp_ > 1) {
    context_.slice = parallel::make_slice_context(groups_->sp, scan_mode_of(par.scan_mode()),
                                                  /*head_groups=*/1, config_.data().seq_len());
  }
  if (par.has_serial_states()) context_.slice.serial_states = par.serial_states();
  // The gradients' sum during the backward (parallel.gradient_sum): BUCKETS over NCCL (slower on two
  // NVLinked H200s: its kernels take SMs from the backward; docs/benchmarks.md); COPY_ENGINES by the
  // copy engines (two GPUs of one host), falling back to one sum after the backward where the GPUs
  // cannot map each other's memory. AFTER_BACKWARD: one sum after the backward.
  const auto overlap = par.gradient_sum();
  if (segments_ && segments_->per_rank() == 1 && sp_ > 1 && groups_->sp_gradients &&
      overlap != config::ParallelConfig::AFTER_BACKWARD) {
    gradient_sum_ = std::make_unique<parallel::OverlappedGradientSum>(model_.parameters(), groups_->sp_gradients,
                                                                      /*bucket_bytes=*/int64_t{64} << 20);
    if (overlap == config::ParallelConfig::COPY_ENGINES) {
      const std::string why = gradient_sum_->use_copy_engines();
      if (!why.empty()) {
        warn("the gradients' sum by the copy engines is not available (" + why + "); summing after the backward");
        gradient_sum_.reset();
      } else {
        log("gradients: summed during the backward in buckets by the copy engines (parallel.gradient_sum: COPY_ENGINES)\n");
      }
    }
  }
  // The update split over the sp ranks (parallel.shard_update, sharded_update.h), where the gradients'
  // sum waits for the backward's end (not with parallel.gradient_sum's buckets).
  if (segments_ && sp_ > 1 && !gradient_sum_ && par.shard_update()) {
    const std::string why = ShardedUpdate::unavailable(model_.parameters(), segments_->sp());
    if (why.empty()) {
      sharded_ = std::make_unique<ShardedUpdate>(model_.parameters(), *optimizer_, segments_->sp(), par.gather_overlap());
      update_line_ = "update: split over the " + std::to_string(sp_) + " sp ranks (parallel.shard_update)";
    } else {
      update_line_ = "update: on every sp rank (parallel.shard_update does not apply: " + why + ")";
    }
  }
  if (sharded_) {
    grad_layout_ = sharded_->layout();
    // The forward waits for the other ranks' updated parameters where it first reads one.
    ShardedUpdate* sharded = sharded_.get();
    context_.before_block = [sharded](int64_t part) { sharded->before_block(part); };
  } else {
    std::vector<int64_t> numels;
    for (auto& [name, p] : model_.parameters()) numels.push_back(p.numel());
    grad_layout_ = parallel::FlatLayout::make(numels);
  }
  // The ranks after the first start their backward, and send the state gradients the rank before them
  // waits for, earlier when their head's weight gradient waits until the end of it (DeferredHeadGradient).
  if (segments_ && segments_->per_rank() == 1 && sp_ > 1 && sp_rank_ > 0)
    deferred_head_bytes_ = par.deferred_head_gradient_mib() << 20;
  // logging.comm_timing ORDER: also each rank's waits of the window's last step one by one (wait_order_).
  const auto timing = config_.logging().comm_timing();
  phase_timing_ = timing != config::LoggingConfig::OFF;
  wait_order_ = timing == config::LoggingConfig::ORDER;
  comm_timing_ = phase_timing_ && groups_;
  if (comm_timing_) {
    groups_->sp->set_wait_timing(true);
    if (gradient_sum_) gradient_sum_->set_timing(true);
  }
}

void Trainer::phase_mark(const char* phase_ending_here) {
  if (!phase_timing_) return;
  TimingMark m = timing_mark(device_.is_cuda() ? device_.index() : -1);
  if (phase_last_) phase_spans_.push_back(PhaseSpan{phase_ending_here, *phase_last_, m});
  phase_last_ = m;
}

std::vector<std::pair<std::string, double>> Trainer::take_phase_seconds() {
  std::vector<std::pair<std::string, double>> out;
  for (const PhaseSpan& s : phase_spans_) {
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& p) { return p.first == s.phase; });
    if (it == out.end()) it = out.insert(out.end(), {s.phase, 0.0});
    it->second += timing_mark_ms(s.from, s.to) / 1e3;
  }
  phase_spans_.clear();
  return out;
}

void Trainer::take_comm_waits() {
  if (!comm_timing_) return;
  groups_->sp->synchronize();
  comm_wait_s_ += groups_->sp->take_waited_seconds();
  for (auto& [kind, s] : groups_->sp->take_waits_by_kind()) waits_by_kind_[kind] += s;
  last_wait_sequence_ = groups_->sp->take_wait_sequence();
  const parallel::Communicator::HostCalls h = groups_->sp->take_host_calls();
  host_calls_ += h.count;
  host_call_s_ += h.seconds;
  host_calls_by_copy_ += h.by_copy_engines;
  if (gradient_sum_) gradient_wait_s_ += gradient_sum_->take_waited_seconds();
}

int Trainer::rank() const { return groups_ ? groups_->world_info.rank : 0; }

// Token files: world rank 0 expands the patterns and reads every token once (ids below
// model.vocab_size) before any rank trains; then every rank opens the files. A failure on any rank
// stops every rank with the message (from rank 0, or from the rank that could not open a file).
void Trainer::open_token_data() {
  const auto& tf = config_.data().token_files();
  std::vector<TokenSourceSpec> sources;
  if (tf.sources_size() == 0) {
    sources.push_back({"data.token_files", {tf.paths().begin(), tf.paths().end()}, 1.0});
  } else {
    for (int s = 0; s < tf.sources_size(); ++s)
      sources.push_back({"data.token_files.sources[" + std::to_string(s) + "]",
                         {tf.sources(s).paths().begin(), tf.sources(s).paths().end()}, tf.sources(s).weight()});
  }
  const std::vector<std::string> eval_patterns(tf.eval_paths().begin(), tf.eval_paths().end());
  const int64_t T = config_.data().seq_len(), V = config_.model().vocab_size();
  auto agree = [&](bool failed, const std::string& what_others_see) {  // every rank learns whether some rank failed
    if (!groups_ || groups_->world->size() == 1) return failed;
    auto flag = at::scalar_tensor(failed ? 1.0 : 0.0, at::kDouble).reshape({1}).to(device_);
    groups_->world->all_reduce_sum(flag);
    const bool any = flag.cpu().item<double>() > 0;
    TORCH_CHECK(!any || failed, what_others_see);
    return any;
  };
  std::string error;
  bool failed = false;
  if (rank() == 0) {
    try {
      std::vector<std::string> all;
      for (auto& s : sources) {
        auto files = expand_token_paths(s.paths, s.name + ".paths");
        all.insert(all.end(), files.begin(), files.end());
      }
      auto eval_files = expand_token_paths(eval_patterns, "data.token_files.eval_paths");
      all.insert(all.end(), eval_files.begin(), eval_files.end());
      const double t0 = now_s();
      const int64_t n = check_token_files(all, V, options_.log);
      log("data check: %zu token file%s, %lld tokens, every id below model.vocab_size = %lld (%.1f s)\n", all.size(),
          all.size() == 1 ? "" : "s", static_cast<long long>(n), static_cast<long long>(V), now_s() - t0);
    } catch (const std::exception& e) {
      failed = true, error = e.what();
    }
  }
  if (agree(failed, "the token files failed the check on world rank 0 (its message says why)"))
    TORCH_CHECK(false, "data check: ", error);
  try {
    train_data_ = std::make_shared<TokenDataset>(sources, T, tf.shuffle(), config_.seed());
    if (!eval_patterns.empty())
      eval_data_ = std::make_shared<TokenDataset>(
          std::vector<TokenSourceSpec>{{"data.token_files.eval_paths", eval_patterns, 1.0}}, T, false, config_.seed());
    failed = false;
  } catch (const std::exception& e) {
    failed = true, error = e.what();
  }
  if (agree(failed, "another rank could not open the token files (its message says why)"))
    TORCH_CHECK(false, "data (world rank ", rank(), "): ", error);
  for (int s = 0; s < train_data_->num_sources(); ++s) {
    const auto& st = train_data_->stream(s);
    log("data: %s: %zu file%s, %lld tokens, %lld windows of %lld tokens (%s)%s\n",
        train_data_->source_name(s).c_str(), st.files().size(), st.files().size() == 1 ? "" : "s",
        static_cast<long long>(st.size()), static_cast<long long>(train_data_->windows(s)),
        static_cast<long long>(T + 1), tf.shuffle() ? "shuffled every epoch" : "in order",
        train_data_->num_sources() > 1
            ? (", " + std::to_string(100.0 * train_data_->slots(s) / TokenDataset::kBlendPeriod).substr(0, 5) +
               "% of the sequences").c_str()
            : "");
  }
}

std::string Trainer::divergence_hint() const {
  const auto& ck = config_.checkpoint();
  std::string where = ck.has_dir() && !ck.dir().empty() ? "The newest checkpoint is in " + ck.dir() + "; "
                                                         : "There is no checkpoint.dir; ";
  return where + "try a lower optimizer.lr, a longer optimizer.warmup_steps or optimizer.grad_clip.";
}

std::string Trainer::layout_text() const {
  return "dp=" + std::to_string(dp_) + " x sp=" + std::to_string(sp_);
}

void Trainer::log(const char* fmt, ...) const {
  if (rank() != 0 || !options_.log) return;
  va_list args;
  va_start(args, fmt);
  std::vfprintf(options_.log, fmt, args);
  va_end(args);
  std::fflush(options_.log);
}

void Trainer::warn(const std::string& text) const {
  if (rank() != 0) return;
  std::fprintf(stderr, "carry: %s\n", text.c_str());
  std::fflush(stderr);
}

void Trainer::all_reduce(at::Tensor& t, bool sp_only) const {
  if (!groups_) return;
  auto& comm = sp_only ? *groups_->sp : *groups_->world;
  if (comm.size() > 1) comm.all_reduce_sum(t);
}

Trainer::Batch Trainer::batch_for(int64_t step, int64_t micro, bool eval) const {
  const auto& data = config_.data();
  const int64_t B = data.batch_size(), T = data.seq_len();
  const auto split = eval ? Split::eval : Split::train;
  // A step's global batch is dp x accum x B sequences; dp rank d's micro-batch m holds the global
  // indices [((step*dp + d)*accum + m)*B, ... + B), so accum micro-batches of B make the sequences of
  // one batch of accum*B (and accum = 1 is the plain dp x B cut).
  const int64_t accum = eval ? 1 : grad_accum_steps();
  const int64_t block = (step * dp_ + dp_rank_) * accum + micro;  // in units of B sequences
  at::Tensor tokens, targets, mask;
  if (data.has_mqar() || data.has_needle()) {
    // The synthetic tasks number sequences (step, dp_rank * B + i): block b of step s is their "dp rank" b - s*dp*accum.
    const int64_t as_rank = block - step * dp_ * accum;
    auto b = data.has_mqar() ? mqar_batch(mqar_spec(data), config_.seed(), step, as_rank, B, split)
                             : needle_batch(needle_spec(data), config_.seed(), step, as_rank, B, split);
    tokens = b.tokens, targets = b.targets, mask = b.loss_mask;
  } else {
    const TokenDataset* source = eval ? eval_data_.get() : train_data_.get();
    TORCH_CHECK(source, "trainer: evaluation needs data.token_files.eval_paths");
    auto window = at::empty({B, T + 1}, at::kLong);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t g = block * B + b;
      if (eval) {  // in order, wrapping around
        const int64_t windows = source->windows(0);
        source->stream(0).read((g % windows) * T, T + 1, window[b].data_ptr<int64_t>());
      } else {
        source->sequence(g, window[b].data_ptr<int64_t>());
      }
    }
    const int64_t V = config_.model().vocab_size();
    auto hi = window.max().item<int64_t>();
    TORCH_CHECK(hi < V, "data.token_files: token id ", hi, " does not fit model.vocab_size = ", V);
    tokens = window.narrow(1, 0, T).contiguous();
    targets = window.narrow(1, 1, T).contiguous();
    mask = at::ones({B, T}, at::kBool);
  }
  at::Tensor starts;  // packed documents: a document starts at every end-of-document token
  if (data.has_token_files() && data.token_files().eod_token() >= 0) starts = tokens.eq(data.token_files().eod_token());
  const int64_t Tp = T / sp_;
  // On CUDA through pinned memory without a host wait: a pageable upload synchronizes the host with the
  // stream, so the GPU finished the previous step's update before the host went on to queue this step.
  auto slice = [&](const at::Tensor& x) {
    auto part = x.narrow(1, sp_rank_ * Tp, Tp).contiguous();
    return device_.is_cuda() ? part.pin_memory().to(device_, /*non_blocking=*/true) : part.to(device_);
  };
  return {slice(tokens), slice(targets), slice(mask), starts};
}


std::pair<Trainer::Batch, ModelContext> Trainer::segment_of(const Batch& b, int j) const {
  segments_->set_segment(j);
  const int64_t L = b.tokens.size(1) / segments_->per_rank();
  auto part = [&](const at::Tensor& x) { return x.narrow(1, j * L, L); };
  Batch s{part(b.tokens), part(b.targets), part(b.loss_mask), b.document_starts};
  ModelContext c = context(s);
  c.slice.offset = segments_->rank() * L;
  return {s, c};
}

namespace {
// CARRY_SYNC_DEBUG=error (CUDA builds): inside a training step, any synchronizing CUDA call (a
// device-to-host copy, .item(), a stream synchronization through PyTorch) throws, naming the
// operation, except the batch's upload and the two reads the step line needs (the loss sums and the
// gradient norm), which run with the check paused. The audit that a step does not stall the GPU on the host.
class SyncAudit {
 public:
  SyncAudit() { set(enabled()); }
  ~SyncAudit() { set(false); }
  template <class F>
  static auto allowed(F f) {  // a sanctioned host read
    set(false);
    auto r = f();
    set(enabled());
    return r;
  }

 private:
  static bool enabled() {
    static const bool on = [] {
      const char* v = std::getenv("CARRY_SYNC_DEBUG");
      return v && std::string(v) == "error";
    }();
    return on;
  }
  static void set(bool on) {
#ifdef CARRY_WITH_CUDA
    c10::cuda::warning_state().set_sync_debug_mode(on ? c10::cuda::SyncDebugMode::L_ERROR
                                                      : c10::cuda::SyncDebugMode::L_DISABLED);
#else
    (void)on;
#endif
  }
};
}  // namespace

void Trainer::prefetch_batches(int64_t step) {
  std::vector<Batch> micro;
  for (int64_t m = 0; m < grad_accum_steps(); ++m)
    micro.push_back(SyncAudit::allowed([&] { return batch_for(step, m, false); }));  // the input upload
  prefetched_ = {step, std::move(micro)};
}

std::vector<Trainer::Batch> Trainer::step_batches() {
  if (!prefetched_ || prefetched_->first != step_) prefetch_batches(step_);
  auto micro = std::move(prefetched_->second);
  prefetched_.reset();
  return micro;
}

at::Tensor Trainer::segmented_forward_backward(const std::vector<Batch>& micro, const at::Tensor& stop,
                                               at::Tensor& gradients) {
  const int k = segments_->per_rank();
  auto params = model_.parameters();
  // The global token count first (exact in any order): every segment's loss is divided by it.
  auto masked = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device_));
  for (auto& b : micro) masked += b.loss_mask.to(at::kDouble).sum();
  all_reduce(masked);
  // Per local segment: [Σ ce·mask, stop signals] and the gradients, each summed over the micro-batches in order (the
  // same order on every layout), then over the segments by the tree.
  std::vector<at::Tensor> losses(k), grads(k);
  for (auto& batch : micro) {
    std::vector<LinearCrossEntropy> ce(k);
    for (int j = 0; j < k; ++j) {
      auto [seg, ctx] = segment_of(batch, j);
      AutocastScope autocast(device_.type(), at::kBFloat16, bf16_);
      ce[j] = model_.loss_sum(seg.tokens, seg.targets, seg.loss_mask, ctx, /*predictions=*/false,
                              deferred_head_bytes_);
      auto l = at::stack({ce[j].loss.detach().to(at::kDouble), at::zeros({}, masked.options())});
      losses[j] = losses[j].defined() ? losses[j] + l : l;
    }
    // One segment and one micro-batch: the gradients' sum goes in buckets while the backward runs.
    const bool overlap = gradient_sum_ && micro.size() == 1;
    phase_mark("forward");
    for (int j = k - 1; j >= 0; --j) {  // the state gradients flow right to left
      segments_->set_segment(j);
      if (overlap) gradient_sum_->begin();
      (ce[j].loss / masked[0].to(ce[j].loss.scalar_type())).backward();
      ce[j] = LinearCrossEntropy{};
      if (overlap) gradients = gradient_sum_->finish();
      else {
        auto g = flat_gradients(params, grad_layout_);
        grads[j] = grads[j].defined() ? grads[j] + g : g;
      }
      for (auto& [name, p] : params) p.mutable_grad() = at::Tensor();
    }
    phase_mark("backward");
  }
  auto* sp = segments_->sp();
  // Split over the sp ranks: each holds its piece's sum (sharded_update.h).
  if (!gradients.defined()) gradients = sharded_ ? parallel::tree_reduce_scatter(grads, sp) : parallel::tree_sum(grads, sp);
  grads.clear();
  losses[0] = losses[0] + at::stack({at::zeros({}, stop.options()), stop});  // the stop signals ride along
  auto loss = parallel::tree_sum(losses, sp);
  return at::stack({loss[0], masked[0], loss[1]});
}

StepStats Trainer::train_step() {
  const double t0 = now_s();
  phase_mark("between steps");
  SyncAudit audit;
  const auto& data = config_.data();
  for (auto& [name, p] : model_.parameters()) p.mutable_grad() = at::Tensor();
  const int64_t accum = grad_accum_steps();
  const auto stop_flag = [&](const at::TensorOptions& o) {
    return at::scalar_tensor(g_stop_signal != 0 || time_is_up_ ? 1.0 : 0.0, o.dtype(at::kDouble));
  };
  // No host read until the step's one sanctioned read after the backward and the clipping: the global
  // token count divides the loss as a device tensor, the loss sums, the stop flag and the gradient norm
  // travel to the host together, and the checks (a token selected, a finite loss and norm) come before
  // the update.
  at::Tensor sums;  // [Σ ce·mask, Σ mask, stop signals] over all ranks, fp64 on the device
  at::Tensor gradients;  // with segments: the flat gradients summed over the sp group
  if (segments_) {
    std::vector<Batch> micro = step_batches();
    // Summed over the sp group by the segment tree; the data-parallel replicas below.
    sums = segmented_forward_backward(micro, stop_flag(at::TensorOptions().device(device_)), gradients);
    if (dp_ > 1) {
      auto dp_sums = at::stack({sums[0], sums[2]});
      groups_->dp->all_reduce_sum(dp_sums);
      sums = at::stack({dp_sums[0], sums[1], dp_sums[1]});
    }
  } else if (accum == 1) {
    auto batch = step_batches()[0];
    // The head and cross entropy run chunk by chunk (chunked_loss.h): Σ ce·mask, never the logits.
    // Ignored targets (kIgnoreIndex < 0) contribute 0.
    LinearCrossEntropy ce;
    {
      AutocastScope autocast(device_.type(), at::kBFloat16, bf16_);
      ce = model_.loss_sum(batch.tokens, batch.targets, batch.loss_mask, context(batch));
    }
    auto w = batch.loss_mask.to(ce.token_losses.options());
    // The loss each rank back-propagates is its share of the mean. The stop flag rides along so that
    // every rank decides the same.
    sums = at::stack({ce.loss.detach().to(at::kDouble), w.sum().to(at::kDouble), stop_flag(w.options())});
    all_reduce(sums);
    phase_mark("forward");
    (ce.loss / sums[1].to(ce.loss.scalar_type())).backward();
    phase_mark("backward");
  } else {
    // Gradient accumulation: the micro-batches' masks give the global token count first (one small
    // all-reduce), then each micro-batch back-propagates its share Σ ce·mask / count, so the summed
    // gradients are those of the whole batch's mean; the loss sums and the stop flag travel after.
    std::vector<Batch> micro = step_batches();
    auto masked = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device_));
    for (auto& b : micro) masked += b.loss_mask.to(at::kDouble).sum();
    all_reduce(masked);
    at::Tensor local_sum;
    for (auto& batch : micro) {
      LinearCrossEntropy ce;
      {
        AutocastScope autocast(device_.type(), at::kBFloat16, bf16_);
        ce = model_.loss_sum(batch.tokens, batch.targets, batch.loss_mask, context(batch));
      }
      auto part = ce.loss.detach().to(at::kDouble);
      local_sum = local_sum.defined() ? local_sum + part : part;
      phase_mark("forward");
      (ce.loss / masked[0].to(ce.loss.scalar_type())).backward();
      phase_mark("backward");
    }
    auto local = at::stack({local_sum, stop_flag(local_sum.options())});
    all_reduce(local);
    sums = at::stack({local[0], masked[0], local[1]});
  }

  // Sum the gradients over all ranks in one message (with segments: over the dp replicas; the sp group
  // summed them already).
  auto params = model_.parameters();
  parallel::Communicator* grad_comm = !groups_ ? nullptr : segments_ ? groups_->dp.get() : groups_->world.get();
  if (grad_comm && grad_comm->size() > 1) {
    if (!gradients.defined()) gradients = flat_gradients(params, grad_layout_);
    if (sharded_) {
      auto piece = sharded_->mine(gradients);  // the piece this rank updates, the same on every replica
      grad_comm->all_reduce_sum(piece);
    } else {
      grad_comm->all_reduce_sum(gradients);
    }
  }
  at::Tensor norm;
  if (sharded_) {
    sharded_->set_gradients(gradients);
    norm = sharded_->clip(config_.optimizer().grad_clip());
  } else {
    if (gradients.defined()) set_gradients(params, gradients, grad_layout_);
    norm = clip_grad_norm_on_device(params, config_.optimizer().grad_clip());
  }
  if (!norm.defined()) norm = at::zeros({}, sums.options());
  phase_mark("gradient sum and clip");
  // The next step's batches, made on the host while the GPU still runs this step's backward. A batch
  // that cannot be made (a token id past the vocabulary) is left for the next step to report, after this
  // step's update, as without the prefetch.
  if (step_ + 1 < config_.optimizer().total_steps()) {
    try {
      prefetch_batches(step_ + 1);
    } catch (const std::exception&) {
      prefetched_.reset();
    }
  }
  // The step's one host read.
  auto host = SyncAudit::allowed([&] { return at::cat({sums, norm.view({1}).to(sums.device())}).cpu(); });
  const double* h = host.data_ptr<double>();
  const double loss_sum = h[0], count = h[1], grad_norm = h[3];
  const bool stop_requested = h[2] > 0;
  TORCH_CHECK(count > 0, "trainer: step ", step_ + 1, ": the loss mask selects no token in the global batch");
  TORCH_CHECK(std::isfinite(loss_sum), "trainer: step ", step_ + 1, ": the loss is ", number_text(loss_sum / count),
              "; the parameters were not updated. ", divergence_hint());
  TORCH_CHECK(std::isfinite(grad_norm), "trainer: step ", step_ + 1, ": the gradient norm is ", number_text(grad_norm),
              " (loss ", number_text(loss_sum / count), "); the parameters were not updated. ", divergence_hint());
  const double lr = learning_rate(config_.optimizer(), step_);
  optimizer_->step(lr);
  if (sharded_) sharded_->gather_parameters();
  phase_mark("update");
  ++step_;
  const int64_t tokens = static_cast<int64_t>(dp_) * accum * data.batch_size() * data.seq_len();
  tokens_seen_ += tokens;
  StepStats s;
  s.step = step_;
  s.loss = loss_sum / count;
  s.grad_norm = grad_norm;
  s.lr = lr;
  s.tokens = tokens;
  s.seconds = now_s() - t0;
  s.stop_requested = stop_requested;
  return s;
}

EvalStats Trainer::evaluate() {
  at::NoGradGuard no_grad;
  if (sharded_) sharded_->wait_parameters();
  const int64_t batches = config_.data().eval_batches();
  // Per rank: [Σ ce·mask, Σ mask, correct]; per sequence (summed over sp): [masked, correct].
  auto totals = at::zeros({3}, at::kDouble);
  double sequences = 0, sequences_correct = 0;
  for (int64_t e = 0; e < batches; ++e) {
    auto whole = batch_for(e, 0, true);
    at::Tensor per_seq;  // [B,2]
    for (int j = 0; j < (segments_ ? segments_->per_rank() : 1); ++j) {  // ordered segments in order
      auto [batch, ctx] = segments_ ? segment_of(whole, j) : std::pair{whole, context(whole)};
      // Chunk by chunk (chunked_loss.h): the losses and the argmax tokens, never the [B,T,V] logits.
      LinearCrossEntropy r;
      {
        AutocastScope autocast(device_.type(), at::kBFloat16, bf16_);
        r = model_.loss_sum(batch.tokens, batch.targets, {}, ctx, /*predictions=*/true);
      }
      const auto& ce = r.token_losses;
      auto w = batch.loss_mask.to(ce.options());
      auto right = (r.predictions == batch.targets).logical_and(batch.loss_mask).to(at::kDouble);
      auto part = at::stack({batch.loss_mask.to(at::kDouble).sum(1), right.sum(1)}, 1).cpu();
      per_seq = per_seq.defined() ? per_seq + part : part;
      totals += at::stack({(ce * w).sum().to(at::kDouble).cpu(), w.sum().to(at::kDouble).cpu(),
                           right.sum().cpu()});
    }
    all_reduce(per_seq, /*sp_only=*/true);
    auto masked = per_seq.select(1, 0), correct = per_seq.select(1, 1);
    auto has = masked > 0;
    double n_seq = has.sum().item<double>();
    double n_ok = (has.logical_and(correct == masked)).sum().item<double>();
    // Sequences count once per dp rank: only sp rank 0 contributes them to the world sum below.
    if (sp_rank_ == 0) sequences += n_seq, sequences_correct += n_ok;
  }
  auto all = at::cat({totals, at::tensor({sequences, sequences_correct}, at::kDouble)});
  all_reduce(all);
  EvalStats r;
  double count = all[1].item<double>();
  r.positions = static_cast<int64_t>(count);
  r.loss = count > 0 ? all[0].item<double>() / count : 0;
  r.accuracy = count > 0 ? all[2].item<double>() / count : 0;
  r.sequence_accuracy = all[3].item<double>() > 0 ? all[4].item<double>() / all[3].item<double>() : 0;
  return r;
}

// ---- checkpoints ----

void Trainer::save_checkpoint() {
  const auto& ck = config_.checkpoint();
  if (!ck.has_dir() || ck.dir().empty()) return;
  // Every rank's moments from the rank that updates them: rank 0 writes them all.
  if (sharded_) sharded_->gather_optimizer_state();
  // Never write a checkpoint with a non-finite parameter: it would become `latest` and every resume
  // would start from it. One reduction, here only (not every step): a not-finite flag per parameter
  // tensor, stacked, summed over the ranks (so that every rank refuses alike) and copied to the host
  // once. Nothing is written and `latest` is not touched.
  auto params = model_.parameters();
  if (!params.empty()) {
    std::vector<at::Tensor> flags;
    flags.reserve(params.size());
    for (auto& [name, p] : params) flags.push_back(at::isfinite(p.detach()).all().logical_not());
    auto bad = at::stack(flags).to(at::kDouble);
    all_reduce(bad);
    auto host = bad.cpu();
    const double* b = host.data_ptr<double>();
    size_t first = params.size(), count = 0;
    for (size_t i = 0; i < params.size(); ++i)
      if (b[i] > 0) {
        if (first == params.size()) first = i;
        ++count;
      }
    if (count > 0) {
      const auto& p = params[first].second;
      std::string what = "on another rank";
      if (!at::isfinite(p.detach()).all().item<bool>()) {
        const int64_t nans = at::isnan(p.detach()).sum().item<int64_t>();
        const int64_t infs = at::isinf(p.detach()).sum().item<int64_t>();
        what = std::to_string(nans) + " NaN and " + std::to_string(infs) + " infinite of its " +
               std::to_string(p.numel()) + " values";
      }
      TORCH_CHECK(false, "trainer: step ", step_, ": refusing to write a checkpoint to ", ck.dir(), ": parameter '",
                  params[first].first, "' is not finite (", what, "; non-finite parameter tensors: ", count, " of ",
                  params.size(), "); nothing was written and 'latest' still names the previous "
                  "checkpoint. ", divergence_hint());
    }
  }
  if (rank() == 0) {
    CheckpointData d;
    d.step = step_;
    d.tokens_seen = tokens_seen_;
    d.data_cursor = step_;  // the next batch index: batches are functions of (seed, step, dp rank)
    d.rng_seed = config_.seed();
    d.config_text = config_to_text(config_);
    for (auto& [name, p] : model_.parameters()) d.model.emplace_back(name, p.detach());
    d.optimizer = optimizer_->state();
    d.extra["layout"] = layout_text();
    d.extra["global_batch"] = std::to_string(dp_ * grad_accum_steps() * config_.data().batch_size());
    // The environment variables of layers/core/knobs.h set for this run (`carry env` lists them).
    if (const std::string env = knobs_set_text(); !env.empty()) d.extra["environment"] = env;
    // Where the metrics file ends at this step: a run resumed from here drops what comes after.
    const std::string& metrics = config_.logging().metrics_file();
    if (!metrics.empty() && file_size(metrics) >= 0) {
      d.extra["metrics_file"] = metrics;
      d.extra["metrics_bytes"] = std::to_string(file_size(metrics));
    }
    if (run_id_.empty()) run_id_ = new_run_id();
    d.run_id = run_id_;
    carry::save_checkpoint(ck.dir(), d, static_cast<int>(ck.keep_last()));
  }
  if (groups_) groups_->world->barrier();
}

namespace {

// Fields that a resumed run may change freely: how it runs, not what it computes (the parallel
// layout, checkpoints, logging, the name, evaluation), plus optimizer.total_steps (to train further)
// and precision. data.batch_size is judged through the global batch.
bool may_change(const std::string& path) {
  for (const char* prefix : {"parallel.", "checkpoint.", "logging."})
    if (path.compare(0, std::strlen(prefix), prefix) == 0) return true;
  for (const char* field : {"name", "precision", "optimizer.total_steps", "data.eval_batches", "data.batch_size",
                            "data.token_files.eval_paths"})
    if (path == field) return true;
  return false;
}

}  // namespace

void Trainer::check_config_against(const CheckpointData& d) const {
  if (d.config_text.empty()) return;  // written without one (a test or another tool)
  const std::string where = config_.checkpoint().dir() + "/" + checkpoint_dir_name(d.step);
  RunConfig stored;
  try {
    stored = parse_stored_run_config(d.config_text, where + "/manifest.textproto (its config_text)");
  } catch (const ConfigError& e) {
    TORCH_CHECK(options_.allow_config_change, "resume from ", where, ": cannot read the config the checkpoint was "
                "written with: ", e.what(), "; pass --allow-config-change to resume without comparing it");
    warn("resume from " + where + ": cannot read its stored config (" + e.what() + "); resuming without "
         "comparing it (--allow-config-change)");
    return;
  }
  std::vector<std::string> refused, noted;
  for (const auto& c : config_changes(stored, config_)) {
    const std::string line = c.path + ": " + c.before + " -> " + c.after;
    (may_change(c.path) ? noted : refused).push_back(line);
  }
  const int64_t global_before = stored.parallel().dp() * stored.data().batch_size();
  const int64_t global_now = static_cast<int64_t>(dp_) * config_.data().batch_size();
  if (global_before != global_now)
    refused.push_back("the global batch (parallel.dp x data.batch_size): " + std::to_string(global_before) + " -> " +
                      std::to_string(global_now) + " sequences (the batches of every later step change)");
  for (const auto& line : noted)
    if (line.compare(0, 9, "parallel.") != 0 && line.compare(0, 16, "data.batch_size:") != 0)
      log("note: changed since the checkpoint: %s\n", line.c_str());
  if (refused.empty()) return;
  std::string list;
  for (const auto& line : refused) list += "\n  " + line;
  TORCH_CHECK(options_.allow_config_change, "resume from ", where, ": this run's config differs from the one the "
              "checkpoint was written with in what makes a run:", list, "\nA checkpoint continues the run that wrote "
              "it: resume with its seed, model, data, optimizer and global batch (the parallel layout, checkpoint and "
              "logging options, precision and optimizer.total_steps may change); give a new run another "
              "checkpoint.dir (or checkpoint.resume=NEVER); or pass --allow-config-change to continue with these "
              "changes.");
  warn("resume from " + where + " with a changed config (--allow-config-change):" + list);
}

void Trainer::apply_checkpoint(const CheckpointData& d) {
  const auto& dir = config_.checkpoint().dir();
  check_config_against(d);
  auto params = model_.parameters();
  std::map<std::string, at::Tensor> by_name(d.model.begin(), d.model.end());
  TORCH_CHECK(by_name.size() == params.size(), "resume from ", dir, ": the checkpoint holds ",
              by_name.size(), " model tensors, the model has ", params.size(), " parameters");
  at::NoGradGuard no_grad;
  for (auto& [name, p] : params) {
    auto it = by_name.find(name);
    TORCH_CHECK(it != by_name.end(), "resume from ", dir, ": parameter '", name,
                "' is not in the checkpoint (a different model?)");
    TORCH_CHECK(it->second.sizes() == p.sizes(), "resume from ", dir, ": parameter '", name,
                "' has shape ", it->second.sizes(), " in the checkpoint, the model's is ", p.sizes());
    p.copy_(it->second);
  }
  optimizer_->load_state(d.optimizer, d.step);
  TORCH_CHECK(d.data_cursor == d.step, "resume from ", dir, ": data_cursor ", d.data_cursor,
              " differs from step ", d.step, " (this trainer keeps them equal)");
  // The state is layout-free (full parameters and optimizer state; batches are functions of the step
  // and the global sequence index), so another dp x sp continues the same run when the global batch
  // is the same (check_config_against made sure of that, unless --allow-config-change).
  auto was = [&](const char* key) {
    auto it = d.extra.find(key);
    return it == d.extra.end() ? std::string() : it->second;
  };
  const std::string global_batch = std::to_string(dp_ * grad_accum_steps() * config_.data().batch_size());
  if (!was("layout").empty() && was("layout") != layout_text())
    log("note: the checkpoint was written by %s, this run is %s\n", was("layout").c_str(), layout_text().c_str());
  if (!was("global_batch").empty() && was("global_batch") != global_batch)
    log("note: the global batch (dp x optimizer.grad_accum_steps x data.batch_size) was %s sequences and is now %s: the run goes on with "
        "other batches than the original would have\n", was("global_batch").c_str(), global_batch.c_str());
}

std::string Trainer::initialize_from(const std::string& path) {
  ModelSource source = load_model_source(path);
  try {
    load_weights(model_, source.weights, "init_from " + source.describe());
  } catch (const ConfigError& e) {
    throw ConfigError(std::string(e.what()) + ". init_from takes weights only: model { } must describe the same "
                      "model (`carry import " + path + "` prints the model section of an FLA folder; a carry "
                      "checkpoint's is in its manifest.textproto)");
  }
  return source.describe();
}

bool Trainer::resume() { return start(/*whole_run=*/false); }

bool Trainer::start(bool whole_run) {
  const auto& ck = config_.checkpoint();
  const bool has_dir = ck.has_dir() && !ck.dir().empty();
  const bool init = config_.has_init_from() && !config_.init_from().empty();
  // World rank 0 reads the checkpoint (it wrote it, so the directory need not be shared between
  // hosts) and broadcasts it: a status, the counters, then every parameter and optimizer tensor.
  enum Status : int64_t { kNone = 0, kLoaded = 1, kFailed = 2, kInitialized = 3 };
  int64_t status = kNone, step = 0, tokens = 0;
  std::string error, init_source;
  if (rank() == 0) {
    try {
      std::optional<CheckpointData> loaded;
      if (has_dir) {
        const std::string& dir = ck.dir();
        struct stat st;
        const bool existed = ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
        TORCH_CHECK(existed || ck.resume() != config::CheckpointConfig::REQUIRED, "checkpoint.resume is REQUIRED "
                    "but checkpoint.dir ", dir, " does not exist (or is not a directory)");
        if (whole_run) {
          check_checkpoint_dir();
          lock_ = std::make_shared<CheckpointDirLock>(dir);
        }
        if (ck.resume() == config::CheckpointConfig::NEVER) {
          auto steps = list_checkpoint_steps(dir);
          if (!steps.empty())
            warn("checkpoint.resume is NEVER: starting from step 0; the " + std::to_string(steps.size()) +
                 " checkpoint(s) already in " + dir + " (steps " + std::to_string(steps.front()) + " to " +
                 std::to_string(steps.back()) + ") are kept: this run deletes only checkpoints it writes");
        } else {
          CheckpointSearch found = find_latest_checkpoint(dir);
          for (const auto& note : found.notes) warn(note);
          const bool required = ck.resume() == config::CheckpointConfig::REQUIRED;
          if (!found.loaded) {
            std::string why = !existed ? "checkpoint.dir " + dir + " does not exist"
                              : found.steps.empty() ? "checkpoint.dir " + dir + " holds no checkpoint"
                                                    : "none of the " + std::to_string(found.steps.size()) +
                                                          " checkpoint(s) in " + dir + " can be used (see above)";
            TORCH_CHECK(!required, "checkpoint.resume is REQUIRED but ", why);
            if (!existed)
              warn(why + ": starting from step 0 (it is created for this run's checkpoints)");
            else if (!found.steps.empty())
              warn("warning: " + why + ": starting from step 0. They are kept (a run deletes only checkpoints "
                   "it wrote); set checkpoint.resume=REQUIRED to make this an error");
            else
              log("checkpoint: %s holds no checkpoint yet; starting from step 0\n", dir.c_str());
          }
          loaded = std::move(found.loaded);
        }
      }
      if (loaded) {
        apply_checkpoint(*loaded);
        status = kLoaded, step = loaded->step, tokens = loaded->tokens_seen;
        run_id_ = loaded->run_id;
      } else if (init) {  // no checkpoint to continue: the weights of init_from, step 0
        init_source = initialize_from(config_.init_from());
        status = kInitialized;
      }
      if (run_id_.empty()) run_id_ = new_run_id();
      if (whole_run) prepare_metrics(loaded ? &*loaded : nullptr);
    } catch (const std::exception& e) {
      const auto* c = dynamic_cast<const c10::Error*>(&e);
      status = kFailed, error = c ? c->what_without_backtrace() : e.what();
    }
  }
  const bool shared = groups_ && groups_->world->size() > 1;
  if (shared) {
    auto header = at::tensor({status, step, tokens}, at::TensorOptions().dtype(at::kLong)).to(device_);
    groups_->world->broadcast(header, 0);
    auto h = header.cpu();
    status = h[0].item<int64_t>(), step = h[1].item<int64_t>(), tokens = h[2].item<int64_t>();
  }
  TORCH_CHECK(status != kFailed, rank() == 0 ? error : (has_dir ? "starting the run from " + ck.dir()
                                                                 : "init_from " + config_.init_from()) +
              " failed on world rank 0 (its message says why)");
  if (status == kNone) return false;
  if (status == kInitialized) {  // weights only: the run starts at step 0
    if (shared) {
      at::NoGradGuard no_grad;
      for (auto& [name, p] : model_.parameters()) {
        auto data = p.detach();
        groups_->world->broadcast(data, 0);
      }
    }
    log("initialized the weights from %s (init_from; weights only, starting at step 0)\n", init_source.c_str());
    return false;
  }
  if (shared) {
    at::NoGradGuard no_grad;
    for (auto& [name, p] : model_.parameters()) {
      auto data = p.detach();
      groups_->world->broadcast(data, 0);
    }
    auto state = optimizer_->state();
    for (auto& [name, t] : state) groups_->world->broadcast(t, 0);
    if (rank() != 0) optimizer_->load_state(state, step);  // sets the step count (the values are in place)
  }
  step_ = step;
  tokens_seen_ = tokens;
  return true;
}

std::string Trainer::data_description() const {
  const auto& d = config_.data();
  std::string source;
  if (d.has_mqar()) {
    source = "MQAR (" + std::to_string(d.mqar().num_kv_pairs()) + " key-value pairs, " +
             std::to_string(d.mqar().num_queries()) + " queries)";
  } else if (d.has_needle()) {
    source = "needle in a haystack (vocabulary " + std::to_string(d.needle().vocab_size()) + ")";
  } else if (d.has_token_files()) {
    const auto& t = d.token_files();
    source = t.sources_size() > 0 ? std::to_string(t.sources_size()) + " token-file sources blended by weight"
                                  : std::to_string(t.paths_size()) + (t.paths_size() == 1 ? " token file" : " token files");
  } else {
    source = "none";
  }
  const int64_t T = d.seq_len(), sequences = dp_ * grad_accum_steps() * d.batch_size();
  return source + "; " + std::to_string(T) + " tokens a sequence (" + std::to_string(T / std::max(1, sp_)) +
         " a rank), " + std::to_string(sequences) + " sequences (" + std::to_string(sequences * T) + " tokens) a step";
}

std::string Trainer::write_resolved_config() const {
  const auto& ck = config_.checkpoint();
  const auto& lg = config_.logging();
  std::string out = "metrics " + (lg.has_metrics_file() && !lg.metrics_file().empty() ? lg.metrics_file() : "not written");
  if (!ck.has_dir() || ck.dir().empty())
    return out + "; no checkpoints (checkpoint.dir unset); resolved config not written (carry train --print-config prints it)";
  out += "; checkpoints " + ck.dir() + " every " + std::to_string(ck.every_steps()) + " steps";
  // The resolved config (every default and --set override applied), beside the checkpoints: what this
  // invocation ran with, rewritten at each start (each checkpoint's manifest keeps its own copy).
  const std::string path = ck.dir() + "/config.textproto";
  if (rank() == 0) {
    const std::string tmp = path + ".tmp";
    const std::string text = config_to_text(config_);
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      f << text;
      f.close();
      TORCH_CHECK(f.good(), "checkpoint.dir: cannot write the resolved config to ", tmp, ": ", std::strerror(errno));
    }
    TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "checkpoint.dir: cannot rename ", tmp, " to ", path,
                ": ", std::strerror(errno));
  }
  return out + "; resolved config " + path;
}

void Trainer::check_checkpoint_dir() const {
  const auto& ck = config_.checkpoint();
  // Room for one more checkpoint (the previous ones are deleted only after it is complete).
  double bytes = 1 << 20;
  for (auto& [name, p] : model_.parameters()) bytes += static_cast<double>(p.nbytes());
  for (auto& [name, t] : optimizer_->state()) bytes += static_cast<double>(t.nbytes());
  check_output_dir(ck.dir(), static_cast<uint64_t>(bytes), "checkpoint.dir");
  const int64_t free = free_bytes(ck.dir());
  if (ck.keep_last() > 1 && free >= 0 && static_cast<double>(free) < bytes * static_cast<double>(ck.keep_last()))
    warn("warning: checkpoint.dir " + ck.dir() + " has " + gib(static_cast<double>(free)) + " free, less than the " +
         std::to_string(ck.keep_last()) + " checkpoints of checkpoint.keep_last (" + gib(bytes) + " each) need");
}

void Trainer::prepare_metrics(const CheckpointData* resumed_from) const {
  const std::string& metrics = config_.logging().metrics_file();
  if (metrics.empty()) return;
  check_output_file(metrics, "logging.metrics_file");
  const int64_t size = file_size(metrics);
  auto extra = [&](const char* key) {
    auto it = resumed_from ? resumed_from->extra.find(key) : std::map<std::string, std::string>::const_iterator();
    return resumed_from && it != resumed_from->extra.end() ? it->second : std::string();
  };
  if (!resumed_from || extra("metrics_file") != metrics || extra("metrics_bytes").empty()) {
    if (size > 0)
      warn("logging.metrics_file " + metrics + " already holds " + std::to_string(size) + " bytes; this run's lines " +
           "are appended after them");
    return;
  }
  // A resumed run: the lines of the steps after the checkpoint were written by the run that stopped
  // and are written again now; drop them, at the line boundary recorded in the checkpoint.
  const std::string recorded = extra("metrics_bytes");
  char* end = nullptr;
  const long long keep = std::strtoll(recorded.c_str(), &end, 10);
  if (*end || keep < 0) {
    warn("the checkpoint of step " + std::to_string(resumed_from->step) + " records metrics_bytes '" +
         printable(recorded) + "', not a byte count; this run's lines are appended to " + metrics);
    return;
  }
  if (size == keep) return;
  char last = '\n';
  if (keep > 0 && size > keep) {
    int fd = ::open(metrics.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || ::pread(fd, &last, 1, keep - 1) != 1) last = 0;
    if (fd >= 0) ::close(fd);
  }
  if (size < keep || last != '\n') {
    warn("logging.metrics_file " + metrics + " has " + std::to_string(size) + " bytes, but had " +
         std::to_string(keep) + " at the checkpoint of step " + std::to_string(resumed_from->step) +
         " (it was changed or replaced since); this run's lines are appended to it");
    return;
  }
  TORCH_CHECK(::truncate(metrics.c_str(), keep) == 0, "logging.metrics_file: cannot drop the lines after step ",
              resumed_from->step, " from ", metrics, ": ", std::strerror(errno));
  log("metrics: dropped %lld bytes of lines after step %lld from %s (those steps run again)\n",
      static_cast<long long>(size - keep), static_cast<long long>(resumed_from->step), metrics.c_str());
}

// ---- the run ----

int Trainer::run() {
  struct Unlock {  // checkpoint.dir stays locked until run() returns or throws
    std::shared_ptr<CheckpointDirLock>& lock;
    ~Unlock() { lock.reset(); }
  } unlock{lock_};
  const bool resumed = start(/*whole_run=*/true);
  const int64_t total = config_.optimizer().total_steps();
  if (resumed && step_ >= total) {
    log("run already complete: %s holds step %lld of optimizer.total_steps = %lld; nothing to do (delete "
        "that directory to start over, or raise optimizer.total_steps to train further)\n",
        config_.checkpoint().dir().c_str(), static_cast<long long>(step_), static_cast<long long>(total));
    return 0;
  }
  log("%s\n", model_.summary().c_str());
  const std::string segments =
      segments_ ? ", " + std::to_string(segments_->size()) + " segments (" + std::to_string(segments_->per_rank()) +
                      " a rank; the same bits on every layout with as many)"
                : "";
  log("parameters: %lld, ranks: dp %d x sp %d (%s, %s), scan mode %s%s\n",
      static_cast<long long>(model_.num_parameters()), dp_, sp_,
      groups_ ? groups_->world->backend().c_str() : "single process", device_.str().c_str(),
      parallel::scan_mode_name(scan_mode_of(config_.parallel().scan_mode())).c_str(), segments.c_str());
  const auto& par = config_.parallel();
  const int64_t keep_last = std::min<int64_t>(par.recompute_keep_last(), model_.blocks().size());
  const std::string kept_last =
      par.recompute() && keep_last > 0 ? " (the last " + (keep_last == 1 ? std::string("layer") : std::to_string(keep_last) + " layers") +
                                             " kept: parallel.recompute_keep_last)"
                                       : "";
  log("precision: %s; activations: %s%s\n",
      bf16_ ? "bf16 autocast (fp32 master weights and optimizer, mixer kernels read bf16 q, k, v and fp32 gates, fp32 states; ATen mixer forms in fp32)" : "fp32",
      !par.recompute()                ? "kept"
      : par.recompute_keeps_mixer() ? "recomputed per layer in backward around each kept mixer core"
      : context_.recompute_overlap  ? "recomputed per layer beside the backward of the layer above"
                                    : "recomputed per layer in backward",
      kept_last.c_str());
  if (!update_line_.empty()) log("%s\n", update_line_.c_str());
  log("data: %s\n", data_description().c_str());
  log("output: %s\n", write_resolved_config().c_str());
  if (const std::string env = knobs_set_text(); !env.empty()) log("environment: %s\n", env.c_str());
  if (resumed) log("resumed from %s at step %lld\n", config_.checkpoint().dir().c_str(), static_cast<long long>(step_));

  // The metrics file and its TensorBoard mirror (rank 0): records past the resumed step go first.
  const auto& lg = config_.logging();
  RunLog metrics(lg.has_metrics_file() ? lg.metrics_file() : "", lg.tensorboard(), rank() == 0);
  const auto begun = metrics.start(step_, resumed, wall_clock_s());
  if (begun.dropped > 0)
    log(resumed ? "metrics: dropped %lld records of %s written after step %lld (after the checkpoint this run resumed "
                  "from)\n"
                : "metrics: %lld records of an earlier run dropped from %s (a new run from step %lld)\n",
        static_cast<long long>(begun.dropped), metrics.metrics_file().c_str(), static_cast<long long>(step_));
  if (!begun.tensorboard_file.empty()) log("tensorboard: %s\n", begun.tensorboard_file.c_str());

  const int64_t log_every = std::max<int64_t>(1, lg.every_steps());
  const int64_t eval_every = lg.eval_every_steps();
  const int64_t ckpt_every = config_.checkpoint().every_steps();
  // MFU only on GPUs: the CPU has no peak rate worth dividing by.
  const bool show_mfu = device_.is_cuda();
  const double peak = kAssumedGpuPeakFlopsPerRank * dp_ * sp_;
  const double flops_per_token = 6.0 * static_cast<double>(model_.num_parameters());
  int64_t window_tokens = 0, window_steps = 0;
  double window_seconds = 0;
  StopSignals signals;
  const double started = now_s();
  int64_t steps_here = 0;
  StepTrace trace(rank(), device_.is_cuda());
  if (trace.enabled()) log("profiler trace (CARRY_TRACE): %s\n", trace.describe().c_str());
  while (step_ < total) {
    trace.before_step(step_ + 1);
    auto s = train_step();
    trace.after_step(s.step);
    ++steps_here;
    take_comm_waits();
    // This invocation's limits. The step count is the same on every rank; the clock is not, so a rank
    // past max_minutes raises its stop flag, which the next step's loss sum carries to all ranks.
    const bool step_limit = options_.max_steps > 0 && steps_here >= options_.max_steps;
    if (options_.max_minutes > 0 && now_s() - started > 60 * options_.max_minutes) time_is_up_ = true;
    window_tokens += s.tokens, window_seconds += s.seconds, ++window_steps;
    if (s.step % log_every == 0 || s.step == total || s.step == 1) {
      const double tps = window_seconds > 0 ? window_tokens / window_seconds : 0;
      const double mfu = flops_per_token * tps / peak;
      const double rss = rss_mib();
      // Elapsed: the whole run's (earlier invocations' time included); ETA: the steps left at this
      // invocation's pace.
      const double here = now_s() - started;
      const double elapsed = begun.elapsed_s + here;
      const double eta = here / static_cast<double>(steps_here) * static_cast<double>(total - s.step);
      // GPU: the caching allocator's peak since the last line (this rank's device).
      const double gpu_peak = device_.is_cuda() ? cuda_peak_allocated_bytes(device_.index()) / (1024.0 * 1024.0) : 0;
      if (device_.is_cuda()) cuda_reset_peak_allocated(device_.index());
      // The caching allocator's cudaMallocs since the last line (the first: since the start; none once
      // the steps are steady) and its retries so far.
      const CudaAllocatorCounts alloc = device_.is_cuda() ? cuda_allocator_counts(device_.index()) : CudaAllocatorCounts{};
      const int64_t new_mallocs = alloc.mallocs - logged_mallocs_;
      logged_mallocs_ = alloc.mallocs;
      char gpu[48] = "", mfu_text[32] = "";
      if (device_.is_cuda()) std::snprintf(gpu, sizeof gpu, " | gpu peak %.0f MiB", gpu_peak);
      if (show_mfu) std::snprintf(mfu_text, sizeof mfu_text, " | MFU %.2f%%", 100 * mfu);
      log("step %6lld/%lld | loss %.4f | grad norm %.3f | lr %.3e | %.0f tok/s%s | rss %.0f MiB%s | elapsed %s | eta %s\n",
          static_cast<long long>(s.step), static_cast<long long>(total), s.loss, s.grad_norm, s.lr, tps, mfu_text,
          rss, gpu, duration_text(elapsed).c_str(), duration_text(eta).c_str());
      std::vector<std::pair<std::string, double>> fields = {
          {"elapsed_s", elapsed}, {"loss", s.loss}, {"grad_norm", s.grad_norm}, {"lr", s.lr}, {"tokens_per_s", tps}};
      if (show_mfu) fields.emplace_back("mfu", mfu);
      fields.emplace_back("rss_mib", rss);
      if (device_.is_cuda()) {
        fields.emplace_back("gpu_peak_mib", gpu_peak);
        fields.emplace_back("gpu_mallocs", static_cast<double>(new_mallocs));
        fields.emplace_back("gpu_alloc_retries", static_cast<double>(alloc.retries));
      }
      fields.emplace_back("tokens_seen", static_cast<double>(tokens_seen_));
      if (comm_timing_) {  // the mean over the ranks of the window's waits (a message at log steps only)
        auto w = at::tensor({comm_wait_s_, gradient_wait_s_}, at::kDouble).to(device_);
        groups_->world->all_reduce_sum(w);
        w = w.cpu() / groups_->world->size();
        fields.emplace_back("comm_wait_s", w[0].item<double>());
        fields.emplace_back("gradient_wait_s", w[1].item<double>());
        fields.emplace_back("window_s", window_seconds);
        comm_wait_s_ = gradient_wait_s_ = 0;
        // Every rank's own waits by kind of message over the window, the longest first, on stderr.
        std::vector<std::pair<double, std::string>> kinds;
        for (auto& [kind, w_s] : waits_by_kind_) kinds.emplace_back(w_s, kind);
        std::sort(kinds.rbegin(), kinds.rend());
        std::string text;
        for (auto& [w_s, kind] : kinds) {
          char line[64];
          std::snprintf(line, sizeof line, "\n  %6.2f%%  ", 100 * w_s / std::max(1e-9, window_seconds));
          text += line + kind;
        }
        if (!kinds.empty())
          std::fprintf(stderr, "carry: step %lld, rank %d: the stream's waits on sp messages by kind, share of %.3f s:%s\n",
                       static_cast<long long>(s.step), rank(), window_seconds, text.c_str());
        if (wait_order_ && !last_wait_sequence_.empty()) {
          // The step's waits one by one, by kind in the order each kind first came (ms).
          std::vector<std::pair<std::string, std::string>> order;
          for (auto& [kind, w_s] : last_wait_sequence_) {
            auto it = std::find_if(order.begin(), order.end(), [&](const auto& o) { return o.first == kind; });
            if (it == order.end()) it = order.insert(order.end(), {kind, ""});
            char v[24];
            std::snprintf(v, sizeof v, " %.3f", 1e3 * w_s);
            it->second += v;
          }
          std::string text;
          for (auto& [kind, values] : order) text += "\n  " + kind + ":" + values;
          std::fprintf(stderr, "carry: step %lld, rank %d: the step's waits on sp messages one by one, ms:%s\n",
                       static_cast<long long>(s.step), rank(), text.c_str());
        }
        if (host_calls_ > 0)
          std::fprintf(stderr, "carry: step %lld, rank %d: %ld sp messages enqueued (%ld by the copy engines), %.2f ms of host time (%.2f%% of %.3f s)\n",
                       static_cast<long long>(s.step), rank(), host_calls_, host_calls_by_copy_, 1e3 * host_call_s_,
                       100 * host_call_s_ / std::max(1e-9, window_seconds), window_seconds);
        waits_by_kind_.clear();
        host_calls_ = 0;
        host_calls_by_copy_ = 0;
        host_call_s_ = 0;
      }
      if (phase_timing_) {  // this rank's phases over the window (the first window has no "between steps")
        std::string text;
        for (auto& [phase, sec] : take_phase_seconds()) {
          char part[96];
          std::snprintf(part, sizeof part, "%s%s %.2f", text.empty() ? "" : ", ", phase.c_str(),
                        1e3 * sec / static_cast<double>(window_steps));
          text += part;
        }
        std::fprintf(stderr, "carry: step %lld, rank %d: the steps' phases on the %s, ms a step over %lld steps: %s\n",
                     static_cast<long long>(s.step), rank(), device_.is_cuda() ? "GPU" : "CPU",
                     static_cast<long long>(window_steps), text.c_str());
      }
      metrics.record(s.step, wall_clock_s(), fields);
      window_tokens = 0, window_seconds = 0, window_steps = 0;
    }
    if (options_.on_step) options_.on_step(s);
    // The evaluation of this step comes before a stop: an invocation cut by --max-steps, --max-minutes or
    // a signal at an eval step still evaluates it (its resumed run starts at the next step).
    if (eval_every > 0 && (s.step % eval_every == 0 || s.step == total)) {
      auto e = evaluate();
      if (config_.data().has_token_files()) {
        // Language data: the mean next-token loss, its perplexity and the top-1 accuracy.
        log("eval step %lld | loss %.4f | perplexity %.2f | next-token accuracy %.4f | %lld tokens\n",
            static_cast<long long>(s.step), e.loss, std::exp(e.loss), e.accuracy, static_cast<long long>(e.positions));
        metrics.record(s.step, wall_clock_s(),
                       {{"eval_loss", e.loss}, {"eval_perplexity", std::exp(e.loss)}, {"eval_accuracy", e.accuracy}});
      } else {
        log("eval step %lld | loss %.4f | accuracy %.4f | sequences all right %.4f | %lld positions\n",
            static_cast<long long>(s.step), e.loss, e.accuracy, e.sequence_accuracy,
            static_cast<long long>(e.positions));
        metrics.record(s.step, wall_clock_s(),
                       {{"eval_loss", e.loss}, {"eval_accuracy", e.accuracy},
                        {"eval_sequence_accuracy", e.sequence_accuracy}});
      }
    }
    if ((s.stop_requested || step_limit) && s.step < total) {  // (at the last step: the normal end)
      save_checkpoint();
      const auto& ck = config_.checkpoint();
      const bool saved = ck.has_dir() && !ck.dir().empty();
      const std::string why = step_limit ? "after the " + std::to_string(options_.max_steps) + " steps of --max-steps"
                                         : "on a stop signal (SIGTERM, SIGINT or SIGUSR1) or --max-minutes";
      log("stopped at step %lld/%lld %s: %s\n", static_cast<long long>(s.step), static_cast<long long>(total),
          why.c_str(), saved ? ("checkpoint written to " + ck.dir() + "; run the same command again to continue").c_str()
                             : "no checkpoint.dir, so this run's progress is not saved");
      time_is_up_ = false;
      return kExitStoppedBySignal;
    }
    if (ckpt_every > 0 && s.step % ckpt_every == 0 && s.step != total) save_checkpoint();
  }
  save_checkpoint();
  return 0;
}

}  // namespace carry
