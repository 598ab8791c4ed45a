// Internal logging to stderr, filtered by the level from the settings.
#pragma once
#include <deferalloc/config.hpp>
#include <deferalloc/export.hpp>

#include <string>

namespace deferalloc::detail {
// Exported (not in a public header) so the optimizer library logs the same way.
DFA_API void log(log_level level, const std::string& msg) noexcept;
}
