// `carry train` (see train_command.h): argument parsing, MPI start, process groups, Trainer::run.
#include "framework/cli/train_command.h"
#include "layers/core/knobs.h"

#include "framework/cli/command_args.h"
#include "framework/cli/error_text.h"
#include "framework/config/config.h"
#include "framework/printable.h"
#include "framework/train/memory_estimate.h"
#include "framework/train/trainer.h"
#include "layers/core/device.h"
#include "parallel/process_group.h"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace carry {

namespace {

const char* kUsage =
    "usage: carry train RUN.textproto [--set field.path=value ...] [--max-steps N] [--max-minutes M]\n"
    "                   [--allow-config-change] [--print-world-size] [--print-config] [--dry-run]\n"
    "  Trains the model of a run config on dp x sp ranks (start them with mpirun -np dp*sp, or use\n"
    "  launcher/train RUN.textproto, which does). --set overrides config fields (repeatable), e.g.\n"
    "  --set optimizer.lr=1e-3 --set parallel.sp=2. --print-world-size prints dp*sp and exits;\n"
    "  --print-config prints the resolved config (textproto) and exits. --dry-run prints the model and the\n"
    "  memory one rank needs (parameters, gradients, optimizer state, activations per layer with and\n"
    "  without recomputation; measured on this CPU) and exits. --max-steps N / --max-minutes M\n"
    "  end this invocation after N steps / the first step past M minutes with a checkpoint and exit\n"
    "  status 75, as SIGTERM, SIGINT, SIGHUP or SIGUSR1 do; the same command continues the run.\n"
    "  A run resumes from checkpoint.dir as checkpoint.resume says (AUTO, REQUIRED, NEVER); a checkpoint\n"
    "  whose config differs in the seed, model, data, optimizer or global batch is refused, listing the\n"
    "  differences, unless --allow-config-change is given.\n";

}  // namespace

std::string gpu_rank_layout_error(const std::string& host, int ranks_on_host, int gpus_on_host) {
  if (ranks_on_host <= gpus_on_host) return "";
  return "host " + host + " runs " + std::to_string(ranks_on_host) + " ranks but has " +
         std::to_string(gpus_on_host) + " GPU" + (gpus_on_host == 1 ? "" : "s") +
         ": carry gives each rank its own GPU. Start at most " + std::to_string(gpus_on_host) +
         " ranks on it (launcher/launch places ranks by the GPU counts of a cluster config), lower "
         "parallel.dp * parallel.sp, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on the CPU";
}

std::string mpirun_stop_warning(const char* launcher, const char* omp_rank, const char* sigkill_timeout) {
  if (launcher || !omp_rank) return "";  // a carry launcher forwards stops as SIGUSR1; or not Open MPI's mpirun
  if (sigkill_timeout) {
    char* end = nullptr;
    const long seconds = std::strtol(sigkill_timeout, &end, 10);
    if (end != sigkill_timeout && *end == 0 && seconds >= kMinSigkillTimeoutS) return "";
  }
  return std::string("carry train: warning: mpirun runs with odls_base_sigkill_timeout ") +
         (sigkill_timeout ? printable(sigkill_timeout, false) : std::string("1 (the default)")) +
         ": a SIGTERM or SIGINT to mpirun kills the ranks before they can write a checkpoint. Stop this run with "
         "SIGUSR1 to mpirun, start it with launcher/train or carry launch, or give mpirun --mca "
         "odls_base_sigkill_timeout 300 (at least " + std::to_string(kMinSigkillTimeoutS) +
         "; see docs/reliability.md)";
}

int run_train_command(int argc, char** argv) {
  std::string path;
  std::vector<std::string> overrides;
  bool print_world_size = false, print_config = false, dry_run = false;
  TrainerOptions limits;
  CommandArgs args(argc, argv);
  if (args.help()) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  try {
    for (std::string a; args.next(a);) {
      if (a == "--set") overrides.push_back(args.value(a));
      else if (a == "--print-world-size") print_world_size = true;
      else if (a == "--print-config") print_config = true;
      else if (a == "--allow-config-change") limits.allow_config_change = true;
      else if (a == "--dry-run") dry_run = true;
      else if (a == "--max-steps") limits.max_steps = args.integer(a, 1);
      else if (a == "--max-minutes") limits.max_minutes = args.positive_number(a);
      else if (a.rfind("-", 0) == 0) throw UsageError("unknown flag '" + a + "'");
      else if (path.empty()) path = a;
      else throw UsageError("one run config expected, got '" + path + "' and '" + a + "'");
    }
    if (path.empty()) throw UsageError("a run config RUN.textproto is needed");
  } catch (const UsageError& e) {
    std::fprintf(stderr, "carry train: %s\n%s", e.what(), kUsage);
    return 2;
  }
  RunConfig config;
  try {
    config = load_run_config(path, overrides);
  } catch (const std::exception& e) {
    // Before MPI starts: every rank has the same error; the rank mpirun numbers 0 (or a lone
    // process) says it.
    const char* launched_rank = knob_value("OMPI_COMM_WORLD_RANK");
    if (!launched_rank) launched_rank = knob_value("PMI_RANK");
    if (!launched_rank) launched_rank = knob_value("RANK");  // torchrun
    if (!launched_rank) launched_rank = knob_value("SLURM_PROCID");  // srun
    if (!launched_rank || std::string(launched_rank) == "0") std::fprintf(stderr, "carry train: %s\n", error_text(e).c_str());
    return 1;
  }
  if (print_config) {
    std::fputs(config_to_text(config).c_str(), stdout);
    return 0;
  }
  if (dry_run) {
    try {
      auto estimate = estimate_memory(config, stderr);
      std::fputs(memory_report(estimate, config).c_str(), stdout);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "carry train --dry-run: %s\n", error_text(e).c_str());
      return 1;
    }
    return 0;
  }
  if (print_world_size) {
    std::printf("%lld\n", static_cast<long long>(config.parallel().dp() * config.parallel().sp()));
    return 0;
  }
  int rc = 1;
  try {
    parallel::init_mpi(&argc, &argv);
    validate_layout(config, parallel::world_info().size);
  } catch (const std::exception& e) {
    // The same on every rank: rank 0 says it.
    if (parallel::world_info().rank == 0) std::fprintf(stderr, "carry train: %s\n", error_text(e).c_str());
    parallel::finalize_mpi();
    return 1;
  }
  if (parallel::world_info().rank == 0) {
    const std::string warning = mpirun_stop_warning(knob_value("CARRY_LAUNCHER"), knob_value("OMPI_COMM_WORLD_RANK"),
                                                    knob_value("OMPI_MCA_odls_base_sigkill_timeout"));
    if (!warning.empty()) std::fprintf(stderr, "%s\n", warning.c_str());
  }
  const bool gpu = cuda_device_count() > 0 && parallel::nccl_available();
  {
    // One GPU a rank: a host that runs more ranks than it has GPUs is refused on every rank (the
    // decision is all-reduced; that host's first rank says why).
    const auto& w = parallel::world_info();
    std::string why = gpu ? gpu_rank_layout_error(w.host, w.local_size, cuda_device_count()) : "";
    int bad = why.empty() ? 0 : 1;
    const int any = parallel::world_max(bad);
    if (any) {
      if (bad && w.local_rank == 0) std::fprintf(stderr, "carry train: %s\n", why.c_str());
      parallel::finalize_mpi();
      return 1;
    }
  }
  try {
    parallel::CommOptions opt;
    opt.copy_engine_neighbours = config.parallel().sp_messages() == config::ParallelConfig::COPY;  // sp group only
    auto groups = std::make_shared<parallel::ProcessGroups>(parallel::make_process_groups(
        {static_cast<int>(config.parallel().dp()), static_cast<int>(config.parallel().sp())},
        gpu ? parallel::Backend::nccl : parallel::Backend::mpi, opt));
    TrainerOptions topt = limits;
    topt.force_cpu = !gpu;
    Trainer trainer(config, groups, topt);
    rc = trainer.run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "carry train (rank %d): %s\n", parallel::world_info().rank, error_text(e).c_str());
    std::fflush(stderr);
    // The other ranks may be waiting for this one in a collective: stop the whole job.
    if (parallel::world_info().size > 1) parallel::abort_world(1);
    rc = 1;
  }
  parallel::finalize_mpi();
  return rc;
}

}  // namespace carry
