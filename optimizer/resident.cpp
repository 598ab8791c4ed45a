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
// On the file tier the resident shards are still committed to the state file (Note
// [Resident shards on the file tier]).
// Limits: host and file tiers (the device tier keeps all its state in HBM); on the file
// tier, fp32 moments only (its state file stores every shard's moments in one format, and
// a resident shard keeps FP32 moments); the chunk pool's budget is window + resident
// bytes; the choice is made once (a later budget change needs a new optimizer).
//
// Note [Resident shards on the file tier]
//
// Rationale: the file tier's promise is that a process killed between steps resumes
// exactly from the state file; a resident shard's state lives in HBM, which dies with the
// process, so HBM alone cannot keep that promise.  What the link saves is the read: a
// streamed shard costs 12 B/param in and 12 out per step, and its reads from the file.
// Approach: the state file keeps every shard's arrays (its layout does not change).  The
// resident shards are chosen by the host tier's rule (place_resident) when the state is
// made (initialize) or resumed (open_state), and stepped in HBM like the host tier's.
// Every commit writes their current arrays into the slot it publishes (store_resident:
// device to host through one aligned buffer, then the file's write_chunk into that slot,
// before the commit record): an init commit main only, a step (or commit_speculation)
// all three, 12 B/param out and none in (an FP32 parameter's main is its durable copy,
// read from the parameter).  A state write writes a resident shard both in HBM and in the
// file's slot, a checkpoint load writes the file's slot only.  HBM is loaded from the
// committed slot (load_resident: moments never written are zeros; an FP32 parameter's
// main goes into the parameter) on resume, after a checkpoint load, and where HBM got
// ahead of the file: a failed step (its resident shards were stepped in place), a state
// write dropped or not published.  Between calls HBM equals the committed slot, so a
// kill at any point resumes what the last commit named.
// Limits: the resident writes run after the streamed pass, not under it (one buffer of
// 32 MiB, synchronous); a resume, a load or a failed step reads all the resident state
// from the file (12 B/param in).

#include <deferalloc/core/errors.hpp>

#include <algorithm>
#include <cstring>

#include "optimizer_impl.hpp"
#include "store/file_store.hpp"

namespace deferalloc::optim {

void streamed_adamw::impl::place_resident() {
  if (cfg.resident_bytes == 0) return;  // (host and file tiers: the constructor checks)
  std::size_t left = cfg.resident_bytes;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    auto& s = shards[i];
    const std::size_t arrays = param_is_main(s.info) ? 2 : 3;  // an FP32 parameter is its main
    const std::size_t bytes = arrays * resident_bytes(*drv, s.info.numel);  // what device_home::add_shard backs
    if (bytes > left) continue;
    hbm_home->add_shard(s);  // backed whole, all or nothing
    left -= bytes;
    shards.mark_resident(i);
    tier_home->drop_shard(i);  // its pinned home (the file tier keeps its arrays in the state file)
  }
}

bool streamed_adamw::impl::any_resident() const {
  for (const auto& s : shards)
    if (s.resident) return true;
  return false;
}

namespace {
constexpr std::size_t k_resident_chunk = std::size_t{8} << 20;  // elements per copy (32 MiB)

/// fn(a, e0, n, buf) over the chunks of shard `s`'s arrays (moments only with `moments`),
/// `buf` aligned for the state file and holding one chunk.
template <typename F>
void for_resident_chunks(std::size_t numel, bool moments, F&& fn) {
  detail::aligned_buffer buf(detail::file_store::io_bytes(std::min(k_resident_chunk, numel)), false,
                             "file tier: no host memory for a resident shard's state");
  for (state_array a : k_state_arrays) {
    if (is_moment(a) && !moments) continue;
    for (std::size_t e0 = 0; e0 < numel; e0 += k_resident_chunk)
      fn(a, e0, std::min(k_resident_chunk, numel - e0), buf.p);
  }
}
}  // namespace

void streamed_adamw::impl::store_resident(int slot, bool moments) {
  for (std::size_t s = 0; s < shards.size(); ++s) {
    if (!shards[s].resident) continue;
    const bool param = param_is_main(shards[s].info);  // main is the parameter: its durable copy
    for_resident_chunks(shards[s].info.numel, moments, [&](state_array a, std::size_t e0, std::size_t n, unsigned char* buf) {
      float* out = reinterpret_cast<float*>(buf);
      if (a == state_array::main && param) read_param(s, e0, n, out);
      else hbm_home->read(s, a, e0, n, out);
      tier_home->write_chunk(s, a, e0, n, buf, slot);
    });
  }
}

void streamed_adamw::impl::load_resident() {
  for (std::size_t s = 0; s < shards.size(); ++s) {
    if (!shards[s].resident) continue;
    const bool param = param_is_main(shards[s].info);
    for_resident_chunks(shards[s].info.numel, true, [&](state_array a, std::size_t e0, std::size_t n, unsigned char* buf) {
      float* in = reinterpret_cast<float*>(buf);
      if (is_moment(a) && !moments_written) std::memset(in, 0, n * 4);  // never stored: zeros
      else tier_home->read_chunk(s, a, e0, n, buf);
      if (a == state_array::main && param) write_param(s, e0, n, in);
      else hbm_home->write(s, a, e0, n, in);
    });
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
