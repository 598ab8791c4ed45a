// The file tier's home: two slots in a state file (Note [File tier] in
// store/file_store.cpp), over the file store (layer 4); a home of layer 5.3 (Note [Homes]
// in home.hpp), made by make_home().
#include <deferalloc/core/errors.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>

#include "file_home.hpp"
#include "log.hpp"
#include "kernels/moment_format.hpp"
#include "store/file_util.hpp"
#include "store/file_store.hpp"

namespace deferalloc::optim {

using detail::file_store;
using clk = std::chrono::steady_clock;

namespace {

double since(clk::time_point t) { return std::chrono::duration<double>(clk::now() - t).count(); }

class file_home final : public home, public piece_mover, public second_copy, public committed_store {
 public:
  file_home(vmm_ops& vmm, stream_ops& streams, const shard_table& shards, const file_home_settings& settings)
      : home(traits_of(tier::file, settings.moments)),
        vmm_(vmm), streams_(streams), shards_(shards), settings_(settings), format_(settings.moments) {
    // At construction, before any step: a missing directory is a typo or an unmounted
    // disk, never created (open() checks it again).
    detail::check_dir(settings_.directory, "file tier", false);
  }
  ~file_home() override { free_staging(); }

  piece_mover* mover() override { return this; }
  second_copy* speculation() override { return this; }
  committed_store* store() override { return this; }

  std::optional<state_counts> open() override {
    if (file_) return std::nullopt;
    std::vector<std::size_t> numel;
    for (auto& s : shards_) numel.push_back(s.info.numel);
    // The packed arrays' images in pinned memory, copied as the staging buffers are.
    file_store::host_memory pinned{[this](std::size_t n) { return vmm_.host_alloc(n); },
                                   [this](void* p) { vmm_.host_free(p); }};
    file_ = std::make_unique<file_store>(settings_.directory, settings_.rank, numel, settings_.resume, settings_.io_threads,
                                         settings_.io_request_bytes, format_, std::move(pinned));
    if (!file_->resumed()) return std::nullopt;
    return state_counts{file_->committed_step(), file_->moments_written(), file_->shard_steps()};
  }
  bool resumed() const override { return file_ && file_->resumed(); }
  detail::file_store& file() override { return *file_; }
  void add_shard(const shard&) override {}  // the state file is made for all shards at open()
  void drop_shard(std::size_t) noexcept override {}

  // A pass: reads run `depth` pieces ahead into a ring of 2 * depth pinned staging
  // buffers; write-backs land in another ring and are written at retire.  Each ring
  // slot's arrays are pinned when a pass first moves them (pinning is not free: the driver
  // locks and zeroes every page), so a pass that moves main only (a load's export of the
  // BF16 params into a fresh optimizer) pins a sixth of what a step does.
  void begin_pass(const pass_plan& plan, step_report& report) override {
    plan_ = &plan;
    report_ = &report;
    read_slot_ = file_->active_slot();
    write_slot_ = plan.kind == pass_kind::step ? 1 - read_slot_ : read_slot_;
    ensure_staging(stage_in_, plan.fetch_main ? fetched_arrays() : 0);
    ensure_staging(stage_out_, plan.write_back ? plan.arrays : 0);
    reads_.assign(plan.pieces.size(), nullptr);
    writes_.assign(plan.pieces.size(), nullptr);
  }
  void prefetch(std::size_t j, const piece_ref& p) override {
    if (!plan_->fetch_main) return;
    std::string what;
    for (state_array a : first_arrays(fetched_arrays())) {
      if (a == state_array::main && steps_param(p)) continue;  // the parameter is the main
      if (file_->packed(read_slot_, p.shard, a)) continue;     // moved from memory (to_device)
      if (what.empty()) what = "state of " + shards_.where(p);
      reads_[j] = file_->read(staging(false, j, a), file_->io_bytes(a, p.e0, p.n),
                              file_->offset(read_slot_, p.shard, a, p.e0), what, reads_[j]);
    }
  }
  // The first array moved (main; a moment where the step reads the parameter) waits for
  // the piece's reads (all its arrays are one batch).  A packed array (Note [Packed arrays]
  // in file_store.cpp) moves from the slot's packed area.
  std::size_t to_device(std::size_t i, const piece_ref& p, state_array a, float* dev, stream_t s) override {
    if (a == (steps_param(p) ? state_array::exp_avg : state_array::main) && reads_[i]) wait_io(*reads_[i]);
    void* from = host_side(read_slot_, p, a);
    if (!from) from = staging(false, i, a);
    if (is_moment(a) && compressed()) return move_moment(from, p, dev, true, s);
    streams_.copy_async(dev, from, p.n * 4, s);
    return p.n * 4;
  }
  // Main first: waits until the piece's staging buffer of the ring is drained.  (A step's
  // main of an FP32 parameter comes from the parameter: the durable copy.)
  std::size_t from_device(std::size_t i, const piece_ref& p, state_array a, float* dev, stream_t s) override {
    const std::size_t ring = 2 * plan_->depth;
    if (a == state_array::main && i >= plan_->skip + ring && writes_[i - ring]) wait_io(*writes_[i - ring]);
    void* to = host_side(write_slot_, p, a);
    if (!to) to = staging(true, i, a);
    if (is_moment(a) && compressed()) return move_moment(to, p, dev, false, s);
    streams_.copy_async(to, dev, p.n * 4, s);
    return p.n * 4;
  }
  void retire(std::size_t i, const piece_ref& p) override {
    if (!plan_->write_back) return;
    std::string what;
    for (state_array a : first_arrays(plan_->arrays)) {
      if (file_->packed(write_slot_, p.shard, a)) continue;  // written by from_device, committed whole
      if (what.empty()) what = "state of " + shards_.where(p);
      writes_[i] = file_->write(staging(true, i, a), file_->io_bytes(a, p.e0, p.n),
                                file_->offset(write_slot_, p.shard, a, p.e0), what, writes_[i]);
    }
  }
  void end_pass() override {
    for (auto& w : writes_)
      if (w) w->wait();
    reads_.clear();
    writes_.clear();
  }
  void drain() noexcept override {
    for (auto* v : {&reads_, &writes_})
      for (auto& b : *v)
        if (b) try {
            b->wait();
          } catch (...) {
            deferalloc::detail::log_current("streamed_adamw: waiting for I/O after a failed pass");
          }
    reads_.clear();
    writes_.clear();
  }
  // A step's new slot becomes the state only here (Note [File tier]).
  void commit(pass_kind kind, const state_counts& counts) override {
    if (kind == pass_kind::init) file_->commit(counts.step, file_->active_slot(), false, counts.shard_steps);
    if (kind == pass_kind::step) file_->commit(counts.step, 1 - file_->active_slot(), true, counts.shard_steps);
  }
  // A speculative step writes the inactive slot like any step; committing it is commit()
  // after the shards not stepped were carried (Note [Speculative steps]), so the second
  // copy needs nothing of its own.  Discarding it leaves the active slot, and the next
  // step writes the inactive one afresh.
  void prepare(std::size_t) override {}
  void make_current(std::size_t) override {}
  int load_slot() const override { return 1 - file_->active_slot(); }
  int active_slot() const override { return file_->active_slot(); }
  void commit_load(int slot, const state_counts& counts) override {
    file_->commit(counts.step, slot, counts.moments_written, counts.shard_steps);
  }

  void read(std::size_t s, state_array a, std::size_t e0, std::size_t n, float* out) override {
    if (is_moment(a) && compressed()) return read_moment(s, a, e0, n, out);
    constexpr std::size_t chunk = std::size_t{32} << 20;  // bytes per read
    const bool direct = reinterpret_cast<std::uintptr_t>(out) % file_store::align == 0 && (n * 4) % file_store::align == 0;
    const std::size_t block = std::min<std::size_t>(chunk, n * 4);
    std::unique_ptr<detail::aligned_buffer> bounce;
    if (!direct)
      bounce = std::make_unique<detail::aligned_buffer>(file_store::io_bytes(block / 4), false,
                                                        "checkpoint: no host memory for a bounce buffer");
    for (std::size_t done = 0; done < n * 4; done += chunk) {
      const std::size_t want = std::min(chunk, n * 4 - done);
      char* to = direct ? reinterpret_cast<char*>(out) + done : reinterpret_cast<char*>(bounce->p);
      file_->read(to, file_store::io_bytes(want / 4), file_->offset(file_->active_slot(), s, a, e0) + done, what(s, a))
          ->wait();
      if (!direct) std::memcpy(reinterpret_cast<char*>(out) + done, to, want);
    }
  }
  void read_chunk(std::size_t s, state_array a, std::size_t e0, std::size_t n, unsigned char* buf) override {
    if (is_moment(a) && compressed()) return read_moment(s, a, e0, n, reinterpret_cast<float*>(buf));
    file_->read(buf, file_store::io_bytes(n), file_->offset(file_->active_slot(), s, a, e0), what(s, a))->wait();
  }
  // `e0` on a chunk boundary (write()'s and the checkpoint's pieces), so a compressed
  // moment's range is whole segments, encoded here as the host tier encodes them.
  void write_chunk(std::size_t s, state_array a, std::size_t e0, std::size_t n, unsigned char* buf, int slot) override {
    const float* in = reinterpret_cast<const float*>(buf);
    if (is_moment(a) && compressed()) {
      const std::size_t io = file_->io_bytes(a, e0, n);
      detail::aligned_buffer enc(io, true, "file tier: no host memory for encoding moments");
      for_segments(e0, n, [&](std::size_t j, std::size_t r, std::uint64_t at) {
        detail::encode_moments(format_, a, enc.p + at, r, 0, r, in + j);
      });
      file_->write(enc.p, io, file_->offset(slot, s, a, e0), what(s, a))->wait();
      return;
    }
    const std::size_t io = file_store::io_bytes(n);
    std::memset(buf + n * 4, 0, io - n * 4);
    file_->write(buf, io, file_->offset(slot, s, a, e0), what(s, a))->wait();
  }
  // Note [State writes]
  //
  // Rationale: write_state_range (and load_state_dict, one call per array) once wrote
  // the committed slot in place: a kill part-way left a mix of old and new arrays under
  // a valid commit record, or a checksum table that no longer matched (refused, and the
  // previous step lost with it).
  // Approach: a write goes to the inactive slot, as a step does, within a state write:
  // begin_state_write's, or one that write_state_range or set_shard_step opens itself when none is open
  // (implicit) and that the next call using the state publishes (a step, a read, a
  // save or load, sync_model_params, begin_state_write, the destructor), so that a
  // caller writing array after array (Megatron's checkpoint load, one parameter at a
  // time) pays one publish, not one per array.  Each array written is marked;
  // end_write(true) fills every array not written from the active slot (moments never
  // written: zeros, when the write wrote some moment, else left unwritten), then commits
  // the inactive slot once with the step count and the shards' step counts.  A kill
  // before that commit leaves the old state, after it the new.  end_write(false)
  // forgets the marks: the inactive slot is not named by any commit record and the next
  // write or step rewrites all of it.  A write of step counts only commits the active
  // slot again (its bytes unchanged) with the new counts.
  // Limits: whole arrays only (home_traits::whole_arrays); a publish copies the arrays not written
  // (one read and one write of the rest of the state), so loading a state dict costs
  // about two passes over the state.  An implicit write is durable only once published:
  // a process killed before its next use of the optimizer resumes the old state.
  void begin_write() override {
    written_.assign(shards_.size(), per_array<bool>{});
    wrote_moment_ = false;
    writing_ = true;
  }
  void end_write(bool publish, const state_counts& counts) override {
    if (!writing_) return;
    writing_ = false;
    struct free_bounce {  // held for one state write
      std::unique_ptr<detail::aligned_buffer>& b;
      ~free_bounce() { b.reset(); }
    } on_return{bounce_};
    if (!publish) return;
    bool any = false;
    for (const auto& w : written_) any = any || w[state_array::main] || w[state_array::exp_avg] || w[state_array::exp_avg_sq];
    if (!any) return publish_steps(counts);  // step counts only: the active slot again
    const int from = file_->active_slot(), to = 1 - from;
    const bool moments = counts.moments_written || wrote_moment_;
    // The stored bytes, copied as they are (compressed moments are not decoded and
    // encoded again; zero bytes are zero moments in every format).
    constexpr std::size_t piece = 4 * k_bounce;  // bytes per request: whole checksum blocks
    unsigned char* buf = bounce();
    for (std::size_t s = 0; s < shards_.size(); ++s)
      for (state_array a : k_state_arrays) {
        if (written_[s][a] || (is_moment(a) && !moments)) continue;
        const bool zeros = is_moment(a) && !file_->moments_written();  // never stored: zeros by construction
        const std::size_t bytes = file_->io_bytes(a, 0, shards_.numel(s));
        for (std::size_t done = 0; done < bytes; done += piece) {
          const std::size_t k = std::min(piece, bytes - done);
          if (zeros) std::memset(buf, 0, k);
          else file_->read(buf, k, file_->offset(from, s, a, 0) + done, what(s, a))->wait();
          file_->write(buf, k, file_->offset(to, s, a, 0) + done, what(s, a))->wait();
        }
      }
    file_->commit(counts.step, to, moments, counts.shard_steps);
  }
  // Whole arrays (home_traits::whole_arrays) into the inactive slot through an aligned bounce buffer,
  // in pieces on checksum-block boundaries (write_chunk() pads each piece to whole blocks),
  // within a state write, published by end_write (Note [State writes]).
  void write(std::size_t shard, state_array a, std::size_t, std::size_t, const float* in) override {
    DFA_EXPECTS(writing_, "write_state_range: the file tier writes within a state write", invalid_state);
    unsigned char* buf = bounce();
    const std::size_t numel = shards_.numel(shard);
    for (std::size_t e0 = 0; e0 < numel; e0 += k_bounce) {
      const std::size_t k = std::min(k_bounce, numel - e0);
      std::memcpy(buf, in + e0, k * 4);
      write_chunk(shard, a, e0, k, buf, 1 - file_->active_slot());
    }
    written_[shard][a] = true;
    wrote_moment_ = wrote_moment_ || is_moment(a);
  }

 private:
  bool compressed() const { return format_ != moment_format::fp32; }
  // Piece p's array `a` in slot `slot`'s packed area (its bytes as stored), or null when
  // the array is not packed.
  void* host_side(int slot, const piece_ref& p, state_array a) const {
    unsigned char* at = file_->packed(slot, p.shard, a);
    if (!at) return nullptr;
    return at + (a == state_array::main ? p.e0 * 4 : file_store::stored_bytes(format_, p.e0));
  }
  // The arrays a pass reads ahead: all three for a step over stored moments, else main;
  // a step reads no main of an FP32 parameter (steps_param).
  int fetched_arrays() const { return plan_->kind == pass_kind::step && plan_->moments_stored ? 3 : 1; }
  bool steps_param(const piece_ref& p) const {
    return plan_->kind == pass_kind::step && param_is_main(shards_[p.shard].info);
  }
  // Step counts only: a commit naming the active slot again.  (A state write is opened
  // on initialized state only: initialize() or a resume set the counts.)
  void publish_steps(const state_counts& counts) {
    if (!file_) return;
    file_->commit(counts.step, file_->active_slot(), file_->moments_written(), counts.shard_steps);
  }
  std::string what(std::size_t s, state_array a) const {
    return std::string(array_name(a)) + " of " + shards_[s].info.name;
  }
  // fn(j, r, at) for each segment of elements [e0 + j, e0 + j + r) of a compressed
  // moment range starting on a segment (Note [File tier moments]), `at` its bytes'
  // offset from the range's first.
  template <typename F>
  void for_segments(std::size_t e0, std::size_t n, F&& fn) const {
    const std::size_t seg = format_ == moment_format::int8 ? file_store::segment(format_) : n;
    const std::uint64_t first = file_store::stored_bytes(format_, e0);
    for (std::size_t j = 0; j < n; j += seg)
      fn(j, std::min(seg, n - j), file_store::stored_bytes(format_, e0 + j) - first);
  }
  // Piece p's compressed moment between its staging buffer (its segments as stored) and
  // its window (the host tier's layout of p.n elements: codes, then scales); returns the
  // bytes moved.
  std::size_t move_moment(void* stage, const piece_ref& p, float* dev, bool to_device, stream_t s) {
    char* st = static_cast<char*>(stage);
    char* d = reinterpret_cast<char*>(dev);
    if (format_ == moment_format::bf16) return copy_run(streams_, d, st, 2 * p.n, to_device, s);
    std::size_t moved = 0;
    for_segments(p.e0, p.n, [&](std::size_t j, std::size_t r, std::uint64_t at) {
      moved += copy_run(streams_, d + j, st + at, r, to_device, s) +
               copy_run(streams_, d + detail::q_scales_offset(p.n) + 4 * (j / detail::k_qblock),
                        st + at + detail::q_scales_offset(r), 4 * detail::q_blocks(r), to_device, s);
    });
    return moved;
  }
  // Elements [e0, e0+n) of a compressed moment, decoded: the segments covering them are
  // read through a bounce buffer, k_bounce elements at a time.
  void read_moment(std::size_t s, state_array a, std::size_t e0, std::size_t n, float* out) {
    const std::size_t numel = shards_.numel(s), seg = file_store::segment(format_);
    const std::size_t first = e0 / seg * seg;
    detail::aligned_buffer buf(file_->io_bytes(a, 0, std::min(k_bounce, numel)), false,
                               "file tier: no host memory for decoding moments");
    for (std::size_t c0 = first; c0 < e0 + n; c0 += k_bounce) {
      const std::size_t k = std::min(k_bounce, numel - c0);
      file_->read(buf.p, file_->io_bytes(a, c0, k), file_->offset(file_->active_slot(), s, a, c0), what(s, a))->wait();
      for_segments(c0, k, [&](std::size_t j, std::size_t r, std::uint64_t at) {
        const std::size_t lo = std::max(e0, c0 + j), hi = std::min(e0 + n, c0 + j + r);
        if (lo < hi) detail::decode_moments(format_, a, buf.p + at, r, lo - c0 - j, hi - lo, out + (lo - e0));
      });
    }
  }
  // Piece i's array `a` in the ring of staging buffers (in: reads, out: writes).
  char* staging(bool out, std::size_t i, state_array a) const {
    const auto& ring = out ? stage_out_ : stage_in_;
    return static_cast<char*>(ring[i % ring.size()][a]);
  }
  // Pins the first `arrays` arrays of every slot of `ring` that are not yet (a failure
  // keeps those pinned so far, freed with the rest).
  void ensure_staging(std::vector<per_array<void*>>& ring, int arrays) {
    ring.resize(2 * plan_->depth);
    for (auto& slot : ring)
      for (state_array a : first_arrays(arrays))
        if (!slot[a]) slot[a] = vmm_.host_alloc(file_store::io_bytes(plan_->window_piece));
  }
  void free_staging() noexcept {
    for (auto* ring : {&stage_in_, &stage_out_}) {
      for (auto& slot : *ring)
        for (void* p : slot)
          if (p) vmm_.host_free(p);
      ring->clear();
    }
  }

  static constexpr std::size_t k_bounce = std::size_t{8} << 20;  // elements per state-write piece (32 MiB)
  // The state write's bounce buffer (k_bounce FP32 values), allocated by its first
  // write or its publish and freed by end_write: a state dict's load writes array
  // after array through one buffer, and an optimizer not writing holds none.  Its
  // callers hold the optimizer's mutex.
  unsigned char* bounce() {
    if (!bounce_)
      bounce_ = std::make_unique<detail::aligned_buffer>(file_store::io_bytes(k_bounce), false,
                                                         "write_state_range: no host memory for a bounce buffer");
    return bounce_->p;
  }
  // Waits for a piece's I/O, counted in the pass's report.
  void wait_io(detail::io_batch& b) {
    const auto t = clk::now();
    b.wait();
    report_->io_wait_seconds += since(t);
  }
  vmm_ops& vmm_;          // pinned staging and images
  stream_ops& streams_;   // copies
  const shard_table& shards_;
  const file_home_settings settings_;  // the state file's, read by open()
  const moment_format format_;
  std::unique_ptr<file_store> file_;  // the state file (open())
  step_report* report_ = nullptr;     // the pass's (its I/O waits)
  std::unique_ptr<detail::aligned_buffer> bounce_;
  bool writing_ = false;                 // a write is open (Note [State writes])
  bool wrote_moment_ = false;
  std::vector<per_array<bool>> written_;  // per shard: the arrays it wrote
  const pass_plan* plan_ = nullptr;
  int read_slot_ = 0, write_slot_ = 0;
  std::vector<std::shared_ptr<detail::io_batch>> reads_, writes_;  // per piece of the pass
  std::vector<per_array<void*>> stage_in_, stage_out_;  // per ring slot: each array's buffer (null until used)
};

}  // namespace

std::unique_ptr<home> make_file_home(vmm_ops& vmm, stream_ops& streams, const shard_table& shards,
                                     const file_home_settings& settings) {
  return std::make_unique<file_home>(vmm, streams, shards, settings);
}

}  // namespace deferalloc::optim
