// `carry tokenize`: text files -> one carry token file (framework/data/token_file.h), each file a
// document preceded by the end-of-document token, tokenized in parallel by one of the tokenizers of
// framework/data/tokenizer.h (the byte-level one by default: each byte its own token 0..255, end of
// document 256, vocabulary 257). `--train-sentencepiece` trains a SentencePiece model instead.
#pragma once

#include <cstdint>

namespace carry {

constexpr uint32_t kByteEndOfDocument = 256;  // the byte tokenizer's end-of-document token
constexpr int64_t kByteVocabSize = 257;

int run_tokenize_command(int argc, char** argv);  // argv[0] is "tokenize"

}  // namespace carry
