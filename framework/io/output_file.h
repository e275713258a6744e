// Where a run writes (checkpoint.dir, logging.metrics_file): checked before the first step, and every
// write checked after. The design decision: a run that cannot keep what it computes must stop at the
// start or at the failing write with a message naming the config field, the path and the system's
// reason (read-only, no space, not a directory), never train on and lose its work silently.
#pragma once

#include <cstdint>
#include <optional>
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
// never truncated; a symbolic link, a FIFO or a directory in its place is refused, a character device
// such as /dev/null taken). Throws c10::Error naming `field`, the path and what is wrong.
void check_output_file(const std::string& path, const std::string& field);

// Appends `text` to `path` (created if missing) with one write, then closes it, checking each call:
// a full disk, a read-only filesystem or an I/O error throws c10::Error naming `field`, the path and
// the system's reason.
void append_to_file(const std::string& path, const std::string& text, const std::string& field);

// The size of a file in bytes, or -1 if it does not exist or is not a regular file.
int64_t file_size(const std::string& path);

// Opens a file carry writes: `flags` (O_WRONLY or O_RDWR with O_CREAT, O_TRUNC, O_APPEND, O_EXCL) plus
// O_NOFOLLOW, O_NONBLOCK and O_CLOEXEC, so a symbolic link in the file's place is refused, not
// followed (it would let anyone who can write the directory redirect the write to any file the run can
// reach), and a FIFO or a device never blocks the open; then anything but a regular file is refused.
// Returns the descriptor (O_NONBLOCK cleared), or throws c10::Error: "<what>: <path> is a symbolic
// link ...", "<what>: <path> is a FIFO, not a regular file ...", or "<what>: cannot open <path> for
// writing (appending): <the system's reason>". With allow_char_device a character device (/dev/null,
// /dev/full) is taken too: a metrics file may be one.
int open_for_writing(const std::string& path, int flags, const std::string& what, bool allow_char_device = false);

// Writes `text` as the whole of `path` (created, or truncated), opened as open_for_writing opens it (a
// symbolic link, a FIFO or a directory in its place is refused, its target left alone; with
// allow_char_device a device such as /dev/null is taken), every write and the close checked, and with
// sync fsynced. Throws c10::Error: "<what>: cannot write <path>: <the system's reason>", or one of
// open_for_writing's.
void write_whole_file(const std::string& path, const std::string& text, const std::string& what, bool sync = false,
                      bool allow_char_device = false);

// For a file a library writes by name (SentencePiece's PREFIX.model): nothing, or a regular file, is at
// `path`; a symbolic link, a FIFO, a directory or a device there throws c10::Error in the words of
// open_for_writing, before the library opens it.
void check_no_link_or_special_file(const std::string& path, const std::string& what);

// Opens a file carry reads: O_RDONLY, O_NONBLOCK and O_CLOEXEC (a FIFO never blocks the open), then
// refuses anything but a regular file. Returns the descriptor (O_NONBLOCK cleared), or -1 with
// *why set ("is a FIFO, not a regular file", or the system's reason).
int open_for_reading(const std::string& path, std::string* why);

// The bytes of a small control file (a manifest, `latest`, an FLA folder's config.json), or nullopt
// with *why set: it cannot be opened, is not a regular file (a FIFO in its place never blocks), or
// holds more than max_bytes (refused from its size, before anything is read).
std::optional<std::string> read_small_file(const std::string& path, int64_t max_bytes, std::string* why);

// What a file of this mode is, for messages: "a directory", "a FIFO", "a socket", "a character
// device", "a block device", "a symbolic link", "a regular file".
const char* file_kind(unsigned mode);

}  // namespace carry
