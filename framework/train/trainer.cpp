// The trainer (see trainer.h): its construction from a run config (model, optimizer, process groups,
// the sequence-parallel context, the gradient sum and the split update), the token data, phase timing
// and logging. The step is in trainer_step.cpp, checkpoints in trainer_checkpoint.cpp, the run loop in
// trainer_run.cpp.
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
  if (par.cuda_graph()) graph_ = std::make_unique<StepGraph>(device_);
  // The gradients' sum during the backward (parallel.gradient_sum): BUCKETS over NCCL (slower on two
  // NVLinked H200s: its kernels take SMs from the backward; docs/benchmarks.md); COPY_ENGINES by the
  // copy engines (two GPUs of one host), falling back to one sum after the backward where the GPUs
  // cannot map each other's memory. AFTER_BACKWARD: one sum after the backward.
  const auto overlap = par.gradient_sum();
  // With dp replicas the gradients are summed over them before the sp group's tree (segmented_forward_backward),
  // so after the backward.
  if (segments_ && segments_->per_rank() == 1 && sp_ > 1 && dp_ == 1 && groups_->sp_gradients &&
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
      sharded_ = std::make_unique<ShardedUpdate>(model_.parameters(), *optimizer_, segments_->sp(), par.gather_overlap(),
                                                 dp_ > 1 ? groups_->dp.get() : nullptr, groups_->world.get());
      update_line_ = sharded_->ranks() > sp_
                         ? "update: split over the " + std::to_string(sharded_->ranks()) + " ranks, " + std::to_string(sp_) +
                               " sp x " + std::to_string(dp_) + " dp (parallel.shard_update)"
                         : "update: split over the " + std::to_string(sp_) + " sp ranks (parallel.shard_update)";
      if (dp_ > 1 && sharded_->ranks() == sp_)
        update_line_ += "; not over dp (" + ShardedUpdate::dp_unavailable(groups_->dp.get(), groups_->world.get()) + ")";
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
  std::string where = "There is no checkpoint.dir; ";
  if (ck.has_dir() && !ck.dir().empty()) {
    const std::vector<int64_t> steps = list_checkpoint_steps(ck.dir());
    where = steps.empty() ? "checkpoint.dir " + ck.dir() + " holds no checkpoint yet; "
                          : "The newest checkpoint is " + ck.dir() + "/" + checkpoint_dir_name(steps.back()) +
                                " (step " + std::to_string(steps.back()) + "); ";
  }
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

}  // namespace carry
