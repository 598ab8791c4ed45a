// Homes: where a shard's state lives between passes, one class per tier (home.cpp,
// file_home.cpp).  The
// optimizer's third layer (Note [Optimizer layers] in optimizer_impl.hpp).
//
// Note [Homes]
//
// Rationale: the three tiers differ in where a shard's state lives between passes, and in
// nothing else: the pipeline, the kernels, state ranges and checkpoints are the same.
// Approach: one home per tier (device_home, host_home in home.cpp, file_home in
// file_home.cpp over the file store and given only the file tier's settings, made by
// make_home from the tier; resident shards of a host-tier optimizer have a device home of
// their own).  Every home backs a shard's state and reads / writes ranges of it in host
// memory (state ranges, checkpoints): the methods of `home`.  What only some tiers
// do is a capability, asked for and null where absent, never an empty method:
//  - piece_mover (host, file): the state streams through the window; it moves a piece
//    between its storage and the piece's slot on the pipeline's streams, with the tier's
//    own waits (the file tier's reads ahead and its ring of staging buffers).
//  - second_copy (host, file): a shard can be stepped into a second copy of its state
//    that a commit makes current (Note [Speculative steps] in speculation.cpp).
//  - committed_store (file): the state lives outside the process and changes only by
//    commits (a pass, a checkpoint load, a state write); without it a home updates in
//    place.
// A home sees the shard table and the lower layers (driver, reservations, its store),
// never the optimizer above it: what it needs of the optimizer's counts comes in as
// arguments (state_counts), what it learns (a resumed state file's counts) goes out as
// return values.  The contract every home keeps is written down, and checked for each
// tier and moment format, in tests/test_home_conformance.cpp.
// Limits: a home is not thread-safe except read_chunk / write_chunk, which the
// checkpoint's lanes call at once for different chunks.
#pragma once
#include <deferalloc/core/reservations.hpp>
#include <deferalloc/optim/optimizer.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "shard_table.hpp"

namespace deferalloc::optim {

namespace detail {
class file_store;
}

/// What a pass does.
enum class pass_kind {
  init,         ///< main from the model's params (upcast), written back
  step,         ///< all three arrays fetched, stepped, written back
  export_bf16,  ///< main fetched, the model's params written from it (downcast)
};

/// One pass of the window pipeline (Note [Window pipeline]).
struct pass_plan {
  pass_kind kind = pass_kind::init;
  std::vector<piece_ref> pieces;
  std::size_t skip = 0;       // pieces a failed try of this step already wrote back
  int arrays = 1;             // arrays mapped and written back: all three (step) or main
  bool fetch_main = false;    // all but init
  bool write_back = false;    // all but export
  bool speculative = false;   // a step writing into the shards' second copy (Note [Speculative steps])
  bool moments_stored = false;  // the moments were ever written (else a step zeroes them on the device)
  std::size_t depth = 1;        // pieces in flight (the window's slots)
  std::size_t window_piece = 0;  // elements of a window slot (the largest piece)
  bool durable_params = false;   // the home's home_traits::durable_params
  bool chain = false;            // leave the last write-backs to the next pass (Note [Chained passes])
  bool resumable = false;        // a plain step on a home that updates in place (no committed_store):
                                 // a retry resumes it at written(), so a failed pass writes back
                                 // the pieces it stepped (Note [The write-back queue])
};

/// What a home is built from: the lower layers and the shard table, which outlive it.
struct home_context {
  vmm_ops& vmm;         // pinned host memory, the granule
  stream_ops& streams;  // copies
  reservation_manager& mgr;
  const shard_table& shards;
  const optimizer_config& cfg;  // read at construction (tier, moment format, file settings)
  stream_t exec;                // the stream of a device home's copies
};

/// The tier's fixed properties.
struct home_traits {
  bool streamed = true;          // the state streams through the window (false: it stays in HBM)
  std::size_t piece_align = 1;   // pieces start on multiples of these bytes (file: its checksum blocks)
  int default_depth = 8;         // pieces in flight when the configuration leaves depth at 0 (Note [Window slots])
  bool whole_arrays = false;     // state ranges are whole arrays only (file)
  bool durable_params = false;   // keeps a copy of FP32 parameters as main (file: Note [The parameter is the truth])
  bool chains_passes = false;    // retire() is the pipeline's wait only (host): a pass may leave its last
                                 // write-backs to the next (Note [Chained passes])
};

/// An FP32 parameter is its shard's main (Note [The parameter is the truth] in
/// streamed_adamw.cpp): steps read and write it in place, and a home holds none of its
/// main but a durable copy (home_traits::durable_params).
inline bool param_is_main(const shard_info& s) { return s.param_type == value_type::fp32; }

class piece_mover;
class second_copy;
class committed_store;

/// Where the state of some shards lives (Note [Homes]).  Never-written moments are the
/// caller's to present as zeros (home::read of one returns what the home holds).
class home {
 public:
  explicit home(home_traits t) : traits_(t) {}
  virtual ~home() = default;
  home(const home&) = delete;
  home& operator=(const home&) = delete;

  const home_traits& traits() const { return traits_; }

  /// Backs the state of shard `s` (its reservations made; the shard table may not hold
  /// it yet), moments zero; of main only where !param_is_main or durable_params.  All or
  /// nothing.  read / write / chunks of a main the home does not hold are refused
  /// (invalid_state): the optimizer reads and writes the parameter.
  virtual void add_shard(const shard& s) = 0;
  /// Frees what add_shard took for shard `s` (a resident shard leaving the host tier);
  /// nothing where add_shard took nothing.
  virtual void drop_shard(std::size_t s) noexcept = 0;
  /// Elements [e0, e0+n) of shard s's array `a` into host memory `out` (moments decoded
  /// to FP32).
  virtual void read(std::size_t s, state_array a, std::size_t e0, std::size_t n, float* out) = 0;
  /// Writes `in` into elements [e0, e0+n) (write_state_range): any range, or whole arrays
  /// where traits().whole_arrays; on a committed store, within a state write.
  virtual void write(std::size_t s, state_array a, std::size_t e0, std::size_t n, const float* in) = 0;
  /// A checkpoint chunk: read() into `buf`, which is aligned to file_store::align with
  /// room for io_bytes(n) (all of which the home may use).
  virtual void read_chunk(std::size_t s, state_array a, std::size_t e0, std::size_t n, unsigned char* buf) {
    read(s, a, e0, n, reinterpret_cast<float*>(buf));
  }
  /// Writes a checkpoint chunk from a buffer as read_chunk's (the file tier pads it with
  /// zeros), `e0` on a chunk boundary, into `slot` (a committed store's load_slot(); 0
  /// for the others).
  virtual void write_chunk(std::size_t s, state_array a, std::size_t e0, std::size_t n, unsigned char* buf, int slot) = 0;
  /// The array as plain FP32 in host memory (host tier, uncompressed), else null: the
  /// checkpoint code reads and writes it there without a copy.
  virtual float* host_array(std::size_t, state_array) const { return nullptr; }

  // -- capabilities (Note [Homes]); null where the tier has none
  virtual piece_mover* mover() { return nullptr; }
  virtual second_copy* speculation() { return nullptr; }
  virtual committed_store* store() { return nullptr; }

 private:
  home_traits traits_;
};

/// A home whose state streams through the window (Note [Window pipeline]).  Piece i is
/// plan.pieces[i]; to_device / from_device enqueue its array `a` on `s` and return the
/// bytes moved; they are called for main first.  A step pass moves no main of a piece
/// whose shard's parameter is its main (param_is_main) to the device; a home with
/// durable_params takes its main from the parameter itself (`dev` is the parameter).
class piece_mover {
 public:
  virtual ~piece_mover() = default;
  /// The pass under way; the home adds its waits for I/O to `report`.
  virtual void begin_pass(const pass_plan& plan, step_report& report) = 0;
  /// Starts reading piece i ahead of its fetch (file).
  virtual void prefetch(std::size_t i, const piece_ref& p) = 0;
  /// Piece i's array `a` into its slot at `dev` (for main: once its host copy is ready).
  virtual std::size_t to_device(std::size_t i, const piece_ref& p, state_array a, float* dev, stream_t s) = 0;
  /// Piece i's array `a` from its slot at `dev` (for main: once the home can take it).
  virtual std::size_t from_device(std::size_t i, const piece_ref& p, state_array a, float* dev, stream_t s) = 0;
  /// Piece i's write-back is done: persist it (file: the writes).
  virtual void retire(std::size_t i, const piece_ref& p) = 0;
  /// Every piece retired: waits for what retire() started.
  virtual void end_pass() = 0;
  /// After a failed pass: waits for all it started (never throws; logs).
  virtual void drain() noexcept = 0;
};

/// A home that can step a shard into a second copy of its state (Note [Speculative steps]).
class second_copy {
 public:
  virtual ~second_copy() = default;
  /// Gives shard `s` its second copy if it has none yet (all or nothing).
  virtual void prepare(std::size_t s) = 0;
  /// Shard `s`'s second copy, written by a speculative pass, becomes its state.
  virtual void make_current(std::size_t s) = 0;
};

/// The optimizer's counts that a committed store publishes with the state.
struct state_counts {
  std::uint64_t step = 0;
  bool moments_written = false;
  std::vector<std::uint64_t> shard_steps;
};

/// A home whose state lives outside the process and changes only by commits (file tier:
/// Note [File tier] in store/file_store.cpp).
class committed_store {
 public:
  virtual ~committed_store() = default;
  /// Opens the state (idempotent).  The first open of a resumed state returns its counts.
  virtual std::optional<state_counts> open() = 0;
  /// The state was resumed from a commit made by an earlier process.
  virtual bool resumed() const = 0;
  /// Publishes a finished init or step pass: `counts` are those after it.
  virtual void commit(pass_kind kind, const state_counts& counts) = 0;
  /// A checkpoint load writes into this slot (home::write_chunk), which changes nothing until
  /// commit_load publishes it with `counts`; a step's pass and a state write write it too.
  virtual int load_slot() const = 0;
  /// The slot an init pass writes and commit(pass_kind::init) publishes: the committed one.
  virtual int active_slot() const = 0;
  virtual void commit_load(int slot, const state_counts& counts) = 0;
  /// Note [State writes] (file_home.cpp): writes between begin_write and end_write(true) are
  /// published together with `counts` (the counts then); end_write(false) drops them.
  virtual void begin_write() = 0;
  virtual void end_write(bool publish, const state_counts& counts) = 0;
  /// The state file (fault injection in tests).
  virtual detail::file_store& file() = 0;
};

/// Copies `bytes` between `dev` and host memory `host` on `s` (to the device when
/// `to_device`); returns `bytes`.  A piece_mover's copy of one run.
inline std::size_t copy_run(stream_ops& drv, char* dev, char* host, std::size_t bytes, bool to_device, stream_t s) {
  if (to_device) drv.copy_async(dev, host, bytes, s);
  else drv.copy_async(host, dev, bytes, s);
  return bytes;
}

/// Bytes of one array of `numel` elements kept in HBM (device tier, resident shards):
/// rounded up to the granule.
inline std::size_t resident_bytes(const vmm_ops& drv, std::size_t numel) {
  const std::size_t g = drv.granularity();
  return (numel * 4 + g - 1) / g * g;
}

/// The traits of tier `t`'s home with moments in `moments` (known before the home is
/// made: they size the window).
home_traits traits_of(tier t, moment_format moments);
/// The home of tier `t` over `ctx` (checks nothing of the configuration but the file
/// tier's directory: the optimizer does).  home.cpp, the one place that names the tiers.
std::unique_ptr<home> make_home(tier t, const home_context& ctx);

}  // namespace deferalloc::optim
