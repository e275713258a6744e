// `carry mixer`, run in-process on files written by the test: for every registered family and both
// forms, its outputs and gradients (of every input and of the initial state) equal those of calling
// the mixer directly with autograd, in fp64; every usage and data error gives its message and exit code.
#include "framework/cli/mixer_command.h"
#include "framework/io/safetensors.h"
#include "tests/helpers/temp_dir.h"
#include "tests/helpers/mixer_testing.h"
#include "layers/core/device.h"

#include <torch/csrc/autograd/autograd.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

namespace carry::testing {
namespace {

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "missing '" << (part) << "' in: " << (text)

// A file in this process's temporary directory (removed at exit).
std::string temp_path(const std::string& name) {
  struct Dir {
    std::string path = make_temp_dir("carry_mixer_command");
    ~Dir() { remove_tree(path); }
  };
  static Dir dir;
  return dir.path + "/" + name;
}

// Runs `carry mixer <args>` in-process; returns the exit code, stderr in *err.
int run_command(const std::vector<std::string>& args, std::string* err = nullptr) {
  std::vector<std::string> all = {"mixer"};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  ::testing::internal::CaptureStderr();
  int rc = run_mixer_command(static_cast<int>(all.size()), argv.data());
  std::string e = ::testing::internal::GetCapturedStderr();
  if (err) *err = e;
  return rc;
}

const std::vector<std::string>& kInputs = MixerInputs::names();

struct Config {
  std::string form;
  int64_t chunk_size;
  bool normalize, with_state, with_do, with_dfinal, plain_state_name, float32_file;
  double scale;  // 0: default
};

TEST(MixerCommand, EqualsDirectCallForEveryFamily) {
  std::vector<Config> configs = {
      {"chunkwise", 16, true, true, true, true, false, false, 0.3},
      {"naive", 64, false, true, true, false, true, false, 0},
      {"chunkwise", 32, false, false, false, true, true, true, 0},
  };
  for (auto& family : mixer_names()) {
    const Mixer& m = get_mixer(family);
    for (size_t ci = 0; ci < configs.size(); ++ci) {
      const Config& c = configs[ci];
      SCOPED_TRACE(family + " config " + std::to_string(ci));
      Shape s;
      s.T = 64;
      s.offset = 64;
      MixerOptions opt;
      opt.chunk_size = c.chunk_size;
      opt.offset = s.offset;
      opt.normalize = c.normalize;
      opt.scale = c.scale;
      auto in = random_inputs(m, s, at::kDouble, 300 + ci);
      if (c.float32_file)  // the file holds fp32 values, computed in fp64 (--dtype float64)
        for (auto n : kInputs)
          if (in.get(n).defined()) in.get(n) = in.get(n).to(at::kFloat).to(at::kDouble);
      State init = c.with_state ? random_state(m, in, opt, 400 + ci) : State{};
      auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + ci);

      // The direct call, differentiated through autograd: every input and the initial state
      // (zeros when none is given) are leaves.
      MixerInputs leaf_in;
      State leaf_state;
      std::vector<Tensor> xs;
      for (auto n : kInputs)
        if (in.get(n).defined()) xs.push_back(leaf_in.get(n) = in.get(n).clone().requires_grad_(true));
      for (auto& t : c.with_state ? init : m.zero_state(in, opt))
        xs.push_back(leaf_state.emplace_back(t.clone().requires_grad_(true)));
      auto out = c.form == "naive" ? m.naive(leaf_in, leaf_state, opt)
                                   : m.chunkwise(leaf_in, leaf_state, opt);
      Tensor d_o = at::randn(out.o.sizes(), gen, out.o.options());
      State d_final;
      for (auto& t : out.final_state) d_final.push_back(at::randn(t.sizes(), gen, t.options()));
      auto loss = at::zeros({}, out.o.options());
      if (c.with_do) loss = loss + (out.o * d_o).sum();
      if (c.with_dfinal)
        for (size_t i = 0; i < d_final.size(); ++i) loss = loss + (out.final_state[i] * d_final[i]).sum();
      // Gradients come when do or a dfinal_state is given (a stateless family has no dfinal_state).
      bool grads = c.with_do || (c.with_dfinal && !d_final.empty());
      std::vector<Tensor> gs;
      if (grads) gs = torch::autograd::grad({loss}, xs, {}, false, false, true);

      // The same through the command.
      std::map<std::string, Tensor> file;
      auto names = state_entry_names(m, m.zero_state(in, opt).size());
      auto state_key = [&](const std::string& prefix, size_t i) {
        return names.size() == 1 && c.plain_state_name ? prefix : prefix + "." + names[i];
      };
      for (auto n : kInputs)
        if (in.get(n).defined()) file[n] = c.float32_file ? in.get(n).to(at::kFloat) : in.get(n);
      for (size_t i = 0; i < init.size(); ++i) file[state_key("initial_state", i)] = init[i];
      if (c.with_do) file["do"] = d_o;
      if (c.with_dfinal)
        for (size_t i = 0; i < d_final.size(); ++i) file[state_key("dfinal_state", i)] = d_final[i];
      auto input = temp_path(family + "_in.safetensors"), output = temp_path(family + "_out.safetensors");
      save_safetensors(input, file);
      std::vector<std::string> args = {"--family", family, "--input", input, "--output", output,
                                       "--form", c.form, "--chunk-size", std::to_string(c.chunk_size),
                                       "--offset", std::to_string(s.offset)};
      if (c.normalize) args.push_back("--normalize");
      if (c.scale > 0) args.insert(args.end(), {"--scale", std::to_string(c.scale)});
      if (c.float32_file) args.insert(args.end(), {"--dtype", "float64"});
      std::string err;
      ASSERT_EQ(run_command(args, &err), 0) << err;
      std::map<std::string, std::string> meta;
      auto result = load_safetensors(output, &meta);
      EXPECT_EQ(meta["family"], family);
      EXPECT_EQ(meta["form"], c.form);
      EXPECT_EQ(meta["dtype"], "float64");

      std::map<std::string, Tensor> want = {{"o", out.o.detach()}};
      for (size_t i = 0; i < names.size(); ++i) want["final_state." + names[i]] = out.final_state[i].detach();
      size_t leaf = 0;
      if (grads) {
        for (auto n : kInputs)
          if (in.get(n).defined()) want[std::string("d") + n] = gs[leaf++];
        for (size_t i = 0; i < names.size(); ++i) want["dinitial_state." + names[i]] = gs[leaf++];
      }
      double worst_out = 0, worst_grad = 0;
      for (auto& [name, w] : want) {
        ASSERT_TRUE(result.count(name)) << "the command did not write " << name;
        Tensor got = result.at(name);
        Tensor ref = w.defined() ? w : at::zeros_like(got);  // autograd: undefined = unused = zero
        EXPECT_EQ(got.scalar_type(), at::kDouble) << name;
        ASSERT_EQ(got.sizes(), ref.sizes()) << name;
        double e = rel_err(got, ref);
        double& worst = name[0] == 'd' ? worst_grad : worst_out;
        worst = std::max(worst, e);
        EXPECT_LE(e, 1e-14) << name;
        // With do every input's gradient is nonzero, so the comparison proves something (a state
        // entry may not reach o: linear attention's z without --normalize).
        if (c.with_do && name[0] == 'd' && name.rfind("dinitial_state", 0) != 0)
          EXPECT_GT(ref.abs().max().item<double>(), 0) << name << " is all zeros";
      }
      EXPECT_EQ(result.size(), want.size()) << "the command wrote tensors nobody asked for";
      std::cout << "[ errors   ] carry mixer " << family << " " << c.form << " vs direct call: outputs "
                << worst_out << " gradients " << worst_grad << "\n";
    }
  }
}

// softmax_attn's sparse patterns from the command line (--window with --global-tokens and/or --stride,
// at offsets): both forms through the command, o and the gradients of q, k, v, against the family's naive
// form called directly with autograd, in fp64; the metadata records the options; and the output differs
// from the window alone, so the flags reach the mixer.
TEST(MixerCommand, SparsePatternsEqualTheNaiveForm) {
  const Mixer& m = get_mixer("softmax_attn");
  struct Case {
    int64_t window, global_tokens, stride, offset;
  };
  const std::vector<Case> cases = {{8, 5, 0, 0}, {8, 0, 6, 3}, {12, 4, 7, 2}, {5, 9, 4, 0}};
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const Case& c = cases[ci];
    Shape s;
    s.T = 64;
    s.offset = c.offset;
    auto in = random_inputs(m, s, at::kDouble, 600 + ci);
    MixerOptions opt;
    opt.window = c.window;
    opt.global_tokens = c.global_tokens;
    opt.stride = c.stride;
    opt.offset = c.offset;
    MixerInputs leaf_in;
    std::vector<Tensor> xs;
    for (auto n : {"q", "k", "v"}) xs.push_back(leaf_in.get(n) = in.get(n).clone().requires_grad_(true));
    auto ref = m.naive(leaf_in, {}, opt);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(700 + ci);
    Tensor d_o = at::randn(ref.o.sizes(), gen, ref.o.options());
    auto gs = torch::autograd::grad({(ref.o * d_o).sum()}, xs);
    MixerOptions window_only = opt;
    window_only.global_tokens = window_only.stride = 0;
    const Tensor o_window = m.naive(in, {}, window_only).o;

    auto input = temp_path("patterns_in.safetensors"), output = temp_path("patterns_out.safetensors");
    save_safetensors(input, {{"q", in.q}, {"k", in.k}, {"v", in.v}, {"do", d_o}});
    for (const std::string form : {"chunkwise", "naive"}) {
      SCOPED_TRACE("window " + std::to_string(c.window) + " global " + std::to_string(c.global_tokens) + " stride " +
                   std::to_string(c.stride) + " offset " + std::to_string(c.offset) + " " + form);
      std::vector<std::string> args = {"--family", "softmax_attn", "--input", input, "--output", output,
                                       "--form", form, "--chunk-size", "16", "--window", std::to_string(c.window),
                                       "--offset", std::to_string(c.offset)};
      if (c.global_tokens > 0) args.insert(args.end(), {"--global-tokens", std::to_string(c.global_tokens)});
      if (c.stride > 0) args.insert(args.end(), {"--stride=" + std::to_string(c.stride)});
      std::string err;
      ASSERT_EQ(run_command(args, &err), 0) << err;
      std::map<std::string, std::string> meta;
      auto result = load_safetensors(output, &meta);
      EXPECT_EQ(meta["window"], std::to_string(c.window));
      EXPECT_EQ(meta["global_tokens"], std::to_string(c.global_tokens));
      EXPECT_EQ(meta["stride"], std::to_string(c.stride));
      std::map<std::string, Tensor> want = {{"o", ref.o.detach()}, {"dq", gs[0]}, {"dk", gs[1]}, {"dv", gs[2]}};
      ASSERT_EQ(result.size(), want.size());
      double worst_out = 0, worst_grad = 0;
      for (auto& [name, w] : want) {
        ASSERT_TRUE(result.count(name)) << "the command did not write " << name;
        const double e = rel_err(result.at(name), w);
        EXPECT_LE(e, 1e-13) << name;
        (name == "o" ? worst_out : worst_grad) = std::max(name == "o" ? worst_out : worst_grad, e);
      }
      const double from_window = rel_err(result.at("o"), o_window);
      EXPECT_GT(from_window, 1e-3) << "the patterns did not change the output";
      std::cout << "[ errors   ] carry mixer softmax_attn " << form << " window " << c.window << " global "
                << c.global_tokens << " stride " << c.stride << " offset " << c.offset
                << " vs naive: outputs " << worst_out << " gradients " << worst_grad
                << " (window alone differs by " << from_window << ")\n";
    }
  }
}

TEST(MixerCommand, WithoutGradientsWritesOutputsOnlyInTheInputDtype) {
  const Mixer& m = get_mixer("linear_attn");
  Shape s;
  s.T = 32;
  auto in = random_inputs(m, s, at::kFloat, 11);
  auto input = temp_path("fp32_in.safetensors"), output = temp_path("fp32_out.safetensors");
  save_safetensors(input, {{"q", in.q}, {"k", in.k}, {"v", in.v}});
  std::string err;
  ASSERT_EQ(run_command({"--family", "linear_attn", "--input", input, "--output", output,
                         "--chunk-size=16"}, &err), 0) << err;
  auto result = load_safetensors(output);
  ASSERT_EQ(result.size(), 3u);
  MixerOptions opt;
  opt.chunk_size = 16;
  auto direct = m.chunkwise(in, {}, opt);
  EXPECT_EQ(result.at("o").scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(result.at("o"), direct.o));
  EXPECT_TRUE(at::equal(result.at("final_state.S"), direct.final_state[0]));
  EXPECT_TRUE(at::equal(result.at("final_state.z"), direct.final_state[1]));
}

TEST(MixerCommand, HelpAndUsage) {
  ::testing::internal::CaptureStdout();
  std::string help_arg = "--help", name = "mixer";
  char* argv[] = {name.data(), help_arg.data(), nullptr};
  EXPECT_EQ(run_mixer_command(2, argv), 0);
  std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_CONTAINS(out, "usage: carry mixer --family NAME");
  EXPECT_CONTAINS(out, "linear_attn: q, k, v; optional initial state initial_state.S, initial_state.z");
  EXPECT_CONTAINS(out, "--sp-mode M       sequence parallelism over the MPI ranks");
  EXPECT_CONTAINS(out, "--global-tokens G softmax_attn:");
  EXPECT_CONTAINS(out, "--stride S        softmax_attn:");
}

// A copy of t with one value replaced.
Tensor with_value(const Tensor& t, double value) {
  Tensor c = t.clone();
  c.view({-1})[c.numel() / 2] = value;
  return c;
}

TEST(MixerCommand, ErrorsGiveMessageAndExitCode) {
  const Mixer& m = get_mixer("linear_attn");
  Shape s;
  s.B = 1, s.T = 64, s.H = 1, s.dk = 4, s.dv = 3;
  auto in = random_inputs(m, s, at::kDouble, 21);
  auto st = random_state(m, in, MixerOptions{}, 22);
  std::map<std::string, Tensor> good = {{"q", in.q}, {"k", in.k}, {"v", in.v}};
  auto input = temp_path("err_in.safetensors"), output = temp_path("err_out.safetensors");
  std::vector<std::string> base = {"--family", "linear_attn", "--input", input, "--output", output};
  auto with = [&](std::vector<std::string> extra) {
    auto a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  auto changed = [&](std::map<std::string, Tensor> edits, std::vector<std::string> drop = {}) {
    auto f = good;
    for (auto& [n, t] : edits) f[n] = t;
    for (auto& n : drop) f.erase(n);
    return f;
  };
  // softmax_attn (the sparse patterns' flags).
  std::map<std::string, Tensor> attn_file = good;
  attn_file["v"] = in.q;
  auto attn = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = {"--family", "softmax_attn", "--input", input, "--output", output};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  struct Case {
    std::string what;
    std::vector<std::string> args;
    std::map<std::string, Tensor> file;
    int rc;
    std::vector<std::string> message;
  };
  std::vector<Case> cases = {
      {"unknown flag", with({"--bogus", "1"}), good, 2, {"unknown flag '--bogus'"}},
      {"positional", with({"extra"}), good, 2, {"unexpected argument 'extra'"}},
      {"missing value", with({"--chunk-size"}), good, 2, {"--chunk-size needs a value"}},
      {"chunk size not a number", with({"--chunk-size", "abc"}), good, 2,
       {"--chunk-size needs an integer >= 1, got 'abc'"}},
      {"chunk size zero", with({"--chunk-size=0"}), good, 2, {"--chunk-size needs an integer >= 1, got '0'"}},
      {"negative window", with({"--window", "-3"}), good, 2, {"--window needs an integer >= 0, got '-3'"}},
      {"negative global tokens", with({"--global-tokens", "-1"}), good, 2,
       {"--global-tokens needs an integer >= 0, got '-1'"}},
      {"stride not a number", with({"--stride", "x"}), good, 2, {"--stride needs an integer >= 0, got 'x'"}},
      {"patterns without a window", attn({"--global-tokens", "4"}), attn_file, 2,
       {"--global-tokens 4 needs --window W > 0", "(see carry mixer --help)"}},
      {"stride without a window", attn({"--stride", "8", "--window", "0"}), attn_file, 2,
       {"--stride 8 needs --window W > 0"}},
      {"patterns for another family", with({"--window", "8", "--stride", "8"}), good, 2,
       {"--stride 8: only softmax_attn reads the sparse patterns, not linear_attn"}},
      {"patterns with the kernel form", attn({"--window", "8", "--global-tokens", "2", "--form", "kernel"}), attn_file,
       2, {"--global-tokens 2 cannot be used with --form kernel: the kernel form computes the window alone"}},
      {"bad scale", with({"--scale", "-1"}), good, 2, {"--scale needs a positive number, got '-1'"}},
      {"bad form", with({"--form", "fast"}), good, 2, {"--form must be naive, chunkwise or kernel, got 'fast'"}},
      {"bad dtype", with({"--dtype", "int8"}), good, 2, {"--dtype must be float64, float32 or bfloat16, got 'int8'"}},
      {"bad device", with({"--device", "tpu"}), good, 2, {"--device must be cpu or cuda, got 'tpu'"}},
      {"kernel on the cpu", with({"--form", "kernel", "--device", "cpu"}), good, 2,
       {"--form kernel runs on the GPU: it cannot be used with --device cpu"}},
      {"bf16 on the cpu", with({"--dtype", "bfloat16"}), good, 2, {"--dtype bfloat16 computes on the GPU: add --device cuda"}},
      {"normalize with value", with({"--normalize=yes"}), good, 2, {"--normalize takes no value"}},
      {"flag twice", with({"--family", "linear_attn"}), good, 2, {"--family given twice"}},
      {"no output", {"--family", "linear_attn", "--input", input}, good, 2, {"--output is required"}},
      {"unknown family", {"--family", "nope", "--input", input, "--output", output}, good, 2,
       {"unknown family 'nope'; known families: ", "linear_attn"}},
      {"missing input file", {"--family", "linear_attn", "--input", input + ".missing", "--output", output},
       good, 1, {input + ".missing: cannot open"}},
      {"missing tensor", base, changed({}, {"v"}), 1,
       {input, "required tensor 'v' is missing; linear_attn reads q, k, v"}},
      {"unknown tensor", base, changed({{"gk", in.q}}), 1,
       {input, "tensor 'gk' is not read by linear_attn", "reads q, k, v"}},
      {"wrong shape", base, changed({{"k", in.k.narrow(3, 0, 3)}}), 1,
       {input, "'k' must have shape [1, 64, 1, 4], got [1, 64, 1, 3]"}},
      {"wrong dtype", base, changed({{"k", in.k.to(at::kInt)}}), 1,
       {input, "tensor 'k' has dtype int32; expected a floating-point tensor"}},
      {"half q needs --dtype", base, changed({{"q", in.q.to(at::kHalf)}}), 1,
       {"'q' has dtype float16 but the mixer computes in float64 or float32; pass --dtype"}},
      {"T not a multiple of the chunk", with({"--chunk-size", "5"}), good, 1,
       {"T=64 must be a multiple of chunk_size=5"}},
      {"partial initial state", base, changed({{"initial_state.S", st[0]}}), 1,
       {"initial_state.S given but initial_state.z missing", "give all of initial_state.S, initial_state.z"}},
      {"plain initial state for a tuple", base, changed({{"initial_state", st[0]}}), 1,
       {"tensor 'initial_state' is not read by linear_attn", "name them initial_state.<entry>"}},
      {"initial state shape", base, changed({{"initial_state.S", st[0].narrow(3, 0, 2)}, {"initial_state.z", st[1]}}), 1,
       {"'initial_state.S' must have shape [1, 1, 4, 3]", "found [1, 1, 4, 2]"}},
      {"do shape", base, changed({{"do", in.v.narrow(1, 0, 8)}}), 1,
       {"'do' must have the shape of o [1, 64, 1, 3], found [1, 8, 1, 3]"}},
      {"dfinal_state shape", base, changed({{"dfinal_state.S", st[0]}, {"dfinal_state.z", st[0]}}), 1,
       {"'dfinal_state.z' must have shape [1, 1, 4]", "found [1, 1, 4, 3]"}},
      // A NaN or an infinity is refused wherever it is: in an input, the initial state or a cotangent.
      {"NaN in q", base, changed({{"q", with_value(in.q, NAN)}}), 1, {input, "'q' has NaN or infinite values"}},
      {"NaN in the initial state", base, changed({{"initial_state.S", with_value(st[0], NAN)}, {"initial_state.z", st[1]}}),
       1, {input + ": 'initial_state.S' has NaN or infinite values"}},
      {"inf in do", base, changed({{"do", with_value(in.v, INFINITY)}}), 1, {input + ": 'do' has NaN or infinite values"}},
      {"NaN in dfinal_state", base, changed({{"dfinal_state.S", st[0]}, {"dfinal_state.z", with_value(st[1], NAN)}}), 1,
       {input + ": 'dfinal_state.z' has NaN or infinite values"}},
  };
  for (auto& c : cases) {
    SCOPED_TRACE(c.what);
    save_safetensors(input, c.file);
    std::remove(output.c_str());
    std::string err;
    EXPECT_EQ(run_command(c.args, &err), c.rc) << err;
    EXPECT_EQ(err.rfind("carry mixer: ", 0), 0u) << err;
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << "one line: " << err;
    for (auto& part : c.message) EXPECT_CONTAINS(err, part);
    EXPECT_FALSE(exists(output)) << "an output was written despite the error";
  }
}

// Without a GPU, --device cuda is one clear line; with one, the kernel form from a file (bf16 q, k, v, fp32
// gates and states) matches the chunkwise form run by the same command in fp32 on the GPU, outputs,
// final state and gradients, within the kernels' bf16 tolerance.
TEST(MixerCommand, KernelFormOnTheGpuFromAFile) {
  const std::string input = temp_path("gpu_in.safetensors"), out_kernel = temp_path("gpu_kernel.safetensors"),
                    out_ref = temp_path("gpu_ref.safetensors");
  for (const std::string family : {"gated_deltanet", "scalar_decay"}) {
    SCOPED_TRACE(family);
    const Mixer& m = get_mixer(family);
    Shape s;
    s.B = 1, s.T = 256, s.H = 2, s.dk = 64, s.dv = 64;
    auto in = random_inputs(m, s, at::kFloat, 5);
    std::map<std::string, Tensor> file;
    for (const auto& n : MixerInputs::names())
      if (in.get(n).defined()) file[n] = in.get(n);
    file["do"] = at::randn_like(in.v);
    auto zero = m.zero_state(in, MixerOptions());
    const auto entries = state_entry_names(m, zero.size());
    for (size_t i = 0; i < entries.size(); ++i) {
      file["initial_state." + entries[i]] = at::randn_like(zero[i]) * 0.1;
      file["dfinal_state." + entries[i]] = at::randn_like(zero[i]);
    }
    save_safetensors(input, file);
    std::string err;
    const std::vector<std::string> common = {"--family", family, "--input", input};
    auto args = [&](std::vector<std::string> extra, const std::string& out) {
      auto a = common;
      a.insert(a.end(), {"--output", out});
      a.insert(a.end(), extra.begin(), extra.end());
      return a;
    };
    if (cuda_device_count() == 0) {
      EXPECT_EQ(run_command(args({"--form", "kernel"}, out_kernel), &err), 1) << err;
      EXPECT_CONTAINS(err, "--device cuda: ");
      EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << "one line: " << err;
      continue;
    }
    ASSERT_EQ(run_command(args({"--form", "kernel", "--dtype", "bfloat16"}, out_kernel), &err), 0) << err;
    ASSERT_EQ(run_command(args({"--device", "cuda", "--dtype", "float32"}, out_ref), &err), 0) << err;
    auto got = load_safetensors(out_kernel), ref = load_safetensors(out_ref);
    ASSERT_EQ(got.size(), ref.size());
    EXPECT_EQ(got.at("o").scalar_type(), at::kBFloat16);
    for (auto& [name, r] : ref) {
      ASSERT_TRUE(got.count(name)) << name;
      const double e = rel_err(got.at(name).to(at::kDouble), r.to(at::kDouble));
      EXPECT_LE(e, 1e-2) << name;
      std::cout << "[ errors   ] carry mixer " << family << " kernel bf16 vs chunkwise fp32: " << name << " " << e << "\n";
    }
  }
}

}  // namespace
}  // namespace carry::testing
