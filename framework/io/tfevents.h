// TensorBoard event files ("events.out.tfevents.*"): a sequence of records, each
//   u64 length (little-endian) | u32 masked CRC-32C of those 8 bytes | `length` bytes: one Event
//   protobuf (framework/io/tfevents.proto) | u32 masked CRC-32C of those bytes,
// where masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8 (mod 2^32), CRC-32C being the Castagnoli
// polynomial (0x82F63B78 reflected). The first event of a file holds file_version "brain.Event:2";
// each later one a Summary of scalar values at a step. TensorBoard shows a directory's files as one
// run; files are written whole records at a time and flushed after each, so a reader (or a crash)
// sees only complete records.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace carry {

uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
uint32_t masked_crc32c(const void* data, size_t n);

class EventFileWriter {
 public:
  // Creates `path` (truncating it) and writes the file-version event. Throws std::runtime_error.
  explicit EventFileWriter(const std::string& path, double wall_time);
  ~EventFileWriter();
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  // One event: scalars (tag, value) at `step`.
  void add_scalars(int64_t step, double wall_time, const std::vector<std::pair<std::string, double>>& scalars);
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& bytes);
  std::string path_;
  std::FILE* file_ = nullptr;
};

// Reads every record of an event file back (checking both CRCs of each); each entry is one serialized
// Event. Throws std::runtime_error naming the file and the record's offset on a bad length or CRC.
std::vector<std::string> read_event_records(const std::string& path);

}  // namespace carry
