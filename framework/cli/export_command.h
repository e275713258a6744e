// `carry export MODEL --format fla|hf --out DIR`: a carry checkpoint as an FLA / Hugging Face folder
// (config.json + model.safetensors; framework/io/fla_format.h says which models map and how).
// `carry import FOLDER [--model-out FILE]`: reads such a folder strictly and prints the carry model
// config it describes (a run's init_from then starts from its weights; eval and generate read it
// directly).
#pragma once

namespace carry {

int run_export_command(int argc, char** argv);  // argv[0] is "export"
int run_import_command(int argc, char** argv);  // argv[0] is "import"

}  // namespace carry
