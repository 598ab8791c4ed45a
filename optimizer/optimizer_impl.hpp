// The optimizer's private state, shared by streamed_adamw.cpp (pipeline) and
// checkpoint.cpp (state transfer and checkpoints).
#pragma once
#include <deferalloc/chunk_pool.hpp>
#include <deferalloc/optimizer.hpp>
#include <deferalloc/reservations.hpp>

#include <array>
#include <chrono>
#include <map>
#include <mutex>
#include <span>

#include "kernels/compute.hpp"
#include "store/file_store.hpp"

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
/// One T per state array, indexed by it (and only by it).
template <typename T>
struct per_array : std::array<T, 3> {
  T& operator[](state_array a) { return std::array<T, 3>::operator[](array_index(a)); }
  const T& operator[](state_array a) const { return std::array<T, 3>::operator[](array_index(a)); }
};

struct streamed_adamw::impl {
  enum class pass { init, step, export_bf16 };
  struct shard {
    shard_info info;
    per_array<reservation_id> res{};
    per_array<float*> home{};  // host tier: pinned home of each array
    std::uint64_t step = 0;               // PyTorch's per-parameter step
    bool resident = false;                // Note [Resident shards]
    /// The device address of array `a` (its reservation).
    float* device(state_array a) const {
      return a == state_array::main ? info.main_param : a == state_array::exp_avg ? info.exp_avg : info.exp_avg_sq;
    }
  };
  struct piece_ref {
    std::size_t shard, e0, n;
  };

  std::mutex mu;
  std::shared_ptr<driver> drv;
  optimizer_config cfg;
  std::shared_ptr<chunk_pool> pool;
  std::unique_ptr<reservation_manager> mgr;
  std::unique_ptr<detail::compute> comp;
  std::unique_ptr<detail::file_store> file;
  std::vector<shard> shards;
  std::vector<shard_info> infos;
  std::map<int, adamw_params> groups;  // set_group; others use cfg.adamw
  std::size_t piece = 0;  // elements per piece (streamed tiers)
  stream_t h2d = nullptr, d2h = nullptr, exec = nullptr;
  std::vector<event_t> events;
  std::vector<void*> stage_in, stage_out;
  std::size_t stage_bytes = 0;
  std::uint64_t step_count = 0;
  bool initialized = false;
  bool moments_written = false;
  std::uint64_t failed_step = 0;       // the step number that failed part-way (in place tiers), 0 = none
  std::size_t failed_pieces_done = 0;  // its pieces (device tier: shards) already written back
  step_report report;
  bool resident_stepped = false;  // this step's resident shards are enqueued (a retry skips them)

  void ensure_file();
  void ensure_staging();
  void free_staging() noexcept;
  event_t event(std::size_t i);
  /// Work enqueued on `waiter` from now on runs after all that is enqueued on `producer` so
  /// far (one record of event 0 + one wait; no host synchronisation).
  void after(stream_t waiter, stream_t producer);
  /// Every piece; with `grads` (a step), only those of shards with a gradient, unless
  /// the file tier must carry the others into the new slot.
  std::vector<piece_ref> pieces(std::span<const void* const> grads = {}) const;
  /// Shard s's scalars for its next step.
  detail::adamw_scalars scalars(std::size_t s, float grad_scale) const;
  std::string where(const piece_ref& p) const;
  /// Host tier, compressed moments: copies moment `a` of piece `p` between its home and
  /// `dev` (the piece's window, in the format's layout) on `s`; returns the bytes moved.
  std::size_t move_moment(const piece_ref& p, state_array a, float* dev, bool to_device, stream_t s);
  void report_progress(const char* phase, std::size_t done, std::size_t total,
                       std::chrono::steady_clock::time_point t0, std::chrono::steady_clock::time_point& last_line);
  void run_pass(pass kind, std::span<const void* const> grads, std::span<const value_type> gts, float grad_scale,
                stream_t user, std::size_t skip);
  /// Copies shard `s`'s array `a` (elements [e0, e0+n)) from its home to host memory `out`.
  void read_home(std::size_t s, state_array a, std::size_t e0, std::size_t n, float* out);
  /// Writes `n` elements from host memory into shard `s`'s array `a` at `e0` (file tier:
  /// into `slot`; `in` aligned, with room for io_bytes(n), `e0` on a block boundary).
  void write_home(std::size_t s, state_array a, std::size_t e0, std::size_t n, float* in, int slot);
  /// Note [Resident shards] (resident.cpp): picks and backs them at initialize(); the
  /// tier a shard's state lives in; the device-tier operations over resident shards
  /// (on exec; `all` also takes the shards of a device-tier optimizer).
  void place_resident();
  tier home_of(std::size_t s) const { return shards[s].resident ? tier::device : cfg.home; }
  void init_device_shards(bool all);
  void step_device_shards(std::span<const void* const> grads, std::span<const value_type> gts, float grad_scale,
                          std::size_t first, bool all);
  void sync_device_shards(bool all);
  /// BF16(main) into the model parameters; `stream` waits for it.
  void sync_model(stream_t stream);
};

}  // namespace deferalloc::optim
