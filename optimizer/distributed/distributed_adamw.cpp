// Note [Distributed step]
//
// Rationale: data-parallel ranks hold the same model; the FP32 main params and Adam
// moments (12 B/param) need to exist once per data-parallel group, not once per rank
// (ZeRO-1, Megatron's distributed optimizer).  Each rank keeps the state of one
// contiguous shard of the flat parameter buffer, and that state is itself deferred and
// streamed (streamed_adamw, any tier), so the state's HBM is a window, not 12 B/param.
//
// Approach
//  - make_layout pads the flat buffers to world * shard elements, shard a multiple of
//    `align`; the padding is zero in params and grads, so AdamW keeps it exactly zero
//    (m = v = 0, update 0 / (0 + eps) = 0, decay of 0 is 0): the optimizer registers the
//    whole padded shard, every rank has a non-empty shard whatever numel and world are.
//  - step(): in-place reduce-scatter (sum) of the gradient buffer, so rank r's block of
//    that buffer holds the summed gradient of its shard -> squared norm of the shard
//    (grad_sq_norm, double), all-gathered, summed in rank order (every rank gets the same
//    bits, whatever order a ring would add in) -> grad_scale = clip / world (averaging
//    folded into the kernel's scale; the BF16 sum is rounded once per NCCL add) ->
//    streamed_adamw::step on the shard, which writes the BF16 shard -> in-place
//    all-gather of the BF16 params, queued on the user's stream.
//  - Buffers the collectives touch are registered with the communicator
//    (ncclCommRegister).  A registration names physical memory that peers may map, so a
//    pause that releases the buffers' memory must deregister them first and register
//    again after the resume (see deregister_buffers / register_buffers), or keep the
//    buffers resident.  A step while deregistered runs unregistered (correct, maybe
//    slower).
//
// Limits: one flat buffer (one dtype) per model; the gradient buffer's non-owned blocks
// are garbage after a step (zero them before the next backward, as Megatron does).
#include <deferalloc/core/chunk_pool.hpp>
#include <deferalloc/core/errors.hpp>
#include <deferalloc/core/reservations.hpp>
#include <deferalloc/distributed/distributed.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <sstream>
#include <vector>

#include "log.hpp"
#include "store/file_util.hpp"

namespace deferalloc::dist {

std::size_t size_of(dtype t) noexcept {
  switch (t) {
    case dtype::bf16: return 2;
    case dtype::fp32: return 4;
    case dtype::fp64: return 8;
  }
  return 0;
}

shard_layout make_layout(std::size_t numel, int world, int rank, std::size_t align) {
  DFA_EXPECTS(numel > 0, "make_layout: numel is zero");
  DFA_EXPECTS(numel <= (std::size_t{1} << 44), "make_layout: numel " + std::to_string(numel) + " is absurd");
  DFA_EXPECTS(world >= 1, "make_layout: world size " + std::to_string(world) + " < 1");
  DFA_EXPECTS(rank >= 0 && rank < world,
              "make_layout: rank " + std::to_string(rank) + " outside [0, " + std::to_string(world) + ")");
  DFA_EXPECTS(align > 0, "make_layout: align is zero");
  shard_layout l;
  l.numel = numel;
  l.world = world;
  l.rank = rank;
  const std::size_t w = static_cast<std::size_t>(world);
  const std::size_t per = (numel + w - 1) / w;
  l.shard = (per + align - 1) / align * align;
  l.padded_numel = l.shard * w;
  l.begin = l.shard * static_cast<std::size_t>(rank);
  l.valid = numel > l.begin ? std::min(l.shard, numel - l.begin) : 0;
  return l;
}

communicator::~communicator() = default;

// ---- world size 1 without NCCL --------------------------------------------------------

namespace {
class local_communicator final : public communicator {
 public:
  explicit local_communicator(std::shared_ptr<stream_ops> ops) : ops_(std::move(ops)) {
    DFA_EXPECTS(ops_ != nullptr, "make_local_communicator: driver is null");
  }
  int rank() const override { return 0; }
  int world() const override { return 1; }
  void reduce_scatter(const void* send, void* recv, std::size_t count, dtype t, stream_t s) override {
    if (send != recv) ops_->copy_async(recv, send, count * size_of(t), s);
  }
  void all_gather(const void* send, void* recv, std::size_t count, dtype t, stream_t s) override {
    if (send != recv) ops_->copy_async(recv, send, count * size_of(t), s);
  }
  void* register_buffer(void*, std::size_t) override { return nullptr; }
  void deregister_buffer(void*) override {}
  std::string name() const override { return "local"; }

 private:
  std::shared_ptr<stream_ops> ops_;  // copies only
};
}  // namespace

std::shared_ptr<communicator> make_local_communicator(std::shared_ptr<driver> drv) {
  return std::make_shared<local_communicator>(std::move(drv));
}

// ---- the distributed optimizer ---------------------------------------------------------

using clk = std::chrono::steady_clock;

struct distributed_adamw::impl {
  std::shared_ptr<driver> drv;
  std::shared_ptr<communicator> comm;
  dist_config cfg;
  shard_layout lay;
  std::uint16_t* params = nullptr;
  void* grads = nullptr;
  std::unique_ptr<optim::streamed_adamw> opt;
  optim::detail::background_prune pruner;  // rank 0's older generations (Note [Distributed checkpoint])
  // One granule for the norms' all-gather (world doubles), from its own manager.
  std::shared_ptr<chunk_pool> pool;
  std::unique_ptr<reservation_manager> mgr;
  reservation_id scratch_id{};
  double* scratch = nullptr;
  void* reg_params = nullptr;
  void* reg_grads = nullptr;
  bool registered = false;

  std::size_t grad_size() const { return cfg.grads == optim::grad_type::bf16 ? 2 : 4; }
  dtype grad_dtype() const { return cfg.grads == optim::grad_type::bf16 ? dtype::bf16 : dtype::fp32; }
  void* grad_shard() const { return static_cast<char*>(grads) + lay.begin * grad_size(); }
  double global_sq_norm(stream_t s);
  // Every rank's `local`, in rank order (a collective; the host waits for it).
  std::vector<double> gather_doubles(double local, stream_t s);
  // Every rank's BF16 shard of the model params into every rank's buffer.
  void gather_params(stream_t s) { comm->all_gather(params + lay.begin, params, lay.shard, dtype::bf16, s); }
};

shard_layout distributed_adamw::layout_for(std::size_t numel, const communicator& comm, std::size_t align) {
  return make_layout(numel, comm.world(), comm.rank(), align);
}

distributed_adamw::distributed_adamw(std::shared_ptr<driver> drv, std::shared_ptr<communicator> comm, std::size_t numel,
                                     std::uint16_t* params, void* grads, dist_config cfg)
    : impl_(std::make_unique<impl>()) {
  auto& self = *impl_;
  DFA_EXPECTS(drv != nullptr, "distributed_adamw: driver is null");
  DFA_EXPECTS(comm != nullptr, "distributed_adamw: communicator is null");
  DFA_EXPECTS(params != nullptr && grads != nullptr, "distributed_adamw: params or grads buffer is null");
  DFA_EXPECTS(std::isfinite(cfg.max_grad_norm) && cfg.max_grad_norm >= 0,
              "distributed_adamw: max_grad_norm must be finite and >= 0");
  self.drv = std::move(drv);
  self.comm = std::move(comm);
  self.cfg = std::move(cfg);
  self.lay = make_layout(numel, self.comm->world(), self.comm->rank(), self.cfg.align);
  self.params = params;
  self.grads = grads;
  optim::optimizer_config oc = self.cfg.optimizer;
  oc.rank = self.comm->rank();
  self.opt = std::make_unique<optim::streamed_adamw>(self.drv, std::move(oc));
  self.opt->add_shard(params + self.lay.begin, self.lay.shard, "rank" + std::to_string(self.lay.rank));
  self.pool = std::make_shared<chunk_pool>(self.drv);
  self.mgr = std::make_unique<reservation_manager>(self.pool, self.drv);
  const std::size_t bytes = std::max<std::size_t>(self.drv->granularity(), sizeof(double) * self.lay.world);
  self.scratch_id = self.mgr->reserve(bytes);
  self.mgr->materialize(self.scratch_id, 0, whole, fill_mode::zero, nullptr);
  self.scratch = static_cast<double*>(self.mgr->address(self.scratch_id));
  if (self.cfg.register_buffers) register_buffers();
}

distributed_adamw::~distributed_adamw() {
  if (!impl_) return;
  try {
    deregister_buffers();
  } catch (const std::exception& e) {
    deferalloc::detail::log(log_level::error, std::string("distributed_adamw: ") + e.what());
  }
}

const shard_layout& distributed_adamw::layout() const { return impl_->lay; }
std::uint64_t distributed_adamw::steps() const { return impl_->opt->steps(); }
optim::streamed_adamw& distributed_adamw::optimizer() { return *impl_->opt; }
communicator& distributed_adamw::comm() { return *impl_->comm; }
bool distributed_adamw::buffers_registered() const { return impl_->registered; }

bool distributed_adamw::register_buffers() {
  auto& self = *impl_;
  if (self.registered) return true;
  self.reg_params = self.comm->register_buffer(self.params, self.lay.padded_numel * 2);
  try {
    self.reg_grads = self.comm->register_buffer(self.grads, self.lay.padded_numel * self.grad_size());
  } catch (...) {
    self.comm->deregister_buffer(self.reg_params);
    self.reg_params = nullptr;
    throw;
  }
  self.registered = true;
  return true;
}

void distributed_adamw::deregister_buffers() {
  auto& self = *impl_;
  if (!self.registered) return;
  void* p = self.reg_params;
  void* g = self.reg_grads;
  self.reg_params = self.reg_grads = nullptr;
  self.registered = false;
  std::exception_ptr failed;
  try {
    self.comm->deregister_buffer(g);
  } catch (...) {
    failed = std::current_exception();
  }
  self.comm->deregister_buffer(p);
  if (failed) rethrow_with_context("deregister_buffers", failed);  // its own class, not cuda_error
}

void distributed_adamw::initialize(stream_t stream) { impl_->opt->initialize(stream); }

// Sum over ranks of each rank's squared shard norm, added in rank order: every rank
// computes the same double (an all-reduce would let a ring add in rank-dependent order).
std::vector<double> distributed_adamw::impl::gather_doubles(double local, stream_t s) {
  if (lay.world == 1) return {local};
  std::vector<double> all(static_cast<std::size_t>(lay.world), 0.0);
  drv->copy_async(scratch + lay.rank, &local, sizeof(double), s);
  comm->all_gather(scratch + lay.rank, scratch, 1, dtype::fp64, s);
  drv->copy_async(all.data(), scratch, sizeof(double) * all.size(), s);
  drv->synchronize_stream(s);
  return all;
}

double distributed_adamw::impl::global_sq_norm(stream_t s) {
  const void* g[1] = {grad_shard()};
  const double local = opt->grad_sq_norm(g, cfg.grads, s);
  if (lay.world == 1) return local;
  double sum = 0;
  for (double v : gather_doubles(local, s)) sum += v;
  return sum;
}

dist_step_report distributed_adamw::step(stream_t stream) {
  auto& self = *impl_;
  DFA_EXPECTS(self.opt->initialized(), "distributed_adamw::step: call initialize() (or load a checkpoint) first",
              invalid_state);
  dist_step_report r;
  auto t0 = clk::now();
  self.comm->reduce_scatter(self.grads, self.grad_shard(), self.lay.shard, self.grad_dtype(), stream);
  const double w = static_cast<double>(self.lay.world);
  double scale = 1.0 / w;
  if (self.cfg.max_grad_norm > 0) {
    const double sq = self.global_sq_norm(stream);
    DFA_EXPECTS(std::isfinite(sq), "distributed_adamw::step: the gradient norm is not finite (step " +
                                       std::to_string(self.opt->steps() + 1) + ")",
                invalid_state);
    r.grad_norm = std::sqrt(sq) / w;
    const double coef = self.cfg.max_grad_norm / (r.grad_norm + 1e-6);
    if (coef < 1.0) scale = coef / w;
  }
  r.grad_scale = static_cast<float>(scale);
  auto t1 = clk::now();
  const void* g[1] = {self.grad_shard()};
  self.opt->step(g, self.cfg.grads, r.grad_scale, stream);
  auto t2 = clk::now();
  self.gather_params(stream);
  auto t3 = clk::now();
  r.seconds_reduce = std::chrono::duration<double>(t1 - t0).count();
  r.seconds_step = std::chrono::duration<double>(t2 - t1).count();
  r.seconds_gather = std::chrono::duration<double>(t3 - t2).count();
  r.optimizer = self.opt->last_report();
  return r;
}

void distributed_adamw::sync_model_params(stream_t stream) {
  auto& self = *impl_;
  self.opt->sync_model_params(stream);
  self.gather_params(stream);
}

namespace {
std::string layout_text(const shard_layout& l) {
  std::ostringstream o;
  o << "deferalloc-distributed 1\nworld " << l.world << "\nnumel " << l.numel << "\nshard " << l.shard << "\n";
  return o.str();
}
}  // namespace

// Note [Distributed checkpoint]
// One generation holds every rank's part: dir/gen-<N>/{rank-<r>/, distributed.txt}.
// The ranks agree on N (each proposes one above the generations it sees, the largest
// wins), each writes and fsyncs its part inside gen-<N>.tmp, all learn whether all
// succeeded, then rank 0 writes distributed.txt and publishes the generation with one
// rename (Note [Checkpoint generations]) and prunes the older ones on a thread of its own
// (its next save waits for that); a last exchange keeps every rank from
// returning (or loading) before the publish.  A save killed or failed on any rank
// leaves the previous generation the newest complete one.  Load: the ranks agree on the
// newest complete generation before any of them changes state.  Assumes, as before, one
// directory tree that every rank sees (one host, or a shared file system).
void distributed_adamw::save_checkpoint(const std::string& dir) {
  auto& self = *impl_;
  DFA_EXPECTS(!dir.empty(), "distributed_adamw::save_checkpoint: directory is empty");
  // Collective: every rank learns whether every rank's part is written, so that no rank
  // loads (or reports success) before the generation is published, and a failure on
  // one rank is an error on all instead of a hang in the next collective.
  // Gathers `value` (0 on this rank's failure) and throws on every rank if any failed.
  auto all_ok = [&](std::exception_ptr& failed, const char* phase, double value = 1.0) {
    const std::vector<double> ok = self.gather_doubles(failed ? 0.0 : value, nullptr);
    if (failed) std::rethrow_exception(failed);
    for (std::size_t r = 0; r < ok.size(); ++r)
      if (ok[r] == 0.0)
        throw io_error("save_checkpoint: rank " + std::to_string(r) + " failed to " + phase + " " + dir);
    return ok;
  };
  std::exception_ptr failed;
  double proposal = 0;
  try {
    self.pruner.wait();  // the previous save's (one prune at a time)
    optim::detail::check_dir(dir, "save_checkpoint");
    proposal = static_cast<double>(optim::detail::next_generation(dir, "save_checkpoint"));
  } catch (...) {
    failed = std::current_exception();
  }
  const std::vector<double> proposals = all_ok(failed, "prepare a checkpoint in", proposal);
  const auto gen = static_cast<std::uint64_t>(*std::max_element(proposals.begin(), proposals.end()));
  const std::string tmp = optim::detail::generation_path(dir, gen, true);
  try {
    optim::detail::check_dir(tmp, "save_checkpoint");
    const std::string part = tmp + "/rank-" + std::to_string(self.lay.rank);
    std::error_code ec;
    std::filesystem::remove_all(part, ec);  // a killed save's (Note [Generation names])
    if (self.lay.rank == 0) std::filesystem::remove(tmp + "/distributed.txt", ec);
    optim::detail::check_dir(part, "save_checkpoint");
    optim::detail::write_checkpoint_files(*self.opt, part);
  } catch (...) {
    failed = std::current_exception();
  }
  all_ok(failed, "write its part of");
  try {
    if (self.lay.rank == 0) {
      const std::string text = layout_text(self.lay);
      optim::detail::write_new_file(tmp + "/distributed.txt", [&](int fd, const std::string& path) {
        optim::detail::write_all(fd, text.data(), text.size(), path);
      });
      optim::detail::publish_generation(dir, gen, "save_checkpoint");
      self.pruner.start(dir, gen);
    }
  } catch (...) {
    failed = std::current_exception();
  }
  all_ok(failed, "publish");
}

void distributed_adamw::load_checkpoint(const std::string& dir, stream_t stream) {
  auto& self = *impl_;
  DFA_EXPECTS(!dir.empty(), "distributed_adamw::load_checkpoint: directory is empty");
  std::exception_ptr failed;
  std::string gen_dir;
  double mine = -1.0;
  try {
    gen_dir = optim::detail::newest_generation(dir, "load_checkpoint");
    mine = static_cast<double>(optim::detail::scan_generations(dir, "load_checkpoint").newest_complete);
    const std::string text = optim::detail::read_text_file(gen_dir + "/distributed.txt", "load_checkpoint");
    if (text != layout_text(self.lay))
      throw corrupt_data("load_checkpoint: " + gen_dir + " was saved with another layout:\n" + text + "this run has:\n" +
                         layout_text(self.lay));
  } catch (...) {
    failed = std::current_exception();
  }
  // Every rank must load the same generation.
  if (failed) mine = -1.0;
  const std::vector<double> seen = self.gather_doubles(mine, nullptr);
  if (failed) std::rethrow_exception(failed);
  for (std::size_t r = 0; r < seen.size(); ++r)
    if (seen[r] != mine)
      throw io_error("load_checkpoint: rank " + std::to_string(r) + " " +
                     (seen[r] < 0 ? "cannot load " + dir : "sees another newest generation in " + dir));
  optim::detail::read_checkpoint_files(*self.opt, gen_dir + "/rank-" + std::to_string(self.lay.rank));
  self.gather_params(stream);  // writes every rank's BF16 shard everywhere
}

}  // namespace deferalloc::dist
