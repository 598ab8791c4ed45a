// Files written whole and read back checked, shared by the optimizer's file tier and
// checkpoints and the C ABI's disk spills (dfa_spill_save / dfa_spill_load): directory
// and owner checks, files created exclusive 0600 and fsynced (removed on failure), full
// reads and writes, the checksum that guards their bytes.  Internal: the deferalloc_files
// target puts this folder on the include path of libdeferalloc and the optimizer.
#pragma once
#include <deferalloc/core/errors.hpp>
#include <deferalloc/core/export.hpp>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

namespace deferalloc::detail {

/// 64-bit checksum for corruption detection (not cryptographic), ~10 GB/s per core.
/// Exported from libdeferalloc: the optimizer's file tier and checkpoints and the
/// checkpoint benchmark use the same function.
DFA_API std::uint64_t checksum64(const void* data, std::size_t bytes, std::uint64_t seed = 0);

/// Creates `dir` (0700) unless it exists (or, without `create`, refuses a missing one),
/// then refuses it unless it is a directory owned by this user and not a symbolic link.
/// @throws io_error naming `what` and dir
inline void check_dir(const std::string& dir, const std::string& what, bool create = true) {
  if (create && ::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    throw io_error(what + ": cannot create " + dir + ": " + std::strerror(errno));
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT) throw io_error(what + ": directory " + dir + " does not exist (create it first)");
    throw io_error(what + ": cannot stat " + dir + ": " + std::strerror(errno));
  }
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

/// Writes all `n` bytes at the file's position.  @throws io_error naming `what` and path
inline void write_all(int fd, const void* data, std::size_t n, const std::string& path,
                      const std::string& what = "checkpoint") {
  const char* c = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, c, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) throw io_error(what + ": writing " + path + " failed: " + std::strerror(errno));
    c += w;
    n -= static_cast<std::size_t>(w);
  }
}

/// Opens `path` with `flags` plus O_DIRECT where the file system has it (else without).
/// Returns -1 with errno set on failure.
inline int open_direct(const std::string& path, int flags, mode_t mode = 0600) {
  int fd = ::open(path.c_str(), flags | O_DIRECT, mode);
  if (fd < 0 && errno == EINVAL) fd = ::open(path.c_str(), flags, mode);
  return fd;
}

/// Creates `path` (0600, exclusive: never an existing file or a symlink; with `direct`,
/// O_DIRECT where possible, so every write must then be aligned), reserves `reserve`
/// bytes for it up front when asked (fallocate: a full disk fails before any write, and
/// writes at any offset land in allocated space, so concurrent O_DIRECT writes are not
/// serialised as file-extending writes are), lets `fill(fd, path)` write it, fsyncs it.
/// On failure the file is removed.  @throws io_error naming `what`
template <typename F>
void write_new_file(const std::string& path, F&& fill, bool direct = false, std::uint64_t reserve = 0,
                    const std::string& what = "checkpoint") {
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
  int fd = direct ? open_direct(path, flags) : ::open(path.c_str(), flags, 0600);
  if (fd < 0) throw io_error(what + ": cannot create " + path + ": " + std::strerror(errno));
  try {
    // A file system without fallocate (EOPNOTSUPP) is written as it comes.
    if (reserve > 0 && ::fallocate(fd, 0, 0, static_cast<off_t>(reserve)) != 0 && errno != EOPNOTSUPP)
      throw io_error(what + ": cannot reserve " + std::to_string(reserve) + " bytes for " + path + ": " +
                     std::strerror(errno));
    fill(fd, path);
    if (::fsync(fd) != 0) throw io_error(what + ": fsync of " + path + " failed: " + std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(path.c_str());
    throw;
  }
  ::close(fd);
}

/// Reads exactly `n` bytes at `off`.  @throws io_error, corrupt_data (end of file first)
inline void pread_all(int fd, void* data, std::size_t n, std::uint64_t off, const std::string& path,
                      const std::string& what = "checkpoint") {
  char* c = static_cast<char*>(data);
  std::size_t got = 0;
  while (got < n) {
    ssize_t r = ::pread(fd, c + got, n - got, static_cast<off_t>(off + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw io_error(what + ": reading " + path + " failed: " + std::strerror(errno));
    if (r == 0)
      throw corrupt_data(what + ": " + path + " is shorter than its manifest says (" + std::to_string(got) + " of " +
                         std::to_string(n) + " bytes at offset " + std::to_string(off) + ")");
    got += static_cast<std::size_t>(r);
  }
}

/// A small regular file (manifest, layout) read whole, without following a symlink.
/// @throws io_error, corrupt_data (over 64 MiB)
inline std::string read_text_file(const std::string& path, const std::string& what) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) throw io_error(what + ": cannot open " + path + ": " + std::strerror(errno));
  struct stat st {};
  std::string text;
  try {
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) throw io_error(what + ": " + path + " is not a regular file");
    if (static_cast<std::size_t>(st.st_size) > (std::size_t{64} << 20)) throw corrupt_data(what + ": " + path + " is too large");
    text.resize(static_cast<std::size_t>(st.st_size));
    pread_all(fd, text.data(), text.size(), 0, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return text;
}

}  // namespace deferalloc::detail
