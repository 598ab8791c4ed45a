// Small file helpers shared by the file tier, checkpoints and the distributed optimizer's
// checkpoint: aligned buffers for O_DIRECT and checkpoint generations, over the library's
// file machinery (directory and owner checks, files written whole: exclusive 0600,
// fsync; durable_files.hpp, shared with libdeferalloc's disk spills).  Internal.
#pragma once
#include <deferalloc/core/errors.hpp>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "durable_files.hpp"
#include "file_store.hpp"

namespace deferalloc::optim::detail {

// The file machinery shared with libdeferalloc's disk spills (durable_files.hpp).
using deferalloc::detail::check_dir;
using deferalloc::detail::check_owned_file;
using deferalloc::detail::fsync_dir;
using deferalloc::detail::open_direct;
using deferalloc::detail::pread_all;
using deferalloc::detail::read_text_file;
using deferalloc::detail::write_all;
using deferalloc::detail::write_new_file;

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

// ---- checkpoint generations (see Note [Checkpoint generations] in checkpoint.cpp) ----

// Note [Generation names]
//
// Rationale: the generation a load takes is the highest gen-<N> in the directory, so
// every entry named like one steers what is loaded and what a save writes next.  A
// stray gen-999999999999999999.tmp once made a save write gen-1000000000000000000
// (a number the loader rejects) and prune the last good generation; an unreadable
// directory restarted the numbering at gen-1; a symlinked newest generation was
// skipped for an older one.
// Approach: numbers have at most k_generation_digits digits, read and written alike,
// and only the saver's spelling is a generation: `gen-` and a decimal number without
// leading zeros (gen-007 is not generation 7: a load does not read it, a save does not
// number from it, a prune never removes it).
// A save numbers from the complete generations only (gen-<N> directories, not
// symlinks): unfinished ones (gen-<N>.tmp) and foreign entries never raise the number;
// a killed save's gen-<N>.tmp of the number a save takes is removed first.  A listing
// that fails throws, naming the directory and the reason, before anything is written
// or removed.  The highest gen-<N> name that is not a real directory (a symlink, a
// file) is refused with the reason by a load, and by a save (whose generation the
// load would otherwise never reach).  The prune removes only real directories below
// the generation just published.
// Limits: a save refuses once the numbers reach k_max_generation (10^18 - 1 saves).
inline constexpr std::size_t k_generation_digits = 18;
inline constexpr std::uint64_t k_max_generation = 999'999'999'999'999'999ull;

struct generations {
  std::uint64_t newest_complete = 0;  // the highest gen-<N> directory (not a symlink); 0: none
  std::uint64_t newest_name = 0;      // the highest gen-<N> name of any kind
  std::string newest_problem;         // why newest_name is no generation ("" when it is newest_complete)
};

/// True when `name` is gen-<N> or gen-<N>.tmp (`tmp` says which), N as the saver
/// writes it (no leading zeros).
inline bool parse_generation(const std::string& name, std::uint64_t& n, bool& tmp) {
  if (name.rfind("gen-", 0) != 0) return false;
  tmp = name.size() > 8 && name.compare(name.size() - 4, 4, ".tmp") == 0;
  const std::string digits = name.substr(4, name.size() - 4 - (tmp ? 4 : 0));
  if (digits.empty() || digits.size() > k_generation_digits || digits.find_first_not_of("0123456789") != std::string::npos ||
      digits[0] == '0')  // only the saver's spelling: gen-007 is someone else's
    return false;
  n = std::stoull(digits);
  return n > 0;
}

/// What an entry of a checkpoint directory is, by lstat: a real directory or not, and why.
inline std::string generation_problem(const std::filesystem::directory_entry& e) {
  std::error_code ec;
  const auto st = e.symlink_status(ec);
  if (ec) return "cannot be examined: " + ec.message();
  if (std::filesystem::is_symlink(st)) return "is a symbolic link";
  if (!std::filesystem::is_directory(st)) return "is not a directory";
  return {};
}

/// Scans `dir` for gen-<N> entries (Note [Generation names]).  Cost: one readdir.
/// @throws io_error naming `what`, the directory and the reason when it cannot be listed
inline generations scan_generations(const std::string& dir, const std::string& what) {
  generations g;
  std::error_code ec;
  auto fail = [&] { throw io_error(what + ": cannot list " + dir + ": " + ec.message()); };
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) fail();
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) {
    if (ec) fail();
    std::uint64_t n = 0;
    bool tmp = false;
    if (!parse_generation(it->path().filename().string(), n, tmp) || tmp) continue;
    const std::string problem = generation_problem(*it);
    if (problem.empty()) g.newest_complete = std::max(g.newest_complete, n);
    if (n > g.newest_name) g.newest_name = n, g.newest_problem = problem;
  }
  if (ec) fail();
  return g;
}

inline std::string generation_path(const std::string& dir, std::uint64_t n, bool tmp) {
  return dir + "/gen-" + std::to_string(n) + (tmp ? ".tmp" : "");
}

/// Refuses (io_error) a newest gen-<N> that is not a real directory.
inline void refuse_foreign_newest(const std::string& dir, const generations& g, const std::string& what) {
  if (!g.newest_problem.empty())
    throw io_error(what + ": the newest generation " + generation_path(dir, g.newest_name, false) + " " + g.newest_problem +
                   "; refusing it (not a generation this library wrote; remove or rename it)");
}

/// The number the next save takes (a stale gen-<N>.tmp of it removed).  @throws io_error
inline std::uint64_t next_generation(const std::string& dir, const std::string& what) {
  const generations g = scan_generations(dir, what);
  refuse_foreign_newest(dir, g, what);
  if (g.newest_complete >= k_max_generation)
    throw io_error(what + ": " + generation_path(dir, g.newest_complete, false) + " is the last generation number this "
                   "library reads; move the checkpoints to a new directory");
  return g.newest_complete + 1;
}

/// The newest complete generation's directory.  @throws io_error when there is none, the
/// directory cannot be listed, or the newest is a symlink or no directory
inline std::string newest_generation(const std::string& dir, const std::string& what) {
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) throw io_error(what + ": cannot open " + dir + ": " + std::strerror(errno));
  if (S_ISLNK(st.st_mode)) throw io_error(what + ": " + dir + " is a symbolic link; refusing to follow it");
  const generations g = scan_generations(dir, what);
  refuse_foreign_newest(dir, g, what);
  if (g.newest_complete == 0) throw io_error(what + ": no complete checkpoint (gen-<N>) in " + dir);
  return generation_path(dir, g.newest_complete, false);
}

/// Publishes gen-`n`.tmp as gen-`n`: fsyncs the generation's directory, renames it,
/// fsyncs `dir`.  The test hook DEFERALLOC_TEST_PUBLISH_DELAY_MS sleeps before the
/// rename (to widen the window a kill test aims at).  @throws io_error
inline void publish_generation(const std::string& dir, std::uint64_t n, const std::string& what) {
  const std::string tmp = generation_path(dir, n, true), fin = generation_path(dir, n, false);
  fsync_dir(tmp, what);
  if (const char* d = std::getenv("DEFERALLOC_TEST_PUBLISH_DELAY_MS"))
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(d)));
  if (::rename(tmp.c_str(), fin.c_str()) != 0)
    throw io_error(what + ": cannot publish " + tmp + " as " + fin + ": " + std::strerror(errno));
  fsync_dir(dir, what);
}

/// Removes every generation (complete or not) older than `keep` that is a real
/// directory (Note [Generation names]).  Best effort: a failure leaves a stale directory
/// that the next save removes.  Never throws.
inline void prune_generations(const std::string& dir, std::uint64_t keep) noexcept {
  try {
    std::error_code ec;
    std::vector<std::filesystem::path> old;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      std::uint64_t n = 0;
      bool tmp = false;
      if (parse_generation(e.path().filename().string(), n, tmp) && n < keep && generation_problem(e).empty())
        old.push_back(e.path());
    }
    for (const auto& p : old) std::filesystem::remove_all(p, ec);
  } catch (...) {
    // A directory changing under the iterator, no memory: the next save prunes again.
  }
}

/// Prunes generations after a publish on a thread of its own, so that a save returns
/// once its generation is published and durable, not once the previous one's blocks are
/// freed (unlinking a written file took 0.14 s per GB on an ext4 mounted with
/// `discard`).  At most one prune is in flight: start() and wait() join the previous
/// one first, and so does the destructor.  A kill during a prune leaves older
/// generations half-removed; they are never loaded (a newer complete one exists) and the
/// next save removes them.  Not thread-safe: its owner serialises the calls.
class background_prune {
 public:
  background_prune() = default;
  background_prune(const background_prune&) = delete;
  background_prune& operator=(const background_prune&) = delete;
  ~background_prune() { wait(); }

  /// Removes the generations of `dir` older than `keep`, on a new thread (or here, when
  /// no thread can be started).
  void start(const std::string& dir, std::uint64_t keep) {
    wait();
    try {
      thread_ = std::thread([dir, keep] { prune_generations(dir, keep); });
    } catch (...) {
      prune_generations(dir, keep);
    }
  }
  /// Returns once the last prune started has finished.
  void wait() noexcept {
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::thread thread_;
};

}  // namespace deferalloc::optim::detail
