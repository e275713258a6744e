// The run loop (see trainer.h): the header, stop signals, the steps with their log lines, metrics,
// evaluation and checkpoints, and the end of a run.
#include "framework/train/trainer.h"
#include "framework/train/trainer_util.h"

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

using namespace trainer_util;

namespace {

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

// Installs on_stop_signal for SIGTERM, SIGINT, SIGHUP (a closed terminal or ssh session) and SIGUSR1
// for its lifetime, then restores the
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
  static constexpr std::array<int, 4> kSignals{SIGTERM, SIGINT, SIGHUP, SIGUSR1};
  std::array<struct sigaction, 4> previous_{};
};

}  // namespace

int trainer_util::stop_signal() { return g_stop_signal; }

std::string Trainer::data_description() const {
  const auto& d = config_.data();
  std::string source;
  if (d.has_mqar()) {
    const auto& q = d.mqar();
    source = "MQAR (" + (q.min_kv_pairs() > 0 ? std::to_string(q.min_kv_pairs()) + " to " : std::string()) +
             std::to_string(q.num_kv_pairs()) + " key-value pairs, " +
             std::to_string(q.num_queries()) + " queries)";
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
    write_whole_file(tmp, config_to_text(config_), "checkpoint.dir: the resolved config");
    TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "checkpoint.dir: cannot rename ", tmp, " to ", path,
                ": ", std::strerror(errno));
  }
  return out + "; resolved config " + path;
}

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
      // GPU: the caching allocator's peak since the last line (this rank's device); a step graph's
      // replays hold its capture's peak without allocating it again.
      int64_t peak_bytes = device_.is_cuda() ? cuda_peak_allocated_bytes(device_.index()) : 0;
      if (graph_) peak_bytes = std::max(peak_bytes, graph_->captured_peak_bytes());
      const double gpu_peak = peak_bytes / (1024.0 * 1024.0);
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
                                         : "on a stop signal (SIGTERM, SIGINT, SIGHUP or SIGUSR1) or --max-minutes";
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
