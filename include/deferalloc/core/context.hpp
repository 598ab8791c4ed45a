// A driver, a chunk pool and a reservation manager built from settings: what the
// C ABI, the demo and the benchmarks use.  Any number can live in one process.
#pragma once
#include <deferalloc/core/config.hpp>
#include <deferalloc/core/reservations.hpp>

#include <memory>

namespace deferalloc {

/// The driver the settings ask for.  driver:auto picks CUDA when a device is present
/// and the host driver otherwise (and says so at log level info).
/// @throws no_device when driver:cuda is asked for and none is present
DFA_API std::shared_ptr<driver> make_driver(const settings& s);

struct DFA_API context {
  explicit context(const settings& s);
  settings config;
  std::shared_ptr<driver> drv;
  std::shared_ptr<chunk_pool> pool;
  std::unique_ptr<reservation_manager> reservations;
};

}  // namespace deferalloc
