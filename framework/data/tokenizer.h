// Tokenizers for `carry tokenize`: text -> token ids, each with its vocabulary size and the
// end-of-document id written before every document (so documents stay apart when token files are
// concatenated, and a run can tell where one begins).
//
// Supported (load_tokenizer's spec):
//   byte                      one token a byte (0..255), end of document 256, vocabulary 257;
//   sentencepiece:MODEL       a SentencePiece model file (Llama 1/2, T5, Gemma, ... or one trained by
//                             `carry tokenize --train-sentencepiece`), through the system's
//                             libsentencepiece (opened at run time: sentencepiece_shim.cpp says why);
//                             end of document: the model's </s> (eos) id;
//   bpe:TOKENIZER.json        a Hugging Face tokenizer.json holding a byte-level BPE model (GPT-2,
//                             RoBERTa, GPT-NeoX, Llama 3, Qwen2, ...): model.type "BPE" over GPT-2's
//                             byte-to-character map, pre-tokenized by GPT-2's ByteLevel regex or a
//                             Split with the GPT-2 or cl100k/Llama 3 regex (hand-written scanners,
//                             framework/data/pretokenize.h) or any other regex (Oniguruma,
//                             framework/data/regex_split.h), with no normalizer or NFC / NFKC
//                             (utf8proc); end of document: the added token <|endoftext|> (GPT-2,
//                             NeoX, Qwen) or <|end_of_text|> (Llama 3);
//   tiktoken:FILE[:PATTERN]   a tiktoken rank file (lines "base64-bytes rank", e.g. cl100k_base.tiktoken
//                             or Llama 3's tokenizer.model), merges implied by the ranks, PATTERN gpt2 or
//                             cl100k (default; = llama3); needs the end-of-document id from the caller.
// The byte-level BPE is carry's own: pieces from the pre-tokenizer, each piece's bytes merged pair by
// pair, lowest merge rank first (all occurrences of that pair, left to right), as GPT-2's reference
// does; a piece seen before is looked up in a per-call cache.
// Every tokenizer here is safe to call from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace carry {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string description() const = 0;  // "SentencePiece m.model (unigram)", ...
  virtual int64_t vocab_size() const = 0;        // every id < this
  virtual uint32_t end_of_document() const = 0;
  // Appends the ids of `text` (no end-of-document token) to `out`.
  virtual void encode(std::string_view text, std::vector<uint32_t>* out) const = 0;
  virtual std::string decode(const std::vector<uint32_t>& ids) const = 0;
};

// `spec` as listed above; `end_of_document` >= 0 overrides the tokenizer's own (and is required for
// tiktoken files). Throws std::runtime_error naming the file and what is wrong or unsupported.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec, int64_t end_of_document = -1);

// A tokenizer as Hugging Face files, for a self-contained export: tokenizer.json's text and the end-of-document
// token's id and text. byte: a byte-level BPE with no merges whose ids are the bytes and whose <|endoftext|> is
// 256 (read back by `bpe:` it encodes as the byte tokenizer does); bpe:FILE: FILE itself; sentencepiece:FILE:
// the model converted (framework/data/sentencepiece_json.h), its end of sentence as the end of document, and
// the model file itself (written beside as tokenizer.model). Throws std::runtime_error for tiktoken files.
struct HfTokenizer {
  std::string tokenizer_json, eos_token;
  int64_t eos_id = -1;
  std::string sentencepiece_model;  // the .model file's bytes, for sentencepiece:FILE
};
HfTokenizer hf_tokenizer(const std::string& spec);

// Whether SentencePiece can be used: libcarry_sentencepiece.so (built when libsentencepiece-dev was
// found) opens beside the running program, or where CARRY_SENTENCEPIECE_LIB names.
bool sentencepiece_available();
// Trains a SentencePiece model with spm_train's flags, e.g. "--input=a.txt,b.txt --model_prefix=out/m
// --vocab_size=4000 --model_type=bpe" (writes out/m.model and out/m.vocab). Throws with the library's message.
void train_sentencepiece(const std::string& flags);

}  // namespace carry
