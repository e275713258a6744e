// `carry scan-bench` (see scan_bench_command.h). Inputs are generated identically on every rank from
// one seed (on the CPU, then moved), so each rank can run the serial reference itself and compare its
// own slice; errors and flags are then reduced over ranks. "bf16" inputs are rounded to bf16 and the
// mixer computes in fp32 (fp32 states), as training does with bf16 activations.
#include "framework/cli/scan_bench_command.h"

#include "framework/cli/command_args.h"
#include "framework/cli/mixer_check.h"
#include "layers/core/device.h"
#include "parallel/process_group.h"
#include "parallel/state_scan.h"

#include <c10/core/InferenceMode.h>

#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

namespace carry {

namespace {

const char* kUsage =
    "usage: carry scan-bench [--family gla,gated_deltanet] [--modes ordered,tree,allgather]\n"
    "                        [--seq-len 131072] [--heads 16] [--head-dim 128] [--chunk-size 64]\n"
    "                        [--dtype bf16|float32|float64] [--device cuda|cpu] [--reps 3]\n"
    "                        [--head-groups 1,4]  (ordered mode: pipelined over this many head groups)\n"
    "  Run under mpirun, one rank a GPU. Prints, per family and mode, the max relative error of the\n"
    "  sequence-parallel forward against the serial run, bitwise equality, and times.\n";

struct Args {
  std::vector<std::string> families{"gla", "gated_deltanet"};
  std::vector<std::string> modes{"ordered", "tree", "allgather"};
  int64_t T = 131072, H = 16, D = 128, C = 64;
  std::string dtype = "bf16";
  bool cuda = true;
  int reps = 3;
  std::vector<int64_t> head_groups{1, 4};  // ordered mode only
};

Args parse(CommandArgs& args) {
  Args a;
  a.cuda = cuda_device_count() > 0;
  for (std::string f; args.next(f);) {
    if (f == "--family") a.families = args.list(f);
    else if (f == "--modes") a.modes = args.list(f);
    else if (f == "--seq-len") a.T = args.integer(f, 1);
    else if (f == "--heads") a.H = args.integer(f, 1);
    else if (f == "--head-dim") a.D = args.integer(f, 1);
    else if (f == "--chunk-size") a.C = args.integer(f, 1);
    else if (f == "--head-groups") a.head_groups = args.integers(f, 1);
    else if (f == "--reps") a.reps = static_cast<int>(args.integer(f, 1));
    else if (f == "--dtype") {
      a.dtype = args.value(f);
      if (a.dtype != "bf16" && a.dtype != "float32" && a.dtype != "float64")
        throw UsageError("--dtype expects bf16, float32 or float64, got '" + a.dtype + "'");
    } else if (f == "--device") {
      auto v = args.value(f);
      if (v != "cpu" && v != "cuda") throw UsageError("--device expects cpu or cuda, got '" + v + "'");
      a.cuda = v == "cuda";
    } else if (f.rfind("-", 0) == 0) {
      throw UsageError("unknown flag '" + f + "'");
    } else {
      throw UsageError("unexpected argument '" + f + "'");
    }
  }
  for (auto& m : a.modes) parallel::parse_scan_mode(m);
  for (auto& f : a.families) {
    const Mixer& m = get_mixer(f);
    if (!m.has_summary()) throw std::invalid_argument(f + " has no state summary to scan");
  }
  return a;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Waits for the device work behind `t` (a host copy of one element).
void sync(const Tensor& t) { (void)t.flatten()[0].item<double>(); }

MixerInputs to_device(const MixerInputs& in, at::Device dev, bool round_bf16, at::ScalarType compute) {
  MixerInputs out;
  for (const auto& n : MixerInputs::names()) {
    const Tensor& t = in.get(n);
    if (!t.defined()) continue;
    auto x = round_bf16 ? t.to(at::kBFloat16) : t;
    out.get(n) = x.to(dev).to(compute);
  }
  return out;
}

int run_bench(const Args& args);

}  // namespace

int run_scan_bench_command(int argc, char** argv) {
  CommandArgs command_args(argc, argv);
  if (command_args.help()) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  Args args;
  try {
    args = parse(command_args);
    if (args.cuda && cuda_device_count() == 0)
      throw std::invalid_argument("--device cuda: no CUDA device is available");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "carry scan-bench: %s\n%s", e.what(), kUsage);
    return 2;
  }
  int rc = run_bench(args);
  parallel::finalize_mpi();
  return rc;
}

namespace {
int run_bench(const Args& args) {
  const auto& world = parallel::world_info();
  int P = world.size;
  auto groups = parallel::make_process_groups({1, P}, args.cuda ? parallel::Backend::nccl
                                                                : parallel::Backend::mpi);
  auto& sp = *groups.sp;
  at::Device dev = args.cuda ? at::Device(at::kCUDA, world.local_rank % cuda_device_count())
                             : at::Device(at::kCPU);
  at::ScalarType compute = args.dtype == "float64" ? at::kDouble : at::kFloat;
  bool rank0 = world.rank == 0;
  if (rank0) {
    std::printf("carry scan-bench: %d rank(s), backend %s, %s; T=%lld H=%lld dk=dv=%lld chunk %lld, "
                "inputs %s, compute/states %s\n",
                P, sp.backend().c_str(), args.cuda ? cuda_device_name(dev.index()).c_str() : "cpu",
                (long long)args.T, (long long)args.H, (long long)args.D, (long long)args.C,
                args.dtype.c_str(), compute == at::kDouble ? "float64" : "float32");
    std::printf("%-16s %-12s %12s %8s %12s %11s %11s %12s %9s\n", "family", "mode", "max rel err",
                "bitwise", "S_in effect", "serial ms", "sp fwd ms", "local fwd ms", "extra ms");
    std::fflush(stdout);
  }
  c10::InferenceMode no_grad;
  for (auto& family : args.families) {
    const Mixer& m = get_mixer(family);
    Shape shape{1, args.T, args.H, args.D, args.D, 0};
    auto host = random_inputs(m, shape, at::kFloat, 1234);
    // Long memories: scale each head's (and key dimension's) log decay by 10^(−4u), u uniform in
    // [0, 1), so half-lives run from about 14 to about 140k tokens and the state entering a slice of
    // 32k+ tokens still shapes its outputs (with decays near 0.95 alone it would be forgotten).
    auto gen = at::make_generator<at::CPUGeneratorImpl>(99);
    for (const char* n : {"g", "gk"}) {
      Tensor& gate = host.get(n);
      if (!gate.defined()) continue;
      auto shape_hd = gate.sizes().slice(2).vec();
      gate = gate * at::pow(10.0, -4.0 * at::rand(shape_hd, gen, gate.options()));
    }
    auto whole = to_device(host, dev, args.dtype == "bf16", compute);
    MixerOptions opt;
    opt.chunk_size = args.C;
    auto slice = parallel::sp_slice(whole, sp.rank(), P, args.C);
    int64_t n = args.T / P;
    // The 1-rank reference, on every rank (each compares its own slice), and its time.
    double t0 = now_s();
    auto serial = m.forward(whole, {}, opt);
    sync(serial.o);
    double serial_ms = (now_s() - t0) * 1e3;
    auto ref = serial.o.narrow(1, sp.rank() * n, n);
    // The local forward of one slice from the zero state: the work every mode does at least once.
    MixerOptions lo = opt;
    lo.offset = sp.rank() * n;
    double local_ms = 1e30;
    MixerOutput local;
    for (int r = 0; r < args.reps; ++r) {
      t0 = now_s();
      local = m.forward(slice, {}, lo);
      sync(local.o);
      local_ms = std::min(local_ms, (now_s() - t0) * 1e3);
    }
    // How much the incoming state matters: the local run from zero against the reference (0 on rank 0).
    double effect = rel_err(local.o.to(at::kDouble), ref.to(at::kDouble));
    std::vector<std::pair<std::string, int64_t>> runs;  // (mode, head groups)
    for (auto& mode_name : args.modes) {
      if (mode_name == "ordered")
        for (auto g : args.head_groups) runs.push_back({mode_name, g});
      else
        runs.push_back({mode_name, 1});
    }
    for (auto& [mode_name, head_groups] : runs) {
      auto mode = parallel::parse_scan_mode(mode_name);
      MixerOutput out;
      double sp_ms = 1e30;
      for (int r = 0; r < args.reps; ++r) {
        sp.barrier();
        t0 = now_s();
        out = parallel::sp_mixer_forward(m, sp, slice, {}, opt, mode, static_cast<int>(head_groups));
        sync(out.o);
        sp.barrier();
        sp_ms = std::min(sp_ms, (now_s() - t0) * 1e3);
      }
      auto stats = at::tensor({rel_err(out.o.to(at::kDouble), ref.to(at::kDouble)),
                               at::equal(out.o, ref) ? 0.0 : 1.0, local_ms, effect},
                              at::TensorOptions().dtype(at::kDouble));
      auto all = groups.world->all_gather(stats.to(sp.device()));
      double err = 0, unequal = 0, local_max = 0, effect_max = 0;
      for (auto& s : all) {
        auto c = s.cpu();
        err = std::max(err, c[0].item<double>());
        unequal += c[1].item<double>();
        local_max = std::max(local_max, c[2].item<double>());
        effect_max = std::max(effect_max, c[3].item<double>());
      }
      if (rank0) {
        std::printf("%-16s %-12s %12.3e %8s %12.3e %11.1f %11.1f %12.1f %9.1f\n", family.c_str(),
                    (mode_name == "ordered" ? "ordered/G=" + std::to_string(head_groups) : mode_name).c_str(), err, unequal == 0 ? "yes" : "no", effect_max, serial_ms,
                    sp_ms, local_max, sp_ms - local_max);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
}  // namespace

}  // namespace carry
