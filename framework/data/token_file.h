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

enum class TokenFileFormat { carry, llmc };

// A read-only token file. Opening validates the header and the size against the token count; every
// error (std::runtime_error) names the path and what was expected, including a file that has become
// shorter since it was opened.
class TokenFile {
 public:
  explicit TokenFile(const std::string& path);
  ~TokenFile();
  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::string& path() const { return path_; }
  TokenFileFormat format() const { return format_; }
  int64_t size() const { return count_; }  // tokens
  int width() const { return width_; }     // bytes per token: 2 or 4

  uint32_t at(int64_t i) const;  // bounds-checked
  // Tokens [start, start+count) into `out` (bounds-checked).
  void read(int64_t start, int64_t count, int64_t* out) const;
  // Tokens [start, start+count) as an int64 CPU tensor [count].
  at::Tensor read_tensor(int64_t start, int64_t count) const;
  // The index of the first token >= bound, or -1 when every token is below it: one pass over the
  // file in blocks of a few MiB. `progress(tokens_done, size())` is called after each block.
  int64_t find_token_at_least(uint32_t bound,
                              const std::function<void(int64_t, int64_t)>& progress = {}) const;

 private:
  void close();
  // The bytes [offset, offset+n) into out; throws naming the file when they are not all there.
  void read_bytes(uint64_t offset, size_t n, unsigned char* out) const;
  std::string path_;
  TokenFileFormat format_ = TokenFileFormat::carry;
  int width_ = 2;
  int64_t count_ = 0;
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

// Writes a whole carry token file; width 0 picks 2 if every token is < 65536, else 4.
void write_token_file(const std::string& path, const std::vector<uint32_t>& tokens, int width = 0);

}  // namespace carry
