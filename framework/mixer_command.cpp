// `carry mixer` (see mixer_command.h): flags -> MixerOptions, tensors by name -> MixerInputs and the
// initial state, one form, then o / final_state and, with do or dfinal_state, autograd gradients.
// Usage errors (flags, unknown family) exit 2; errors in files and tensors exit 1.
#include "framework/mixer_command.h"

#include "framework/safetensors.h"
#include "framework/version.h"
#include "layers/common.h"
#include "layers/mixer.h"

#include <torch/csrc/autograd/autograd.h>

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
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

// Bad flags: exit code 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

const char* const kInputOrder[] = {"q", "k", "v", "g", "gk", "beta", "l"};

std::string join(const std::vector<std::string>& v, const std::string& sep = ", ") {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}

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
       "  --input PATH      inputs [B,T,H,D] by name: q, k, v, g, gk, beta, l (those the family reads);\n"
       "                    initial_state.<entry> (all entries, or none for the zero state; a state\n"
       "                    of one entry may be named plain initial_state); for gradients do and/or\n"
       "                    dfinal_state.<entry> (all entries): the one left out counts as zero\n"
       "  --output PATH     written: o, final_state.<entry>; with gradients also d<input> for every\n"
       "                    input read and dinitial_state.<entry>: autograd of\n"
       "                    sum(o*do) + sum(final_state*dfinal_state)\n"
       "  --form F          chunkwise (default) or naive\n"
       "  --chunk-size C    chunk size of the chunkwise form (default 64)\n"
       "  --dtype D         compute dtype: float64 or float32 (default: the dtype of q)\n"
       "  --scale S         query scale, > 0 (default 1/sqrt(dk))\n"
       "  --normalize       divide by the normalizer (families that have one)\n"
       "  --window W        sliding window, >= 0 (default 0: full causal)\n"
       "  --offset P        absolute position of the first token, >= 0 (default 0)\n"
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

int64_t parse_int(const std::string& flag, const std::string& value, int64_t min) {
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || errno == ERANGE || v < min)
    throw UsageError(flag + " must be an integer >= " + std::to_string(min) + ", got '" + value + "'");
  return v;
}

double parse_positive(const std::string& flag, const std::string& value) {
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(value.c_str(), &end);
  if (value.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v) || v <= 0)
    throw UsageError(flag + " must be a positive number, got '" + value + "'");
  return v;
}

struct Args {
  std::string family, input, output, form = "chunkwise";
  std::optional<at::ScalarType> dtype;
  MixerOptions opt;
  bool help = false;
};

Args parse_args(int argc, char** argv) {
  Args a;
  std::set<std::string> seen;
  const std::set<std::string> with_value = {"--family", "--input",  "--output", "--chunk-size", "--form",
                                            "--dtype",  "--scale", "--window", "--offset"};
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      a.help = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) throw UsageError("unexpected argument '" + arg + "' (flags start with --)");
    std::string flag = arg, value;
    bool inline_value = false;
    if (auto eq = arg.find('='); eq != std::string::npos) {
      flag = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      inline_value = true;
    }
    if (flag != "--normalize" && !with_value.count(flag))
      throw UsageError("unknown flag '" + flag + "'");
    if (!seen.insert(flag).second) throw UsageError(flag + " given twice");
    if (flag == "--normalize") {
      if (inline_value) throw UsageError("--normalize takes no value, got '" + arg + "'");
      a.opt.normalize = true;
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= argc) throw UsageError(flag + " needs a value");
      value = argv[++i];
    }
    if (flag == "--family") a.family = value;
    else if (flag == "--input") a.input = value;
    else if (flag == "--output") a.output = value;
    else if (flag == "--chunk-size") a.opt.chunk_size = parse_int(flag, value, 1);
    else if (flag == "--window") a.opt.window = parse_int(flag, value, 0);
    else if (flag == "--offset") a.opt.offset = parse_int(flag, value, 0);
    else if (flag == "--scale") a.opt.scale = parse_positive(flag, value);
    else if (flag == "--form") {
      if (value != "naive" && value != "chunkwise")
        throw UsageError("--form must be naive or chunkwise, got '" + value + "'");
      a.form = value;
    } else if (flag == "--dtype") {
      if (value == "float64") a.dtype = at::kDouble;
      else if (value == "float32") a.dtype = at::kFloat;
      else throw UsageError("--dtype must be float64 or float32, got '" + value + "'");
    }
    if (value.empty() && (flag == "--family" || flag == "--input" || flag == "--output"))
      throw UsageError(flag + " needs a non-empty value");
  }
  if (a.help) return a;
  const std::pair<const char*, const std::string*> required[] = {
      {"--family", &a.family}, {"--input", &a.input}, {"--output", &a.output}};
  for (auto& [flag, value] : required)
    if (value->empty()) throw UsageError(std::string(flag) + " is required");
  auto names = mixer_names();
  if (std::find(names.begin(), names.end(), a.family) == names.end())
    throw UsageError("unknown family '" + a.family + "'; known families: " + join(names));
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

int run(const Args& a) {
  const Mixer& m = get_mixer(a.family);
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
  at::ScalarType dtype = a.dtype.value_or(q0.scalar_type());
  TORCH_CHECK(dtype == at::kDouble || dtype == at::kFloat, path, ": '", m.input_names()[0],
              "' has dtype ", dtype_name(q0.scalar_type()),
              " but the mixer computes in float64 or float32; pass --dtype float64 or --dtype float32");
  for (auto& [name, t] : file) t = t.to(dtype);

  // The inputs, in MixerInputs order.
  std::vector<std::string> inputs;
  auto required = m.input_names(), optional = m.optional_input_names();
  for (auto n : kInputOrder) {
    bool is_required = std::find(required.begin(), required.end(), n) != required.end();
    bool is_optional = std::find(optional.begin(), optional.end(), n) != optional.end();
    if (is_required || (is_optional && file.count(n))) inputs.push_back(n);
  }
  MixerInputs in;
  for (auto& n : inputs) in.get(n) = file.at(n);
  bool chunked = a.form == "chunkwise";
  try {
    m.check(in, a.opt, chunked);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, path, ": ", e.what_without_backtrace());
  }
  State zero = m.zero_state(in, a.opt);
  auto entries = state_entry_names(m, zero.size());

  // Every tensor must be one the family reads.
  std::set<std::string> known(inputs.begin(), inputs.end());
  for (auto& n : m.optional_input_names()) known.insert(n);
  known.insert("do");
  for (auto prefix : {"initial_state", "dfinal_state"}) {
    for (auto& k : prefixed(prefix, entries)) known.insert(k);
    if (entries.size() == 1) known.insert(prefix);
  }
  for (auto& [name, t] : file) {
    if (known.count(name)) continue;
    bool tuple = (name == "initial_state" || name == "dfinal_state") && !entries.empty();
    TORCH_CHECK(false, path, ": tensor '", name, "' is not read by ", m.name(),
                tuple ? " (its state has entries " + join(entries) + ": name them " + name +
                            ".<entry>)"
                      : std::string(),
                "; ", m.name(), " reads ", what_family_reads(m, entries));
  }

  State init = read_state(m, file, "initial_state", entries, path);
  check_state_shapes(init, zero, prefixed("initial_state", entries), path,
                     m.name() + "'s state for these inputs");
  Tensor d_o = file.count("do") ? file.at("do") : Tensor();
  State d_final = read_state(m, file, "dfinal_state", entries, path);
  check_state_shapes(d_final, zero, prefixed("dfinal_state", entries), path,
                     "the shape of the final state");
  bool grads = d_o.defined() || !d_final.empty();

  // With gradients every input and every initial-state entry is a leaf (the zero state when none).
  std::vector<Tensor> leaves;
  if (grads) {
    for (auto& n : inputs) {
      in.get(n) = in.get(n).detach().requires_grad_(true);
      leaves.push_back(in.get(n));
    }
    if (init.empty()) init = zero;
    for (auto& t : init) {
      t = t.detach().requires_grad_(true);
      leaves.push_back(t);
    }
  }
  c10::AutoGradMode grad_mode(grads);
  MixerOutput out = chunked ? m.chunkwise(in, init, a.opt) : m.naive(in, init, a.opt);
  TORCH_INTERNAL_ASSERT(out.final_state.size() == zero.size(), m.name(), " returned ",
                        out.final_state.size(), " final state entries but its zero state has ",
                        zero.size());

  std::map<std::string, Tensor> result;
  result["o"] = out.o.detach();
  auto final_keys = prefixed("final_state", entries);
  for (size_t i = 0; i < final_keys.size(); ++i) result[final_keys[i]] = out.final_state[i].detach();

  if (grads) {
    TORCH_CHECK(!d_o.defined() || d_o.sizes() == out.o.sizes(), path, ": 'do' must have the shape of o ",
                shape_str(out.o.sizes()), ", found ", shape_str(d_o.sizes()));
    Tensor loss = at::zeros({}, out.o.options());
    if (d_o.defined()) loss = loss + (out.o * d_o).sum();
    for (size_t i = 0; i < d_final.size(); ++i) loss = loss + (out.final_state[i] * d_final[i]).sum();
    std::vector<Tensor> d(leaves.size());
    if (loss.requires_grad())
      d = torch::autograd::grad({loss}, leaves, {}, /*retain_graph=*/false, /*create_graph=*/false,
                                /*allow_unused=*/true);
    std::vector<std::string> names;
    for (auto& n : inputs) names.push_back("d" + n);
    for (auto& k : prefixed("dinitial_state", entries)) names.push_back(k);
    for (size_t i = 0; i < leaves.size(); ++i)
      result[names[i]] = d[i].defined() ? d[i].detach() : at::zeros_like(leaves[i]).detach();
  }

  std::ostringstream scale;
  scale.precision(17);
  scale << a.opt.scale_for(in.get(m.input_names()[0]).size(3));
  std::map<std::string, std::string> meta = {
      {"carry_version", version()},
      {"family", m.name()},
      {"form", a.form},
      {"dtype", dtype_name(dtype)},
      {"scale", scale.str()},
      {"normalize", a.opt.normalize ? "true" : "false"},
      {"window", std::to_string(a.opt.window)},
      {"offset", std::to_string(a.opt.offset)},
  };
  if (chunked) meta["chunk_size"] = std::to_string(a.opt.chunk_size);
  save_safetensors(a.output, result, meta);
  return 0;
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

int run_mixer_command(int argc, char** argv) {
  try {
    Args a = parse_args(argc, argv);
    if (a.help) {
      std::fputs(usage().c_str(), stdout);
      return 0;
    }
    return run(a);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "carry mixer: %s (see carry mixer --help)\n", e.what());
    return 2;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "carry mixer: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "carry mixer: %s\n", e.what());
    return 1;
  }
}

}  // namespace carry
