// `carry bench kernels` (see bench_command.h).
//
// Floors counted per token and head (bf16 inputs, fp32 gates, C = 64 the chunk):
//   bytes, forward: read q, k (2·dk each), v (2·dv), the gate (4 for a scalar, 4·dk for GLA, plus
//     2 for beta), write o (2·dv); forward+backward: the forward's reads twice, o and d_o, and the
//     gradients written (the same sizes as the inputs). States and intra-chunk matrices saved by the
//     forward are not counted (a kernel that recomputed them would not write them).
//   FLOPs, forward: the chunk form's products, 2·C·(dk + dv) (intra-chunk QKᵀ and PV) plus
//     4·dk·dv (the state's product with q and its update); the delta rule adds its WY preparation,
//     2·C·(dk + dk + dv). Forward+backward counts three forwards.
//   softmax attention (sliding window w, --window): the same bytes without gates; FLOPs, forward,
//     2·(dk + dv) a visible (query, key) pair (QKᵀ and PV), min(t+1, w) pairs for query t; forward+
//     backward counts 3.5 forwards (FlashAttention's convention: the backward's five products).
#include "framework/cli/bench_command.h"

#include "framework/cli/command_args.h"
#include "framework/io/checkpoint.h"
#include "layers/core/device.h"
#include "layers/kernel_schedule.h"
#include "layers/mixer.h"

#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace carry {
namespace {

const char* kUsage =
    "usage: carry bench kernels [--families gla,scalar_decay,linear_attn,deltanet,gated_deltanet,softmax_attn]\n"
    "                           (also hla2, ahla, loglinear_mamba2, loglinear_gdn, mamba1)\n"
    "                           [--T 16384,65536] [--heads 16] [--dk 128] [--dv 128] [--window 2048] [--reps 20]\n"
    "                           [--timer events|wall] [--serial] [--pieces N [--ramp]] [--delta-segments N]\n"
    "                           [--decay-segments N] [--decay-pieces N] [--scan-segments N] [--checksum]\n"
    "  Times the kernel forms on the GPU (bf16, B = 1): forward and forward+backward ms, tokens/s,\n"
    "  GB/s and TFLOP/s against counted floors, and the MiB one forward+backward adds at its peak above its\n"
    "  inputs and the output's gradient (saved tensors, outputs, workspaces, the inputs' gradients). Without --T/--heads/--dk/--dv it runs the issue's shapes:\n"
    "  H=16 dk=dv=128 at T = 16384, 65536, 131072; H=4 dk=128 dv=256 and H=4 dk=96 dv=192 at 32768, 131072;\n"
    "  softmax_attn (sliding window --window) at H=6 dk=dv=128, T = 32768, 131072. --serial walks every\n"
    "  state pass in order (MixerOptions::serial_states: no segments, as the ordered scan runs them).\n"
    "  --pieces N cuts the delta rule's state walks into N pieces (1: one walk; without it: automatic);\n"
    "  with --ramp the end pieces are shorter (a quarter and a half of the others, from 5 pieces).\n"
    "  --delta-segments N walks the delta rule's chunks (bf16, dk = 128) in N segments at once, each from\n"
    "  its exact incoming state (1: one walk; N must divide the chunks; without it: automatic).\n"
    "  --decay-segments N cuts the decay class's state recurrence into N segments (1: in order; without\n"
    "  it: automatic). --decay-pieces N walks the decay class's bf16 recurrence in N pieces, the output\n"
    "  and gradient kernels of each finished piece on a second stream beside the next (1: one walk;\n"
    "  without it: automatic). --scan-segments N cuts Mamba-1's selective scan into N segments (1: in\n"
    "  order; without it: automatic).\n"
    "  --timer: events (default) times each rep on the GPU as the anchors' triton.testing.do_bench does (the\n"
    "  L2 cache flushed before it, CUDA events around it, no host wait between reps); wall: the host's clock\n"
    "  from launch to a device synchronize after each rep (an older timer, kept for comparison). Both take the median.\n"
    "  --checksum prints, after each row, FNV-1a hashes of the bytes of o, of every final-state entry and\n"
    "  of the gradients of one forward+backward on the row's fixed-seed inputs: two builds or settings\n"
    "  that print the same hashes computed the same bits.\n";

struct Shape {
  int64_t H, dk, dv;
  std::vector<int64_t> Ts;
  std::vector<std::string> families;  // the families timed on this shape
};

struct Args {
  std::vector<std::string> families{"gla", "scalar_decay", "linear_attn", "deltanet", "gated_deltanet",
                                    "softmax_attn"};
  std::vector<Shape> shapes;
  int64_t window = 2048;  // softmax_attn's sliding window
  int reps = 20;
  bool wall = false;  // --timer wall: host clock with a synchronize a rep, instead of CUDA events
  bool serial = false;  // MixerOptions::serial_states
  int pieces = 0;       // the delta rule's walk pieces (KernelSchedule::delta_rule_pieces)
  bool ramp = false;    // and whether forced pieces ramp
  int delta_segments = 0;  // the delta rule's walk segments (KernelSchedule::delta_rule_segments)
  int decay_segments = 0;  // the decay class's state segments (KernelSchedule::decay_segments)
  int scan_segments = 0;   // the selective scan's segments (KernelSchedule::scan_segments)
  int decay_pieces = 0;    // the decay class's walk pieces (KernelSchedule::decay_pieces)
  bool checksum = false;   // print the hashes of one run's outputs and gradients
};

Args parse(CommandArgs& args) {
  Args a;
  Shape custom{16, 128, 128, {}};
  bool any_shape = false, kernels = false;
  for (std::string f; args.next(f);) {
    if (f == "--families") a.families = args.list(f);
    else if (f == "--T") {
      for (int64_t T : args.integers(f, 1)) custom.Ts.push_back(T);
      any_shape = true;
    }
    else if (f == "--heads") custom.H = args.integer(f, 1), any_shape = true;
    else if (f == "--dk") custom.dk = args.integer(f, 1), any_shape = true;
    else if (f == "--dv") custom.dv = args.integer(f, 1), any_shape = true;
    else if (f == "--window") a.window = args.integer(f, 1);
    else if (f == "--reps") a.reps = (int)args.integer(f, 1);
    else if (f == "--timer") {
      const std::string t = args.value(f);
      if (t != "events" && t != "wall") throw UsageError("--timer: expected events or wall, got '" + t + "'");
      a.wall = t == "wall";
    }
    else if (f == "--serial") a.serial = true;
    else if (f == "--pieces") a.pieces = (int)args.integer(f, 1);
    else if (f == "--ramp") a.ramp = true;
    else if (f == "--decay-segments") a.decay_segments = (int)args.integer(f, 1);
    else if (f == "--delta-segments") a.delta_segments = (int)args.integer(f, 1);
    else if (f == "--scan-segments") a.scan_segments = (int)args.integer(f, 1);
    else if (f == "--decay-pieces") a.decay_pieces = (int)args.integer(f, 1);
    else if (f == "--checksum") a.checksum = true;
    else if (f.rfind("-", 0) == 0) throw UsageError("unknown flag '" + f + "'");
    else if (f == "kernels" && !kernels) kernels = true;
    else throw UsageError("unexpected argument '" + f + "' (expected 'kernels' and flags)");
  }
  if (!kernels) throw UsageError("expected 'kernels'");
  if (a.ramp && a.pieces == 0)
    throw std::invalid_argument("--ramp needs --pieces N (the automatic pieces choose their own ramp)");
  for (auto& name : a.families) get_mixer(name);  // an unknown family fails here, with the list
  if (any_shape) {
    if (custom.Ts.empty()) custom.Ts = {16384};
    custom.families = a.families;
    a.shapes = {custom};
  } else {
    // The linear-attention families on the shapes, softmax attention on its own.
    std::vector<std::string> linear;
    for (auto& name : a.families)
      if (name != "softmax_attn") linear.push_back(name);
    if (!linear.empty())
      a.shapes = {{16, 128, 128, {16384, 65536, 131072}, linear}, {4, 128, 256, {32768, 131072}, linear},
                  {4, 96, 192, {32768, 131072}, linear}};
    if (linear.size() < a.families.size()) a.shapes.push_back({6, 128, 128, {32768, 131072}, {"softmax_attn"}});
  }
  return a;
}

// The median of reps timed runs of f after 3 warm-ups: GPU time between CUDA events with the L2 cache
// flushed before each run (as FLA's triton.testing.do_bench), or with wall the host's clock from launch
// to a device synchronize.
double median_ms(const std::function<void()>& f, int reps, bool wall) {
  for (int i = 0; i < 3; ++i) f();
  cuda_synchronize();
  std::vector<double> ms;
  if (!wall) ms = cuda_event_times_ms(f, reps);  // empty on a build without CUDA: the host clock then
  const bool host_clock = ms.empty();
  for (int i = 0; i < (host_clock ? reps : 0); ++i) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    cuda_synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Log-linear level weights a sequence of T tokens from position 0 needs: levels 0..bit_width(T−1) and
// the state at T (L = bit_width(T) + 1).
int64_t levels_for(int64_t T) {
  int64_t w = 0;
  for (uint64_t x = static_cast<uint64_t>(T); x; x >>= 1) ++w;
  return w + 1;
}

MixerInputs bench_inputs(const Mixer& m, int64_t T, const Shape& s) {
  auto o = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  auto rnd = [&](at::IntArrayRef shape) { return at::randn(shape, gen, at::kFloat).to(o.device()); };
  auto decay = [&](at::IntArrayRef shape) {  // half-lives from about 2 to 7·10^4 tokens
    auto u = at::rand(shape, gen, at::kFloat).to(o.device()) * (std::log(0.3) - std::log(1e-5)) + std::log(1e-5);
    return -at::exp(u);
  };
  // Rows a token (Gated DeltaProduct's k, v and beta: its default num_householder steps a token).
  auto rows = [&](const char* n) { return T * m.rows_per_token(n, MixerOptions{}); };
  MixerInputs in;
  auto heads = [&](const char* n) { return m.broadcasts_heads(n) ? int64_t{1} : s.H; };  // Mamba-1's q, k: one
  in.q = rnd({1, T, heads("q"), s.dk});
  in.k = rnd({1, rows("k"), heads("k"), s.dk});
  in.k = in.k / in.k.norm(2, -1, true);
  in.v = rnd({1, rows("v"), s.H, s.dv});
  std::vector<std::string> names = m.input_names();
  for (const auto& n : m.optional_input_names()) names.push_back(n);  // HLA's decay: timed with it
  const bool rate = std::find(names.begin(), names.end(), "decay_rate") != names.end();
  for (const auto& n : names) {
    if (n == "beta") in.beta = at::sigmoid(rnd({1, rows("beta"), s.H}));
    if (n == "g") in.g = rate ? at::softplus(rnd({1, T, s.H})) : decay({1, T, s.H});  // Mamba-1: g = Δ
    if (n == "decay_rate") in.decay_rate = -at::exp(rnd({s.H, s.dk}) * 0.5);
    if (n == "gk") in.gk = decay({1, T, s.H, s.dk});
    if (n == "l") in.l = at::softplus(rnd({1, T, s.H, levels_for(T)}));  // log-linear's level weights
  }
  for (const auto& n : MixerInputs::names())
    if (in.get(n).defined()) in.get(n) = in.get(n).to(at::kBFloat16);
  return in;
}

// FNV-1a 64 (framework/io/checkpoint.h) of the tensors' bytes, one hash a tensor, then of those hashes in
// order; undefined tensors are skipped. Equal hashes, equal bits.
uint64_t bytes_hash(const std::vector<Tensor>& ts) {
  std::vector<uint64_t> each;
  for (const Tensor& t : ts) {
    if (!t.defined()) continue;
    const Tensor c = t.detach().contiguous().cpu();
    each.push_back(fnv1a64(c.data_ptr(), c.nbytes()));
  }
  return fnv1a64(each.data(), each.size() * sizeof(uint64_t));
}

struct Floors {
  double fwd_bytes, fb_bytes, fwd_flops, fb_flops;
};

Floors floors(const Mixer& m, int64_t T, const Shape& s, int64_t window) {
  double per = 2.0 * (2 * s.dk + s.dv), gate = 0, C = 64;
  for (const auto& n : m.input_names()) {
    if (n == "g") gate += 4;
    if (n == "gk") gate += 4.0 * s.dk;
    if (n == "beta") gate += 2;
    if (n == "l") gate += 2.0 * levels_for(T);
  }
  const double out = 2.0 * s.dv, th = double(T) * s.H;
  const double fwd_bytes = th * (per + gate + out), fb_bytes = th * (2 * (per + gate) + 2 * out + per + gate);
  if (m.name() == "softmax_attn") {
    // Σ_t min(t+1, w) visible pairs a head: T·w − w(w−1)/2 when w ≤ T, T(T+1)/2 otherwise.
    const double w = double(std::min<int64_t>(window, T)), pairs = T * w - w * (w - 1) / 2;
    const double flops = 2.0 * (s.dk + s.dv) * pairs * s.H;
    return {fwd_bytes, fb_bytes, flops, 3.5 * flops};
  }
  double flops = 2 * C * (s.dk + s.dv) + 4.0 * s.dk * s.dv;
  if (m.name() == "deltanet" || m.name() == "gated_deltanet") flops += 2 * C * (2 * s.dk + s.dv);
  // HLA, per token, the products of its chunkwise form (layers/hla/hla.cpp): hla2 three C-wide products
  // on dk and on dv, two dk×dk (Q S, the S update) and five dk×dv; ahla one on dk, two on dv, four dk×dv.
  if (m.name() == "hla2") flops = 2 * (3 * C * s.dk + 3 * C * s.dv + 2.0 * s.dk * s.dk + 5.0 * s.dk * s.dv);
  if (m.name() == "ahla") flops = 2 * (C * s.dk + 2 * C * s.dv + 4.0 * s.dk * s.dv);
  // Log-linear Mamba-2: the chunk's pairs, then per level above the chunk a state read and update.
  if (m.name() == "loglinear_mamba2") flops = 2 * C * (s.dk + s.dv) + (levels_for(T) - 7) * 4.0 * s.dk * s.dv;
  return {fwd_bytes, fb_bytes, th * flops, 3 * th * flops};
}

int run(const Args& a) {
  set_kernel_schedule({a.pieces, a.ramp, a.decay_segments, a.decay_pieces, a.scan_segments, a.delta_segments});
  std::printf("carry bench kernels: %s, bf16, B = 1, median of %d (after 3 warm-ups; %s)%s\n",
              cuda_device_name(0).c_str(), a.reps,
              a.wall ? "host clock, a synchronize a rep" : "CUDA events, L2 flushed before each rep, as do_bench",
              a.serial ? ", serial state passes" : "");
  for (const Shape& s : a.shapes) {
    const bool attention = std::find(s.families.begin(), s.families.end(), "softmax_attn") != s.families.end();
    std::printf("\nH=%lld dk=%lld dv=%lld", (long long)s.H, (long long)s.dk, (long long)s.dv);
    if (attention) std::printf(" (softmax_attn: window %lld)", (long long)a.window);
    std::printf("\n");
    std::printf("%-16s %8s %10s %12s %14s %9s %9s %9s %9s\n", "family", "T", "fwd ms", "fwd+bwd ms", "tokens/s",
                "fwd GB/s", "f+b GB/s", "f+b TF/s", "f+b MiB");
    for (int64_t T : s.Ts) {
      for (const auto& name : s.families) {
        const Mixer& m = get_mixer(name);
        MixerInputs in = bench_inputs(m, T, s);
        MixerOptions opt;
        opt.form = Form::kernel;
        opt.serial_states = a.serial;
        if (name == "softmax_attn") opt.window = a.window;
        if (!m.has_kernel() || !m.kernel_supports(in, opt)) {
          std::printf("%-16s %8lld   (no kernel form for this shape)\n", name.c_str(), (long long)T);
          continue;
        }
        double fwd = median_ms([&] {
          c10::InferenceMode guard;
          m.forward(in, {}, opt);
        }, a.reps, a.wall);
        MixerInputs leaves;
        std::vector<Tensor> xs;
        for (const auto& n : MixerInputs::names())
          if (in.get(n).defined()) xs.push_back(leaves.get(n) = in.get(n).detach().requires_grad_(true));
        // from a seeded generator, so --checksum's hashes compare across runs and builds
        auto d_o = at::randn(in.v.sizes(), at::make_generator<at::CPUGeneratorImpl>(4321), at::kFloat)
                       .to(in.v.options());
        double fb = median_ms([&] {
          // Each rep starts without gradients (as the FLA anchor's grad_to_none does), so the time is
          // the op's, not that of adding into the previous rep's .grad.
          for (auto& x : xs) x.mutable_grad().reset();
          auto out = m.forward(leaves, {}, opt);
          torch::autograd::backward({out.o}, {d_o});
        }, a.reps, a.wall);
        // The memory one forward+backward adds above its inputs and d_o at its peak: saved tensors, the
        // output and final state, workspaces and the inputs' gradients (tools/fla_kernel_memory.py
        // measures FLA's ops the same way).
        for (auto& x : xs) x.mutable_grad().reset();
        cuda_synchronize();
        cuda_reset_peak_allocated(0);
        const int64_t held = cuda_peak_allocated_bytes(0);
        {
          auto out = m.forward(leaves, {}, opt);
          torch::autograd::backward({out.o}, {d_o});
          cuda_synchronize();
        }
        const double added_mib = double(cuda_peak_allocated_bytes(0) - held) / (1024.0 * 1024.0);
        for (auto& x : xs) x.mutable_grad().reset();
        Floors f = floors(m, T, s, a.window);
        std::printf("%-16s %8lld %10.3f %12.3f %14.0f %9.0f %9.0f %9.1f %9.0f\n", name.c_str(), (long long)T, fwd, fb,
                    T / (fb * 1e-3), f.fwd_bytes / (fwd * 1e-3) / 1e9, f.fb_bytes / (fb * 1e-3) / 1e9,
                    f.fb_flops / (fb * 1e-3) / 1e12, added_mib);
        if (a.checksum) {
          for (auto& x : xs) x.mutable_grad().reset();
          auto out = m.forward(leaves, {}, opt);
          torch::autograd::backward({out.o}, {d_o});
          std::vector<Tensor> grads;
          for (auto& x : xs) grads.push_back(x.grad());
          std::printf("  checksum %s T=%lld: o %016llx final state %016llx gradients %016llx\n", name.c_str(),
                      (long long)T, (unsigned long long)bytes_hash({out.o}),
                      (unsigned long long)bytes_hash(out.final_state), (unsigned long long)bytes_hash(grads));
        }
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

}  // namespace

int run_bench_command(int argc, char** argv) {
  CommandArgs args(argc, argv);
  if (args.help()) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  Args a;
  try {
    a = parse(args);
    if (cuda_device_count() == 0)
      throw std::invalid_argument("no CUDA device here (the kernel forms need a CUDA build and a GPU)");
  } catch (const c10::Error& e) {  // before std::exception, which it derives from: no backtrace
    std::fprintf(stderr, "carry bench: %s\n%s", e.what_without_backtrace(), kUsage);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "carry bench: %s\n%s", e.what(), kUsage);
    return 2;
  }
  try {
    return run(a);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "carry bench: %s\n", e.what_without_backtrace());
    return 1;
  }
}

}  // namespace carry
