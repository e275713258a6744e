// Output checks and checked appends (see output_file.h). POSIX calls only.
#include "framework/io/output_file.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

namespace carry {
namespace {

std::string errno_text(int err) { return std::strerror(err); }

std::string mib(uint64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

// mkdir -p, naming the first component that cannot be made.
void make_dirs(const std::string& path, const std::string& field) {
  for (size_t i = 1; i <= path.size(); ++i) {
    if (i != path.size() && path[i] != '/') continue;
    std::string prefix = path.substr(0, i);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST)
      TORCH_CHECK(false, field, ": cannot create the directory ", prefix, " (for ", path, "): ", errno_text(errno));
  }
  struct stat st;
  TORCH_CHECK(::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode), field, ": ", path,
              " exists and is not a directory");
}

std::string parent_of(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Writes all of `data` to fd; 0 or the errno of the failing write.
int write_all(int fd, const char* data, size_t size) {
  size_t done = 0;
  while (done < size) {
    ssize_t n = ::write(fd, data + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EIO;
    done += static_cast<size_t>(n);
  }
  return 0;
}

}  // namespace

const char* file_kind(unsigned mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

int open_for_writing(const std::string& path, int flags, const std::string& what, bool allow_char_device) {
  int fd = ::open(path.c_str(), flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    struct stat st;
    const bool have = ::lstat(path.c_str(), &st) == 0;
    TORCH_CHECK(!(have && S_ISLNK(st.st_mode)), what, ": ", path, " is a symbolic link; carry writes no file "
                "through a link (remove the link, or name the file it points to)");
    TORCH_CHECK(!(have && !S_ISREG(st.st_mode) && !(allow_char_device && S_ISCHR(st.st_mode))), what, ": ", path, " is ",
                file_kind(st.st_mode),
                ", not a regular file; remove it or choose another path");
    TORCH_CHECK(false, what, ": cannot open ", path, (flags & O_APPEND) ? " for appending: " : " for writing: ",
                errno_text(err));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !(S_ISREG(st.st_mode) || (allow_char_device && S_ISCHR(st.st_mode)))) {
    const unsigned mode = st.st_mode;
    ::close(fd);
    TORCH_CHECK(false, what, ": ", path, " is ", file_kind(mode), ", not a regular file; remove it or choose "
                "another path");
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

void write_whole_file(const std::string& path, const std::string& text, const std::string& what, bool sync,
                      bool allow_char_device) {
  const int fd = open_for_writing(path, O_WRONLY | O_CREAT | O_TRUNC, what, allow_char_device);
  int err = write_all(fd, text.data(), text.size());
  if (err == 0 && sync && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  TORCH_CHECK(err == 0, what, ": cannot write ", path, ": ", errno_text(err));
}

void check_no_link_or_special_file(const std::string& path, const std::string& what) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return;
  TORCH_CHECK(!S_ISLNK(st.st_mode), what, ": ", path, " is a symbolic link; carry writes no file through a link "
              "(remove the link, or name the file it points to)");
  TORCH_CHECK(S_ISREG(st.st_mode), what, ": ", path, " is ", file_kind(st.st_mode),
              ", not a regular file; remove it or choose another path");
}

int open_for_reading(const std::string& path, std::string* why) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (why) *why = errno_text(errno);
    return -1;
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    if (why) *why = std::string("is ") + file_kind(st.st_mode) + ", not a regular file";
    ::close(fd);
    return -1;
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

std::optional<std::string> read_small_file(const std::string& path, int64_t max_bytes, std::string* why) {
  int fd = open_for_reading(path, why);
  if (fd < 0) return std::nullopt;
  struct stat st;
  if (::fstat(fd, &st) != 0 || st.st_size > max_bytes) {
    *why = std::to_string(static_cast<long long>(st.st_size)) + " bytes, more than the " +
           std::to_string(static_cast<long long>(max_bytes)) + " such a file may hold";
    ::close(fd);
    return std::nullopt;
  }
  std::string text;
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      *why = errno_text(errno);
      ::close(fd);
      return std::nullopt;
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (static_cast<int64_t>(text.size()) > max_bytes) {  // grew while being read
      *why = "more than the " + std::to_string(static_cast<long long>(max_bytes)) + " bytes such a file may hold";
      ::close(fd);
      return std::nullopt;
    }
  }
  ::close(fd);
  return text;
}

int64_t free_bytes(const std::string& path) {
  struct statvfs vfs;
  if (::statvfs(path.c_str(), &vfs) != 0) return -1;
  return static_cast<int64_t>(vfs.f_bavail) * static_cast<int64_t>(vfs.f_frsize);
}

int64_t file_size(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return -1;
  return static_cast<int64_t>(st.st_size);
}

void check_output_dir(const std::string& dir, uint64_t bytes_needed, const std::string& field) {
  make_dirs(dir, field);
  const std::string probe = (dir.back() == '/' ? dir : dir + "/") + ".carry_write_test." + std::to_string(::getpid());
  int fd = open_for_writing(probe, O_WRONLY | O_CREAT | O_TRUNC, field + ": cannot create a file in " + dir);
  const std::vector<char> block(4096, 'x');
  int err = write_all(fd, block.data(), block.size());
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  ::unlink(probe.c_str());
  TORCH_CHECK(err == 0, field, ": cannot write a file in ", dir, ": ", errno_text(err));
  const int64_t free = free_bytes(dir);
  TORCH_CHECK(free < 0 || static_cast<uint64_t>(free) >= bytes_needed, field, ": ", dir, " has ",
              mib(static_cast<uint64_t>(free)), " free, but this run needs about ", mib(bytes_needed),
              " there; free some space or choose another directory");
}

void check_output_file(const std::string& path, const std::string& field) {
  TORCH_CHECK(!path.empty() && path.back() != '/', field, ": '", path, "' is not a file name");
  make_dirs(parent_of(path), field);
  struct stat st;
  TORCH_CHECK(::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode), field, ": ", path,
              " is a directory; expected a file name");
  ::close(open_for_writing(path, O_WRONLY | O_APPEND | O_CREAT, field, /*allow_char_device=*/true));
}

void append_to_file(const std::string& path, const std::string& text, const std::string& field) {
  int fd = open_for_writing(path, O_WRONLY | O_APPEND | O_CREAT, field, /*allow_char_device=*/true);
  int err = write_all(fd, text.data(), text.size());
  if (::close(fd) != 0 && err == 0) err = errno;
  TORCH_CHECK(err == 0, field, ": cannot write to ", path, ": ", errno_text(err));
}

}  // namespace carry
