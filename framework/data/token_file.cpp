// Token files (see token_file.h): the header is checked before the tokens are touched (magic,
// version, width, and file size == header + count*width; for a Megatron dataset its whole index,
// streamed in blocks, against the .bin); tokens are read with pread and decoded with memcpy (the
// formats are little-endian, as is every host carry builds for). A read that comes back short (the
// file was truncated after it was opened) throws.
#include "framework/data/token_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <utility>

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token files are little-endian; so must the host be");

namespace carry {

namespace {

constexpr char kMagic[8] = {'C', 'A', 'R', 'R', 'Y', 'T', 'O', 'K'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 24;
constexpr int32_t kLlmcGpt2Magic = 20240520, kLlmcLlama3Magic = 20240801;
constexpr size_t kLlmcHeaderBytes = 256 * sizeof(int32_t);
constexpr char kMegatronMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr size_t kMegatronHeaderBytes = 9 + 8 + 1 + 8 + 8;

bool ends_with(const std::string& s, const char* tail) {
  const size_t n = std::strlen(tail);
  return s.size() >= n && s.compare(s.size() - n, n, tail) == 0;
}

bool is_regular_file(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool starts_with_megatron_magic(const std::string& p) {
  std::FILE* f = std::fopen(p.c_str(), "rb");
  if (!f) return false;
  char head[9] = {};
  const bool ok = std::fread(head, 1, 9, f) == 9 && std::memcmp(head, kMegatronMagic, 9) == 0;
  std::fclose(f);
  return ok;
}

// The Megatron prefix `spec` names (its .idx, its .bin with an MMIDIDX .idx beside it, or the prefix
// itself when no such file exists but PREFIX.idx does); false for any other file.
bool megatron_prefix(const std::string& spec, std::string* prefix) {
  if (ends_with(spec, ".idx")) {
    *prefix = spec.substr(0, spec.size() - 4);
    return true;
  }
  if (ends_with(spec, ".bin")) {
    const std::string stem = spec.substr(0, spec.size() - 4);
    if (is_regular_file(stem + ".idx") && starts_with_megatron_magic(stem + ".idx")) {
      *prefix = stem;
      return true;
    }
    return false;
  }
  if (!is_regular_file(spec) && is_regular_file(spec + ".idx")) {
    *prefix = spec;
    return true;
  }
  return false;
}

// Megatron's DType codes: (bytes, signed) or (0, _) for the float and unknown codes.
std::pair<int, bool> megatron_dtype(unsigned code) {
  switch (code) {
    case 1: return {1, false};  // uint8
    case 2: return {1, true};   // int8
    case 3: return {2, true};   // int16
    case 4: return {4, true};   // int32
    case 5: return {8, true};   // int64
    case 8: return {2, false};  // uint16
    default: return {0, false};
  }
}

template <class... Args>
std::runtime_error error(const std::string& path, const Args&... args) {
  std::ostringstream os;
  os << path << ": ";
  (os << ... << args);
  return std::runtime_error(os.str());
}

template <class T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

std::string hex_bytes(const unsigned char* p, size_t n) {
  std::ostringstream os;
  static const char* digits = "0123456789abcdef";
  for (size_t i = 0; i < n; ++i) os << (i ? " " : "") << digits[p[i] >> 4] << digits[p[i] & 15];
  return os.str();
}

// The token count and width must account for the file size exactly.
void check_size(const std::string& path, const char* what, size_t header, int64_t count, int width, size_t size) {
  auto need = static_cast<unsigned long long>(header) + static_cast<unsigned long long>(count) * width;
  if (size < need)
    throw error(path, "truncated: the ", what, " header announces ", count, " tokens of ", width, " bytes (",
                need, " bytes with the header), but the file has ", size, " bytes");
  if (size > need)
    throw error(path, "the ", what, " header announces ", count, " tokens of ", width, " bytes (", need,
                " bytes with the header), but the file has ", size, " bytes (", size - need, " extra)");
}

}  // namespace

int raw_token_width(const std::string& spec, std::string* path) {
  for (auto [prefix, width] : {std::pair<const char*, int>{"uint16:", 2}, {"uint32:", 4}})
    if (spec.rfind(prefix, 0) == 0) {
      *path = spec.substr(std::strlen(prefix));
      return width;
    }
  *path = spec;
  return 0;
}

TokenFile::TokenFile(const std::string& spec) : path_(spec) {
  std::string path, prefix;
  const int raw_width = raw_token_width(spec, &path);
  data_path_ = path;
  if (raw_width == 0 && megatron_prefix(path, &prefix)) {
    open_megatron(prefix);
    return;
  }
  // O_NONBLOCK: a FIFO in the file's place is refused below, never waited on.
  fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd_ < 0) throw error(path, "cannot open token file: ", std::strerror(errno));
  try {
    struct stat st;
    if (::fstat(fd_, &st) != 0) throw error(path, "cannot stat token file: ", std::strerror(errno));
    if (S_ISDIR(st.st_mode)) throw error(path, "is a directory, not a token file");
    if (!S_ISREG(st.st_mode)) throw error(path, "is not a regular file (a token file is read by offset)");
    ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_NONBLOCK);
    auto size = static_cast<size_t>(st.st_size);
    if (raw_width > 0) {
      format_ = TokenFileFormat::raw;
      width_ = raw_width;
      if (size % raw_width != 0)
        throw error(path, "a raw file of uint", 8 * raw_width, " tokens must have a multiple of ", raw_width,
                    " bytes, but it has ", size, " (", size % raw_width, " extra): is it another width, or truncated?");
      count_ = static_cast<int64_t>(size / raw_width);
      tokens_offset_ = 0;
      return;
    }
    if (size < 8)
      throw error(path, "not a token file: ", size, " bytes, shorter than any header (", kHeaderBytes,
                  " bytes for CARRYTOK, ", kLlmcHeaderBytes, " for llm.c .bin)");
    unsigned char head[kLlmcHeaderBytes] = {};
    read_bytes(0, std::min(size, kLlmcHeaderBytes), head);
    if (std::memcmp(head, kMagic, 8) == 0) {
      format_ = TokenFileFormat::carry;
      if (size < kHeaderBytes)
        throw error(path, "truncated: ", size, " bytes, shorter than the CARRYTOK header (", kHeaderBytes, " bytes)");
      auto version = load<uint32_t>(head + 8);
      auto width = load<uint32_t>(head + 12);
      auto count = load<uint64_t>(head + 16);
      if (version != kVersion)
        throw error(path, "unsupported CARRYTOK version ", version, " (this build reads version ", kVersion, ")");
      if (width != 2 && width != 4) throw error(path, "unsupported token width ", width, " bytes (expected 2 or 4)");
      if (count > static_cast<uint64_t>(INT64_MAX / 4))
        throw error(path, "the header announces an impossible token count ", count);
      width_ = static_cast<int>(width);
      count_ = static_cast<int64_t>(count);
      check_size(path, "CARRYTOK", kHeaderBytes, count_, width_, size);
      tokens_offset_ = kHeaderBytes;
    } else if (auto magic = load<int32_t>(head); magic == kLlmcGpt2Magic || magic == kLlmcLlama3Magic) {
      format_ = TokenFileFormat::llmc;
      if (size < kLlmcHeaderBytes)
        throw error(path, "truncated: ", size, " bytes, shorter than the llm.c header (", kLlmcHeaderBytes, " bytes)");
      auto version = load<int32_t>(head + 4);
      auto count = load<int32_t>(head + 8);
      int32_t expected = magic == kLlmcGpt2Magic ? 1 : 7;
      if (version != expected)
        throw error(path, "unsupported llm.c version ", version, " for magic ", magic, " (expected ", expected, ": ",
                    magic == kLlmcGpt2Magic ? "GPT-2, uint16 tokens" : "Llama 3, uint32 tokens", ")");
      if (count < 0) throw error(path, "the llm.c header announces a negative token count ", count);
      width_ = magic == kLlmcGpt2Magic ? 2 : 4;
      count_ = count;
      check_size(path, "llm.c", kLlmcHeaderBytes, count_, width_, size);
      tokens_offset_ = kLlmcHeaderBytes;
    } else {
      throw error(path, "not a token file: it starts with bytes ", hex_bytes(head, 8),
                  ", expected the magic \"CARRYTOK\", an llm.c .bin header (int32 ", kLlmcGpt2Magic, " or ",
                  kLlmcLlama3Magic, ") or a Megatron .bin with its .idx beside it; a raw token array is named "
                  "\"uint16:", path, "\" or \"uint32:", path, "\"");
    }
  } catch (...) {
    close();
    throw;
  }
}

void TokenFile::open_megatron(const std::string& prefix) {
  format_ = TokenFileFormat::megatron;
  const std::string idx = prefix + ".idx", bin = prefix + ".bin";
  data_path_ = bin;
  int ifd = ::open(idx.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // a FIFO: refused below, not waited on
  if (ifd < 0) throw error(idx, "cannot open the Megatron index: ", std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{ifd};
  struct stat st;
  if (::fstat(ifd, &st) != 0 || !S_ISREG(st.st_mode)) throw error(idx, "is not a regular file (a Megatron index)");
  const auto idx_size = static_cast<uint64_t>(st.st_size);
  auto read_at = [&](uint64_t offset, size_t n, unsigned char* out) {
    size_t done = 0;
    while (done < n) {
      ssize_t got = ::pread(ifd, out + done, n - done, static_cast<off_t>(offset + done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) throw error(idx, "cannot read bytes [", offset + done, ", ", offset + n, ") of the Megatron index");
      done += static_cast<size_t>(got);
    }
  };
  if (idx_size < kMegatronHeaderBytes)
    throw error(idx, "truncated: ", idx_size, " bytes, shorter than the Megatron index header (", kMegatronHeaderBytes,
                " bytes)");
  unsigned char head[kMegatronHeaderBytes];
  read_at(0, kMegatronHeaderBytes, head);
  if (std::memcmp(head, kMegatronMagic, 9) != 0)
    throw error(idx, "not a Megatron index: it starts with bytes ", hex_bytes(head, 9),
                ", expected \"MMIDIDX\\0\\0\" (4d 4d 49 44 49 44 58 00 00)");
  const auto version = load<uint64_t>(head + 9);
  if (version != 1) throw error(idx, "unsupported Megatron index version ", version, " (this build reads version 1)");
  const unsigned code = head[17];
  const auto [width, is_signed] = megatron_dtype(code);
  if (width == 0)
    throw error(idx, "the Megatron index's dtype code ", code, " is not an integer token type (expected 1 uint8, 2 int8, "
                "3 int16, 4 int32, 5 int64 or 8 uint16", code == 6 || code == 7 ? "; 6 and 7 are floats" : "", ")");
  width_ = width;
  signed_ = is_signed;
  const auto S = load<uint64_t>(head + 18), D = load<uint64_t>(head + 26);
  if (S > (uint64_t{1} << 40) || D > (uint64_t{1} << 40))
    throw error(idx, "the Megatron index announces an impossible size: ", S, " sequences, ", D, " documents");
  const uint64_t need = kMegatronHeaderBytes + 4 * S + 8 * S + 8 * D;
  if (idx_size != need && idx_size != need + S)  // (+ S: one mode byte a sequence, multimodal datasets)
    throw error(idx, idx_size < need ? "truncated: " : "", "the Megatron index header announces ", S, " sequences and ",
                D, " documents (", need, " bytes of index, or ", need + S, " with sequence modes), but the file has ",
                idx_size, " bytes");
  // Sizes and pointers, in blocks: the sequences must lie end to end from byte 0 of the .bin.
  constexpr uint64_t kBlock = uint64_t{1} << 20;
  std::vector<unsigned char> sizes, pointers;
  uint64_t tokens = 0;
  for (uint64_t s0 = 0; s0 < S; s0 += kBlock) {
    const uint64_t n = std::min(kBlock, S - s0);
    sizes.resize(4 * n);
    pointers.resize(8 * n);
    read_at(kMegatronHeaderBytes + 4 * s0, sizes.size(), sizes.data());
    read_at(kMegatronHeaderBytes + 4 * S + 8 * s0, pointers.size(), pointers.data());
    for (uint64_t i = 0; i < n; ++i) {
      const auto size = load<int32_t>(sizes.data() + 4 * i);
      const auto pointer = load<int64_t>(pointers.data() + 8 * i);
      if (size < 0) throw error(idx, "sequence ", s0 + i, " has a negative size ", size);
      if (static_cast<uint64_t>(pointer) != tokens * width_)
        throw error(idx, "sequence ", s0 + i, " starts at byte ", pointer, " of ", bin, ", but the sequences before it end at byte ",
                    tokens * width_, " (carry reads datasets whose sequences lie end to end, as Megatron writes them)");
      tokens += static_cast<uint64_t>(size);
    }
  }
  // doc_idx: from 0, never decreasing, ending at S.
  std::vector<unsigned char> docs;
  int64_t previous = 0;
  for (uint64_t d0 = 0; d0 < D; d0 += kBlock) {
    const uint64_t n = std::min(kBlock, D - d0);
    docs.resize(8 * n);
    read_at(kMegatronHeaderBytes + 12 * S + 8 * d0, docs.size(), docs.data());
    for (uint64_t i = 0; i < n; ++i) {
      const auto v = load<int64_t>(docs.data() + 8 * i);
      if ((d0 + i == 0 && v != 0) || v < previous || static_cast<uint64_t>(v) > S)
        throw error(idx, "document index entry ", d0 + i, " is ", v, "; expected entries from 0, never decreasing, up to the ",
                    S, " sequences");
      previous = v;
    }
  }
  if (D == 0 || static_cast<uint64_t>(previous) != S)
    throw error(idx, "the document index ends at sequence ", previous, ", expected the sequence count ", S);
  documents_ = static_cast<int64_t>(D) - 1;
  count_ = static_cast<int64_t>(tokens);
  tokens_offset_ = 0;
  fd_ = ::open(bin.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // read by pread: O_NONBLOCK changes nothing else
  if (fd_ < 0) throw error(bin, "cannot open the Megatron data file (", idx, " is its index): ", std::strerror(errno));
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    close();
    throw error(bin, "is not a regular file (a Megatron data file)");
  }
  const auto bin_size = static_cast<uint64_t>(st.st_size);
  if (bin_size != tokens * width_) {
    close();
    throw error(bin, bin_size < tokens * width_ ? "truncated: " : "", "its index ", idx, " announces ", tokens,
                " tokens of ", width_, " bytes (", tokens * width_, " bytes), but the file has ", bin_size, " bytes");
  }
}

TokenFile::~TokenFile() { close(); }

void TokenFile::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

TokenFile::TokenFile(TokenFile&& other) noexcept { *this = std::move(other); }

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this == &other) return *this;
  close();
  path_ = std::move(other.path_);
  format_ = other.format_;
  data_path_ = std::move(other.data_path_);
  width_ = other.width_;
  signed_ = other.signed_;
  count_ = other.count_;
  documents_ = other.documents_;
  fd_ = other.fd_;
  tokens_offset_ = other.tokens_offset_;
  other.fd_ = -1;
  other.count_ = 0;
  return *this;
}

void TokenFile::read_bytes(uint64_t offset, size_t n, unsigned char* out) const {
  if (fd_ < 0) throw error(path_, "the token file is not open");
  size_t done = 0;
  while (done < n) {
    ssize_t got = ::pread(fd_, out + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) throw error(data_path_, "cannot read bytes [", offset + done, ", ", offset + n, "): ", std::strerror(errno));
    if (got == 0) {
      struct stat st;
      long long now = ::fstat(fd_, &st) == 0 ? static_cast<long long>(st.st_size) : -1;
      throw error(data_path_, "the file ends at byte ", offset + done, " but bytes up to ", offset + n,
                  " were expected (it has ", now, " bytes now, ", tokens_offset_ + static_cast<uint64_t>(count_) * width_,
                  " when it was opened): it was truncated or replaced while in use");
    }
    done += static_cast<size_t>(got);
  }
}

uint32_t TokenFile::at(int64_t i) const {
  if (i < 0 || i >= count_) throw error(path_, "token index ", i, " is out of range [0, ", count_, ")");
  int64_t v = 0;
  read(i, 1, &v);
  return static_cast<uint32_t>(v);
}

void TokenFile::read(int64_t start, int64_t count, int64_t* out) const {
  if (start < 0 || count < 0 || start > count_ || count > count_ - start)
    throw error(path_, "cannot read tokens [", start, ", ", start + count, "): the file has ", count_, " tokens");
  std::vector<unsigned char> bytes(static_cast<size_t>(count) * width_);
  if (count > 0) read_bytes(tokens_offset_ + static_cast<uint64_t>(start) * width_, bytes.size(), bytes.data());
  const unsigned char* p = bytes.data();
  switch (width_ * 2 + signed_) {
    case 2: for (int64_t i = 0; i < count; ++i) out[i] = p[i]; break;
    case 3: for (int64_t i = 0; i < count; ++i) out[i] = static_cast<int8_t>(p[i]); break;
    case 4: for (int64_t i = 0; i < count; ++i) out[i] = load<uint16_t>(p + 2 * i); break;
    case 5: for (int64_t i = 0; i < count; ++i) out[i] = load<int16_t>(p + 2 * i); break;
    case 8: for (int64_t i = 0; i < count; ++i) out[i] = load<uint32_t>(p + 4 * i); break;
    case 9: for (int64_t i = 0; i < count; ++i) out[i] = load<int32_t>(p + 4 * i); break;
    default: for (int64_t i = 0; i < count; ++i) out[i] = load<int64_t>(p + 8 * i); break;
  }
}

at::Tensor TokenFile::read_tensor(int64_t start, int64_t count) const {
  auto t = at::empty({count}, at::kLong);
  read(start, count, t.data_ptr<int64_t>());
  return t;
}

int64_t TokenFile::find_token_at_least(uint32_t bound, const std::function<void(int64_t, int64_t)>& progress) const {
  constexpr int64_t kBlockTokens = int64_t{1} << 21;  // 4 or 8 MiB a read
  std::vector<unsigned char> bytes;
  for (int64_t start = 0; start < count_; start += kBlockTokens) {
    const int64_t n = std::min(kBlockTokens, count_ - start);
    if (width_ != 2 && width_ != 4) {  // Megatron's other dtypes: decoded
      std::vector<int64_t> ids(static_cast<size_t>(n));
      read(start, n, ids.data());
      for (int64_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= static_cast<int64_t>(bound)) return start + i;
      if (progress) progress(start + n, count_);
      continue;
    }
    bytes.resize(static_cast<size_t>(n) * width_);
    read_bytes(tokens_offset_ + static_cast<uint64_t>(start) * width_, bytes.size(), bytes.data());
    const unsigned char* p = bytes.data();
    if (width_ == 2) {
      if (bound <= 0xFFFF)
        for (int64_t i = 0; i < n; ++i)
          if (load<uint16_t>(p + 2 * i) >= bound) return start + i;
    } else {
      for (int64_t i = 0; i < n; ++i)
        if (load<uint32_t>(p + 4 * i) >= bound) return start + i;
    }
    if (progress) progress(start + n, count_);
  }
  return -1;
}

// ---- writing ----

TokenFileWriter::TokenFileWriter(const std::string& path, int width) : path_(path), width_(width) {
  if (width != 2 && width != 4) throw error(path, "token width must be 2 or 4 bytes, got ", width);
  temp_path_ = path + ".tmp." + std::to_string(::getpid());
  // A file or a symbolic link left at this name (a writer of the same pid that was killed, or a link
  // planted to redirect the write) is removed, never followed; O_EXCL then creates a new file.
  ::unlink(temp_path_.c_str());
  const int fd = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) throw error(temp_path_, "cannot create token file: ", std::strerror(errno));
  file_ = ::fdopen(fd, "wb");
  if (!file_) {
    const int e = errno;
    ::close(fd);
    ::unlink(temp_path_.c_str());
    throw error(temp_path_, "cannot create token file: ", std::strerror(e));
  }
  unsigned char header[kHeaderBytes] = {};
  std::memcpy(header, kMagic, 8);
  uint32_t version = kVersion, w = static_cast<uint32_t>(width);
  std::memcpy(header + 8, &version, 4);
  std::memcpy(header + 12, &w, 4);
  if (std::fwrite(header, 1, kHeaderBytes, file_) != kHeaderBytes) {
    int e = errno;
    std::fclose(file_);
    file_ = nullptr;
    ::unlink(temp_path_.c_str());
    throw error(temp_path_, "cannot write: ", std::strerror(e));
  }
}

TokenFileWriter::~TokenFileWriter() {
  if (file_) {
    std::fclose(file_);
    ::unlink(temp_path_.c_str());
  }
}

void TokenFileWriter::append(const uint32_t* tokens, size_t n) {
  if (!file_) throw error(path_, "append after commit");
  buffer_.resize(n * width_);
  for (size_t i = 0; i < n; ++i) {
    if (width_ == 2) {
      if (tokens[i] > 0xFFFF)
        throw error(path_, "token ", tokens[i], " (at index ", count_ + static_cast<int64_t>(i),
                    ") does not fit a 2-byte token file");
      auto t = static_cast<uint16_t>(tokens[i]);
      std::memcpy(buffer_.data() + 2 * i, &t, 2);
    } else {
      std::memcpy(buffer_.data() + 4 * i, &tokens[i], 4);
    }
  }
  if (n && std::fwrite(buffer_.data(), 1, buffer_.size(), file_) != buffer_.size())
    throw error(temp_path_, "cannot write: ", std::strerror(errno));
  count_ += static_cast<int64_t>(n);
}

void TokenFileWriter::commit() {
  if (!file_) throw error(path_, "commit called twice");
  auto count = static_cast<uint64_t>(count_);
  bool ok = std::fseek(file_, 16, SEEK_SET) == 0 && std::fwrite(&count, 8, 1, file_) == 1 &&
            std::fflush(file_) == 0 && ::fsync(::fileno(file_)) == 0;
  int e = errno;
  ok = std::fclose(file_) == 0 && ok;
  file_ = nullptr;
  if (!ok || std::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    if (ok) e = errno;
    ::unlink(temp_path_.c_str());
    throw error(path_, "cannot finish the token file: ", std::strerror(e));
  }
}

void write_token_file(const std::string& path, const std::vector<uint32_t>& tokens, int width) {
  if (width == 0) {
    width = 2;
    for (auto t : tokens)
      if (t > 0xFFFF) width = 4;
  }
  TokenFileWriter writer(path, width);
  writer.append(tokens.data(), tokens.size());
  writer.commit();
}

}  // namespace carry
