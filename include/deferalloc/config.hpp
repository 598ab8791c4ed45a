// Settings: one parser for the PYTORCH_CUDA_ALLOC_CONF grammar,
//   key:value,key:[v1,v2],...
// read from DEFERALLOC_CONF by the C ABI and the preload library.  An unknown key or
// a bad value is an error that lists the valid keys.
#pragma once
#include <deferalloc/export.hpp>

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

enum class driver_kind { automatic, cuda, host };

/// A quarter of the machine's physical memory (64 MiB when it cannot be read): the default
/// of pinned_cache_mb and of the host driver's capacity.
DFA_API std::size_t quarter_of_ram() noexcept;

/// Every setting of the library, with its default.
struct settings {
  driver_kind driver = driver_kind::automatic;  ///< driver: auto | cuda | host
  int device = 0;                               ///< device: ordinal
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
};

/// The valid keys, comma-separated, for messages.
DFA_API std::string settings_keys();

/// Parses `text` into settings (defaults for keys not given).
/// @throws invalid_argument naming the key and listing the valid keys.
DFA_API settings parse_settings(std::string_view text);

/// The level that library messages are printed at (stderr).  Default warn.
DFA_API void set_log_level(log_level l) noexcept;
DFA_API log_level get_log_level() noexcept;

}  // namespace deferalloc
