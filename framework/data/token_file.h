// Token files: a flat array of token ids, read with pread (not memory-mapped: a file truncated or
// replaced while a run reads it is then an error message naming the file, not a SIGBUS).
//
// carry's format (".tok"), all little-endian:
//   bytes 0..7    magic "CARRYTOK"
//   bytes 8..11   version (u32) = 1
//   bytes 12..15  token width in bytes (u32): 2 (ids < 65536) or 4
//   bytes 16..23  token count (u64)
//   bytes 24..    the tokens, `width` bytes each; the file ends right after the last one.
// llm.c's ".bin" files are read too: a header of 256 int32 (1024 bytes): [0] magic, [1] version,
// [2] token count; magic 20240520 with version 1 = GPT-2, uint16 tokens; magic 20240801 with version
// 7 = Llama 3, uint32 tokens; tokens from byte 1024.
// Megatron-LM's indexed datasets (`.bin` + `.idx`, megatron/core/datasets/indexed_dataset.py) are
// read as one stream of their sequences in order: the path names the prefix ("corpus_text_document",
// as Megatron does), its `.bin` or its `.idx`. The `.idx` ("MMIDIDX\0\0", all little-endian):
//   9 bytes magic, u64 version = 1, u8 dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
//   8 uint16; 6 and 7 are floats, refused), u64 sequence count S, u64 document count D,
//   i32 sizes[S] (tokens a sequence), i64 pointers[S] (byte offset of each sequence in the .bin),
//   i64 doc_idx[D] (the first sequence of each document, then S), optionally i8 modes[S];
// the pointers must lay the sequences end to end from byte 0 and the `.bin` must end after the last.
// Raw token files (a flat array of little-endian uint16 or uint32, no header; nanoGPT's and many
// others' `.bin`) are named with their width before the path: "uint16:data/train.bin",
// "uint32:shards/*.bin"; the file size must be a multiple of the width.
// Files are written to a temporary name in the same directory and renamed when complete, so a
// reader never sees half a file under the final name.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace carry {

enum class TokenFileFormat { carry, llmc, megatron, raw };

// A read-only token file. Opening validates the header and the size against the token count; every
// error (std::runtime_error) names the path and what was expected, including a file that has become
// shorter since it was opened.
class TokenFile {
 public:
  // `path` as a run config names it: a file, a Megatron prefix, or "uint16:"/"uint32:" and a raw file.
  explicit TokenFile(const std::string& path);
  ~TokenFile();
  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::string& path() const { return path_; }
  TokenFileFormat format() const { return format_; }
  int64_t size() const { return count_; }  // tokens
  int width() const { return width_; }     // bytes per token: 2 or 4 (Megatron: 1, 2, 4 or 8)
  // Megatron datasets: the data file read and the documents its index counts (0 for other formats).
  const std::string& data_path() const { return data_path_; }
  int64_t documents() const { return documents_; }

  uint32_t at(int64_t i) const;  // bounds-checked
  // Tokens [start, start+count) into `out` (bounds-checked). Signed Megatron dtypes keep their sign:
  // check_token_files reports a negative id.
  void read(int64_t start, int64_t count, int64_t* out) const;
  // Tokens [start, start+count) as an int64 CPU tensor [count].
  at::Tensor read_tensor(int64_t start, int64_t count) const;
  // The index of the first token >= bound, or -1 when every token is below it: one pass over the
  // file in blocks of a few MiB. `progress(tokens_done, size())` is called after each block.
  int64_t find_token_at_least(uint32_t bound,
                              const std::function<void(int64_t, int64_t)>& progress = {}) const;

 private:
  void close();
  void open_megatron(const std::string& prefix);
  // The bytes [offset, offset+n) into out; throws naming the file when they are not all there.
  void read_bytes(uint64_t offset, size_t n, unsigned char* out) const;
  std::string path_;
  TokenFileFormat format_ = TokenFileFormat::carry;
  std::string data_path_;  // the file read (path_ without a "uint16:" prefix; a Megatron .bin)
  int width_ = 2;
  bool signed_ = false;
  int64_t count_ = 0, documents_ = 0;
  int fd_ = -1;
  uint64_t tokens_offset_ = 0;  // bytes of the header
};

// Streams tokens into a new carry token file: writes to "<path>.tmp.<pid>", and commit() patches the
// count into the header, flushes and renames it to `path`. Destroyed without commit(), it removes the
// temporary file. Tokens must fit the width (2: < 65536).
class TokenFileWriter {
 public:
  TokenFileWriter(const std::string& path, int width);
  ~TokenFileWriter();
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;

  void append(const uint32_t* tokens, size_t n);
  void append(uint32_t token) { append(&token, 1); }
  int64_t count() const { return count_; }
  // The temporary file the tokens go to until commit() renames it to the path (removed by the
  // destructor when commit() was not reached).
  const std::string& temp_path() const { return temp_path_; }
  void commit();

 private:
  std::string path_, temp_path_;
  int width_;
  int64_t count_ = 0;
  std::FILE* file_ = nullptr;
  std::vector<unsigned char> buffer_;
};

// Splits "uint16:PATH" / "uint32:PATH" into the width (2, 4) and the path; 0 and `spec` otherwise.
int raw_token_width(const std::string& spec, std::string* path);

// Writes a whole carry token file; width 0 picks 2 if every token is < 65536, else 4.
void write_token_file(const std::string& path, const std::vector<uint32_t>& tokens, int width = 0);

}  // namespace carry
