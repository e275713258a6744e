// `carry generate MODEL --prompt TEXT | --prompt-ids IDS ...`: samples a continuation from a trained
// model (framework/infer/generate.h: the prompt read chunkwise, then one recurrent step a token).
// `carry generate --help` lists the flags.
#pragma once

namespace carry {

int run_generate_command(int argc, char** argv);  // argv[0] is "generate"

}  // namespace carry
