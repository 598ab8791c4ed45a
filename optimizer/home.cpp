// The homes of the optimizer state, one class per tier: see Note [Homes] in
// optimizer_impl.hpp.  This file is the one place that names the tiers.
#include <deferalloc/errors.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "log.hpp"
#include "kernels/moment_format.hpp"
#include "store/file_util.hpp"
#include "optimizer_impl.hpp"

namespace deferalloc::optim {

const char* to_string(tier t) noexcept {
  switch (t) {
    case tier::device: return "device";
    case tier::host: return "host";
    case tier::file: return "file";
  }
  return "unknown";
}

tier parse_tier(const std::string& s) {
  if (s == "device") return tier::device;
  if (s == "host") return tier::host;
  if (s == "file") return tier::file;
  throw invalid_argument("unknown state tier '" + s + "' (device, host or file)");
}

using detail::file_store;
using clk = std::chrono::steady_clock;

namespace {
double since(clk::time_point t) { return std::chrono::duration<double>(clk::now() - t).count(); }
}  // namespace

// ---- device: the state stays in HBM -------------------------------------------------

class streamed_adamw::impl::device_home final : public home {
 public:
  using home::home;
  bool streamed() const override { return false; }

  // Backed for its elements (rounded up to the granule): the moments zeroed, main left
  // for the initializer (an upcast).
  void add_shard(shard& s) override {
    const std::size_t len = I.resident_bytes(s);
    std::vector<range> rs{{s.res[state_array::exp_avg], 0, len}, {s.res[state_array::exp_avg_sq], 0, len}};
    I.mgr->materialize(rs, fill_mode::zero, I.exec);
    try {
      I.mgr->materialize(s.res[state_array::main], 0, len, fill_mode::undefined, I.exec);
    } catch (...) {
      I.mgr->release(rs, keep_mode::discard, I.exec);
      throw;
    }
  }

  void read(std::size_t s, state_array a, std::size_t e0, std::size_t n, float* out) override {
    std::lock_guard lk(mu_);
    I.drv->copy_async(out, I.shards[s].device(a) + e0, n * 4, I.exec);
    I.drv->synchronize_stream(I.exec);
  }
  void write(std::size_t s, state_array a, std::size_t e0, std::size_t n, float* in, int) override {
    write_range(s, a, e0, n, in);
  }
  void write_range(std::size_t s, state_array a, std::size_t e0, std::size_t n, const float* in) override {
    std::lock_guard lk(mu_);
    I.drv->copy_async(I.shards[s].device(a) + e0, in, n * 4, I.exec);
    I.drv->synchronize_stream(I.exec);
  }

 private:
  std::mutex mu_;  // the copies share one stream (the checkpoint's lanes run at once)
};

// ---- host: pinned memory, moments possibly compressed (Note [Moment formats]) -------

class streamed_adamw::impl::host_home final : public home {
 public:
  using home::home;
  ~host_home() override {
    for (auto* v : {&homes_, &spare_})
      for (auto& h : *v)
        for (float* p : h) I.drv->host_free(p);
  }

  void add_shard(shard& s) override {
    const std::size_t mb = detail::moment_bytes(format(), s.info.numel);
    per_array<float*> h = alloc_copy(s.info.numel);
    // Zero moments at home: a shard skipped by the first steps, or state loaded into
    // some shards only, reads zeros (PyTorch's initial moments), never garbage.
    // (Compressed: zero codes and zero scales decode to zero.)
    std::memset(h[state_array::exp_avg], 0, mb);
    std::memset(h[state_array::exp_avg_sq], 0, mb);
    try {
      homes_.push_back(h);
      spare_.emplace_back();  // (null until its first speculative step)
    } catch (...) {
      if (homes_.size() > spare_.size()) homes_.pop_back();
      for (float* p : h) I.drv->host_free(p);
      throw;
    }
  }
  void drop_shard(std::size_t s) noexcept override {
    for (auto* v : {&homes_, &spare_})
      for (float*& p : (*v)[s])
        if (p) I.drv->host_free(p), p = nullptr;
  }

  // A speculative step reads the current copy and writes the second one.
  void begin_pass(const pass_plan& plan) override { speculative_ = plan.kind == pass::step && plan.speculative; }
  std::size_t to_device(std::size_t, const piece_ref& p, state_array a, float* dev, stream_t s) override {
    if (is_moment(a) && compressed()) return move_moment(homes_[p.shard][a], p, dev, true, s);
    I.drv->copy_async(dev, homes_[p.shard][a] + p.e0, p.n * 4, s);
    return p.n * 4;
  }
  std::size_t from_device(std::size_t, const piece_ref& p, state_array a, float* dev, stream_t s) override {
    float* to = (speculative_ ? spare_ : homes_)[p.shard][a];
    if (is_moment(a) && compressed()) return move_moment(to, p, dev, false, s);
    I.drv->copy_async(to + p.e0, dev, p.n * 4, s);
    return p.n * 4;
  }

  bool speculates() const override { return true; }
  // The second copy has the layout of the first; a speculative pass writes every byte of
  // it for the shards it steps (all three arrays, whole shards), so it needs no zeroing.
  void prepare_speculation(std::size_t s) override {
    if (!spare_[s][state_array::main]) spare_[s] = alloc_copy(I.shards[s].info.numel);
  }
  void commit_speculation(std::size_t s) override { std::swap(homes_[s], spare_[s]); }

  void read(std::size_t s, state_array a, std::size_t e0, std::size_t n, float* out) override {
    if (is_moment(a) && compressed())
      detail::decode_moments(format(), a, homes_[s][a], I.shards[s].info.numel, e0, n, out);
    else
      std::memcpy(out, homes_[s][a] + e0, n * 4);
  }
  void write(std::size_t s, state_array a, std::size_t e0, std::size_t n, float* in, int) override {
    // Note [Moment formats]: int8 is blockwise (k_qblock elements, one scale each); the
    // streamed checkpoint writes on chunk boundaries, which are whole blocks, so no
    // block is re-encoded from a partly written state.
    DFA_EXPECTS(!is_moment(a) || I.cfg.moments != moment_format::int8 ||
                    (e0 % detail::k_qblock == 0 && (n % detail::k_qblock == 0 || e0 + n == I.shards[s].info.numel)),
                "write_home: an int8 moment range [" + std::to_string(e0) + ", " + std::to_string(e0 + n) +
                    ") is not whole blocks",
                invalid_state);
    write_range(s, a, e0, n, in);
  }
  void write_range(std::size_t s, state_array a, std::size_t e0, std::size_t n, const float* in) override {
    if (is_moment(a) && compressed())
      detail::encode_moments(format(), a, homes_[s][a], I.shards[s].info.numel, e0, n, in);
    else
      std::memcpy(homes_[s][a] + e0, in, n * 4);
  }
  float* host_array(std::size_t s, state_array a) const override {
    return is_moment(a) && compressed() ? nullptr : homes_[s][a];
  }

 private:
  // Pinned memory for one copy of a shard's three arrays in the format's layout (all or
  // nothing; contents undefined).
  per_array<float*> alloc_copy(std::size_t numel) {
    const std::size_t mb = detail::moment_bytes(format(), numel);
    per_array<float*> h{};
    try {
      for (state_array a : k_state_arrays) h[a] = static_cast<float*>(I.drv->host_alloc(is_moment(a) ? mb : numel * 4));
    } catch (...) {
      for (float* p : h)
        if (p) I.drv->host_free(p);
      throw;
    }
    return h;
  }
  // Copies a moment of piece `p` between `array` (one copy of its home) and `dev` (the
  // piece's window, in the format's layout) on `s`; returns the bytes moved.
  std::size_t move_moment(float* array, const piece_ref& p, float* dev, bool to_device, stream_t s) {
    char* home = reinterpret_cast<char*>(array);
    char* d = reinterpret_cast<char*>(dev);
    if (format() == detail::k_mom_bf16) return copy_run(d, home + 2 * p.e0, 2 * p.n, to_device, s);
    // int8: the piece's codes, then its blocks' scales (pieces start on a block: the
    // piece size is a multiple of the granule, itself of 256 elements).
    const std::size_t numel = I.shards[p.shard].info.numel;
    return copy_run(d, home + p.e0, p.n, to_device, s) +
           copy_run(d + detail::q_scales_offset(p.n), home + detail::q_scales_offset(numel) + 4 * (p.e0 / detail::k_qblock),
                    4 * detail::q_blocks(p.n), to_device, s);
  }

  std::vector<per_array<float*>> homes_;  // per shard: the pinned home of each array
  std::vector<per_array<float*>> spare_;  // per shard: its second copy (Note [Speculative steps])
  bool speculative_ = false;              // the pass under way writes spare_
};

// ---- file: two slots in a state file (Note [File tier]) ------------------------------

class streamed_adamw::impl::file_home final : public home {
 public:
  explicit file_home(impl& owner) : home(owner) {
    DFA_EXPECTS(!I.cfg.directory.empty(), "streamed_adamw: the file tier needs a directory");
  }
  ~file_home() override { free_staging(); }

  bool in_place() const override { return false; }
  // Whole checksum blocks (Note [File tier integrity]) of every array: a moment's pieces
  // are whole segments of its format (Note [File tier moments]).
  std::size_t piece_align() const override { return std::max(file_store::block, 4 * file_store::segment(format())); }
  // Its reads ahead and staging ring are `depth` pieces deep; its figures (bench_checkpoint,
  // the file-tier tests) were measured at 3, deeper was not.
  int default_depth() const override { return 3; }
  bool whole_arrays() const override { return true; }

  void open() override {
    if (I.file) return;
    std::vector<std::size_t> numel;
    for (auto& s : I.shards) numel.push_back(s.info.numel);
    I.file = std::make_unique<file_store>(I.cfg.directory, I.cfg.rank, numel, I.cfg.resume, I.cfg.io_threads,
                                          I.cfg.io_request_bytes, format());
    if (I.file->resumed()) {
      I.step_count = I.file->committed_step();
      for (std::size_t s = 0; s < I.shards.size(); ++s) I.shards[s].step = I.file->shard_steps()[s];
      I.moments_written = I.file->moments_written();
      I.initialized = true;
    }
  }
  void add_shard(shard&) override {}  // the state file is made for all shards at open()

  // A pass: reads run `depth` pieces ahead into a ring of 2 * depth pinned staging
  // buffers; write-backs land in another ring and are written at retire.  Each ring
  // slot's arrays are pinned when a pass first moves them (pinning is not free: the driver
  // locks and zeroes every page), so a pass that moves main only (a load's export of the
  // BF16 params into a fresh optimizer) pins a sixth of what a step does.
  void begin_pass(const pass_plan& plan) override {
    plan_ = &plan;
    read_slot_ = I.file->active_slot();
    write_slot_ = plan.kind == pass::step ? 1 - read_slot_ : read_slot_;
    ensure_staging(stage_in_, plan.fetch_main ? (plan.kind == pass::step && I.moments_written ? 3 : 1) : 0);
    ensure_staging(stage_out_, plan.write_back ? plan.arrays : 0);
    reads_.assign(plan.pieces.size(), nullptr);
    writes_.assign(plan.pieces.size(), nullptr);
  }
  void prefetch(std::size_t j, const piece_ref& p) override {
    if (!plan_->fetch_main) return;
    const int n_arr = plan_->kind == pass::step && I.moments_written ? 3 : 1;
    for (state_array a : first_arrays(n_arr))
      reads_[j] = I.file->read(staging(false, j, a), I.file->io_bytes(a, p.e0, p.n),
                               I.file->offset(read_slot_, p.shard, a, p.e0), "state of " + I.where(p), reads_[j]);
  }
  void await_fetch(std::size_t i) override {
    const auto t = clk::now();
    reads_[i]->wait();
    I.report.io_wait_seconds += since(t);
  }
  std::size_t to_device(std::size_t i, const piece_ref& p, state_array a, float* dev, stream_t s) override {
    if (is_moment(a) && compressed()) return move_moment(staging(false, i, a), p, dev, true, s);
    I.drv->copy_async(dev, staging(false, i, a), p.n * 4, s);
    return p.n * 4;
  }
  void await_write_back(std::size_t i) override {
    const std::size_t ring = 2 * static_cast<std::size_t>(I.cfg.depth);
    if (i >= plan_->skip + ring && writes_[i - ring]) {
      const auto t = clk::now();
      writes_[i - ring]->wait();
      I.report.io_wait_seconds += since(t);
    }
  }
  std::size_t from_device(std::size_t i, const piece_ref& p, state_array a, float* dev, stream_t s) override {
    if (is_moment(a) && compressed()) return move_moment(staging(true, i, a), p, dev, false, s);
    I.drv->copy_async(staging(true, i, a), dev, p.n * 4, s);
    return p.n * 4;
  }
  void retire(std::size_t i, const piece_ref& p) override {
    if (!plan_->write_back) return;
    for (state_array a : first_arrays(plan_->arrays))
      writes_[i] = I.file->write(staging(true, i, a), I.file->io_bytes(a, p.e0, p.n),
                                 I.file->offset(write_slot_, p.shard, a, p.e0), "state of " + I.where(p), writes_[i]);
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
  void commit(pass kind, std::span<const std::uint64_t> steps) override {
    if (kind == pass::init) I.file->commit(0, I.file->active_slot(), false, steps);
    if (kind == pass::step) I.file->commit(I.step_count + 1, 1 - I.file->active_slot(), true, steps);
  }
  // A speculative step writes the inactive slot like any step; committing it is commit()
  // after the shards not stepped were carried (Note [Speculative steps]).  Discarding it
  // leaves the active slot, and the next step writes the inactive one afresh.
  bool speculates() const override { return true; }
  int load_slot() const override { return 1 - I.file->active_slot(); }
  void commit_load(std::uint64_t step, int slot, bool moments, std::span<const std::uint64_t> steps) override {
    I.file->commit(step, slot, moments, steps);
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
      I.file->read(to, file_store::io_bytes(want / 4), I.file->offset(I.file->active_slot(), s, a, e0) + done, what(s, a))
          ->wait();
      if (!direct) std::memcpy(reinterpret_cast<char*>(out) + done, to, want);
    }
  }
  void read_io(std::size_t s, state_array a, std::size_t e0, std::size_t n, unsigned char* buf) override {
    if (is_moment(a) && compressed()) return read_moment(s, a, e0, n, reinterpret_cast<float*>(buf));
    I.file->read(buf, file_store::io_bytes(n), I.file->offset(I.file->active_slot(), s, a, e0), what(s, a))->wait();
  }
  // `e0` on a chunk boundary (write_range's and the checkpoint's pieces), so a compressed
  // moment's range is whole segments, encoded here as the host tier encodes them.
  void write(std::size_t s, state_array a, std::size_t e0, std::size_t n, float* in, int slot) override {
    if (is_moment(a) && compressed()) {
      const std::size_t io = I.file->io_bytes(a, e0, n);
      detail::aligned_buffer buf(io, true, "file tier: no host memory for encoding moments");
      for_segments(e0, n, [&](std::size_t j, std::size_t r, std::uint64_t at) {
        detail::encode_moments(format(), a, buf.p + at, r, 0, r, in + j);
      });
      I.file->write(buf.p, io, I.file->offset(slot, s, a, e0), what(s, a))->wait();
      return;
    }
    const std::size_t io = file_store::io_bytes(n);
    std::memset(reinterpret_cast<char*>(in) + n * 4, 0, io - n * 4);
    I.file->write(in, io, I.file->offset(slot, s, a, e0), what(s, a))->wait();
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
  // Limits: whole arrays only (whole_arrays()); a publish copies the arrays not written
  // (one read and one write of the rest of the state), so loading a state dict costs
  // about two passes over the state.  An implicit write is durable only once published:
  // a process killed before its next use of the optimizer resumes the old state.
  void begin_write() override {
    written_.assign(I.shards.size(), per_array<bool>{});
    wrote_moment_ = false;
    writing_ = true;
  }
  void end_write(bool publish) override {
    if (!writing_) return;
    writing_ = false;
    struct free_bounce {  // held for one state write
      std::unique_ptr<detail::aligned_buffer>& b;
      ~free_bounce() { b.reset(); }
    } on_return{bounce_};
    if (!publish) return;
    bool any = false;
    for (const auto& w : written_) any = any || w[state_array::main] || w[state_array::exp_avg] || w[state_array::exp_avg_sq];
    if (!any) return publish_steps();  // step counts only: the active slot again
    const int from = I.file->active_slot(), to = 1 - from;
    const bool moments = I.moments_written || wrote_moment_;
    // The stored bytes, copied as they are (compressed moments are not decoded and
    // encoded again; zero bytes are zero moments in every format).
    constexpr std::size_t piece = 4 * k_bounce;  // bytes per request: whole checksum blocks
    unsigned char* buf = bounce();
    for (std::size_t s = 0; s < I.shards.size(); ++s)
      for (state_array a : k_state_arrays) {
        if (written_[s][a] || (is_moment(a) && !moments)) continue;
        const bool zeros = is_moment(a) && !I.file->moments_written();  // never stored: zeros by construction
        const std::size_t bytes = I.file->io_bytes(a, 0, I.shards[s].info.numel);
        for (std::size_t done = 0; done < bytes; done += piece) {
          const std::size_t k = std::min(piece, bytes - done);
          if (zeros) std::memset(buf, 0, k);
          else I.file->read(buf, k, I.file->offset(from, s, a, 0) + done, what(s, a))->wait();
          I.file->write(buf, k, I.file->offset(to, s, a, 0) + done, what(s, a))->wait();
        }
      }
    I.file->commit(I.step_count, to, moments, I.shard_steps());
  }
  // Whole arrays (whole_arrays()) into the inactive slot through an aligned bounce buffer,
  // in pieces on checksum-block boundaries (write() pads each piece to whole blocks),
  // within a state write, published by end_write (Note [State writes]).
  void write_range(std::size_t shard, state_array a, std::size_t, std::size_t, const float* in) override {
    DFA_EXPECTS(writing_, "write_state_range: the file tier writes within a state write", invalid_state);
    unsigned char* buf = bounce();
    const std::size_t numel = I.shards[shard].info.numel;
    for (std::size_t e0 = 0; e0 < numel; e0 += k_bounce) {
      const std::size_t k = std::min(k_bounce, numel - e0);
      std::memcpy(buf, in + e0, k * 4);
      write(shard, a, e0, k, reinterpret_cast<float*>(buf), 1 - I.file->active_slot());
    }
    written_[shard][a] = true;
    wrote_moment_ = wrote_moment_ || is_moment(a);
  }

 private:
  // Step counts only: a commit naming the active slot again.
  void publish_steps() {
    if (!I.file || !I.initialized) return;  // initialize() or a resume sets them
    I.file->commit(I.step_count, I.file->active_slot(), I.file->moments_written(), I.shard_steps());
  }
  std::string what(std::size_t s, state_array a) const {
    return std::string(array_name(a)) + " of " + I.shards[s].info.name;
  }
  // fn(j, r, at) for each segment of elements [e0 + j, e0 + j + r) of a compressed
  // moment range starting on a segment (Note [File tier moments]), `at` its bytes'
  // offset from the range's first.
  template <typename F>
  void for_segments(std::size_t e0, std::size_t n, F&& fn) const {
    const std::size_t seg = format() == detail::k_mom_int8 ? file_store::segment(format()) : n;
    const std::uint64_t first = file_store::stored_bytes(format(), e0);
    for (std::size_t j = 0; j < n; j += seg)
      fn(j, std::min(seg, n - j), file_store::stored_bytes(format(), e0 + j) - first);
  }
  // Piece p's compressed moment between its staging buffer (its segments as stored) and
  // its window (the host tier's layout of p.n elements: codes, then scales); returns the
  // bytes moved.
  std::size_t move_moment(void* stage, const piece_ref& p, float* dev, bool to_device, stream_t s) {
    char* st = static_cast<char*>(stage);
    char* d = reinterpret_cast<char*>(dev);
    if (format() == detail::k_mom_bf16) return copy_run(d, st, 2 * p.n, to_device, s);
    std::size_t moved = 0;
    for_segments(p.e0, p.n, [&](std::size_t j, std::size_t r, std::uint64_t at) {
      moved += copy_run(d + j, st + at, r, to_device, s) +
               copy_run(d + detail::q_scales_offset(p.n) + 4 * (j / detail::k_qblock), st + at + detail::q_scales_offset(r),
                        4 * detail::q_blocks(r), to_device, s);
    });
    return moved;
  }
  // Elements [e0, e0+n) of a compressed moment, decoded: the segments covering them are
  // read through a bounce buffer, k_bounce elements at a time.
  void read_moment(std::size_t s, state_array a, std::size_t e0, std::size_t n, float* out) {
    const std::size_t numel = I.shards[s].info.numel, seg = file_store::segment(format());
    const std::size_t first = e0 / seg * seg;
    detail::aligned_buffer buf(I.file->io_bytes(a, 0, std::min(k_bounce, numel)), false,
                               "file tier: no host memory for decoding moments");
    for (std::size_t c0 = first; c0 < e0 + n; c0 += k_bounce) {
      const std::size_t k = std::min(k_bounce, numel - c0);
      I.file->read(buf.p, I.file->io_bytes(a, c0, k), I.file->offset(I.file->active_slot(), s, a, c0), what(s, a))->wait();
      for_segments(c0, k, [&](std::size_t j, std::size_t r, std::uint64_t at) {
        const std::size_t lo = std::max(e0, c0 + j), hi = std::min(e0 + n, c0 + j + r);
        if (lo < hi) detail::decode_moments(format(), a, buf.p + at, r, lo - c0 - j, hi - lo, out + (lo - e0));
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
    ring.resize(2 * static_cast<std::size_t>(I.cfg.depth));
    for (auto& slot : ring)
      for (state_array a : first_arrays(arrays))
        if (!slot[a]) slot[a] = I.drv->host_alloc(file_store::io_bytes(I.piece));
  }
  void free_staging() noexcept {
    for (auto* ring : {&stage_in_, &stage_out_}) {
      for (auto& slot : *ring)
        for (void* p : slot)
          if (p) I.drv->host_free(p);
      ring->clear();
    }
  }

  static constexpr std::size_t k_bounce = std::size_t{8} << 20;  // elements per state-write piece (32 MiB)
  // The state write's bounce buffer (k_bounce FP32 values), allocated by its first
  // write_range or its publish and freed by end_write: a state dict's load writes array
  // after array through one buffer, and an optimizer not writing holds none.  Its
  // callers hold the optimizer's mutex.
  unsigned char* bounce() {
    if (!bounce_)
      bounce_ = std::make_unique<detail::aligned_buffer>(file_store::io_bytes(k_bounce), false,
                                                         "write_state_range: no host memory for a bounce buffer");
    return bounce_->p;
  }
  std::unique_ptr<detail::aligned_buffer> bounce_;
  bool writing_ = false;                 // a write is open (Note [State writes])
  bool wrote_moment_ = false;
  std::vector<per_array<bool>> written_;  // per shard: the arrays it wrote
  const pass_plan* plan_ = nullptr;
  int read_slot_ = 0, write_slot_ = 0;
  std::vector<std::shared_ptr<detail::io_batch>> reads_, writes_;  // per piece of the pass
  std::vector<per_array<void*>> stage_in_, stage_out_;  // per ring slot: each array's buffer (null until used)
};

std::size_t streamed_adamw::impl::home::to_device(std::size_t, const piece_ref&, state_array, float*, stream_t) {
  throw invalid_state("streamed_adamw: this tier's state does not stream");
}
std::size_t streamed_adamw::impl::home::from_device(std::size_t, const piece_ref&, state_array, float*, stream_t) {
  throw invalid_state("streamed_adamw: this tier's state does not stream");
}

void streamed_adamw::impl::make_homes() {
  DFA_EXPECTS(cfg.moments == moment_format::fp32 || cfg.home != tier::device,
              std::string("streamed_adamw: ") + to_string(cfg.moments) + " moments need the host or file tier (the " +
                  to_string(cfg.home) + " tier keeps fp32 moments)");
  DFA_EXPECTS(cfg.resident_bytes == 0 || cfg.home == tier::host,
              std::string("streamed_adamw: resident_bytes needs the host tier (the ") + to_string(cfg.home) +
                  " tier keeps all or none of its state in HBM)");
  switch (cfg.home) {
    case tier::device: tier_home = std::make_unique<device_home>(*this); break;
    case tier::host: tier_home = std::make_unique<host_home>(*this); break;
    case tier::file: tier_home = std::make_unique<file_home>(*this); break;
    default: throw invalid_argument("streamed_adamw: unknown tier " + std::to_string(static_cast<int>(cfg.home)));
  }
  hbm_home = std::make_unique<device_home>(*this);
}

}  // namespace deferalloc::optim
