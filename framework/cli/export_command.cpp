// `carry export` and `carry import` (export_command.h).
#include "framework/cli/export_command.h"

#include "framework/cli/command_args.h"
#include "framework/config/config.h"
#include "framework/io/fla_format.h"
#include "framework/io/model_source.h"
#include "framework/io/output_file.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <fstream>
#include <string>

namespace carry {
namespace {

const char* kExportUsage =
    "usage: carry export MODEL --format fla|hf --out DIR [--dtype fp32|bf16]\n"
    "                    [--tokenizer byte|bpe:FILE|sentencepiece:FILE]\n"
    "  Writes DIR/config.json and DIR/model.safetensors in flash-linear-attention's names and layouts, loadable\n"
    "  with fla.models.<Class>.from_pretrained(DIR) or, after `import fla`, transformers'\n"
    "  AutoModelForCausalLM.from_pretrained(DIR) (--format hf writes the same folder: FLA's classes are what\n"
    "  transformers loads). MODEL: a carry checkpoint (a run's checkpoint.dir, whose newest valid step is\n"
    "  taken, or one step_* directory). Maps gated_deltanet, gated_deltaproduct, deltanet, gla and rwkv7 models (gla\n"
    "  without short convolutions; rwkv7 with norm layer_norm, the rwkv7 channel mix and norm_eps 1e-5, FLA's\n"
    "  RWKV7ForCausalLM); other models are refused with the reasons. --dtype: of the written weights (fp32\n"
    "  default: the checkpoint's values bit for bit). --tokenizer: the tokenizer the run's token files were\n"
    "  made with (carry tokenize's spec), written beside the weights as tokenizer.json, tokenizer_config.json\n"
    "  and special_tokens_map.json (a SentencePiece model converted to tokenizer.json that encodes as\n"
    "  SentencePiece does, and the model itself as tokenizer.model), its end-of-document token as\n"
    "  eos_token_id in config.json and generation_config.json (transformers' AutoTokenizer then loads\n"
    "  DIR). Without it, the run's\n"
    "  data.token_files.eod_token (when set) is the eos_token_id.\n";

const char* kImportUsage =
    "usage: carry import FOLDER [--model-out MODEL.textproto]\n"
    "  Reads an FLA / Hugging Face folder (config.json + model.safetensors, or shards listed in\n"
    "  model.safetensors.index.json) as carry reads it for init_from, eval and generate: every weight is\n"
    "  matched by name and shape, nothing left over. Prints the carry model config it describes; with\n"
    "  --model-out also writes it as a model preset (for a run's model_preset, with init_from: FOLDER).\n";

std::string message_of(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

}  // namespace

int run_export_command(int argc, char** argv) {
  CommandArgs args(argc, argv);
  if (args.help()) {
    std::fputs(kExportUsage, stdout);
    return 0;
  }
  std::string model_path, format, out, dtype = "fp32", tokenizer;
  try {
    std::string a;
    while (args.next(a)) {
      if (a == "--format") format = args.value(a);
      else if (a == "--out") out = args.value(a);
      else if (a == "--dtype") dtype = args.value(a);
      else if (a == "--tokenizer") tokenizer = args.value(a);
      else if (a.rfind("-", 0) == 0) throw UsageError("unknown flag '" + a + "'");
      else if (model_path.empty()) model_path = a;
      else throw UsageError("one MODEL expected, got '" + model_path + "' and '" + a + "'");
    }
    if (model_path.empty()) throw UsageError("MODEL (a carry checkpoint) is required");
    if (format != "fla" && format != "hf") throw UsageError("--format must be fla or hf, got '" + format + "'");
    if (out.empty()) throw UsageError("--out DIR is required");
    if (dtype != "fp32" && dtype != "bf16") throw UsageError("--dtype must be fp32 or bf16, got '" + dtype + "'");
  } catch (const UsageError& e) {
    std::fprintf(stderr, "carry export: %s\n%s", e.what(), kExportUsage);
    return 2;
  }
  try {
    ModelSource source = load_model_source(model_path);
    FlaExportOptions opt;
    opt.dtype = dtype == "bf16" ? at::kBFloat16 : at::kFloat;
    opt.tokenizer = tokenizer;
    if (!source.run_config_text.empty()) {
      const RunConfig run = parse_stored_run_config(source.run_config_text, source.describe());
      if (run.data().has_token_files() && run.data().token_files().eod_token() >= 0)
        opt.eos_token_id = run.data().token_files().eod_token();
    }
    opt.metadata["carry_source"] = source.describe();
    if (source.step >= 0) opt.metadata["step"] = std::to_string(source.step);
    if (!source.run_config_text.empty()) opt.metadata["carry_run_config"] = source.run_config_text;
    export_fla_folder(out, source.model, source.weights, opt);
    int64_t count = 0;
    for (auto& [name, t] : source.weights) count += t.numel();
    std::printf("carry export: %s -> %s (config.json, model.safetensors: %zu tensors, %.2fM parameters, %s%s)\n",
                source.describe().c_str(), out.c_str(), source.weights.size(), static_cast<double>(count) / 1e6,
                dtype.c_str(), tokenizer.empty() ? "" : "; tokenizer.json from the tokenizer");
    std::printf("  load: python3 -c \"import fla, transformers; transformers.AutoModelForCausalLM.from_pretrained('%s')\"\n",
                out.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "carry export: %s\n", message_of(e).c_str());
    return 1;
  }
}

int run_import_command(int argc, char** argv) {
  CommandArgs args(argc, argv);
  if (args.help()) {
    std::fputs(kImportUsage, stdout);
    return 0;
  }
  std::string folder, model_out;
  try {
    std::string a;
    while (args.next(a)) {
      if (a == "--model-out") model_out = args.value(a);
      else if (a.rfind("-", 0) == 0) throw UsageError("unknown flag '" + a + "'");
      else if (folder.empty()) folder = a;
      else throw UsageError("one FOLDER expected, got '" + folder + "' and '" + a + "'");
    }
    if (folder.empty()) throw UsageError("FOLDER (an FLA / Hugging Face folder) is required");
  } catch (const UsageError& e) {
    std::fprintf(stderr, "carry import: %s\n%s", e.what(), kImportUsage);
    return 2;
  }
  try {
    if (!is_fla_folder(folder))
      throw ConfigError(folder + ": no config.json: expected an FLA / Hugging Face folder (a carry checkpoint needs no "
                        "import: init_from, eval and generate read it as it is)");
    ModelSource source = load_model_source(folder);
    Model model = build_model_from_source(source);  // the strict check: every weight in its place
    const std::string text = config_to_text(source.model);
    std::printf("carry import: %s: %s\n", source.describe().c_str(), model.summary().c_str());
    std::printf("# the model config (a run's model { ... } or model_preset; init_from: \"%s\")\n%s", folder.c_str(),
                text.c_str());
    if (!model_out.empty()) {
      write_whole_file(model_out, "# carry model config of " + folder + " (carry import)\n" + text, "--model-out",
                       /*sync=*/false, /*allow_char_device=*/true);
      std::printf("wrote %s\n", model_out.c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "carry import: %s\n", message_of(e).c_str());
    return 1;
  }
}

}  // namespace carry
