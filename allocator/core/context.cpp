// context: wires driver -> chunk pool -> reservation manager from settings.
#include <deferalloc/core/context.hpp>
#include <deferalloc/core/errors.hpp>

#include "log.hpp"

#include <string>

namespace deferalloc {

std::shared_ptr<driver> make_driver(const settings& s) {
  switch (s.driver) {
    case driver_kind::cuda:
      try {
        return make_cuda_driver(s.device, s.share);
      } catch (const no_device& e) {  // asked for by name: say which setting, and the way out
        throw no_device(std::string("driver:cuda is set (DEFERALLOC_CONF or the settings given) but there is no "
                                    "usable CUDA device: ") + e.what() +
                        "; driver:host (or driver:auto) runs on the host driver with CPU tensors");
      }
    case driver_kind::host: return make_host_driver({s.host_granularity, s.host_capacity});
    case driver_kind::automatic:
    default:
      if (cuda_device_available()) return make_cuda_driver(s.device, s.share);
      detail::log(log_level::info, "no CUDA device: using the host driver (driver:auto)");
      return make_host_driver({s.host_granularity, s.host_capacity});
  }
}

context::context(const settings& s) : config(s) {
  set_log_level(s.level);
  drv = make_driver(s);
  pool = std::make_shared<chunk_pool>(drv, chunk_pool_config{s.chunk_classes, s.pool_budget, s.pool_cache});
  reservations = std::make_unique<reservation_manager>(pool, drv, reservation_manager_config{s.pinned_cache});
}

}  // namespace deferalloc
