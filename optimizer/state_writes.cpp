// State writes (Note [State writes] in file_home.cpp): a write of the state opened, ended,
// and settled by the next call that uses the state, on the facade (layer 5.5, Note
// [Optimizer layers]).
#include <deferalloc/core/errors.hpp>
#include <deferalloc/optim/optimizer.hpp>

#include <string>

#include "optimizer_impl.hpp"

namespace deferalloc::optim {

void streamed_adamw::impl::open_write(bool implicit) {
  if (committed_store* store = tier_home->store()) store->begin_write();
  state_write.begin(implicit, counts());
}

void streamed_adamw::impl::ensure_state_write() {
  if (!state_write.open() && !in_place()) open_write(true);
}

void streamed_adamw::impl::close_write(bool publish) {
  if (!state_write.open()) return;
  const state_counts before = state_write.end();
  // A write not published leaves the file tier's committed state, and so its counts and
  // its resident shards' state (Note [Resident shards on the file tier]); the in-place
  // tiers keep what was written.
  auto keep_old = [&] {
    if (in_place()) return;
    moments_written = before.moments_written;
    for (std::size_t s = 0; s < shards.size(); ++s) shards[s].step = before.shard_steps[s];
    if (any_resident()) load_resident();
  };
  try {
    if (committed_store* store = tier_home->store()) store->end_write(publish, counts());
  } catch (...) {
    keep_old();
    throw;
  }
  if (!publish) keep_old();
}

void streamed_adamw::impl::settle_writes(const char* fn) {
  if (!state_write.open()) return;
  DFA_EXPECTS(state_write.implicit(), std::string(fn) + ": a state write is open (end_state_write first)", invalid_state);
  close_write(true);
}

void streamed_adamw::begin_state_write() {
  auto& self = *impl_;
  impl::entry_guard g(self, "begin_state_write",
                entry_needs::opened | entry_needs::initialized | entry_needs::settled | entry_needs::not_speculating);
  self.open_write(false);
}

void streamed_adamw::end_state_write(bool publish) {
  auto& self = *impl_;
  impl::entry_guard g(self);
  if (!self.state_write.open() || self.state_write.implicit()) return;
  self.close_write(publish);
}

}  // namespace deferalloc::optim
