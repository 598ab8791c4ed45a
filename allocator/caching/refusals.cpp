// Note [Refusals]: every allocation refused leaves one warn line and an exception with
// the same text: "deferalloc refused <N> bytes (<human>)[ in tag 'T']: <reason>. Fix:
// <what to do>."  The C ABI keeps it for dfa_last_refusal (PyTorch's allocator
// interface drops our message: the Python face shows it as an exception note).
#include <deferalloc/caching/caching_allocator.hpp>
#include <deferalloc/core/errors.hpp>

#include <string>

#include "caching/allocator_state.hpp"
#include "log.hpp"

namespace deferalloc {

std::string caching_allocator::impl::refusal_text(std::size_t bytes, const tag_state* t, const std::string& reason,
                                                  const std::string& fix) const {
  return "deferalloc refused " + std::to_string(bytes) + " bytes (" + human_bytes(bytes) + ")" +
         (t != nullptr ? " in tag '" + t->name + "'" : std::string()) + ": " + reason + ". Fix: " + fix + ".";
}

out_of_memory caching_allocator::impl::refuse_oom(std::size_t bytes, std::size_t size, const tag_state* t,
                                                  const std::string& cause, stream_t stream) {
  const pool_stats ps = mgr.pool().stats();
  const std::size_t budget = mgr.pool().budget();
  std::size_t dev_free = 0;
  std::string reason, fix;
  if (fraction_refused) {
    reason = "the memory fraction " + std::to_string(cfg.memory_fraction) + " allows " + std::to_string(limit) +
             " bytes (" + human_bytes(limit) + ") and " + std::to_string(reserved) + " (" + human_bytes(reserved) +
             ") are backed";
    fix = "free tensors, pause a tag, or raise the fraction (torch.cuda.set_per_process_memory_fraction, or "
          "memory_fraction in DEFERALLOC_CONF)";
  } else if (budget != 0 && ps.alive_bytes + size > budget) {
    reason = "the chunk pool's budget of " + std::to_string(budget) + " bytes (" + human_bytes(budget) + ") is reached (" +
             std::to_string(ps.alive_bytes) + " bytes alive)";
    fix = "free tensors, pause a tag, or raise pool_budget_mb in DEFERALLOC_CONF";
  } else {
    std::string dev = "the device's free memory is unknown";
    try {
      const auto mi = vmm.get_memory_info();
      dev_free = mi.free_bytes;
      dev = std::to_string(mi.free_bytes) + " of " + std::to_string(mi.total_bytes) + " bytes (" +
            human_bytes(mi.free_bytes) + " of " + human_bytes(mi.total_bytes) + ") are free";
    } catch (...) {
      detail::log_current("out-of-memory report: device memory info", log_level::warn);
    }
    reason = "the device is out of memory: " + dev + "; deferalloc holds " + std::to_string(reserved) + " bytes backed, " +
             std::to_string(st.allocated_bytes[pool_all].current) + " of them allocated";
    fix = "free tensors, pause a tag (deferalloc.pause), or make the other users of the device give memory back";
  }
  if (history.on()) record(trace_action::oom, 0, bytes, stream, nullptr, dev_free);
  return refuse<out_of_memory>(bytes, t, fraction_refused ? reason : reason + " (" + cause + ")", fix);
}

}  // namespace deferalloc
