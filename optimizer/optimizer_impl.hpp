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

#include "kernels/compute.hpp"
#include "store/file_store.hpp"

namespace deferalloc::optim {

struct streamed_adamw::impl {
  enum class pass { init, step, export_bf16 };
  struct shard {
    shard_info info;
    std::array<reservation_id, 3> res{};  // main, exp_avg, exp_avg_sq
    std::array<float*, 3> home{};         // host tier: pinned home of each array
    std::uint64_t step = 0;               // PyTorch's per-parameter step
    bool resident = false;                // Note [Resident shards]
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
  std::size_t move_moment(const piece_ref& p, int a, float* dev, bool to_device, stream_t s);
  void report_progress(const char* phase, std::size_t done, std::size_t total,
                       std::chrono::steady_clock::time_point t0, std::chrono::steady_clock::time_point& last_line);
  void run_pass(pass kind, std::span<const void* const> grads, std::span<const value_type> gts, float grad_scale,
                stream_t user, std::size_t skip);
  /// Copies shard `s`'s array `a` (elements [e0, e0+n)) from its home to host memory `out`.
  void read_home(std::size_t s, int a, std::size_t e0, std::size_t n, float* out);
  /// Writes `n` elements from host memory into shard `s`'s array `a` at `e0` (file tier:
  /// into `slot`; `in` aligned, with room for io_bytes(n), `e0` on a block boundary).
  void write_home(std::size_t s, int a, std::size_t e0, std::size_t n, float* in, int slot);
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
