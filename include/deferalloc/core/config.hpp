// Settings: one parser for the PYTORCH_CUDA_ALLOC_CONF grammar,
//   key:value,key:[v1,v2],...
// read from DEFERALLOC_CONF by the C ABI and the preload library, and the allocator's
// settings table (the optimizer's keys are its own: deferalloc/optim/optimizer_settings.hpp).
// An unknown key or a bad value is an error that lists the valid keys.
#pragma once
#include <deferalloc/core/driver.hpp>
#include <deferalloc/core/export.hpp>

#include <cstddef>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace deferalloc {

enum class log_level : int { off = 0, error, warn, info, debug };

/// A parsed but uninterpreted setting: a scalar or a list.
struct config_value {
  std::vector<std::string> items;  ///< one item for a scalar
  bool is_list = false;
};

/// Splits `text` by the grammar.  Whitespace around tokens is ignored; a key given
/// twice keeps the last value.  @throws invalid_argument on a syntax error.
DFA_API std::map<std::string, config_value> parse_config_text(std::string_view text);


/// A quarter of the machine's physical memory (64 MiB when it cannot be read): the default
/// of pinned_cache_mb and of the host driver's capacity.
DFA_API std::size_t quarter_of_ram() noexcept;

struct caching_allocator_config {
  /// Requests up to this size go to the small-block segment (PyTorch's small pool).
  std::size_t small_size = std::size_t{1} << 20;
  /// Address space of each segment (reservation); 0 = twice the device's memory,
  /// rounded up to the granularity.  A group that fills one gets another.
  std::size_t segment_reserve = 0;
  /// Fraction of the device's total memory that the allocator may keep backed
  /// (PyTorch's set_per_process_memory_fraction), in (0, 1].
  double memory_fraction = 1.0;
  /// The largest growth step.  When a block needs physical memory, the unbacked free
  /// space after it is backed too, up to the next multiple of the group's step: an
  /// eighth of what the group (small pool, large pool or tag) holds, at least one
  /// granule in the small pool and 16 MiB elsewhere, at most `grow_bytes` rounded down to
  /// a power of two.  A growing heap then
  /// pays one cuMemCreate + cuMemMap + cuMemSetAccess per step rather than per block, and
  /// holds at most one step unused at its end.  0 = back block by block.
  std::size_t grow_bytes = std::size_t{64} << 20;
};

/// Every setting of the library, with its default.
struct settings {
  driver_kind driver = driver_kind::automatic;  ///< driver: auto | cuda | host
  int device = 0;                               ///< device: ordinal
  /// shareable_handles: auto | none | posix_fd (Note [Shareable chunks] in cuda_driver.cpp)
  shareable_handle share = shareable_handle::automatic;
  std::vector<std::size_t> chunk_classes;       ///< chunk_classes_mb: [2,32,...]; empty = powers of two
  std::size_t pool_budget = 0;                  ///< pool_budget_mb: bytes of chunks alive; 0 = no limit
  std::size_t host_capacity = 0;                ///< host_capacity_mb: host driver capacity; 0 = 1/4 of RAM
  std::size_t host_granularity = std::size_t{2} << 20;  ///< host_granularity_kb
  /// pinned_cache_mb: pinned backup buffers kept cached after a restore, for the next
  /// pause; beyond it they are freed (0 = none kept; default 1/4 of physical RAM, as
  /// PyTorch's pinned host cache keeps everything).  empty_cache and trim free them.
  /// Note [Physical memory policy] in allocator/core/chunk_pool.cpp.
  std::size_t pinned_cache = quarter_of_ram();
  /// pool_cache_mb: bytes of physical chunks the pool keeps cached for churn; chunks
  /// given back beyond it are released to the device at once (0 = none kept).
  std::size_t pool_cache = std::size_t{64} << 20;
  log_level level = log_level::warn;            ///< log_level: off | error | warn | info | debug
  /// small_size_kb, segment_reserve_mb, memory_fraction, grow_mb: the caching
  /// allocator of the C ABI / preload / LibTorch faces.
  caching_allocator_config caching;
};

/// One row of the settings table (Note [Settings table] in allocator/core/config.cpp).
struct setting_doc {
  const char* key;
  const char* type;     ///< what a value looks like, e.g. "MB", "list of MB", "auto|cuda|host"
  const char* range;    ///< the accepted values, e.g. "[0, 16777216]"
  const char* def;      ///< the default, as text
  const char* doc;      ///< one line of meaning
};

/// The allocator's keys, in table order (docs/SETTINGS.md's allocator table lists exactly
/// these).  The optimizer's are in deferalloc::optim::optimizer_settings_table().
DFA_API std::vector<setting_doc> settings_table();

/// The allocator's keys, comma-separated, for messages.
DFA_API std::string settings_keys();

/// The names of the keys other libraries of the package own (the optimizer's), which the
/// allocator accepts and ignores (Note [Keys other libraries own] in allocator/core/config.cpp).
DFA_API std::vector<std::string> other_libraries_keys();

/// Parses `text` into settings (defaults for keys not given; keys other libraries own are
/// passed over).  @throws invalid_argument naming the key and listing the valid keys.
DFA_API settings parse_settings(std::string_view text);

/// parse_settings of keys already split by parse_config_text.
DFA_API settings settings_from(const std::map<std::string, config_value>& keys);

/// The level that library messages are printed at (stderr).  Default warn.
DFA_API void set_log_level(log_level l) noexcept;
DFA_API log_level get_log_level() noexcept;

}  // namespace deferalloc
