// TensorBoard event files (see tfevents.h): CRC-32C by a 256-entry table, records framed and flushed
// one at a time.
#include "framework/io/tfevents.h"

#include "framework/io/output_file.h"

#include "framework/io/tfevents.pb.h"

#include <array>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include <fcntl.h>
#include <unistd.h>

namespace carry {

namespace {

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto& t = crc_table();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = t[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

EventFileWriter::EventFileWriter(const std::string& path, double wall_time) : path_(path) {
  const int fd = open_for_writing(path, O_WRONLY | O_CREAT | O_TRUNC, "the TensorBoard event file");
  file_ = ::fdopen(fd, "wb");
  if (!file_) ::close(fd);
  if (!file_) throw std::runtime_error(path + ": cannot create the TensorBoard event file: " + std::strerror(errno));
  tfevents::Event e;
  e.set_wall_time(wall_time);
  e.set_step(0);
  e.set_file_version("brain.Event:2");
  write_record(e.SerializeAsString());
}

EventFileWriter::~EventFileWriter() {
  if (file_) std::fclose(file_);
}

void EventFileWriter::add_scalars(int64_t step, double wall_time,
                                  const std::vector<std::pair<std::string, double>>& scalars) {
  tfevents::Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  auto* summary = e.mutable_summary();
  for (auto& [tag, value] : scalars) {
    auto* v = summary->add_value();
    v->set_tag(tag);
    v->set_simple_value(static_cast<float>(value));
  }
  write_record(e.SerializeAsString());
}

void EventFileWriter::write_record(const std::string& bytes) {
  unsigned char header[12];
  const uint64_t length = bytes.size();
  std::memcpy(header, &length, 8);  // little-endian hosts only (static_assert in token_file.cpp)
  const uint32_t length_crc = masked_crc32c(header, 8);
  std::memcpy(header + 8, &length_crc, 4);
  const uint32_t data_crc = masked_crc32c(bytes.data(), bytes.size());
  bool ok = std::fwrite(header, 1, 12, file_) == 12 && std::fwrite(bytes.data(), 1, bytes.size(), file_) == bytes.size() &&
            std::fwrite(&data_crc, 1, 4, file_) == 4 && std::fflush(file_) == 0;
  if (!ok) throw std::runtime_error(path_ + ": cannot write the TensorBoard event file: " + std::strerror(errno));
}

std::vector<std::string> read_event_records(const std::string& path) {
  std::string why;
  const int fd = open_for_reading(path, &why);  // a FIFO in its place is refused, never waited on
  if (fd < 0) throw std::runtime_error(path + ": cannot open: " + why);
  std::FILE* f = ::fdopen(fd, "rb");
  if (!f) {
    const int err = errno;
    ::close(fd);
    throw std::runtime_error(path + ": cannot open: " + std::strerror(err));
  }
  std::vector<std::string> out;
  long offset = 0;
  while (true) {
    unsigned char header[12];
    size_t got = std::fread(header, 1, 12, f);
    if (got == 0) break;
    auto fail = [&](const std::string& why) {
      std::fclose(f);
      throw std::runtime_error(path + ": record at byte " + std::to_string(offset) + ": " + why);
    };
    if (got != 12) fail("truncated header");
    uint64_t length;
    uint32_t length_crc;
    std::memcpy(&length, header, 8);
    std::memcpy(&length_crc, header + 8, 4);
    if (length_crc != masked_crc32c(header, 8)) fail("the length's CRC does not match");
    if (length > (uint64_t{1} << 30)) fail("implausible length " + std::to_string(length));
    std::string data(length, '\0');
    uint32_t data_crc;
    if (std::fread(data.data(), 1, length, f) != length || std::fread(&data_crc, 1, 4, f) != 4) fail("truncated data");
    if (data_crc != masked_crc32c(data.data(), data.size())) fail("the data's CRC does not match");
    out.push_back(std::move(data));
    offset += static_cast<long>(16 + length);
  }
  std::fclose(f);
  return out;
}

}  // namespace carry
