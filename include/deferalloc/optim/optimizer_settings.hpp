// The streamed optimizer's settings: its own table of DEFERALLOC_CONF keys (tier,
// window_mb, ...; Note [Optimizer settings] in optimizer/settings.cpp), which sets
// optimizer_config, beside the allocator's table (core/config.hpp) for the driver.
#pragma once
#include <deferalloc/core/config.hpp>
#include <deferalloc/core/export.hpp>
#include <deferalloc/optim/optimizer.hpp>

#include <string>
#include <string_view>
#include <vector>

namespace deferalloc::optim {

/// What a settings text gives an optimizer: its own keys, and the allocator's (the driver,
/// the device, the log level) for the driver it runs on.
struct engine_settings {
  optimizer_config optimizer;
  deferalloc::settings allocator;
};

/// The optimizer's keys, in table order (docs/SETTINGS.md's optimizer table lists exactly these).
DFA_API std::vector<setting_doc> optimizer_settings_table();

/// The optimizer's keys, comma-separated, for messages.
DFA_API std::string optimizer_settings_keys();

/// Checks `v` and stores it in `oc` when `key` is one of the optimizer's keys; false when it is not.
/// @throws invalid_argument naming the key for a bad value.
DFA_API bool apply_optimizer_setting(optimizer_config& oc, const std::string& key, const config_value& v);

/// Splits `text` (parse_config_text): the optimizer's keys through its table, the rest
/// through the allocator's (settings_from); defaults for keys not given.
/// @throws invalid_argument for a bad value, or a key neither table knows (listing both).
DFA_API engine_settings parse_optimizer_settings(std::string_view text);

}  // namespace deferalloc::optim
