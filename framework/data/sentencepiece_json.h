// A SentencePiece model as a Hugging Face tokenizer.json that encodes as SentencePiece does, for a
// self-contained export (`carry export --tokenizer sentencepiece:m.model`).
//
// The model file is SentencePiece's ModelProto, read here from its wire format (the fields named below;
// carry does not link the protobuf that Debian's libsentencepiece bundles): the pieces (text, score,
// type), the trainer's model type, unk id and piece, byte fallback, and the normalizer (its precompiled
// character map, dummy prefix, extra-whitespace removal, whitespace escaping). The tokenizer.json follows
// the model's own settings in SentencePiece's order:
//   normalizer    the character map (Hugging Face's Precompiled reads the same map), then, when the model
//                 removes extra whitespace, the spaces at the ends dropped and runs of spaces made one;
//                 spaces escaped to U+2581 "▁"; a leading "▁" doubled where the dummy prefix is added
//                 (Metaspace adds none to a text that starts with one; SentencePiece always does)
//   pre_tokenizer Metaspace adding the dummy prefix (no split), then user-defined pieces isolated
//                 (SentencePiece emits them whole)
//   model         unigram: the pieces with their scores, the unk id, byte fallback; BPE: the pieces as the
//                 vocabulary and a merge (left, right) for every normal piece that two normal pieces make,
//                 ranked by the merged piece's score (SentencePiece merges the best-scoring pair first)
//   decoder       "▁" back to spaces, byte pieces to bytes, the dummy prefix's space removed
// Control and unknown pieces are special added tokens. Refused with what was found: a file that is not
// such a model, word and char models, whitespace treated as a suffix.
#pragma once

#include <string>

namespace carry {

struct SentencePieceJson {
  std::string tokenizer_json;
  std::string eos_piece;  // the end-of-sentence piece's text ("" when the model has none)
  int64_t eos_id = -1;
};

// From the model file's bytes; throws std::runtime_error naming `path` and what is wrong.
SentencePieceJson sentencepiece_tokenizer_json(const std::string& model_bytes, const std::string& path);

}  // namespace carry
