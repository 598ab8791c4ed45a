// Small file helpers shared by the file tier, checkpoints and the distributed optimizer's
// checkpoint: a private directory, aligned buffers for O_DIRECT, and files written whole
// (exclusive 0600 temporary, fsync, rename).  Internal.
#pragma once
#include <deferalloc/errors.hpp>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "file_store.hpp"

namespace deferalloc::optim::detail {

/// Creates `dir` (0700) unless it exists, then refuses it unless it is a directory
/// owned by this user and not a symbolic link.  @throws io_error naming `what` and dir
inline void check_dir(const std::string& dir, const std::string& what) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    throw io_error(what + ": cannot create " + dir + ": " + std::strerror(errno));
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) throw io_error(what + ": cannot stat " + dir + ": " + std::strerror(errno));
  if (S_ISLNK(st.st_mode)) throw io_error(what + ": " + dir + " is a symbolic link; refusing to follow it");
  if (!S_ISDIR(st.st_mode)) throw io_error(what + ": " + dir + " is not a directory");
  if (st.st_uid != ::geteuid())
    throw io_error(what + ": " + dir + " is owned by uid " + std::to_string(st.st_uid) + ", not by this user");
}

/// Refuses an existing path (from lstat) that is not a regular file owned by this user.
/// @throws io_error
inline void check_owned_file(const std::string& path, const struct stat& st, const std::string& what) {
  if (S_ISLNK(st.st_mode)) throw io_error(what + ": " + path + " is a symbolic link; refusing to follow it");
  if (!S_ISREG(st.st_mode)) throw io_error(what + ": " + path + " is not a regular file; refusing to use it");
  if (st.st_uid != ::geteuid())
    throw io_error(what + ": " + path + " is owned by uid " + std::to_string(st.st_uid) +
                   ", not by this user; refusing to use it");
}

/// Makes a directory's entries (renames, creations) durable.  @throws io_error
inline void fsync_dir(const std::string& dir, const std::string& what) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) throw io_error(what + ": cannot open directory " + dir + ": " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int e = errno;
  ::close(fd);
  if (rc != 0) throw io_error(what + ": fsync of directory " + dir + " failed: " + std::strerror(e));
}

/// `n` bytes on the heap aligned for O_DIRECT (file_store::align), zeroed if asked.
struct aligned_buffer {
  aligned_buffer(std::size_t n, bool zero, const char* what)
      : p(static_cast<unsigned char*>(std::aligned_alloc(file_store::align, n))) {
    if (!p) throw out_of_memory(what);
    if (zero) std::memset(p, 0, n);
  }
  ~aligned_buffer() { std::free(p); }
  aligned_buffer(const aligned_buffer&) = delete;
  aligned_buffer& operator=(const aligned_buffer&) = delete;
  unsigned char* p;
};

inline void write_all(int fd, const void* data, std::size_t n, const std::string& path) {
  const char* c = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, c, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) throw io_error("checkpoint: writing " + path + " failed: " + std::strerror(errno));
    c += w;
    n -= static_cast<std::size_t>(w);
  }
}

/// Creates `path`.tmp (0600, exclusive, no symlink), lets `fill(fd, tmp)` write it,
/// syncs, renames it to `path`.
template <typename F>
void write_file_atomically(const std::string& path, F&& fill) {
  const std::string tmp = path + ".tmp";
  ::unlink(tmp.c_str());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) throw io_error("checkpoint: cannot create " + tmp + ": " + std::strerror(errno));
  try {
    fill(fd, tmp);
    if (::fsync(fd) != 0) throw io_error("checkpoint: fsync of " + tmp + " failed: " + std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0)
    throw io_error("checkpoint: cannot rename " + tmp + ": " + std::strerror(errno));
}

}  // namespace deferalloc::optim::detail
