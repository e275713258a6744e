// Where a trained model comes from, for the commands that use one (eval, generate, export, import) and
// for a run's `init_from`: a carry checkpoint (a checkpoint.dir, whose newest valid step is taken, or
// one step_* directory) or an FLA / Hugging Face folder (config.json + safetensors, fla_format.h).
// Weights only: the optimizer state and the data cursor of a checkpoint are not read.
#pragma once

#include "framework/config/config.h"
#include "framework/model/model.h"

#include <cstdint>
#include <string>

namespace carry {

struct ModelSource {
  std::string kind;      // "carry checkpoint" or "FLA folder"
  std::string path;      // the step directory or the folder that was read
  ModelConfig model;     // resolved and validated
  NamedParameters weights;  // by carry name, on the CPU
  int64_t step = -1;     // the checkpoint's step (-1 for an FLA folder)
  int64_t tokens_seen = -1;
  std::string run_config_text;  // a carry checkpoint's resolved run config ("" for an FLA folder)
  // One line: "carry checkpoint runs/x/checkpoints/step_00000600 (step 600)" or "FLA folder out/gdn".
  std::string describe() const;
};

// Reads `path` as above. Throws ConfigError naming the path and what was expected (no valid
// checkpoint, not a directory, a malformed folder, ...).
ModelSource load_model_source(const std::string& path);

// Copies `weights` into the model's parameters: every parameter present with its shape and nothing
// left over, else ConfigError naming `source`, the parameter and both shapes (values are cast to the
// parameters' dtype and device).
void load_weights(const Model& model, const NamedParameters& weights, const std::string& source);

// The model of a source, built in `options`' dtype and device with the source's weights.
Model build_model_from_source(const ModelSource& source,
                              at::TensorOptions options = at::TensorOptions().dtype(at::kFloat));

}  // namespace carry
