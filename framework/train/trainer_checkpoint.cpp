// Checkpoints of a training run (see trainer.h): saving, checking a checkpoint's config against the
// run's, applying one, starting or resuming a run, weights to start from, and the checks of where a
// run writes.
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

void Trainer::save_checkpoint() {
  const auto& ck = config_.checkpoint();
  if (!ck.has_dir() || ck.dir().empty()) return;
  // Every rank's moments from the rank that holds them, to rank 0 (in host memory): it writes them all.
  std::vector<std::pair<std::string, at::Tensor>> moments;
  if (sharded_) moments = sharded_->whole_optimizer_state();
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
    TORCH_INTERNAL_ASSERT(!sharded_ || !moments.empty(), "trainer: world rank 0 did not receive the gathered "
                          "optimizer moments (it is not rank 0 of the ranks they are split over)");
    d.optimizer = sharded_ ? std::move(moments) : optimizer_->state();
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
  for (const char* field : {"name", "precision", "fused_ops", "optimizer.total_steps", "data.eval_batches", "data.batch_size",
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
  std::vector<std::pair<std::string, at::Tensor>> whole_moments;  // rank 0, a split update: the checkpoint's
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
        if (sharded_) whole_moments = loaded->optimizer;  // each rank keeps its piece of them (below)
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
    std::vector<std::pair<std::string, at::Tensor>> state;
    if (sharded_) {
      // Each rank holds only its piece's moments: the checkpoint's whole moments travel from rank 0 and
      // every rank keeps its piece of them.
      std::map<std::string, at::Tensor> from(whole_moments.begin(), whole_moments.end());
      for (const char* prefix : {"exp_avg.", "exp_avg_sq."})
        for (auto& [name, p] : model_.parameters()) {
          const std::string key = prefix + name;
          auto it = from.find(key);
          state.emplace_back(key, rank() == 0 && it != from.end() ? it->second.to(p.options()).contiguous()
                                                                  : at::zeros(p.sizes(), p.options()));
        }
    } else {
      state = optimizer_->state();
    }
    for (auto& [name, t] : state) groups_->world->broadcast(t, 0);
    // The step count on every rank; the values where this rank holds them (without a split update, rank
    // 0's are in place already).
    if (sharded_ || rank() != 0) optimizer_->load_state(state, step);
  }
  step_ = step;
  tokens_seen_ = tokens;
  return true;
}

void Trainer::check_checkpoint_dir() const {
  const auto& ck = config_.checkpoint();
  // Room for one more checkpoint (the previous ones are deleted only after it is complete).
  double bytes = 1 << 20;
  // The parameters and AdamW's two moments a parameter, in the parameters' dtype.
  for (auto& [name, p] : model_.parameters()) bytes += 3.0 * static_cast<double>(p.nbytes());
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

}  // namespace carry
