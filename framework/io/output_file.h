// Where a run writes (checkpoint.dir, logging.metrics_file): checked before the first step, and every
// write checked after. The design decision: a run that cannot keep what it computes must stop at the
// start or at the failing write with a message naming the config field, the path and the system's
// reason (read-only, no space, not a directory), never train on and lose its work silently.
#pragma once

#include <cstdint>
#include <string>

namespace carry {

// Bytes free to an unprivileged writer on the filesystem holding `path` (statvfs f_bavail), or -1
// when unknown.
int64_t free_bytes(const std::string& path);

// `dir` (created with its parents if missing) can take new files: a probe file is written, fsynced
// and removed; and at least `bytes_needed` bytes are free there. Throws c10::Error naming `field`,
// the path and what is wrong.
void check_output_dir(const std::string& dir, uint64_t bytes_needed, const std::string& field);

// `path` can be appended to (its directory created if missing; the file is created if missing and
// never truncated). Throws c10::Error naming `field`, the path and what is wrong.
void check_output_file(const std::string& path, const std::string& field);

// Appends `text` to `path` (created if missing) with one write, then closes it, checking each call:
// a full disk, a read-only filesystem or an I/O error throws c10::Error naming `field`, the path and
// the system's reason.
void append_to_file(const std::string& path, const std::string& text, const std::string& field);

// The size of a file in bytes, or -1 if it does not exist or is not a regular file.
int64_t file_size(const std::string& path);

}  // namespace carry
