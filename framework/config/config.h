// Loading, overriding, validating and printing configs (schema: framework/config/carry.proto and
// cluster.proto). A run config is read in this order:
//   1. parse the textproto file (unknown fields are errors; a parse error names file:line:column and
//      shows the line with a caret under the column);
//   2. apply `--set model_preset=...` if given, then load the model preset (a ModelConfig file,
//      relative to the run file) and overlay the run's own `model { }` fields on it;
//   3. apply the other `--set field.path=value` overrides, in order;
//   4. fill every unset field that has a declared default (so the resolved config is explicit);
//   5. validate: every error names its field path, and the file:line:column where that field was
//      written when it came from a file (or the --set that gave it). Every float/double field must be
//      finite; integers are bounded so that no product the validation or the trainer forms wraps
//      (chunk_size <= 2^16, dp*sp <= 2^20, seq_len and batch_size <= 2^40, task lengths <= seq_len).
// The parallel layout against the launch's world size is checked separately (validate_layout), as the
// world size is known only at launch.
#pragma once

#include "framework/config/carry.pb.h"
#include "framework/config/cluster.pb.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace carry {

using config::ClusterConfig;
using config::DataConfig;
using config::ModelConfig;
using config::RunConfig;
// config::MixerOptions is not brought into carry:: (layers/mixer.h defines carry::MixerOptions, the
// mixer hyperparameters), so this header and the layers' headers can be included together.

// Bad config files, overrides or values. what() is the complete message for the user (it may span
// several lines: one per validation error).
class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Reads, resolves and validates a run config (steps 1-5 above). `overrides` are "a.b.c=value"
// assignments (see apply_override).
RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides = {});
// The same from text; `source_name` names the text in errors and its directory resolves model_preset
// (e.g. a config stored in a checkpoint manifest).
RunConfig run_config_from_text(const std::string& text, const std::string& source_name,
                               const std::vector<std::string>& overrides = {});
// The same for the config a checkpoint stores (its resolved config): a model_preset in it is refused
// (ConfigError naming source_name and the preset), so a crafted manifest cannot make carry read, and
// echo in an error, a file it names.
RunConfig stored_run_config_from_text(const std::string& text, const std::string& source_name,
                                      const std::vector<std::string>& overrides = {});
// A model preset file on its own (defaults filled, validated as a model).
ModelConfig load_model_config(const std::string& path);
ClusterConfig load_cluster_config(const std::string& path);

// Sets one field of `message` from "path=value" via reflection. The path is field names joined by
// dots, with [i] to pick an element of a repeated field (i == size appends one):
//   optimizer.lr=1e-3   parallel.scan_mode=tree   model.mixers=gla,gla,softmax_attn
//   model.mixer_options[0].window=512   data.mqar={num_kv_pairs: 8}   model.mixer_options=
// Numbers, bools (true/false/1/0), strings and enum names (any case) are parsed by the field's type;
// a repeated scalar field without [i] takes a comma-separated list; a message field takes textproto
// (braces optional); an empty value clears the field. Unknown fields are errors that name the path
// and list the valid fields at that level. Throws ConfigError.
void apply_override(google::protobuf::Message& message, const std::string& assignment);

// Every semantic error of a resolved run config, each "field.path: what is wrong" (no location).
std::vector<std::string> run_config_errors(const RunConfig& config);
std::vector<std::string> model_config_errors(const ModelConfig& model);
std::vector<std::string> cluster_config_errors(const ClusterConfig& cluster);

// The launch: dp * sp must equal the number of ranks. Throws ConfigError, e.g.
//   "parallel: dp*sp = 6 but the launch has 4 ranks"
void validate_layout(const RunConfig& config, int64_t world_size);

// A config as textproto (every set field; after loading that is every field with a default).
std::string config_to_text(const google::protobuf::Message& message);

// A resolved config as a checkpoint stored it: parsed (errors name `source_name`, line and column)
// and every unset field that has a default filled in (a field added to the schema since reads as its
// default), not validated (the rules may have changed since). Throws ConfigError.
RunConfig parse_stored_run_config(const std::string& text, const std::string& source_name);

// One field whose value differs between two configs.
struct ConfigChange {
  std::string path;    // "optimizer.lr", "data.mqar.num_kv_pairs", "model.mixers"
  std::string before;  // the value as textproto (a list as [a, b], a message on one line), or "(unset)"
  std::string after;
};
// The fields that differ between `before` and `after` (messages of one type), in field-number order:
// sub-messages field by field, lists and maps whole.
std::vector<ConfigChange> config_changes(const google::protobuf::Message& before,
                                         const google::protobuf::Message& after);

// ---- derived model quantities ----

// Mixer kinds a config may name (the model assembly builds these).
const std::vector<std::string>& known_mixer_kinds();

// The resolved mixer of one layer: its kind and its options with defaults, the general entry and the
// kind's entry applied (see carry.proto, MixerOptions).
struct LayerMixer {
  std::string kind;
  config::MixerOptions options;  // every field set
};
LayerMixer layer_mixer(const ModelConfig& model, int64_t layer);

int64_t head_dim_k(const ModelConfig& model);   // head_dim_k, or d_model / n_heads
int64_t head_dim_v(const ModelConfig& model);   // head_dim_v, or d_model / n_heads
int64_t mlp_hidden_size(const ModelConfig& model);  // mlp_ratio * d_model rounded up to 64

// Whether a run rebuilds each recomputed layer beside the backward of the layer above
// (parallel.recompute_overlap; unset: at sp = 1): with recompute, without recompute_keeps_mixer. With
// `if_recomputed`, as if parallel.recompute were on (the memory estimate's recomputed peak).
bool recompute_overlap_applies(const RunConfig& config, bool if_recomputed = false);

// The ranks a run splits the optimizer's update and AdamW's moments over (parallel.shard_update,
// framework/train/sharded_update.h), as the config says: sp under the ordered scan at a power-of-two
// sp > 1 with the gradients summed after the backward or several segments a rank, times dp at a
// power-of-two dp; else 1. (The trainer also needs every parameter of one dtype.)
int64_t update_split_ranks(const RunConfig& config);

}  // namespace carry
