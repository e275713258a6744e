// `carry tokenize`: text files -> one carry token file (framework/data/token_file.h) with the built-in
// byte-level tokenizer: each byte is its own token (0..255), and an end-of-document token (256)
// separates consecutive input files. Vocabulary: 257 tokens; stored 2 bytes per token.
#pragma once

#include <cstdint>

namespace carry {

constexpr uint32_t kByteEndOfDocument = 256;  // the byte tokenizer's end-of-document token
constexpr int64_t kByteVocabSize = 257;

int run_tokenize_command(int argc, char** argv);  // argv[0] is "tokenize"

}  // namespace carry
