// Loading and resolving configs (see config.h): a run file parsed, its model preset loaded and
// overlaid field by field, the `--set` overrides applied, declared defaults filled in and the result
// validated, with each validation error pointed at the file:line:column (or the --set) that gave the
// field. Also the config as text, the changes between two configs, and the quantities derived from a
// model config. The parts live beside it, internal to framework/config: text_format.h (reading
// textproto with located errors), overrides.h (`--set`), defaults.h (declared defaults) and
// validation.h (the checks).
#include "framework/config/config.h"
#include "framework/printable.h"

#include "framework/config/defaults.h"
#include "framework/config/overrides.h"
#include "framework/config/text_format.h"
#include "framework/config/validation.h"
#include "layers/layer_kind.h"
#include "layers/layout.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>
#include <google/protobuf/text_format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace carry {

namespace pb = google::protobuf;
using pb::FieldDescriptor;
using pb::Message;
using pb::TextFormat;

using config_internal::check_cluster;
using config_internal::check_model;
using config_internal::check_run;
using config_internal::Errors;
using config_internal::FieldError;
using config_internal::fill_defaults;
using config_internal::Location;
using config_internal::override_path;
using config_internal::parse_into;
using config_internal::parse_path;
using config_internal::read_text_file;
using config_internal::Segment;
using config_internal::Source;
using config_internal::to_location;

namespace {

// ---------------------------------------------------------------------------------------------
// A preset overlaid by the run's own model fields

void copy_field(const Message& from, Message& to, const FieldDescriptor* f) {
  auto* rf = from.GetReflection();
  auto* rt = to.GetReflection();
  if (f->is_repeated()) {
    rt->ClearField(&to, f);
    for (int i = 0; i < rf->FieldSize(from, f); ++i) {
      switch (f->cpp_type()) {
        case FieldDescriptor::CPPTYPE_INT32: rt->AddInt32(&to, f, rf->GetRepeatedInt32(from, f, i)); break;
        case FieldDescriptor::CPPTYPE_INT64: rt->AddInt64(&to, f, rf->GetRepeatedInt64(from, f, i)); break;
        case FieldDescriptor::CPPTYPE_UINT32: rt->AddUInt32(&to, f, rf->GetRepeatedUInt32(from, f, i)); break;
        case FieldDescriptor::CPPTYPE_UINT64: rt->AddUInt64(&to, f, rf->GetRepeatedUInt64(from, f, i)); break;
        case FieldDescriptor::CPPTYPE_DOUBLE: rt->AddDouble(&to, f, rf->GetRepeatedDouble(from, f, i)); break;
        case FieldDescriptor::CPPTYPE_FLOAT: rt->AddFloat(&to, f, rf->GetRepeatedFloat(from, f, i)); break;
        case FieldDescriptor::CPPTYPE_BOOL: rt->AddBool(&to, f, rf->GetRepeatedBool(from, f, i)); break;
        case FieldDescriptor::CPPTYPE_ENUM: rt->AddEnum(&to, f, rf->GetRepeatedEnum(from, f, i)); break;
        case FieldDescriptor::CPPTYPE_STRING: rt->AddString(&to, f, rf->GetRepeatedString(from, f, i)); break;
        case FieldDescriptor::CPPTYPE_MESSAGE:
          rt->AddMessage(&to, f)->CopyFrom(rf->GetRepeatedMessage(from, f, i));
          break;
      }
    }
    return;
  }
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: rt->SetInt32(&to, f, rf->GetInt32(from, f)); break;
    case FieldDescriptor::CPPTYPE_INT64: rt->SetInt64(&to, f, rf->GetInt64(from, f)); break;
    case FieldDescriptor::CPPTYPE_UINT32: rt->SetUInt32(&to, f, rf->GetUInt32(from, f)); break;
    case FieldDescriptor::CPPTYPE_UINT64: rt->SetUInt64(&to, f, rf->GetUInt64(from, f)); break;
    case FieldDescriptor::CPPTYPE_DOUBLE: rt->SetDouble(&to, f, rf->GetDouble(from, f)); break;
    case FieldDescriptor::CPPTYPE_FLOAT: rt->SetFloat(&to, f, rf->GetFloat(from, f)); break;
    case FieldDescriptor::CPPTYPE_BOOL: rt->SetBool(&to, f, rf->GetBool(from, f)); break;
    case FieldDescriptor::CPPTYPE_ENUM: rt->SetEnum(&to, f, rf->GetEnum(from, f)); break;
    case FieldDescriptor::CPPTYPE_STRING: rt->SetString(&to, f, rf->GetString(from, f)); break;
    case FieldDescriptor::CPPTYPE_MESSAGE: rt->MutableMessage(&to, f)->CopyFrom(rf->GetMessage(from, f)); break;
  }
}

// Every field set in `top` replaces the one in `base`; sub-messages recursively; lists whole.
void overlay(Message& base, const Message& top) {
  std::vector<const FieldDescriptor*> fields;
  top.GetReflection()->ListFields(top, &fields);
  for (auto* f : fields) {
    if (!f->is_repeated() && f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE)
      overlay(*base.GetReflection()->MutableMessage(&base, f), top.GetReflection()->GetMessage(top, f));
    else
      copy_field(top, base, f);
  }
}

// ---------------------------------------------------------------------------------------------
// Errors pointed at where the field was written

// Where the field at `path` was written in `source`, if it was.
Location locate(const Source& source, const pb::Descriptor* root, const std::vector<Segment>& path) {
  const TextFormat::ParseInfoTree* tree = source.tree.get();
  const pb::Descriptor* d = root;
  for (size_t i = 0; i < path.size() && tree && d; ++i) {
    auto* f = d->FindFieldByName(path[i].name);
    if (!f) return {};
    int index = f->is_repeated() ? std::max(path[i].index, 0) : -1;
    if (i + 1 == path.size() || !f->message_type()) {
      auto loc = tree->GetLocation(f, index);
      return to_location(source.text, loc.line, loc.column);
    }
    tree = tree->GetTreeForNested(f, index);
    d = f->message_type();
  }
  return {};
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

// The sources a resolved run config came from, to point errors at where a field was written.
struct Provenance {
  Source* run = nullptr;
  Source* preset = nullptr;
  std::vector<std::string> overrides;  // assignments, in order
};

std::string describe(const FieldError& err, const Provenance& prov, const pb::Descriptor* root) {
  std::string path = err.path;
  for (auto it = prov.overrides.rbegin(); it != prov.overrides.rend(); ++it) {
    auto op = override_path(*it);
    auto is_prefix = [](const std::string& a, const std::string& b) {  // a is b or a parent of b
      return starts_with(b, a) && (b.size() == a.size() || b[a.size()] == '.' || b[a.size()] == '[');
    };
    if (is_prefix(op, path) || is_prefix(path, op))
      return prov.run->name + ": " + path + ": " + err.message + " (set by --set " + *it + ")";
  }
  std::vector<Segment> segs;
  try {
    segs = parse_path(path);
  } catch (const ConfigError&) {
  }
  auto at = [&](const Source& s, const Location& loc) {
    return s.name + ":" + std::to_string(loc.line) + ":" + std::to_string(loc.column) + ": " + path + ": " +
           err.message;
  };
  if (!segs.empty()) {
    auto loc = locate(*prov.run, root, segs);
    if (loc.line > 0) return at(*prov.run, loc);
    if (prov.preset && segs[0].name == "model" && segs.size() > 1) {
      loc = locate(*prov.preset, ModelConfig::descriptor(), {segs.begin() + 1, segs.end()});
      if (loc.line > 0) return at(*prov.preset, loc);
    }
  }
  return prov.run->name + ": " + path + ": " + err.message;
}

void throw_if_errors(const std::vector<FieldError>& errors, const Provenance& prov, const pb::Descriptor* root,
                     size_t more = 0) {
  if (errors.empty()) return;
  std::vector<std::string> lines;
  for (auto& err : errors) lines.push_back(describe(err, prov, root));
  if (more) lines.push_back(config_internal::more_errors_line(more));
  throw ConfigError(join(lines, "\n"));
}

// ---------------------------------------------------------------------------------------------
// Resolution

std::string directory_of(const std::string& path) {
  auto slash = path.find_last_of('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
}

std::string resolve_relative(const std::string& base_file, const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  return directory_of(base_file) + path;
}

RunConfig resolve_run(Source& run_source, const std::vector<std::string>& overrides) {
  RunConfig raw;
  parse_into(run_source, raw);
  Provenance prov;
  prov.run = &run_source;
  prov.overrides = overrides;

  std::vector<std::string> late;
  for (auto& o : overrides) {
    if (override_path(o) == "model_preset") apply_override(raw, o);
    else late.push_back(o);
  }

  RunConfig config;
  Source preset_source;
  if (!raw.model_preset().empty()) {
    preset_source.name = resolve_relative(run_source.name, raw.model_preset());
    try {
      preset_source.text = read_text_file(preset_source.name);
    } catch (const ConfigError& err) {
      throw_if_errors({{"model_preset", err.what()}}, prov, RunConfig::descriptor());
    }
    ModelConfig preset;
    parse_into(preset_source, preset);
    prov.preset = &preset_source;
    config = raw;
    *config.mutable_model() = preset;
    overlay(*config.mutable_model(), raw.model());
    config.clear_model_preset();
  } else {
    config = raw;
  }
  for (auto& o : late) apply_override(config, o);
  fill_defaults(config);

  Errors errors;
  check_run(config, errors);
  throw_if_errors(errors.list, prov, RunConfig::descriptor(), errors.more);
  return config;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Public API

RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides) {
  Source source;
  source.name = path;
  source.text = read_text_file(path);
  return resolve_run(source, overrides);
}

RunConfig run_config_from_text(const std::string& text, const std::string& source_name,
                               const std::vector<std::string>& overrides) {
  Source source;
  source.name = source_name;
  source.text = text;
  return resolve_run(source, overrides);
}

RunConfig stored_run_config_from_text(const std::string& text, const std::string& source_name,
                                      const std::vector<std::string>& overrides) {
  Source source;
  source.name = source_name;
  source.text = text;
  RunConfig raw;
  parse_into(source, raw);
  if (!raw.model_preset().empty())
    throw ConfigError(source_name + ": model_preset: a checkpoint stores its resolved config, which names no preset "
                      "file, but this one names '" + printable(raw.model_preset().substr(0, 200), false) +
                      "' (not written by carry train, or changed since); carry reads no file a checkpoint names");
  return resolve_run(source, overrides);
}

ModelConfig load_model_config(const std::string& path) {
  Source source;
  source.name = path;
  source.text = read_text_file(path);
  ModelConfig model;
  parse_into(source, model);
  fill_defaults(model);
  Errors errors;
  check_model(model, "", errors);
  Provenance prov;
  prov.run = &source;
  throw_if_errors(errors.list, prov, ModelConfig::descriptor(), errors.more);
  return model;
}

ClusterConfig load_cluster_config(const std::string& path) {
  Source source;
  source.name = path;
  source.text = read_text_file(path);
  ClusterConfig cluster;
  parse_into(source, cluster);
  fill_defaults(cluster);
  Errors errors;
  check_cluster(cluster, errors);
  Provenance prov;
  prov.run = &source;
  throw_if_errors(errors.list, prov, ClusterConfig::descriptor(), errors.more);
  return cluster;
}

std::string config_to_text(const Message& message) {
  TextFormat::Printer printer;
  printer.SetUseShortRepeatedPrimitives(true);
  std::string out;
  printer.PrintToString(message, &out);
  return out;
}

RunConfig parse_stored_run_config(const std::string& text, const std::string& source_name) {
  Source source;
  source.name = source_name;
  source.text = text;
  RunConfig config;
  parse_into(source, config);
  fill_defaults(config);
  return config;
}

namespace {

std::string one_line(const Message& m) {
  TextFormat::Printer printer;
  printer.SetSingleLineMode(true);
  printer.SetUseShortRepeatedPrimitives(true);
  std::string out;
  printer.PrintToString(m, &out);
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return "{" + out + "}";
}

// A field's value as text: a scalar as textproto prints it, a message on one line, a list as [...].
std::string field_text(const Message& m, const FieldDescriptor* f) {
  auto* r = m.GetReflection();
  auto element = [&](int index) {
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE)
      return one_line(index < 0 ? r->GetMessage(m, f) : r->GetRepeatedMessage(m, f, index));
    std::string out;
    TextFormat::PrintFieldValueToString(m, f, index, &out);
    return out;
  };
  if (!f->is_repeated()) return r->HasField(m, f) ? element(-1) : "(unset)";
  std::vector<std::string> items;
  for (int i = 0; i < r->FieldSize(m, f); ++i) items.push_back(element(i));
  return "[" + join(items, ", ") + "]";
}

void collect_changes(const Message& a, const Message& b, const std::string& prefix, std::vector<ConfigChange>& out) {
  auto* d = a.GetDescriptor();
  auto* ra = a.GetReflection();
  auto* rb = b.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    auto* f = d->field(i);
    const std::string path = prefix + f->name();
    if (!f->is_repeated() && f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE && ra->HasField(a, f) &&
        rb->HasField(b, f)) {
      collect_changes(ra->GetMessage(a, f), rb->GetMessage(b, f), path + ".", out);
      continue;
    }
    std::string x = field_text(a, f), y = field_text(b, f);
    if (x != y) out.push_back({path, x, y});
  }
}

}  // namespace

std::vector<ConfigChange> config_changes(const Message& before, const Message& after) {
  if (before.GetDescriptor() != after.GetDescriptor())
    throw ConfigError("config_changes: a " + before.GetTypeName() + " against a " + after.GetTypeName());
  std::vector<ConfigChange> out;
  collect_changes(before, after, "", out);
  return out;
}

const std::vector<std::string>& known_mixer_kinds() { return layer_kind_names(); }

LayerMixer layer_mixer(const ModelConfig& model, int64_t layer) {
  if (model.mixers().empty()) throw ConfigError("model.mixers: no mixer kinds");
  if (layer < 0) throw ConfigError("layer_mixer: negative layer " + std::to_string(layer));
  LayerMixer out;
  out.kind = model.mixers(static_cast<int>(layer % model.mixers_size()));
  for (auto& o : model.mixer_options())
    if (!o.has_kind()) out.options.MergeFrom(o);
  for (auto& o : model.mixer_options())
    if (o.has_kind() && o.kind() == out.kind) out.options.MergeFrom(o);
  out.options.set_kind(out.kind);
  fill_defaults(out.options);
  return out;
}

bool recompute_overlap_applies(const RunConfig& config, bool if_recomputed) {
  const auto& par = config.parallel();
  const bool on = par.has_recompute_overlap() ? par.recompute_overlap() : par.sp() == 1;
  return (if_recomputed || par.recompute()) && on && !par.recompute_keeps_mixer();
}

int64_t update_split_ranks(const RunConfig& config) {
  const auto& par = config.parallel();
  const int64_t sp = par.sp(), dp = par.dp();
  auto power_of_two = [](int64_t n) { return n > 1 && (n & (n - 1)) == 0; };
  const int64_t per_rank = par.segments() > 0 ? par.segments() / sp : 1;
  const bool split = par.scan_mode() == config::ParallelConfig::ORDERED && power_of_two(sp) && par.shard_update() &&
                     (par.gradient_sum() == config::ParallelConfig::AFTER_BACKWARD || per_rank > 1);
  return !split ? 1 : sp * (power_of_two(dp) ? dp : 1);
}

int64_t head_dim_k(const ModelConfig& model) {
  return model.has_head_dim_k() ? model.head_dim_k() : model.d_model() / std::max<int64_t>(model.n_heads(), 1);
}

int64_t head_dim_v(const ModelConfig& model) {
  return model.has_head_dim_v() ? model.head_dim_v() : model.d_model() / std::max<int64_t>(model.n_heads(), 1);
}

int64_t mlp_hidden_size(const ModelConfig& model) {
  auto h = static_cast<int64_t>(std::ceil(model.mlp_ratio() * static_cast<double>(model.d_model()) - 1e-9));
  return (h + 63) / 64 * 64;
}

}  // namespace carry
