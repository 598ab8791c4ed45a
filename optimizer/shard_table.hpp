// The shard table, the optimizer's lowest layer (Note [Optimizer layers] in
// optimizer_impl.hpp): what the optimizer knows of each registered shard, and the state
// arrays' order.
#pragma once
#include <deferalloc/core/reservations.hpp>
#include <deferalloc/optim/optimizer.hpp>

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace deferalloc::optim {

/// The three state arrays in storage order (main, exp_avg, exp_avg_sq): reservations,
/// pinned homes, file slots and checkpoint files all keep them in this order.
inline constexpr std::array<state_array, 3> k_state_arrays{state_array::main, state_array::exp_avg,
                                                           state_array::exp_avg_sq};
/// The first `n` of them: main alone (init and export passes) or all three (a step).
inline std::span<const state_array> first_arrays(int n) { return std::span(k_state_arrays).first(n); }
inline bool is_moment(state_array a) { return a != state_array::main; }
/// Its position in that order (offsets in files and buffers).
constexpr std::size_t array_index(state_array a) { return static_cast<std::size_t>(a); }
inline const char* array_name(state_array a) {
  return a == state_array::main ? "main" : a == state_array::exp_avg ? "exp_avg" : "exp_avg_sq";
}
/// One T per state array, indexed by it (and only by it).
template <typename T>
struct per_array : std::array<T, 3> {
  T& operator[](state_array a) { return std::array<T, 3>::operator[](array_index(a)); }
  const T& operator[](state_array a) const { return std::array<T, 3>::operator[](array_index(a)); }
};

/// One registered shard.
struct shard {
  shard_info info;
  per_array<reservation_id> res{};  // its three deferred reservations
  std::uint64_t step = 0;           // PyTorch's per-parameter step
  bool resident = false;            // Note [Resident shards]
  bool speculative = false;         // stepped speculatively, not committed (Note [Speculative steps])
  /// The device address of array `a` (its reservation).
  float* device(state_array a) const {
    return a == state_array::main ? info.main_param : a == state_array::exp_avg ? info.exp_avg : info.exp_avg_sq;
  }
};

/// n elements of one shard from element e0: what a pass moves and steps at once.
struct piece_ref {
  std::size_t shard, e0, n;
};

/// The shards in registration order, and the copy of their shard_info that
/// streamed_adamw::shards() returns.
class shard_table {
 public:
  std::size_t size() const { return shards_.size(); }
  bool empty() const { return shards_.empty(); }
  shard& operator[](std::size_t s) { return shards_[s]; }
  const shard& operator[](std::size_t s) const { return shards_[s]; }
  auto begin() { return shards_.begin(); }
  auto end() { return shards_.end(); }
  auto begin() const { return shards_.begin(); }
  auto end() const { return shards_.end(); }

  /// Appends `s` (its info copied for infos()); returns its index.
  std::size_t add(shard s);
  const std::vector<shard_info>& infos() const { return infos_; }
  /// Shard `s` is resident in HBM from now on (Note [Resident shards]).
  void mark_resident(std::size_t s);
  /// Shard `s` was stepped speculatively (Note [Speculative steps]); until
  /// end_speculation() its `speculative` flag is set and it counts in speculating().
  void mark_speculative(std::size_t s);
  /// The speculation is committed or discarded: no shard is speculative.
  void end_speculation();
  std::size_t speculating() const { return speculating_; }
  /// Shard `s`'s model parameter moves to `param` (both copies of the pointer).
  void set_param(std::size_t s, void* param);

  std::size_t numel(std::size_t s) const { return shards_[s].info.numel; }
  /// Every shard's step count, in shard order.
  std::vector<std::uint64_t> steps() const;
  /// "shard 3 ('name') elements [e0, e1)": where a failure happened.
  std::string where(const piece_ref& p) const;

 private:
  std::vector<shard> shards_;
  std::vector<shard_info> infos_;
  std::size_t speculating_ = 0;  // shards with `speculative` set
};

}  // namespace deferalloc::optim
