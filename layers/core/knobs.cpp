// The registry of environment variables (see knobs.h).
#include "layers/core/knobs.h"

#include <c10/util/Exception.h>

#include <cstdlib>

namespace carry {

namespace {
using A = KnobAudience;
}  // namespace

const std::vector<Knob>& knobs() {
  static const std::vector<Knob> all = {
      // user
      {"CARRY_COMM_TIMEOUT_S", "300", A::user, "seconds a communicator operation may take before the run stops naming it"},
      {"CARRY_CPU_MATH", "pinned", A::user, "native: leave MKL's and ATen's CPU code paths to the machine (the bitwise promises need them pinned)"},
      {"MKL_CBWR", "COMPATIBLE", A::user, "set by carry at start-up (a value in the environment is replaced) unless CARRY_CPU_MATH=native"},
      {"ATEN_CPU_CAPABILITY", "avx2", A::user, "set by carry at start-up unless CARRY_CPU_MATH=native; a value you set is kept"},
      {"CARRY_SENTENCEPIECE_LIB", "beside the binary", A::user, "path of libcarry_sentencepiece.so, through which carry tokenize reads SentencePiece models"},
      {"CARRY_NCCL_POLL", "yield", A::user, "how a rank waits for NCCL to finish enqueuing: yield the core, or sleep 20 us between polls"},
      // diagnostics
      {"CARRY_TRACE", "off", A::diagnostics, "a directory: record CARRY_TRACE_STEPS with PyTorch's profiler into DIR/trace_rank<r>.json"},
      {"CARRY_TRACE_STEPS", "3:4", A::diagnostics, "A:B or A: the steps (1-based, inclusive) CARRY_TRACE records"},
      {"CARRY_TRACE_CPU", "off", A::diagnostics, "1: the trace records ATen's host calls on GPUs too"},
      {"CARRY_SYNC_DEBUG", "off", A::diagnostics, "error: any synchronizing CUDA call inside a training step raises, except the sanctioned ones"},
      {"CARRY_CHECK_VALUES", "off", A::diagnostics, "1: check every mixer input's values and every batch's token ids (reads tensors back: slow)"},
      {"CARRY_GDN_TIMELINE", "off", A::diagnostics, "1: the delta rule's kernels print a [timeline] line a piece launch (read by tools/gdn_timeline.py)"},
      // mpi
      {"OMPI_COMM_WORLD_RANK", "set by mpirun", A::mpi, "before MPI starts, config errors print on rank 0 only"},
      {"PMI_RANK", "set by mpirun", A::mpi, "as OMPI_COMM_WORLD_RANK, for other MPI launchers"},
      {"PMIX_RANK", "set by srun --mpi=pmix", A::mpi, "as OMPI_COMM_WORLD_RANK: MPI's world, started by a PMIx launcher"},
      {"RANK", "set by torchrun", A::mpi, "without MPI's variables: this process's rank (torchrun); the ranks meet through a TCP store"},
      {"WORLD_SIZE", "set by torchrun", A::mpi, "with RANK: the number of ranks"},
      {"LOCAL_RANK", "set by torchrun", A::mpi, "with RANK: the rank on this host, which picks the GPU"},
      {"LOCAL_WORLD_SIZE", "set by torchrun", A::mpi, "with RANK: the ranks on this host"},
      {"MASTER_ADDR", "set by torchrun", A::mpi, "without MPI: rank 0's host, where its TCP store listens (srun: default the job's first host)"},
      {"MASTER_PORT", "set by torchrun", A::mpi, "without MPI: the TCP store's port (srun: default 29500 + SLURM_JOB_ID % 10000)"},
      {"SLURM_PROCID", "set by srun", A::mpi, "without MPI's and torchrun's variables: this process's rank"},
      {"SLURM_NTASKS", "set by srun", A::mpi, "with SLURM_PROCID: the number of ranks"},
      {"SLURM_LOCALID", "set by srun", A::mpi, "with SLURM_PROCID: the rank on this host, which picks the GPU"},
      {"SLURM_NTASKS_PER_NODE", "set by sbatch", A::mpi, "with SLURM_PROCID: the ranks on a host"},
      {"SLURM_STEP_TASKS_PER_NODE", "set by srun", A::mpi, "as SLURM_NTASKS_PER_NODE when that is unset"},
      {"SLURM_STEP_NODELIST", "set by srun", A::mpi, "the step's hosts: the first is MASTER_ADDR's default"},
      {"SLURM_JOB_NODELIST", "set by sbatch", A::mpi, "as SLURM_STEP_NODELIST when that is unset"},
      {"SLURM_JOB_ID", "set by sbatch", A::mpi, "MASTER_PORT's default under srun: 29500 + SLURM_JOB_ID % 10000"},
      {"LD_LIBRARY_PATH", "system", A::mpi, "when set, carry launch forwards it to the ranks"},
      {"OMPI_MCA_odls_base_sigkill_timeout", "1", A::mpi, "set by mpirun --mca odls_base_sigkill_timeout N: seconds mpirun waits before it signals, then kills, the ranks; carry train warns under a plain mpirun without it"},
      {"CARRY_LAUNCHER", "unset", A::mpi, "set by launcher/train and carry launch for the ranks: a stop signal reaches them as SIGUSR1, so carry train does not warn about odls_base_sigkill_timeout"},
      // launcher
      {"CARRY_BUILD_DIR", "build", A::launcher, "the build directory of the launcher scripts"},
      {"CARRY_JOBS", "nproc", A::launcher, "parallel build jobs (launcher/setup)"},
      {"CARRY_PYTHON", "found", A::launcher, "a python3 with torch 2.11 whose libtorch to build against instead of .venv; launcher/parity_run: the python3 that runs FLA's side"},
      {"CARRY_CUDA", "detected", A::launcher, "ON or OFF: build the CUDA kernels and NCCL backend, overriding the GPU detection"},
      {"CARRY_SKIP_SETUP", "0", A::launcher, "1: launcher/train uses the build as it is"},
      {"CARRY_MPIRUN_ARGS", "none", A::launcher, "extra arguments for launcher/train's mpirun"},
      {"NCCL_NVLS_ENABLE", "0", A::launcher, "exported to every rank by the launcher scripts: NVLink multicast stays off"},
      {"CARRY_TEST_JOBS", "nproc", A::launcher, "parallel CTest jobs (launcher/test)"},
      {"CARRY_RESUME_A", "1 1", A::launcher, "launcher/resume_check: the dp sp layout of the straight run"},
      {"CARRY_RESUME_B", "1 2", A::launcher, "launcher/resume_check: the layout of the first part"},
      {"CARRY_RESUME_C", "2 1", A::launcher, "launcher/resume_check: the layout of the resumed part"},
      {"CARRY_RESUME_STEPS", "60", A::launcher, "launcher/resume_check: the run's steps"},
      {"CARRY_RESUME_SPLIT", "30", A::launcher, "launcher/resume_check: the step it stops at"},
      {"CARRY_RESUME_TIMEOUT", "300", A::launcher, "launcher/resume_check: seconds each part may take"},
      {"CARRY_BENCH_SCAN", "1", A::launcher, "0: launcher/bench builds and tests only"},
      {"CARRY_BENCH_ROWS", "every row", A::launcher, "the rows of launcher/train_bench to run"},
      {"CARRY_BENCH_STEPS", "6", A::launcher, "launcher/train_bench: steps a row"},
      {"CARRY_BENCH_SET", "none", A::launcher, "launcher/train_bench: key=value ... added as --set to every row"},
      {"CARRY_BENCH_TAG", "none", A::launcher, "launcher/train_bench: a suffix for the rows' names and metrics files"},
      {"CARRY_BENCH_TIMEOUT", "200", A::launcher, "launcher/train_bench: seconds a row may take"},
      {"CARRY_PARITY_DEVICE", "cuda", A::launcher, "launcher/parity_run: where FLA's side runs (cpu: FLA's references, for the tests)"},
      {"CARRY_BENCH_MPIRUN_ARGS", "none", A::launcher, "launcher/train_bench: extra arguments for every row's mpirun"},
  };
  return all;
}

const Knob* find_knob(const std::string& name) {
  for (const auto& k : knobs())
    if (name == k.name) return &k;
  return nullptr;
}

const char* knob_value(const char* name) {
  TORCH_INTERNAL_ASSERT(find_knob(name) != nullptr, "the environment variable ", name,
                        " is read but not registered in layers/core/knobs.cpp");
  return std::getenv(name);
}

const char* knob_audience_name(KnobAudience a) {
  switch (a) {
    case A::user: return "user";
    case A::diagnostics: return "diagnostics";
    case A::launcher: return "launcher";
    case A::mpi: return "MPI and system";
  }
  return "?";
}

std::vector<std::pair<std::string, std::string>> knobs_set() {
  std::vector<std::pair<std::string, std::string>> set;
  for (const auto& k : knobs()) {
    if (k.audience == A::launcher || k.audience == A::mpi) continue;
    // MKL_CBWR and ATEN_CPU_CAPABILITY are set by carry itself: a run records them only with CARRY_CPU_MATH.
    if (std::string(k.name) == "MKL_CBWR" || std::string(k.name) == "ATEN_CPU_CAPABILITY") continue;
    if (const char* v = std::getenv(k.name)) set.emplace_back(k.name, v);
  }
  return set;
}

std::string knobs_set_text() {
  std::string text;
  for (const auto& [name, value] : knobs_set()) text += (text.empty() ? "" : " ") + name + "=" + value;
  return text;
}

}  // namespace carry
