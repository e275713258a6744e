// `carry check` (see check_command.h).
#include "framework/cli/check_command.h"

#include "framework/cli/command_args.h"
#include "framework/cli/error_text.h"
#include "framework/cli/mixer_check.h"
#include "layers/core/device.h"

#include <chrono>
#include <cstdio>
#include <string>

namespace carry {

namespace {

struct CheckArgs {
  std::vector<std::string> families;
  int64_t timing_T = 4096;
  bool timing = true;
  bool cuda = false;
};

const char* kUsage =
    "usage: carry check [--family NAME[,NAME...]] [--timing-len T] [--no-timing] [--device cpu|cuda]\n"
    "  Checks every mixer family (or those named): chunkwise vs naive in fp64 with gradients, pieces\n"
    "  with the state passed vs the whole, summaries vs the final state; then times the chunkwise\n"
    "  form (fp32 forward+backward, B=1 H=4 dk=dv=64, chunk 64) at length T (default 4096).\n";

void parse(CommandArgs& args, CheckArgs& a) {
  for (std::string f; args.next(f);) {
    if (f == "--family") {
      for (auto& n : args.list(f)) a.families.push_back(n);
    } else if (f == "--timing-len") {
      a.timing_T = args.integer(f, 1);
      if (a.timing_T % 64)
        throw UsageError("--timing-len must be a positive multiple of 64, got " + std::to_string(a.timing_T));
    } else if (f == "--no-timing") {
      a.timing = false;
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
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int run_check_command(int argc, char** argv) {
  CommandArgs command_args(argc, argv);
  if (command_args.help()) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  CheckArgs args;
  try {
    parse(command_args, args);
    if (args.families.empty()) args.families = mixer_names();
    for (auto& f : args.families) get_mixer(f);  // unknown names fail here, listing the known ones
    if (args.cuda && cuda_device_count() == 0)
      throw std::invalid_argument("--device cuda: no CUDA device is available to this process");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "carry check: %s\n%s", error_text(e).c_str(), kUsage);
    return 2;
  }
  at::Device dev = args.cuda ? at::Device(at::kCUDA) : at::Device(at::kCPU);
  const double bound = 1e-10;
  Shape s{/*B=*/1, /*T=*/256, /*H=*/2, /*dk=*/16, /*dv=*/16, /*offset=*/0};
  const int64_t C = 32;
  std::printf("carry check: %zu mixer families on %s\n", args.families.size(),
              args.cuda ? cuda_device_name(0).c_str() : "cpu");
  std::printf("  errors: fp64, B=%lld T=%lld H=%lld dk=%lld dv=%lld, chunk %lld, max-norm relative; bound %.0e\n",
              (long long)s.B, (long long)s.T, (long long)s.H, (long long)s.dk, (long long)s.dv,
              (long long)C, bound);
  if (args.timing)
    std::printf("  timing: chunkwise fp32 forward+backward, B=1 T=%lld H=4 dk=dv=64, chunk 64\n",
                (long long)args.timing_T);
  std::printf("%-18s %12s %12s %12s %12s %12s %12s\n", "family", "fwd err", "grad err",
              "pieces err", "summary err", "fwd+bwd ms", "tokens/s");
  bool ok = true;
  auto t_all = std::chrono::steady_clock::now();
  for (auto& name : args.families) {
    const Mixer& m = get_mixer(name);
    MixerOptions opt;
    opt.chunk_size = C;
    try {
      auto in = random_inputs(m, s, at::kDouble, 1, dev);
      auto st = random_state(m, in, opt, 2);
      auto a = run_with_grads(m, Form::chunkwise, in, st, opt);
      auto b = run_with_grads(m, Form::naive, in, st, opt);
      double ef = max_rel_err(a.outputs, b.outputs), eg = max_rel_err(a.grads, b.grads);
      double ep = -1, es = -1;
      if (m.has_summary()) {
        // Four uneven pieces on chunk boundaries, state passed along; and their composed summary.
        int64_t cuts[] = {0, 1 * C, 3 * C, 4 * C, s.T};
        auto whole = m.forward(in, st, opt);
        State cur = st;
        std::vector<Tensor> outs;
        Summary total;
        for (int i = 0; i < 4; ++i) {
          MixerOptions po = opt;
          po.offset = cuts[i];
          auto piece = in.slice(cuts[i], cuts[i + 1] - cuts[i]);
          auto r = m.forward(piece, cur, po);
          outs.push_back(r.o);
          cur = r.final_state;
          auto sum = m.summarize(piece, po);
          total = i == 0 ? sum : m.compose(total, sum);
        }
        ep = std::max(rel_err(at::cat(outs, 1), whole.o), max_rel_err(cur, whole.final_state));
        es = max_rel_err(m.apply(total, st), whole.final_state);
      }
      double worst = std::max({ef, eg, ep, es});
      ok = ok && worst <= bound;
      std::string ms = "-", tps = "-";
      if (args.timing) {
        Shape ts{1, args.timing_T, 4, 64, 64, 0};
        MixerOptions to;
        to.chunk_size = 64;
        auto tin = random_inputs(m, ts, at::kFloat, 3, dev);
        auto once = [&] { run_with_grads(m, Form::chunkwise, tin, {}, to); };
        once();  // warm-up
        auto t0 = std::chrono::steady_clock::now();
        int reps = 0;
        do {
          once();
          ++reps;
        } while (seconds_since(t0) < 1.0 && reps < 20);
        double sec = seconds_since(t0) / reps;
        char buf[64];
        std::snprintf(buf, sizeof buf, "%.1f", sec * 1e3);
        ms = buf;
        std::snprintf(buf, sizeof buf, "%.3g", args.timing_T / sec);
        tps = buf;
      }
      auto cell = [](double e) {
        if (e < 0) return std::string("-");
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.2e", e);
        return std::string(buf);
      };
      std::printf("%-18s %12s %12s %12s %12s %12s %12s%s\n", name.c_str(), cell(ef).c_str(),
                  cell(eg).c_str(), cell(ep).c_str(), cell(es).c_str(), ms.c_str(), tps.c_str(),
                  worst <= bound ? "" : "  ABOVE BOUND");
    } catch (const c10::Error& e) {
      ok = false;
      std::printf("%-18s failed: %s\n", name.c_str(), e.what_without_backtrace());
    }
    std::fflush(stdout);
  }
  std::printf("%s: %zu families checked in %.1f s\n", ok ? "ok" : "FAILED", args.families.size(),
              seconds_since(t_all));
  return ok ? 0 : 1;
}

}  // namespace carry
