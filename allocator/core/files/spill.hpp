// Disk spills: device ranges written to one file and read back into them (the C ABI's
// dfa_spill_save / dfa_spill_load; Note [Disk spills] in spill.cpp).  Internal.
#pragma once
#include <deferalloc/core/driver.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace deferalloc::detail {

/// One device range of a spill: `bytes` at `ptr` (device memory of the driver's device,
/// or host memory on the host driver).
struct spill_range {
  void* ptr = nullptr;
  std::size_t bytes = 0;
};

/// The checksummed unit of a spill's data.
inline constexpr std::size_t spill_block_bytes = std::size_t{64} << 10;

/// Writes the ranges' bytes to `path` through two pinned staging buffers of up to
/// `chunk_bytes` each (rounded up to spill_block_bytes), copied on `s`: a temporary file
/// beside it (exclusive, 0600, space reserved first), fsynced, renamed into place, the
/// directory fsynced.  Never leaves a partial file under `path`.  The directory is made
/// (0700) if missing and refused unless owned by this user and not a symbolic link.
/// Waits for the copies before it returns.
/// @throws invalid_argument (bad ranges, chunk_bytes 0), io_error (directory, disk full,
/// any I/O error; no file under `path`), out_of_memory (staging)
void spill_save(const std::string& path, const std::vector<spill_range>& ranges, std::size_t chunk_bytes,
                vmm_ops& vmm, stream_ops& streams, stream_t s);

/// Reads `path` (written by spill_save for ranges of the same count and sizes) into the
/// ranges, each block's checksum verified before its bytes are copied to the device (a
/// range at null: verified, not copied).
/// Waits for the copies before it returns.  On an error some ranges may hold part of the
/// file's bytes (every byte copied was verified); the caller treats them as undefined.
/// @throws invalid_argument (count or sizes differ from the file's, naming it),
/// corrupt_data (bad header, truncated, a checksum mismatch: naming the file and the
/// offset), io_error (missing, a symbolic link, not this user's, a read error)
void spill_load(const std::string& path, const std::vector<spill_range>& ranges, std::size_t chunk_bytes,
                vmm_ops& vmm, stream_ops& streams, stream_t s);

/// Makes `dir` (0700) unless it exists, then refuses it unless it is a directory owned by
/// this user and not a symbolic link.  Returns true when it lives in memory (tmpfs, ramfs).
/// @throws io_error naming the directory
bool spill_check_dir(const std::string& dir);

}  // namespace deferalloc::detail
