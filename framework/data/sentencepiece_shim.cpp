// The bridge to the system's libsentencepiece, built as its own shared library
// (libcarry_sentencepiece.so beside the carry program) and opened at run time by tokenizer.cpp with
// dlmopen into a link-map namespace of its own. Debian's libsentencepiece carries its own copy of
// protobuf 3.14 and exports its symbols; linked into carry beside the system's libprotobuf (3.21), one
// of the two binds the other's symbols and the process aborts ("compiled against version 3.14.0 ...
// not compatible") or crashes. In its own namespace (with its own libstdc++ and C library) each keeps
// its protobuf. Only C types cross this boundary, and memory is never freed on the other side: ids
// and text come back through the caller's sink functions, which copy them.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

namespace {

void set_error(char* error, size_t size, const std::string& what) {
  if (error && size > 0) std::snprintf(error, size, "%s", what.c_str());
}

}  // namespace

extern "C" {

void* carry_spm_load(const char* path, char* error, size_t error_size) {
  auto* sp = new sentencepiece::SentencePieceProcessor;
  auto status = sp->Load(path);
  if (!status.ok()) {
    set_error(error, error_size, status.ToString());
    delete sp;
    return nullptr;
  }
  return sp;
}

void carry_spm_free(void* handle) { delete static_cast<sentencepiece::SentencePieceProcessor*>(handle); }

int64_t carry_spm_piece_size(void* handle) {
  return static_cast<sentencepiece::SentencePieceProcessor*>(handle)->GetPieceSize();
}

int64_t carry_spm_eos_id(void* handle) { return static_cast<sentencepiece::SentencePieceProcessor*>(handle)->eos_id(); }

// Encodes text; the ids go to sink(context, ids, n). Returns 0, or 1 with the message in `error`.
int carry_spm_encode(void* handle, const char* text, size_t length, void (*sink)(void*, const int*, size_t),
                     void* context, char* error, size_t error_size) {
  std::vector<int> ids;
  auto status = static_cast<sentencepiece::SentencePieceProcessor*>(handle)->Encode(std::string_view(text, length), &ids);
  if (!status.ok()) {
    set_error(error, error_size, status.ToString());
    return 1;
  }
  sink(context, ids.data(), ids.size());
  return 0;
}

int carry_spm_decode(void* handle, const int* ids, size_t n, void (*sink)(void*, const char*, size_t), void* context) {
  std::string text;
  auto status = static_cast<sentencepiece::SentencePieceProcessor*>(handle)->Decode(std::vector<int>(ids, ids + n), &text);
  if (!status.ok()) return 1;
  sink(context, text.data(), text.size());
  return 0;
}

// SentencePieceTrainer::Train with spm_train's flags ("--input=a.txt --model_prefix=m --vocab_size=8000").
int carry_spm_train(const char* args, char* error, size_t error_size) {
  // The trainer logs its command line to std::cerr before it reads --minloglevel; errors come back in
  // the status, so its stream is muted while it runs.
  std::cerr.setstate(std::ios::failbit);
  auto status = sentencepiece::SentencePieceTrainer::Train(args);
  std::cerr.clear();
  if (!status.ok()) {
    set_error(error, error_size, status.ToString());
    return 1;
  }
  return 0;
}

}  // extern "C"
