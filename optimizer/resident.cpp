// Note [Resident shards]
//
// Rationale: when HBM holds part of the FP32 state, streaming all of it wastes the link:
// a shard that stays in HBM steps at HBM speed (~28 B/param at 4.8 TB/s) and costs no
// PCIe bytes, so a budget covering half the state halves the streamed bytes.
// Approach: optimizer_config::resident_bytes (C ABI resident_mb; Python resident_mb or
// "auto" from free HBM).  At initialize(), shards are taken in registration order while
// their three FP32 arrays, each rounded up to the granule, fit the budget (a shard that
// does not fit is skipped, later smaller ones may still fit); that much of their
// reservations is backed (a norm of 2,048 elements costs 3 granules), their pinned homes
// freed, and from then on they are device-tier shards inside a host-tier optimizer:
// initialize upcasts, step runs the device tier's kernel on the exec stream (enqueued
// before the streamed pass, so the GPU steps them while the link streams the rest),
// state ranges and checkpoints read HBM.  One optimizer, one checkpoint, one step count.
// The arithmetic is the same kernel's, so the split is bit-identical to all-streamed.
// Compressed moments (Note [Moment formats]) apply to the streamed shards only; resident
// shards keep FP32 moments (they cost no link bytes).
// Limits: host tier only (the file tier refuses a budget: its resident shards would have to
// be written to the state file at each commit, not implemented); the chunk pool's budget is
// window + resident bytes; the choice is made once (a later budget change needs a new
// optimizer).
#include <deferalloc/core/errors.hpp>

#include "optimizer_impl.hpp"

namespace deferalloc::optim {

void streamed_adamw::impl::place_resident() {
  if (cfg.resident_bytes == 0) return;  // (host tier only: make_homes checks)
  std::size_t left = cfg.resident_bytes;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    auto& s = shards[i];
    const std::size_t arrays = param_is_main(s.info) ? 2 : 3;  // an FP32 parameter is its main
    const std::size_t bytes = arrays * resident_bytes(*drv, s.info.numel);  // what device_home::add_shard backs
    if (bytes > left) continue;
    hbm_home->add_shard(s);  // backed whole, all or nothing
    left -= bytes;
    shards.mark_resident(i);
    tier_home->drop_shard(i);  // its pinned home
  }
}

void streamed_adamw::impl::init_device_shards(bool all) {
  for (auto& s : shards)
    if ((all || s.resident) && !param_is_main(s.info))
      comp->upcast(s.info.param, s.info.param_type, s.info.main_param, s.info.numel, exec());
}

void streamed_adamw::impl::step_device_shards(std::span<const void* const> grads, std::span<const value_type> gts,
                                              float grad_scale, std::size_t first, bool all) {
  for (std::size_t s = first; s < shards.size(); ++s) {
    auto& sh = shards[s].info;
    if ((all || shards[s].resident) && grads[s] != nullptr && s < edit_checked.size() && edit_checked[s])
      comp->adopt_if_edited(s, sh.param, sh.param_type, sh.main_param, sh.numel, exec());
    if ((all || shards[s].resident) && grads[s] != nullptr)
      comp->adamw({sh.main_param, sh.exp_avg, sh.exp_avg_sq, sh.param, grads[s], sh.param_type, gts[s], sh.numel},
                  scalars(s, grad_scale), exec());
    if (all) retry.progressed(s + 1);
  }
}

void streamed_adamw::impl::sync_device_shards(bool all) {
  for (auto& s : shards)
    if ((all || s.resident) && !param_is_main(s.info))
      comp->downcast(s.info.main_param, s.info.param, s.info.param_type, s.info.numel, exec());
}

}  // namespace deferalloc::optim
