// `carry mixer` (see mixer_command.h): flags -> MixerOptions, tensors by name -> MixerInputs and the
// initial state, one form, then o / final_state and, with do or dfinal_state, autograd gradients.
// With --sp-mode the chunkwise form runs sequence-parallel over the MPI ranks
// (parallel::sp_mixer_forward on each rank's slice of T, its collective backward with each rank's
// slice of do), rank 0 gathers the slices and writes the file. Every failure is agreed on by all
// ranks (one message, the same everywhere, printed by rank 0) so that no rank waits for another.
// Usage and layout errors (flags, unknown family, T not a multiple of P·chunk_size) exit 2; errors
// in files and tensors exit 1.
#include "framework/cli/mixer_command.h"

#include "framework/cli/command_args.h"
#include "framework/io/safetensors.h"
#include "framework/version.h"
#include "layers/core/device.h"
#include "layers/layout.h"
#include "layers/mixer.h"
#include "layers/mixer_grads.h"
#include "parallel/process_group.h"
#include "parallel/state_scan.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace carry {
namespace {

// Inputs that cannot be cut into the ranks' slices (T not a multiple of P·chunk_size): exit code 2.
struct LayoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// How a step ended: exit code 0 (and no message) or the exit code and the error line, without the
// "carry mixer: " prefix.
struct Outcome {
  int rc = 0;
  std::string message;
};

// Runs f, turning what it throws into an Outcome.
template <class F>
Outcome guarded(F&& f) {
  try {
    f();
    return {};
  } catch (const UsageError& e) {
    return {2, std::string(e.what()) + " (see carry mixer --help)"};
  } catch (const LayoutError& e) {
    return {2, e.what()};
  } catch (const c10::Error& e) {
    return {1, e.what_without_backtrace()};
  } catch (const std::exception& e) {
    return {1, e.what()};
  }
}

const std::vector<std::string>& kInputOrder = MixerInputs::names();


// prefix.<entry> for each entry name.
std::vector<std::string> prefixed(const std::string& prefix, const std::vector<std::string>& entries) {
  std::vector<std::string> keys;
  for (auto& e : entries) keys.push_back(prefix + "." + e);
  return keys;
}

// "q, k, v; optional g; optional initial state initial_state.S, ...; for gradients do, dfinal_state.S"
std::string what_family_reads(const Mixer& m, const std::vector<std::string>& entries) {
  std::string s = join(m.input_names());
  if (!m.optional_input_names().empty()) s += "; optional " + join(m.optional_input_names());
  if (!entries.empty()) s += "; optional initial state " + join(prefixed("initial_state", entries));
  auto grads = prefixed("dfinal_state", entries);
  grads.insert(grads.begin(), "do");
  return s + "; for gradients " + join(grads);
}

std::string usage() {
  std::ostringstream s;
  s << "usage: carry mixer --family NAME --input IN.safetensors --output OUT.safetensors [options]\n"
       "\n"
       "Runs one mixer family on tensors read by name from IN and writes OUT.\n"
       "\n"
       "  --family NAME     the mixer family (listed below)\n"
       "  --input PATH      inputs [B,T,H,D] by name: q, k, v, g, gk, beta, l, and decay_rate [H,D]\n"
       "                    (those the family reads);\n"
       "                    initial_state.<entry> (all entries, or none for the zero state; a state\n"
       "                    of one entry may be named plain initial_state); for gradients do and/or\n"
       "                    dfinal_state.<entry> (all entries): the one left out counts as zero\n"
       "  --output PATH     written: o, final_state.<entry>; with gradients also d<input> for every\n"
       "                    input read and dinitial_state.<entry>: autograd of\n"
       "                    sum(o*do) + sum(final_state*dfinal_state)\n"
       "  --form F          chunkwise (default), naive, or kernel (on the GPU: implies --device cuda)\n"
       "  --device D        cpu (default) or cuda: where the tensors live and the form runs; OUT is\n"
       "                    written from the host either way\n"
       "  --chunk-size C    chunk size of the chunkwise form (default 64)\n"
       "  --dtype D         compute dtype: float64, float32 or, with --device cuda, bfloat16: then\n"
       "                    the gates (g, gk) and every state entry are float32 and the other\n"
       "                    tensors bfloat16, as the kernels take them (default: the dtype of q)\n"
       "  --scale S         query scale, > 0 (default 1/sqrt(dk))\n"
       "  --normalize       divide by the normalizer (families that have one)\n"
       "  --window W        sliding window, >= 0 (default 0: full causal)\n"
       "  --global-tokens G softmax_attn: beside the window every token also attends to the earlier\n"
       "                    tokens at positions p < G (Longformer's global tokens; row t is at position\n"
       "                    --offset + t), >= 0 (default 0: none); needs --window > 0\n"
       "  --stride S        softmax_attn: beside the window every token also attends to the earlier\n"
       "                    tokens at positions p with p mod S = S-1 (the Sparse Transformer's\n"
       "                    summary columns), >= 0 (default 0: none); needs --window > 0. Not with\n"
       "                    --form kernel, which computes the window alone (either flag)\n"
       "  --offset P        absolute position of the first token, >= 0 (default 0)\n"
       "  --num-householder N  gated_deltaproduct: delta-rule steps a token, >= 1 (default 2); k, v\n"
       "                    and beta then have T*N rows, the steps of a token interleaved\n"
       "  --sp-mode M       sequence parallelism over the MPI ranks (run under mpirun -np P):\n"
       "                    ordered, tree or allgather (the scan of the states between ranks).\n"
       "                    Every rank reads IN and runs the chunkwise form with autograd on its\n"
       "                    slice of T (T must be a multiple of P*chunk_size; families with a state\n"
       "                    only; not with --form naive), the backward on its slice of do\n"
       "                    (dfinal_state acts on the last rank's final state); rank 0 gathers and\n"
       "                    writes OUT with the same tensors as a serial run: bitwise equal for\n"
       "                    ordered, equal up to rounding for tree and allgather. Other ranks write\n"
       "                    and print nothing; an error on any rank stops every rank with the same\n"
       "                    message, printed by rank 0. With P = 1 it still runs the scan path.\n"
       "  --help            this text\n"
       "\n"
       "Families and the tensors they read:\n";
  for (auto& name : mixer_names()) {
    const Mixer& m = get_mixer(name);
    s << "  " << name << ": " << what_family_reads(m, m.state_names()) << "\n";
  }
  s << "(a family whose state holds one entry per level names them <entry>.0, <entry>.1, ...)\n";
  return s.str();
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return "float64";
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(t);
  }
}

struct Args {
  std::string family, input, output, form = "chunkwise", device;
  std::optional<at::ScalarType> dtype;
  std::optional<parallel::ScanMode> sp_mode;
  MixerOptions opt = values_checked();
  bool help = false;

  static MixerOptions values_checked() {  // the command line reads every value: check them
    MixerOptions o;
    o.check_values = true;
    return o;
  }
};

// Whether the arguments ask for --sp-mode (looked at before parsing, so that under mpirun even a
// usage error is agreed on and printed once).
bool wants_sp(int argc, char** argv) { return CommandArgs(argc, argv).has("--sp-mode"); }

std::vector<std::string> families_with_summary() {
  std::vector<std::string> names;
  for (auto& n : mixer_names())
    if (get_mixer(n).has_summary()) names.push_back(n);
  return names;
}

// Usage errors are UsageError (exit code 2).
Args parse_args(int argc, char** argv) {
  Args a;
  std::set<std::string> seen;
  CommandArgs args(argc, argv);
  for (std::string flag; args.next(flag);) {
    if (flag == "--help" || flag == "-h") {
      a.help = true;
      continue;
    }
    if (flag.rfind("--", 0) != 0) throw UsageError("unexpected argument '" + flag + "' (flags start with --)");
    if (flag != "--normalize" && flag != "--family" && flag != "--input" && flag != "--output" &&
        flag != "--chunk-size" && flag != "--form" && flag != "--dtype" && flag != "--scale" &&
        flag != "--window" && flag != "--offset" && flag != "--sp-mode" && flag != "--device" &&
        flag != "--num-householder" && flag != "--global-tokens" && flag != "--stride")
      throw UsageError("unknown flag '" + flag + "'");
    if (!seen.insert(flag).second) throw UsageError(flag + " given twice");
    if (flag == "--normalize") a.opt.normalize = true;
    else if (flag == "--chunk-size") a.opt.chunk_size = args.integer(flag, 1);
    else if (flag == "--window") a.opt.window = args.integer(flag, 0);
    else if (flag == "--offset") a.opt.offset = args.integer(flag, 0);
    else if (flag == "--global-tokens") a.opt.global_tokens = args.integer(flag, 0);
    else if (flag == "--stride") a.opt.stride = args.integer(flag, 0);
    else if (flag == "--num-householder") a.opt.num_householder = args.integer(flag, 1);
    else if (flag == "--scale") a.opt.scale = args.positive_number(flag);
    else {
      const std::string value = args.value(flag);
      if (value.empty() && (flag == "--family" || flag == "--input" || flag == "--output"))
        throw UsageError(flag + " needs a non-empty value");
      if (flag == "--family") a.family = value;
      else if (flag == "--input") a.input = value;
      else if (flag == "--output") a.output = value;
      else if (flag == "--form") {
        if (value != "naive" && value != "chunkwise" && value != "kernel")
          throw UsageError("--form must be naive, chunkwise or kernel, got '" + value + "'");
        a.form = value;
      } else if (flag == "--dtype") {
        if (value == "float64") a.dtype = at::kDouble;
        else if (value == "float32") a.dtype = at::kFloat;
        else if (value == "bfloat16") a.dtype = at::kBFloat16;
        else throw UsageError("--dtype must be float64, float32 or bfloat16, got '" + value + "'");
      } else if (flag == "--device") {
        if (value != "cpu" && value != "cuda") throw UsageError("--device must be cpu or cuda, got '" + value + "'");
        a.device = value;
      } else if (flag == "--sp-mode") {
        if (value != "ordered" && value != "tree" && value != "allgather")
          throw UsageError("--sp-mode must be ordered, tree or allgather, got '" + value + "'");
        a.sp_mode = parallel::parse_scan_mode(value);
      }
    }
  }
  if (a.help) return a;
  const std::pair<const char*, const std::string*> required[] = {
      {"--family", &a.family}, {"--input", &a.input}, {"--output", &a.output}};
  for (auto& [flag, value] : required)
    if (value->empty()) throw UsageError(std::string(flag) + " is required");
  if (a.device.empty()) a.device = a.form == "kernel" ? "cuda" : "cpu";
  if (a.form == "kernel" && a.device != "cuda")
    throw UsageError("--form kernel runs on the GPU: it cannot be used with --device cpu");
  if (a.dtype == at::kBFloat16 && a.device != "cuda")
    throw UsageError("--dtype bfloat16 computes on the GPU: add --device cuda (the CPU forms compute in "
                     "float64 or float32)");
  if (a.sp_mode && a.device != "cpu")
    throw UsageError("--sp-mode runs the ranks on the CPU (MPI): it cannot be used with --device " + a.device);
  auto names = mixer_names();
  if (std::find(names.begin(), names.end(), a.family) == names.end())
    throw UsageError("unknown family '" + a.family + "'; known families: " + join(names));
  // The sparse patterns of softmax attention (layers/softmax_attn/softmax_attn.h).
  for (auto [flag, value] : {std::pair<const char*, int64_t>{"--global-tokens", a.opt.global_tokens},
                             std::pair<const char*, int64_t>{"--stride", a.opt.stride}}) {
    if (value == 0) continue;
    const std::string given = std::string(flag) + " " + std::to_string(value);
    if (a.family != "softmax_attn")
      throw UsageError(given + ": only softmax_attn reads the sparse patterns, not " + a.family);
    if (a.opt.window == 0)
      throw UsageError(given + " needs --window W > 0 (the pattern's keys are added to a sliding window; "
                       "with --window 0 every earlier key is attended already)");
    if (a.form == "kernel")
      throw UsageError(given + " cannot be used with --form kernel: the kernel form computes the window "
                       "alone; the chunkwise form (the default) runs the patterns on the GPU too");
  }
  if (a.sp_mode) {
    if (a.form != "chunkwise")
      throw UsageError("--form " + a.form +
                       " cannot be used with --sp-mode: sequence parallelism runs the chunkwise form");
    if (!get_mixer(a.family).has_summary())
      throw UsageError("--sp-mode: " + a.family +
                       " has no recurrent state to pass between ranks; families with one: " +
                       join(families_with_summary()));
  }
  return a;
}

// Reads the state tuple `prefix` (initial_state / dfinal_state) with these entry names from the file:
// all entries, or none (an empty State). A state of one entry may be named plain `prefix`.
State read_state(const Mixer& m, std::map<std::string, Tensor>& file, const std::string& prefix,
                 const std::vector<std::string>& entries, const std::string& path) {
  auto keys = prefixed(prefix, entries);
  if (file.count(prefix) && entries.size() == 1) {
    TORCH_CHECK(!file.count(keys[0]), path, ": both '", prefix, "' and '", keys[0],
                "' are given; give one of them");
    file[keys[0]] = file.at(prefix);
    file.erase(prefix);
  }
  std::vector<std::string> given, missing;
  for (auto& k : keys) (file.count(k) ? given : missing).push_back(k);
  if (given.empty()) return {};
  TORCH_CHECK(missing.empty(), path, ": ", join(given), " given but ", join(missing), " missing; ",
              m.name(), "'s ", prefix, " has entries ", join(entries), ": give all of ", join(keys),
              prefix == "initial_state" ? ", or none for the zero state" : ", or none");
  State s;
  for (auto& k : keys) s.push_back(file.at(k));
  return s;
}

// Every entry must have the shape of `like` (the family's state for these inputs).
void check_state_shapes(const State& s, const State& like, const std::vector<std::string>& keys,
                        const std::string& path, const std::string& what) {
  for (size_t i = 0; i < s.size(); ++i)
    TORCH_CHECK(s[i].sizes() == like[i].sizes(), path, ": '", keys[i], "' must have shape ",
                shape_str(like[i].sizes()), " (", what, "), found ", shape_str(s[i].sizes()));
}

// What a run needs, read and checked from the input file (the whole sequence).
struct Job {
  const Mixer* m = nullptr;
  at::ScalarType dtype = at::kDouble;
  std::vector<std::string> inputs;   // the inputs read, in MixerInputs order
  std::vector<std::string> entries;  // the state's entry names
  MixerInputs in;
  State zero, init, d_final;
  Tensor d_o;
  bool grads = false;  // do or dfinal_state given
};

// Reads and checks the input file. With sp_size > 0 (--sp-mode), T must also be a multiple of
// sp_size·chunk_size (a LayoutError otherwise, checked after the shapes, before the chunk size).
Job prepare(const Args& a, int sp_size) {
  Job j;
  const Mixer& m = get_mixer(a.family);
  j.m = &m;
  auto file = load_safetensors(a.input);
  const std::string& path = a.input;

  for (auto& n : m.input_names())
    TORCH_CHECK(file.count(n), path, ": required tensor '", n, "' is missing; ", m.name(), " reads ",
                what_family_reads(m, m.state_names()));
  for (auto& [name, t] : file)
    TORCH_CHECK(at::isFloatingType(t.scalar_type()), path, ": tensor '", name, "' has dtype ",
                dtype_name(t.scalar_type()),
                "; expected a floating-point tensor (float64, float32, float16 or bfloat16)");
  const Tensor& q0 = file.at(m.input_names()[0]);
  const bool cuda = a.device == "cuda";
  j.dtype = a.dtype.value_or(q0.scalar_type());
  TORCH_CHECK(j.dtype == at::kDouble || j.dtype == at::kFloat || (cuda && j.dtype == at::kBFloat16), path, ": '",
              m.input_names()[0], "' has dtype ", dtype_name(q0.scalar_type()), " but the mixer computes in ",
              cuda ? "float64, float32 or bfloat16" : "float64 or float32", "; pass --dtype ",
              cuda ? "float64, float32 or bfloat16" : "float64 or float32");
  if (cuda) {
    TORCH_CHECK(cuda_device_count() > 0, "--device cuda: ",
                built_with_cuda() ? "no CUDA device is visible (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them)"
                             : "this carry was built without CUDA (launcher/setup builds it with CUDA where a GPU is visible)");
    cuda_make_current(0);
  }
  // bf16: the gates and the states in fp32 (the kernels' inputs); everything on the chosen device.
  for (auto& [name, t] : file) {
    const bool fp32 = j.dtype == at::kBFloat16 && (name == "g" || name == "gk" || name == "decay_rate" ||
                                                   name.rfind("initial_state", 0) == 0 ||
                                                   name.rfind("dfinal_state", 0) == 0);
    t = t.to(fp32 ? at::kFloat : j.dtype);
    if (cuda) t = t.to(at::kCUDA);
  }

  // The inputs, in MixerInputs order.
  auto required = m.input_names(), optional = m.optional_input_names();
  for (auto n : kInputOrder) {
    bool is_required = std::find(required.begin(), required.end(), n) != required.end();
    bool is_optional = std::find(optional.begin(), optional.end(), n) != optional.end();
    if (is_required || (is_optional && file.count(n))) j.inputs.push_back(n);
  }
  for (auto& n : j.inputs) j.in.get(n) = file.at(n);
  bool chunked = a.form != "naive";
  try {
    if (sp_size > 0) {
      m.check(j.in, a.opt, /*chunked=*/false);
      try {
        parallel::sp_slice(j.in, 0, sp_size, a.opt.chunk_size);
      } catch (const c10::Error& e) {
        throw LayoutError(path + ": " + e.what_without_backtrace());
      }
    }
    m.check(j.in, a.opt, chunked);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, path, ": ", e.what_without_backtrace());
  }
  j.zero = m.zero_state(j.in, a.opt);
  j.entries = state_entry_names(m, j.zero.size());

  // Every tensor must be one the family reads.
  std::set<std::string> known(j.inputs.begin(), j.inputs.end());
  for (auto& n : m.optional_input_names()) known.insert(n);
  known.insert("do");
  for (auto prefix : {"initial_state", "dfinal_state"}) {
    for (auto& k : prefixed(prefix, j.entries)) known.insert(k);
    if (j.entries.size() == 1) known.insert(prefix);
  }
  for (auto& [name, t] : file) {
    if (known.count(name)) continue;
    bool tuple = (name == "initial_state" || name == "dfinal_state") && !j.entries.empty();
    TORCH_CHECK(false, path, ": tensor '", name, "' is not read by ", m.name(),
                tuple ? " (its state has entries " + join(j.entries) + ": name them " + name +
                            ".<entry>)"
                      : std::string(),
                "; ", m.name(), " reads ", what_family_reads(m, j.entries));
  }

  j.init = read_state(m, file, "initial_state", j.entries, path);
  check_state_shapes(j.init, j.zero, prefixed("initial_state", j.entries), path,
                     m.name() + "'s state for these inputs");
  j.d_o = file.count("do") ? file.at("do") : Tensor();
  j.d_final = read_state(m, file, "dfinal_state", j.entries, path);
  check_state_shapes(j.d_final, j.zero, prefixed("dfinal_state", j.entries), path,
                     "the shape of the final state");
  j.grads = j.d_o.defined() || !j.d_final.empty();
  // The family checks the values of its inputs (m.check); the state and the cotangents are checked
  // here alike, so that a NaN anywhere in the file is named instead of propagating.
  auto check_values = [&](const State& s, const std::vector<std::string>& keys) {
    for (size_t i = 0; i < s.size(); ++i) check_finite(s[i], path + ": '" + keys[i] + "'");
  };
  check_values(j.init, prefixed("initial_state", j.entries));
  check_values(j.d_final, prefixed("dfinal_state", j.entries));
  if (j.d_o.defined()) check_finite(j.d_o, path + ": 'do'");
  return j;
}

// `do` must have the shape of o (`o_sizes`, the whole sequence's).
void check_do(const Job& j, at::IntArrayRef o_sizes, const std::string& path) {
  TORCH_CHECK(!j.d_o.defined() || j.d_o.sizes() == o_sizes, path, ": 'do' must have the shape of o ",
              shape_str(o_sizes), ", found ", shape_str(j.d_o.sizes()));
}

// The gradient names, in leaf order: d<input>..., dinitial_state.<entry>....
std::vector<std::string> gradient_names(const Job& j) {
  std::vector<std::string> names;
  for (auto& n : j.inputs) names.push_back("d" + n);
  for (auto& k : prefixed("dinitial_state", j.entries)) names.push_back(k);
  return names;
}

// One process: the chosen form over the whole sequence.
std::map<std::string, Tensor> run_serial(const Args& a, Job& j) {
  const Mixer& m = *j.m;
  MixerInputs in = j.in;
  State init = j.init;
  // With gradients every input and every initial-state entry is a leaf (the zero state when none);
  // j.inputs are in MixerInputs order, as the leaves are.
  std::vector<Tensor> leaves;
  if (j.grads) {
    MixerLeaves l = make_mixer_leaves(in, init.empty() ? j.zero : init);
    in = l.in, init = l.state, leaves = l.all();
  }
  c10::AutoGradMode grad_mode(j.grads);
  MixerOptions opt = a.opt;
  opt.form = parse_form(a.form);
  MixerOutput out = m.forward(in, init, opt);
  TORCH_INTERNAL_ASSERT(out.final_state.size() == j.zero.size(), m.name(), " returned ",
                        out.final_state.size(), " final state entries but its zero state has ",
                        j.zero.size());

  std::map<std::string, Tensor> result;
  result["o"] = out.o.detach();
  auto final_keys = prefixed("final_state", j.entries);
  for (size_t i = 0; i < final_keys.size(); ++i) result[final_keys[i]] = out.final_state[i].detach();

  if (j.grads) {
    check_do(j, out.o.sizes(), a.input);
    Tensor loss = at::zeros({}, out.o.options());
    if (j.d_o.defined()) loss = loss + (out.o * j.d_o).sum();
    for (size_t i = 0; i < j.d_final.size(); ++i)
      loss = loss + (out.final_state[i] * j.d_final[i]).sum();
    auto d = leaf_grads({loss}, leaves);
    auto names = gradient_names(j);
    for (size_t i = 0; i < leaves.size(); ++i) result[names[i]] = d[i];
  }
  return result;
}

// The file's metadata; sp_size > 0 adds sp_mode and sp_ranks.
std::map<std::string, std::string> metadata(const Args& a, const Job& j, int sp_size) {
  const Mixer& m = *j.m;
  std::ostringstream scale;
  scale.precision(17);
  scale << a.opt.scale_for(j.in.get(m.input_names()[0]).size(3));
  std::map<std::string, std::string> meta = {
      {"carry_version", version()},
      {"carry_commit", git_commit()},
      {"family", m.name()},
      {"form", a.form},
      {"device", a.device},
      {"dtype", dtype_name(j.dtype)},
      {"scale", scale.str()},
      {"normalize", a.opt.normalize ? "true" : "false"},
      {"window", std::to_string(a.opt.window)},
      {"global_tokens", std::to_string(a.opt.global_tokens)},
      {"stride", std::to_string(a.opt.stride)},
      {"offset", std::to_string(a.opt.offset)},
  };
  if (a.form == "chunkwise") meta["chunk_size"] = std::to_string(a.opt.chunk_size);
  if (sp_size > 0) {
    meta["sp_mode"] = parallel::scan_mode_name(*a.sp_mode);
    meta["sp_ranks"] = std::to_string(sp_size);
  }
  return meta;
}

int run(const Args& a) {
  Job j = prepare(a, /*sp_size=*/0);
  auto result = run_serial(a, j);
  for (auto& [name, t] : result) t = t.to(at::kCPU);
  save_safetensors(a.output, result, metadata(a, j, 0));
  return 0;
}

// ---- sequence parallelism ----

constexpr int kTagGather = 31;

// Every rank's outcome of a step, agreed: all ranks return the same. On failure the message and
// exit code of the lowest failing rank, prefixed "rank r: " unless every rank failed identically.
Outcome agree(parallel::Communicator& comm, const Outcome& mine) {
  // The message travels one int64 a character: all_gather_packed views every rank's payload at
  // its offset in one buffer, so payloads are kept whole multiples of 8 bytes.
  std::vector<Tensor> part = {at::tensor({static_cast<int64_t>(mine.rc)}, at::kLong), Tensor()};
  if (mine.rc != 0) {
    std::string text = mine.message.empty() ? "error" : mine.message;
    std::vector<int64_t> chars(text.begin(), text.end());
    part[1] = at::tensor(chars, at::kLong);
  }
  std::vector<std::vector<Tensor>> all;
  {
    parallel::CommContext ctx("carry mixer: agreeing on the outcome");
    all = parallel::all_gather_packed(comm, part, at::TensorOptions());
  }
  std::vector<Outcome> outcomes;
  for (auto& p : all) {
    Outcome o;
    o.rc = static_cast<int>(p.at(0).item<int64_t>());
    if (o.rc != 0 && p.size() > 1 && p[1].defined()) {
      auto chars = p[1].contiguous();
      for (int64_t i = 0; i < chars.numel(); ++i)
        o.message += static_cast<char>(chars.data_ptr<int64_t>()[i]);
    }
    outcomes.push_back(o);
  }
  for (size_t r = 0; r < outcomes.size(); ++r) {
    if (outcomes[r].rc == 0) continue;
    bool everywhere = true;
    for (auto& o : outcomes)
      everywhere = everywhere && o.rc == outcomes[r].rc && o.message == outcomes[r].message;
    Outcome out = outcomes[r];
    if (!everywhere) out.message = "rank " + std::to_string(r) + ": " + out.message;
    return out;
  }
  return {};
}

// The sp run on every rank of `comm`: agreed outcomes after reading, computing, gathering and
// writing. Rank 0 prints the help or the error.
Outcome run_sp(parallel::Communicator& comm, int argc, char** argv) {
  const int r = comm.rank(), P = comm.size();
  Args a;
  Job j;
  Outcome o = agree(comm, guarded([&] {
    a = parse_args(argc, argv);
    if (!a.help) j = prepare(a, P);
  }));
  if (o.rc != 0) return o;
  if (a.help) {
    if (r == 0) std::fputs(usage().c_str(), stdout);
    return o;
  }
  const Mixer& m = *j.m;

  // This rank's slice, forward and backward (collective: every rank runs both or neither).
  std::vector<Tensor> part;  // o, d<input>... (with gradients), final_state... (last rank)
  State d_init;              // rank 0, with gradients
  o = agree(comm, guarded([&] {
    MixerInputs in = parallel::sp_slice(j.in, r, P, a.opt.chunk_size);
    const int64_t n = j.in.get(j.inputs[0]).size(1) / P;
    std::vector<Tensor> leaves;
    State init = r == 0 ? j.init : State{};
    if (j.grads) {  // the inputs; on rank 0 also the initial state (the zero state when none)
      MixerLeaves l = make_mixer_leaves(in, r == 0 && init.empty() ? j.zero : init);
      in = l.in, init = l.state, leaves = l.all();
    }
    c10::AutoGradMode grad_mode(j.grads);
    MixerOutput out = parallel::sp_mixer_forward(m, comm, in, init, a.opt, *a.sp_mode);
    TORCH_INTERNAL_ASSERT(out.final_state.size() == j.zero.size(), m.name(), " returned ",
                          out.final_state.size(), " final state entries but its zero state has ",
                          j.zero.size());
    part.push_back(out.o.detach());
    if (j.grads) {
      // The shape of the whole o: every rank's slice has the same.
      auto o_sizes = out.o.sizes().vec();
      o_sizes[1] *= P;
      check_do(j, o_sizes, a.input);
      // o always takes part (with zeros when no do is given) so that every rank runs the backward.
      std::vector<Tensor> outs = {out.o},
                          cots = {j.d_o.defined() ? j.d_o.narrow(1, r * n, n)
                                                  : at::zeros_like(out.o)};
      if (r == P - 1)
        for (size_t i = 0; i < j.d_final.size(); ++i) {
          outs.push_back(out.final_state[i]);
          cots.push_back(j.d_final[i]);
        }
      auto d = leaf_grads(outs, leaves, cots);
      for (size_t i = 0; i < leaves.size(); ++i) (i < j.inputs.size() ? part : d_init).push_back(d[i]);
    }
    if (r == P - 1)
      for (auto& t : out.final_state) part.push_back(t.detach());
  }));
  if (o.rc != 0) return o;

  // Rank 0 gathers the slices, concatenates them on T and writes the file.
  o = agree(comm, guarded([&] {
    parallel::CommContext ctx("carry mixer: gathering the slices on rank 0");
    if (r > 0) {
      parallel::send_packed(comm, part, 0, kTagGather);
      return;
    }
    std::vector<std::vector<Tensor>> parts = {part};
    for (int s = 1; s < P; ++s)
      parts.push_back(parallel::recv_packed(comm, s, at::TensorOptions(), kTagGather));
    const size_t n_t = 1 + (j.grads ? j.inputs.size() : 0);  // tensors cut on T
    for (int s = 0; s < P; ++s)
      TORCH_INTERNAL_ASSERT(parts[s].size() == n_t + (s == P - 1 ? j.zero.size() : 0),
                            "rank ", s, " sent ", parts[s].size(), " tensors");
    auto along_t = [&](size_t i) {
      std::vector<Tensor> pieces;
      for (auto& p : parts) pieces.push_back(p[i]);
      return at::cat(pieces, 1);
    };
    std::map<std::string, Tensor> result;
    result["o"] = along_t(0);
    auto final_keys = prefixed("final_state", j.entries);
    for (size_t i = 0; i < final_keys.size(); ++i) result[final_keys[i]] = parts[P - 1][n_t + i];
    // A constant without T (decay_rate) is every rank's: its gradient is the ranks' sum, in rank order.
    auto summed = [&](size_t i) {
      Tensor sum = parts[0][i];
      for (int s = 1; s < P; ++s) sum = sum + parts[s][i];
      return sum;
    };
    if (j.grads) {
      auto names = gradient_names(j);
      for (size_t i = 0; i < j.inputs.size(); ++i)
        result[names[i]] = MixerInputs::per_token(j.inputs[i]) ? along_t(1 + i) : summed(1 + i);
      for (size_t i = 0; i < d_init.size(); ++i) result[names[j.inputs.size() + i]] = d_init[i];
    }
    save_safetensors(a.output, result, metadata(a, j, P));
  }));
  return o;
}

}  // namespace

std::vector<std::string> state_entry_names(const Mixer& m, size_t entries) {
  auto names = m.state_names();
  if (names.size() == entries) return names;
  std::vector<std::string> out;
  for (size_t j = 0; j < entries; ++j)
    out.push_back(names.size() == 1 ? names[0] + "." + std::to_string(j) : std::to_string(j));
  return out;
}

int run_mixer_command(int argc, char** argv, const MixerCommandOptions& options) {
  if (options.error) options.error->clear();
  Outcome o;
  if (wants_sp(argc, argv)) {
    int rank = 0;
    try {
      parallel::CommOptions copt;
      copt.name = "sp";
      auto comm = parallel::make_mpi_communicator(MPI_COMM_WORLD, copt);
      rank = comm->rank();
      o = run_sp(*comm, argc, argv);
    } catch (const c10::Error& e) {  // MPI itself failed: every rank says so
      o = {1, std::string("MPI: ") + e.what_without_backtrace()};
    } catch (const std::exception& e) {
      o = {1, std::string("MPI: ") + e.what()};
    }  // the communicator is freed before MPI is finalized
    if (options.finalize_mpi) parallel::finalize_mpi();
    if (o.rc != 0 && rank == 0) std::fprintf(stderr, "carry mixer: %s\n", o.message.c_str());
  } else {
    Args a;
    o = guarded([&] {
      a = parse_args(argc, argv);
      if (a.help)
        std::fputs(usage().c_str(), stdout);
      else
        run(a);
    });
    if (o.rc != 0) std::fprintf(stderr, "carry mixer: %s\n", o.message.c_str());
  }
  if (options.error && o.rc != 0) *options.error = "carry mixer: " + o.message;
  return o.rc;
}

}  // namespace carry
