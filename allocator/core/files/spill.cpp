// Note [Disk spills]
//
// Rationale: torch_memory_saver's disk backup writes a paused region's bytes to files and
// reads them back at resume.  A backup that comes back wrong is silently wrong weights, so
// the file must never be torn (a kill or a full disk mid-write) and every byte read back
// must be checked before it reaches the device; it goes through the library's file
// machinery (durable_files.hpp: owned 0700 directory, exclusive 0600 files, fsync) and
// the checksum of the file tier and checkpoints (checksum64 per 64 KiB block).
// Approach: the ranges are one stream of bytes, cut into chunks of up to chunk_bytes.
// A save copies chunk k+1 device-to-host into one pinned staging buffer (async, on the
// caller's stream) while it checksums and writes chunk k from the other, into
// `<path>.tmp-<random>` (created exclusive, 0600, its whole size reserved with fallocate,
// so a full disk fails before the first write), fsyncs it, renames it to `path` and
// fsyncs the directory: under `path` there is the whole file or none.  The file:
//   header  "DFASPILL", version (1), block bytes (65536), the ranges' count, their total
//           bytes, the writer's chunk bytes, the data's offset; the ranges' sizes; the
//           checksum64 of all that; zeros up to the data's offset (a 4 KiB multiple)
//   data    the ranges' bytes, back to back
//   table   checksum64 of each 64 KiB block of the data (seeded with its index, so a
//           block moved is a mismatch), then the checksum64 of the table
// A load checks the header, that the file holds the ranges it is given (count and each
// size: else invalid_argument), its exact size (a truncated file is corrupt before any
// byte is copied) and the table's checksum; it then reads chunk k+1 while chunk k is
// copied host-to-device from the other buffer, and verifies every block of a chunk
// before any of it is copied.  A range given at null is verified and not copied (a
// segment freed while its tag was paused).  A mismatch is corrupt_data naming the file and the offset.
// Limits: the ranges must be backed memory of the driver's device (a host-driver range
// that is not faults as the device would); two staging buffers of the chunk size are
// pinned for the call; the file is in this machine's byte order; no O_DIRECT (the chunks
// are not aligned): the file's page cache is dropped (POSIX_FADV_DONTNEED, as TMS) once it
// is fsynced and after a load, so a paused region does not stay in host memory as cache.
#include "spill.hpp"

#include <deferalloc/core/errors.hpp>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

#include "durable_files.hpp"

namespace deferalloc::detail {

namespace {

constexpr char k_magic[8] = {'D', 'F', 'A', 'S', 'P', 'I', 'L', 'L'};
constexpr std::uint32_t k_version = 1;
constexpr std::size_t k_page = 4096;
const std::string k_what = "disk spill";

struct fixed_header {
  char magic[8];
  std::uint32_t version;
  std::uint32_t block_bytes;
  std::uint64_t count;
  std::uint64_t total_bytes;
  std::uint64_t chunk_bytes;
  std::uint64_t data_offset;
};
static_assert(sizeof(fixed_header) == 48);

std::size_t round_up(std::size_t v, std::size_t m) { return (v + m - 1) / m * m; }

// Drops a written (fsynced, so clean) file's page cache: best effort, the backup stands anyway.
void drop_page_cache(int fd) { (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED); }

void drop_page_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return;
  drop_page_cache(fd);
  ::close(fd);
}

// The file's layout for ranges of these sizes.
struct layout {
  std::uint64_t total = 0, data_offset = 0, blocks = 0, table_offset = 0, file_bytes = 0;
};

layout layout_of(const std::vector<spill_range>& ranges, bool saving) {
  layout l;
  for (const spill_range& r : ranges) {
    if (saving && r.bytes > 0 && r.ptr == nullptr)
      throw invalid_argument("a range of " + std::to_string(r.bytes) + " bytes at null");
    if (r.bytes > (std::uint64_t{1} << 62) - l.total) throw invalid_argument("the ranges' total size overflows");
    l.total += r.bytes;
  }
  l.data_offset = round_up(sizeof(fixed_header) + 8 * (ranges.size() + 1), k_page);
  l.blocks = (l.total + spill_block_bytes - 1) / spill_block_bytes;
  l.table_offset = l.data_offset + l.total;
  l.file_bytes = l.table_offset + 8 * (l.blocks + 1);
  return l;
}

// The staging chunk: chunk_bytes rounded up to whole blocks, no larger than the data.
std::size_t staging_bytes(std::size_t chunk_bytes, std::uint64_t total) {
  if (chunk_bytes == 0) throw invalid_argument("chunk_bytes is 0");
  const std::size_t c = round_up(std::min<std::uint64_t>(chunk_bytes, (std::uint64_t{1} << 40)), spill_block_bytes);
  return static_cast<std::size_t>(std::min<std::uint64_t>(c, std::max<std::uint64_t>(round_up(total, spill_block_bytes), spill_block_bytes)));
}

// Two pinned staging buffers and an event each; the destructor waits for the stream
// before it frees them (a copy may still read or write one when an error unwinds).
class staging {
 public:
  staging(vmm_ops& vmm, stream_ops& streams, stream_t s, std::size_t bytes)
      : vmm_(vmm), streams_(streams), s_(s), bytes_(bytes) {
    try {
      for (int i = 0; i < 2; ++i) {
        buf_[i] = static_cast<unsigned char*>(vmm_.host_alloc(bytes));
        ev_[i] = streams_.create_event();
      }
    } catch (...) {
      free_all();
      throw;
    }
  }
  ~staging() {
    try {
      streams_.synchronize_stream(s_);
    } catch (...) {  // the stream is broken: its copies are over either way
    }
    free_all();
  }
  staging(const staging&) = delete;
  staging& operator=(const staging&) = delete;
  unsigned char* buf(std::size_t k) const { return buf_[k % 2]; }
  void recorded(std::size_t k) {
    streams_.record(ev_[k % 2], s_);
    used_[k % 2] = true;
  }
  void wait(std::size_t k) {
    if (used_[k % 2]) streams_.synchronize(ev_[k % 2]);
    used_[k % 2] = false;
  }
  std::size_t bytes() const { return bytes_; }

 private:
  void free_all() noexcept {
    for (int i = 0; i < 2; ++i) {
      if (ev_[i]) streams_.destroy_event(ev_[i]);
      if (buf_[i]) vmm_.host_free(buf_[i]);
      ev_[i] = nullptr;
      buf_[i] = nullptr;
    }
  }
  vmm_ops& vmm_;
  stream_ops& streams_;
  stream_t s_;
  std::size_t bytes_;
  unsigned char* buf_[2] = {nullptr, nullptr};
  event_t ev_[2] = {nullptr, nullptr};
  bool used_[2] = {false, false};
};

// Enqueues the copies between the chunk [begin, begin + n) of the ranges' byte stream
// and `host` on `s`: device-to-host when `to_host`, else host-to-device (a range at null
// is skipped).
void copy_chunk(const std::vector<spill_range>& ranges, std::uint64_t begin, std::size_t n, unsigned char* host,
                bool to_host, stream_ops& streams, stream_t s) {
  std::uint64_t at = 0;
  for (const spill_range& r : ranges) {
    const std::uint64_t lo = std::max(at, begin), hi = std::min(at + r.bytes, begin + n);
    if (lo < hi && r.ptr != nullptr) {
      unsigned char* dev = static_cast<unsigned char*>(r.ptr) + (lo - at);
      unsigned char* h = host + (lo - begin);
      if (to_host)
        streams.copy_async(h, dev, hi - lo, s);
      else
        streams.copy_async(dev, h, hi - lo, s);
    }
    at += r.bytes;
    if (at >= begin + n) break;
  }
}

std::string header_bytes(const std::vector<spill_range>& ranges, const layout& l, std::size_t chunk) {
  std::string h(l.data_offset, '\0');
  fixed_header f{};
  std::memcpy(f.magic, k_magic, sizeof k_magic);
  f.version = k_version;
  f.block_bytes = static_cast<std::uint32_t>(spill_block_bytes);
  f.count = ranges.size();
  f.total_bytes = l.total;
  f.chunk_bytes = chunk;
  f.data_offset = l.data_offset;
  std::memcpy(h.data(), &f, sizeof f);
  std::size_t at = sizeof f;
  for (const spill_range& r : ranges) {
    const std::uint64_t b = r.bytes;
    std::memcpy(h.data() + at, &b, 8);
    at += 8;
  }
  const std::uint64_t sum = checksum64(h.data(), at);
  std::memcpy(h.data() + at, &sum, 8);
  return h;
}

std::string parent_of(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string temp_name(const std::string& path) {
  char suffix[32];
  std::snprintf(suffix, sizeof suffix, ".tmp-%016llx", static_cast<unsigned long long>(std::random_device{}()) << 32 ^
                                                            static_cast<unsigned long long>(std::random_device{}()));
  return path + suffix;
}

// Writes the data and the checksum table of `ranges` at the file's position (the header
// written before), through `st`.
void write_data(int fd, const std::string& path, const std::vector<spill_range>& ranges, const layout& l, staging& st,
                stream_ops& streams, stream_t s) {
  std::vector<std::uint64_t> table;
  table.reserve(l.blocks + 1);
  const std::uint64_t chunks = (l.total + st.bytes() - 1) / st.bytes();
  auto issue = [&](std::uint64_t k) {
    const std::uint64_t begin = k * st.bytes();
    copy_chunk(ranges, begin, static_cast<std::size_t>(std::min<std::uint64_t>(st.bytes(), l.total - begin)),
               st.buf(k), true, streams, s);
    st.recorded(k);
  };
  if (chunks > 0) issue(0);
  for (std::uint64_t k = 0; k < chunks; ++k) {
    if (k + 1 < chunks) issue(k + 1);  // its buffer's last chunk (k - 1) is written already
    st.wait(k);
    const std::uint64_t begin = k * st.bytes();
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(st.bytes(), l.total - begin));
    for (std::size_t b = 0; b < n; b += spill_block_bytes)
      table.push_back(checksum64(st.buf(k) + b, std::min(spill_block_bytes, n - b), (begin + b) / spill_block_bytes));
    write_all(fd, st.buf(k), n, path, k_what);
  }
  table.push_back(checksum64(table.data(), table.size() * 8, l.total));
  write_all(fd, table.data(), table.size() * 8, path, k_what);
}

}  // namespace

void spill_save(const std::string& path, const std::vector<spill_range>& ranges, std::size_t chunk_bytes,
                vmm_ops& vmm, stream_ops& streams, stream_t s) {
  if (path.empty()) throw invalid_argument("path is empty");
  const layout l = layout_of(ranges, true);
  const std::size_t chunk = staging_bytes(chunk_bytes, l.total);
  const std::string dir = parent_of(path);
  check_dir(dir, k_what);
  staging st(vmm, streams, s, chunk);
  const std::string tmp = temp_name(path);
  write_new_file(
      tmp,
      [&](int fd, const std::string& p) {
        const std::string h = header_bytes(ranges, l, chunk_bytes);
        write_all(fd, h.data(), h.size(), p, k_what);
        write_data(fd, p, ranges, l, st, streams, s);
      },
      false, l.file_bytes, k_what);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    throw io_error(k_what + ": cannot rename " + tmp + " to " + path + ": " + std::strerror(e));
  }
  try {
    fsync_dir(dir, k_what);
  } catch (...) {
    ::unlink(path.c_str());  // not durable: no backup rather than one that may vanish
    throw;
  }
  drop_page_cache(path);
}

namespace {

// Opens a spill file for reading: a regular file of this user, not through a symlink.
int open_spill(const std::string& path, struct stat& st) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    if (e == ELOOP) throw io_error(k_what + ": " + path + " is a symbolic link; refusing to follow it");
    throw io_error(k_what + ": cannot open " + path + ": " + std::strerror(e));
  }
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw io_error(k_what + ": cannot stat " + path + ": " + std::strerror(e));
  }
  try {
    check_owned_file(path, st, k_what);
  } catch (...) {
    ::close(fd);
    throw;
  }
  return fd;
}

// Checks the header and the size of the file against `ranges`; returns the checksum table.
std::vector<std::uint64_t> check_file(int fd, const std::string& path, std::uint64_t file_size,
                                      const std::vector<spill_range>& ranges, const layout& l) {
  auto corrupt = [&](const std::string& why) { return corrupt_data(k_what + ": " + path + " " + why); };
  fixed_header f{};
  if (file_size < sizeof f) throw corrupt("is truncated (" + std::to_string(file_size) + " bytes: no header)");
  pread_all(fd, &f, sizeof f, 0, path, k_what);
  if (std::memcmp(f.magic, k_magic, sizeof k_magic) != 0) throw corrupt("is not a deferalloc disk spill (bad magic)");
  if (f.version != k_version)
    throw corrupt("has format version " + std::to_string(f.version) + "; this library reads " + std::to_string(k_version));
  // The count sizes the header's buffer: bounded by the file and tied to the data's offset
  // before anything is allocated from it (the header's checksum is verified after).
  if (f.block_bytes != spill_block_bytes || f.count > file_size / 8 || f.data_offset > file_size ||
      f.data_offset != round_up(sizeof f + 8 * (f.count + 1), k_page))
    throw corrupt("has a damaged header");
  std::string h(sizeof f + 8 * (f.count + 1), '\0');
  pread_all(fd, h.data(), h.size(), 0, path, k_what);
  std::uint64_t sum = 0;
  std::memcpy(&sum, h.data() + h.size() - 8, 8);
  if (checksum64(h.data(), h.size() - 8) != sum) throw corrupt("has a damaged header (checksum mismatch)");
  if (f.count != ranges.size())
    throw invalid_argument(k_what + ": " + path + " holds " + std::to_string(f.count) + " ranges, " +
                           std::to_string(ranges.size()) + " given");
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    std::uint64_t b = 0;
    std::memcpy(&b, h.data() + sizeof f + 8 * i, 8);
    if (b != ranges[i].bytes)
      throw invalid_argument(k_what + ": " + path + " holds " + std::to_string(b) + " bytes for range " +
                             std::to_string(i) + ", " + std::to_string(ranges[i].bytes) + " given");
  }
  if (f.data_offset != l.data_offset || f.total_bytes != l.total) throw corrupt("has a damaged header");
  if (file_size != l.file_bytes)
    throw corrupt("is " + std::string(file_size < l.file_bytes ? "truncated" : "too long") + " (" +
                  std::to_string(file_size) + " bytes, " + std::to_string(l.file_bytes) + " expected)");
  std::vector<std::uint64_t> table(l.blocks + 1);
  pread_all(fd, table.data(), table.size() * 8, l.table_offset, path, k_what);
  if (checksum64(table.data(), l.blocks * 8, l.total) != table.back())
    throw corrupt("has a damaged checksum table (at offset " + std::to_string(l.table_offset) + ")");
  return table;
}

void read_data(int fd, const std::string& path, const std::vector<spill_range>& ranges, const layout& l,
               const std::vector<std::uint64_t>& table, staging& st, stream_ops& streams, stream_t s) {
  const std::uint64_t chunks = (l.total + st.bytes() - 1) / st.bytes();
  for (std::uint64_t k = 0; k < chunks; ++k) {
    st.wait(k);  // chunk k - 2's copy out of this buffer is done
    const std::uint64_t begin = k * st.bytes();
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(st.bytes(), l.total - begin));
    pread_all(fd, st.buf(k), n, l.data_offset + begin, path, k_what);
    for (std::size_t b = 0; b < n; b += spill_block_bytes) {
      const std::uint64_t block = (begin + b) / spill_block_bytes;
      if (checksum64(st.buf(k) + b, std::min(spill_block_bytes, n - b), block) != table[block])
        throw corrupt_data(k_what + ": " + path + ": the block at data offset " + std::to_string(begin + b) +
                           " (file offset " + std::to_string(l.data_offset + begin + b) +
                           ") fails its checksum: the file is corrupt");
    }
    copy_chunk(ranges, begin, n, st.buf(k), false, streams, s);
    st.recorded(k);
  }
  streams.synchronize_stream(s);
}

}  // namespace

void spill_load(const std::string& path, const std::vector<spill_range>& ranges, std::size_t chunk_bytes,
                vmm_ops& vmm, stream_ops& streams, stream_t s) {
  if (path.empty()) throw invalid_argument("path is empty");
  const layout l = layout_of(ranges, false);
  const std::size_t chunk = staging_bytes(chunk_bytes, l.total);
  struct stat fst {};
  const int fd = open_spill(path, fst);
  try {
    const std::vector<std::uint64_t> table = check_file(fd, path, static_cast<std::uint64_t>(fst.st_size), ranges, l);
    staging st(vmm, streams, s, chunk);
    read_data(fd, path, ranges, l, table, st, streams, s);
  } catch (...) {
    ::close(fd);
    throw;
  }
  drop_page_cache(fd);
  ::close(fd);
}

bool spill_check_dir(const std::string& dir) {
  if (dir.empty()) throw invalid_argument("the directory is empty");
  check_dir(dir, k_what);
  struct statfs sfs {};
  if (::statfs(dir.c_str(), &sfs) != 0) return false;
  constexpr unsigned long tmpfs_magic = 0x01021994, ramfs_magic = 0x858458f6;
  const auto type = static_cast<unsigned long>(sfs.f_type);
  return type == tmpfs_magic || type == ramfs_magic;
}

}  // namespace deferalloc::detail
