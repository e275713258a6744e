// Model sources (model_source.h): carry checkpoints through framework/io/checkpoint.h, FLA folders
// through framework/io/fla_format.h; strict name-and-shape matching when weights go into a model.
#include "framework/io/model_source.h"

#include "framework/io/checkpoint.h"
#include "framework/io/fla_format.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <map>
#include <sys/stat.h>

namespace carry {
namespace {

bool is_dir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_file(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string join_path(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::string shape_text(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

ModelSource from_checkpoint(const CheckpointData& data, const std::string& path) {
  ModelSource s;
  s.kind = "carry checkpoint";
  s.path = path;
  s.step = data.step;
  s.tokens_seen = data.tokens_seen;
  s.run_config_text = data.config_text;
  try {
    s.model = stored_run_config_from_text(data.config_text, join_path(path, "manifest.textproto")).model();
  } catch (const ConfigError& e) {
    throw ConfigError("checkpoint " + path + ": its stored run config does not load: " + e.what());
  }
  s.weights = data.model;
  return s;
}

}  // namespace

std::string ModelSource::describe() const {
  return kind + " " + path + (step >= 0 ? " (step " + std::to_string(step) + ")" : "");
}

ModelSource load_model_source(const std::string& path) {
  if (!is_dir(path))
    throw ConfigError(path + ": expected a carry checkpoint directory (a run's checkpoint.dir or one of its step_* "
                      "directories) or an FLA / Hugging Face folder (config.json + model.safetensors); " +
                      (is_file(path) ? "this is a file" : "it does not exist"));
  if (is_fla_folder(path)) {
    ImportedModel m = import_fla_folder(path);
    ModelSource s;
    s.kind = "FLA folder";
    s.path = path;
    s.model = m.model;
    s.weights = std::move(m.weights);
    auto step = m.metadata.find("step");
    if (step != m.metadata.end()) {
      try {
        s.step = std::stoll(step->second);
      } catch (const std::exception&) {
      }
    }
    return s;
  }
  try {
    if (is_file(join_path(path, "manifest.textproto"))) return from_checkpoint(load_checkpoint(path), path);
    auto latest = load_latest_checkpoint(path);
    if (!latest)
      throw ConfigError(path + ": no valid carry checkpoint here (no step_* directory with a complete manifest), and "
                        "no config.json of an FLA / Hugging Face folder");
    std::string step_dir = join_path(path, checkpoint_dir_name(latest->step));
    return from_checkpoint(*latest, step_dir);
  } catch (const c10::Error& e) {
    throw ConfigError(e.what_without_backtrace());
  }
}

void load_weights(const Model& model, const NamedParameters& weights, const std::string& source) {
  std::map<std::string, at::Tensor> by_name;
  for (const auto& [name, t] : weights)
    if (!by_name.emplace(name, t).second) throw ConfigError(source + ": tensor '" + name + "' appears twice");
  at::NoGradGuard no_grad;
  for (const auto& [name, p] : model.parameters()) {
    auto it = by_name.find(name);
    if (it == by_name.end())
      throw ConfigError(source + ": parameter '" + name + "' of the model is missing (a different model?)");
    if (it->second.sizes() != p.sizes())
      throw ConfigError(source + ": parameter '" + name + "' has shape " + shape_text(it->second.sizes()) +
                        ", the model's is " + shape_text(p.sizes()));
    p.copy_(it->second);
    by_name.erase(it);
  }
  if (!by_name.empty())
    throw ConfigError(source + ": tensor '" + by_name.begin()->first + "' is not a parameter of the model (" +
                      std::to_string(by_name.size()) + " such tensors; a different model?)");
}

Model build_model_from_source(const ModelSource& source, at::TensorOptions options) {
  Model m = build_model(source.model, 0, options);
  load_weights(m, source.weights, source.describe());
  return m;
}

}  // namespace carry
