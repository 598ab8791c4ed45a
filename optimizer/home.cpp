// The homes of the optimizer state, one class per tier: see Note [Homes] in home.hpp.
// The device and host homes are here, the file tier's in file_home.cpp.  This file is the
// one place that names the tiers.
#include <deferalloc/core/errors.hpp>

#include <algorithm>
#include <cstring>
#include <mutex>

#include "kernels/moment_format.hpp"
#include "store/file_util.hpp"
#include "file_home.hpp"
#include "home.hpp"
#include "store/file_store.hpp"

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

namespace {

// ---- device: the state stays in HBM -------------------------------------------------

class device_home final : public home {
 public:
  explicit device_home(const home_context& ctx)
      : home(traits_of(tier::device, ctx.cfg.moments)), vmm_(ctx.vmm), streams_(ctx.streams), mgr_(ctx.mgr), shards_(ctx.shards), exec_(ctx.exec) {}

  // Backed for its elements (rounded up to the granule): the moments zeroed, main left
  // for the initializer (an upcast).
  void add_shard(const shard& s) override {
    const std::size_t len = resident_bytes(vmm_, s.info.numel);
    std::vector<range> rs{{s.res[state_array::exp_avg], 0, len}, {s.res[state_array::exp_avg_sq], 0, len}};
    mgr_.materialize(rs, fill_mode::zero, exec_);
    if (param_is_main(s.info)) return;  // main is the parameter: no HBM for it
    try {
      mgr_.materialize(s.res[state_array::main], 0, len, fill_mode::undefined, exec_);
    } catch (...) {
      mgr_.release(rs, keep_mode::discard, exec_);
      throw;
    }
  }
  // Its reservations are the optimizer's: what add_shard backed is freed with them.
  void drop_shard(std::size_t) noexcept override {}

  void read(std::size_t s, state_array a, std::size_t e0, std::size_t n, float* out) override {
    std::lock_guard lk(mu_);
    streams_.copy_async(out, shards_[s].device(a) + e0, n * 4, exec_);
    streams_.synchronize_stream(exec_);
  }
  void write(std::size_t s, state_array a, std::size_t e0, std::size_t n, const float* in) override {
    std::lock_guard lk(mu_);
    streams_.copy_async(shards_[s].device(a) + e0, in, n * 4, exec_);
    streams_.synchronize_stream(exec_);
  }
  void write_chunk(std::size_t s, state_array a, std::size_t e0, std::size_t n, unsigned char* buf, int) override {
    write(s, a, e0, n, reinterpret_cast<const float*>(buf));
  }

 private:
  vmm_ops& vmm_;          // pinned memory, the granule
  stream_ops& streams_;   // copies
  reservation_manager& mgr_;
  const shard_table& shards_;
  stream_t exec_;
  std::mutex mu_;  // the copies share one stream (the checkpoint's lanes run at once)
};

// ---- host: pinned memory, moments possibly compressed (Note [Moment formats]) -------

class host_home final : public home, public piece_mover, public second_copy {
 public:
  explicit host_home(const home_context& ctx)
      : home(traits_of(tier::host, ctx.cfg.moments)), vmm_(ctx.vmm), streams_(ctx.streams), shards_(ctx.shards), format_(ctx.cfg.moments) {}
  ~host_home() override {
    for (auto* v : {&homes_, &spare_})
      for (auto& h : *v)
        for (float* p : h) vmm_.host_free(p);
  }

  void add_shard(const shard& s) override {
    const std::size_t mb = detail::moment_bytes(format_, s.info.numel);
    per_array<float*> h = alloc_copy(s.info);
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
      for (float* p : h) vmm_.host_free(p);
      throw;
    }
  }
  void drop_shard(std::size_t s) noexcept override {
    for (auto* v : {&homes_, &spare_})
      for (float*& p : (*v)[s])
        if (p) vmm_.host_free(p), p = nullptr;
  }

  void read(std::size_t s, state_array a, std::size_t e0, std::size_t n, float* out) override {
    held(s, a);
    if (is_moment(a) && compressed())
      detail::decode_moments(format_, a, homes_[s][a], shards_.numel(s), e0, n, out);
    else
      std::memcpy(out, homes_[s][a] + e0, n * 4);
  }
  void write(std::size_t s, state_array a, std::size_t e0, std::size_t n, const float* in) override {
    held(s, a);
    if (is_moment(a) && compressed())
      detail::encode_moments(format_, a, homes_[s][a], shards_.numel(s), e0, n, in);
    else
      std::memcpy(homes_[s][a] + e0, in, n * 4);
  }
  void write_chunk(std::size_t s, state_array a, std::size_t e0, std::size_t n, unsigned char* buf, int) override {
    // Note [Moment formats]: int8 is blockwise (k_qblock elements, one scale each); the
    // streamed checkpoint writes on chunk boundaries, which are whole blocks, so no
    // block is re-encoded from a partly written state.
    DFA_EXPECTS(!is_moment(a) || format_ != moment_format::int8 ||
                    (e0 % detail::k_qblock == 0 && (n % detail::k_qblock == 0 || e0 + n == shards_.numel(s))),
                "write_home: an int8 moment range [" + std::to_string(e0) + ", " + std::to_string(e0 + n) +
                    ") is not whole blocks",
                invalid_state);
    write(s, a, e0, n, reinterpret_cast<const float*>(buf));
  }
  float* host_array(std::size_t s, state_array a) const override {
    return is_moment(a) && compressed() ? nullptr : homes_[s][a];
  }

  piece_mover* mover() override { return this; }
  second_copy* speculation() override { return this; }

  // -- piece_mover.  A speculative step reads the current copy and writes the second one.
  void begin_pass(const pass_plan& plan, step_report&) override {
    speculative_ = plan.kind == pass_kind::step && plan.speculative;
  }
  void prefetch(std::size_t, const piece_ref&) override {}
  std::size_t to_device(std::size_t, const piece_ref& p, state_array a, float* dev, stream_t s) override {
    if (is_moment(a) && compressed()) return move_moment(homes_[p.shard][a], p, dev, true, s);
    streams_.copy_async(dev, homes_[p.shard][a] + p.e0, p.n * 4, s);
    return p.n * 4;
  }
  std::size_t from_device(std::size_t, const piece_ref& p, state_array a, float* dev, stream_t s) override {
    float* to = (speculative_ ? spare_ : homes_)[p.shard][a];
    if (is_moment(a) && compressed()) return move_moment(to, p, dev, false, s);
    streams_.copy_async(to + p.e0, dev, p.n * 4, s);
    return p.n * 4;
  }
  void retire(std::size_t, const piece_ref&) override {}
  void end_pass() override {}
  void drain() noexcept override {}

  // -- second_copy.  It has the layout of the first; a speculative pass writes every byte
  // of it for the shards it steps (all three arrays, whole shards), so it needs no zeroing.
  void prepare(std::size_t s) override {
    if (!spare_[s][state_array::exp_avg]) spare_[s] = alloc_copy(shards_[s].info);
  }
  void make_current(std::size_t s) override { std::swap(homes_[s], spare_[s]); }

 private:
  bool compressed() const { return format_ != moment_format::fp32; }
  // The home holds no main of an FP32 parameter (Note [The parameter is the truth]).
  void held(std::size_t s, state_array a) const {
    DFA_EXPECTS(homes_[s][a] != nullptr,
                "host tier: " + std::string(array_name(a)) + " of shard " + std::to_string(s) +
                    " is not held at home (its FP32 parameter is its main)",
                invalid_state);
  }
  // Pinned memory for one copy of a shard's arrays in the format's layout: the moments,
  // and main unless the parameter is the main (all or nothing; contents undefined).
  per_array<float*> alloc_copy(const shard_info& info) {
    const std::size_t numel = info.numel;
    const std::size_t mb = detail::moment_bytes(format_, numel);
    per_array<float*> h{};
    try {
      for (state_array a : k_state_arrays)
        if (is_moment(a) || !param_is_main(info))
          h[a] = static_cast<float*>(vmm_.host_alloc(is_moment(a) ? mb : numel * 4));
    } catch (...) {
      for (float* p : h)
        if (p) vmm_.host_free(p);
      throw;
    }
    return h;
  }
  // Copies a moment of piece `p` between `array` (one copy of its home) and `dev` (the
  // piece's window, in the format's layout) on `s`; returns the bytes moved.
  std::size_t move_moment(float* array, const piece_ref& p, float* dev, bool to_device, stream_t s) {
    char* host = reinterpret_cast<char*>(array);
    char* d = reinterpret_cast<char*>(dev);
    if (format_ == moment_format::bf16) return copy_run(streams_, d, host + 2 * p.e0, 2 * p.n, to_device, s);
    // int8: the piece's codes, then its blocks' scales (pieces start on a block: the
    // piece size is a multiple of the granule, itself of 256 elements).
    const std::size_t numel = shards_.numel(p.shard);
    return copy_run(streams_, d, host + p.e0, p.n, to_device, s) +
           copy_run(streams_, d + detail::q_scales_offset(p.n),
                    host + detail::q_scales_offset(numel) + 4 * (p.e0 / detail::k_qblock), 4 * detail::q_blocks(p.n),
                    to_device, s);
  }

  vmm_ops& vmm_;          // pinned memory, the granule
  stream_ops& streams_;   // copies
  const shard_table& shards_;
  const moment_format format_;
  std::vector<per_array<float*>> homes_;  // per shard: the pinned home of each array
  std::vector<per_array<float*>> spare_;  // per shard: its second copy (Note [Speculative steps])
  bool speculative_ = false;              // the pass under way writes spare_
};

}  // namespace

home_traits traits_of(tier t, moment_format moments) {
  switch (t) {
    case tier::device: return {.streamed = false};
    case tier::host: return {.chains_passes = true};
    // Pieces are whole checksum blocks (Note [File tier integrity]) of every array: a
    // moment's pieces are whole segments of its format (Note [File tier moments]).  Its
    // reads ahead and staging ring are `depth` pieces deep; its figures (bench_checkpoint,
    // the file-tier tests) were measured at 3, deeper was not.
    case tier::file:
      return {.streamed = true,
              .piece_align = std::max(file_store::block, 4 * file_store::segment(moments)),
              .default_depth = 3,
              .whole_arrays = true,
              .durable_params = true};
  }
  throw invalid_argument("streamed_adamw: unknown tier " + std::to_string(static_cast<int>(t)));
}

std::unique_ptr<home> make_home(tier t, const home_context& ctx) {
  switch (t) {
    case tier::device: return std::make_unique<device_home>(ctx);
    case tier::host: return std::make_unique<host_home>(ctx);
    case tier::file:
      return make_file_home(ctx.vmm, ctx.streams, ctx.shards,
                            {.directory = ctx.cfg.directory,
                             .rank = ctx.cfg.rank,
                             .resume = ctx.cfg.resume,
                             .io_threads = ctx.cfg.io_threads,
                             .io_request_bytes = ctx.cfg.io_request_bytes,
                             .moments = ctx.cfg.moments});
  }
  throw invalid_argument("streamed_adamw: unknown tier " + std::to_string(static_cast<int>(t)));
}

}  // namespace deferalloc::optim
