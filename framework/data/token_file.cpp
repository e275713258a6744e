// Token files (see token_file.h): the header is checked before the tokens are touched (magic,
// version, width, and file size == header + count*width); tokens are read with pread and decoded with
// memcpy (the formats are little-endian, as is every host carry builds for). A read that comes back
// short (the file was truncated after it was opened) throws.
#include "framework/data/token_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token files are little-endian; so must the host be");

namespace carry {

namespace {

constexpr char kMagic[8] = {'C', 'A', 'R', 'R', 'Y', 'T', 'O', 'K'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 24;
constexpr int32_t kLlmcGpt2Magic = 20240520, kLlmcLlama3Magic = 20240801;
constexpr size_t kLlmcHeaderBytes = 256 * sizeof(int32_t);

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

TokenFile::TokenFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw error(path, "cannot open token file: ", std::strerror(errno));
  try {
    struct stat st;
    if (::fstat(fd_, &st) != 0) throw error(path, "cannot stat token file: ", std::strerror(errno));
    if (S_ISDIR(st.st_mode)) throw error(path, "is a directory, not a token file");
    if (!S_ISREG(st.st_mode)) throw error(path, "is not a regular file (a token file is read by offset)");
    auto size = static_cast<size_t>(st.st_size);
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
                  ", expected the magic \"CARRYTOK\" or an llm.c .bin header (int32 ", kLlmcGpt2Magic, " or ",
                  kLlmcLlama3Magic, ")");
    }
  } catch (...) {
    close();
    throw;
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
  width_ = other.width_;
  count_ = other.count_;
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
    if (got < 0) throw error(path_, "cannot read bytes [", offset + done, ", ", offset + n, "): ", std::strerror(errno));
    if (got == 0) {
      struct stat st;
      long long now = ::fstat(fd_, &st) == 0 ? static_cast<long long>(st.st_size) : -1;
      throw error(path_, "the file ends at byte ", offset + done, " but bytes up to ", offset + n,
                  " were expected (it has ", now, " bytes now, ", tokens_offset_ + static_cast<uint64_t>(count_) * width_,
                  " when it was opened): it was truncated or replaced while in use");
    }
    done += static_cast<size_t>(got);
  }
}

uint32_t TokenFile::at(int64_t i) const {
  if (i < 0 || i >= count_) throw error(path_, "token index ", i, " is out of range [0, ", count_, ")");
  unsigned char b[4] = {};
  read_bytes(tokens_offset_ + static_cast<uint64_t>(i) * width_, width_, b);
  return width_ == 2 ? load<uint16_t>(b) : load<uint32_t>(b);
}

void TokenFile::read(int64_t start, int64_t count, int64_t* out) const {
  if (start < 0 || count < 0 || start > count_ || count > count_ - start)
    throw error(path_, "cannot read tokens [", start, ", ", start + count, "): the file has ", count_, " tokens");
  std::vector<unsigned char> bytes(static_cast<size_t>(count) * width_);
  if (count > 0) read_bytes(tokens_offset_ + static_cast<uint64_t>(start) * width_, bytes.size(), bytes.data());
  const unsigned char* p = bytes.data();
  if (width_ == 2) {
    for (int64_t i = 0; i < count; ++i) out[i] = load<uint16_t>(p + 2 * i);
  } else {
    for (int64_t i = 0; i < count; ++i) out[i] = load<uint32_t>(p + 4 * i);
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
  file_ = std::fopen(temp_path_.c_str(), "wb");
  if (!file_) throw error(temp_path_, "cannot create token file: ", std::strerror(errno));
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
