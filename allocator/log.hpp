// Internal logging to stderr, filtered by the level from the settings.
#pragma once
#include <deferalloc/config.hpp>

#include <string>

namespace deferalloc::detail {
void log(log_level level, const std::string& msg) noexcept;
}
