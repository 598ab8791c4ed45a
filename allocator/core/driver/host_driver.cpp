// host_driver: the VMM primitives on host memory, with the GPU's semantics.
//
// Approach
//   reserve    = mmap(PROT_NONE, MAP_NORESERVE), trimmed to the alignment
//   create     = memfd_create + fallocate (pages committed now, so OOM happens here)
//   map        = mmap(MAP_FIXED | MAP_SHARED, fd) with PROT_NONE (no access yet)
//   set_access = mprotect(PROT_READ | PROT_WRITE)
//   unmap      = mmap(PROT_NONE, MAP_FIXED | MAP_NORESERVE): the reservation is back
//   release    = close(fd): the pages go once no mapping holds them
// Contents of a chunk survive unmap/remap exactly as on the GPU, and touching an
// unbacked granule faults (SIGSEGV) as a GPU kernel would.  Every precondition the
// CUDA driver checks (whole mappings, mapped before access, unmapped before free)
// is checked here too, so misuse found on the host is misuse on the GPU.
//
// Limits: streams and events are trivial (every copy completes on return); the
// capacity is a byte budget on created chunks, not the machine's real memory.
#include <deferalloc/core/config.hpp>
#include <deferalloc/core/driver.hpp>
#include <deferalloc/core/errors.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace deferalloc {
namespace {

std::string errno_text(const char* call) { return std::string(call) + ": " + std::strerror(errno); }

class host_driver final : public driver {
 public:
  explicit host_driver(const host_driver_config& cfg) : granularity_(cfg.granularity), capacity_(cfg.capacity) {
    const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    DFA_EXPECTS(granularity_ >= page && granularity_ % page == 0,
                "host_driver: granularity must be a multiple of the page size (" + std::to_string(page) + ")");
    if (capacity_ == 0) capacity_ = quarter_of_ram();
  }
  ~host_driver() override {
    for (auto& [va, bytes] : reservations_) ::munmap(reinterpret_cast<void*>(va), bytes);
    for (auto& [h, bytes] : chunks_) ::close(static_cast<int>(h));
  }

  std::string name() const override { return "host"; }
  driver_kind kind() const override { return driver_kind::host; }
  std::size_t granularity() const override { return granularity_; }
  memory_info get_memory_info() override {
    std::lock_guard lk(mu_);
    return {capacity_ - created_, capacity_};
  }

  stream_t create_stream() override { return stream_t{sentinel()}; }
  void destroy_stream(stream_t) noexcept override {}
  event_t create_event() override { return event_t{sentinel()}; }
  void destroy_event(event_t) noexcept override {}
  void record(event_t, stream_t) override {}
  void stream_wait(stream_t, event_t) override {}
  void synchronize(event_t) override {}
  bool query(event_t) override { return true; }
  void synchronize_stream(stream_t) override {}
  void copy_async(void* dst, const void* src, std::size_t bytes, stream_t) override {
    std::memcpy(dst, src, bytes);
  }
  void zero_async(void* dst, std::size_t bytes, stream_t) override { std::memset(dst, 0, bytes); }
  bool asynchronous() const override { return false; }

 private:
  static void* sentinel() {
    static char token;
    return &token;
  }

  std::uintptr_t do_reserve(std::size_t bytes, std::size_t alignment) override {
    DFA_EXPECTS(bytes > 0 && bytes % granularity_ == 0, "host_driver::reserve: size must be a positive multiple of the granularity");
    DFA_EXPECTS((alignment & (alignment - 1)) == 0, "host_driver::reserve: alignment must be a power of two (as cuMemAddressReserve requires)");
    if (alignment < granularity_) alignment = granularity_;
    const std::size_t span = bytes + alignment;
    void* p = ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw out_of_memory(errno_text("host_driver::reserve: mmap"));
    auto base = reinterpret_cast<std::uintptr_t>(p);
    auto aligned = (base + alignment - 1) / alignment * alignment;
    if (aligned > base) ::munmap(p, aligned - base);
    if (aligned + bytes < base + span) ::munmap(reinterpret_cast<void*>(aligned + bytes), base + span - aligned - bytes);
    std::lock_guard lk(mu_);
    reservations_[aligned] = bytes;
    return aligned;
  }

  void do_free_reservation(std::uintptr_t va, std::size_t bytes) override {
    std::lock_guard lk(mu_);
    auto it = reservations_.find(va);
    if (it == reservations_.end() || it->second != bytes)
      throw invalid_argument("host_driver::free_reservation: not a reservation");
    auto m = mappings_.lower_bound(va);
    if (m != mappings_.end() && m->first < va + bytes)
      throw invalid_state("host_driver::free_reservation: range still has mappings");
    ::munmap(reinterpret_cast<void*>(va), bytes);
    reservations_.erase(it);
  }

  chunk_handle do_create(std::size_t bytes) override {
    DFA_EXPECTS(bytes > 0 && bytes % granularity_ == 0, "host_driver::create: size must be a positive multiple of the granularity");
    {
      std::lock_guard lk(mu_);
      if (created_ + bytes > capacity_)
        throw out_of_memory("host_driver::create: capacity of " + std::to_string(capacity_) + " bytes exhausted (" +
                            std::to_string(created_) + " in use, " + std::to_string(bytes) + " asked)");
      created_ += bytes;
    }
    int fd = ::memfd_create("deferalloc-chunk", MFD_CLOEXEC);
    if (fd < 0) return undo_create(bytes, errno_text("host_driver::create: memfd_create"));
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0 || ::fallocate(fd, 0, 0, static_cast<off_t>(bytes)) != 0) {
      std::string msg = errno_text("host_driver::create: fallocate");
      ::close(fd);
      return undo_create(bytes, msg);
    }
    std::lock_guard lk(mu_);
    chunks_[static_cast<chunk_handle>(fd)] = bytes;
    return static_cast<chunk_handle>(fd);
  }
  chunk_handle undo_create(std::size_t bytes, const std::string& msg) {
    std::lock_guard lk(mu_);
    created_ -= bytes;
    throw out_of_memory(msg);
  }

  void do_release(chunk_handle h) override {
    std::lock_guard lk(mu_);
    auto it = chunks_.find(h);
    if (it == chunks_.end()) throw invalid_argument("host_driver::release: unknown chunk");
    ::close(static_cast<int>(h));
    created_ -= it->second;
    chunks_.erase(it);
  }

  bool inside_reservation(std::uintptr_t va, std::size_t bytes) const {
    auto it = reservations_.upper_bound(va);
    if (it == reservations_.begin()) return false;
    --it;
    return va >= it->first && va + bytes <= it->first + it->second;
  }

  void do_map(std::uintptr_t va, std::size_t bytes, chunk_handle h) override {
    std::lock_guard lk(mu_);
    auto c = chunks_.find(h);
    if (c == chunks_.end()) throw invalid_argument("host_driver::map: unknown chunk");
    if (c->second != bytes) throw invalid_argument("host_driver::map: size differs from the chunk's");
    if (va % granularity_ != 0 || !inside_reservation(va, bytes))
      throw invalid_argument("host_driver::map: range outside any reservation or misaligned");
    auto m = mappings_.lower_bound(va);
    if ((m != mappings_.end() && m->first < va + bytes) ||
        (m != mappings_.begin() && std::prev(m)->first + std::prev(m)->second > va))
      throw invalid_state("host_driver::map: range already mapped");
    void* p = ::mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE, MAP_FIXED | MAP_SHARED, static_cast<int>(h), 0);
    if (p == MAP_FAILED) throw cuda_error(errno_text("host_driver::map: mmap"));
    mappings_[va] = bytes;
  }

  // True when [va, va+bytes) is exactly a run of whole, adjacent mappings.
  bool whole_mappings(std::uintptr_t va, std::size_t bytes) const {
    std::uintptr_t cur = va;
    auto m = mappings_.find(va);
    while (cur < va + bytes) {
      if (m == mappings_.end() || m->first != cur) return false;
      cur += m->second;
      ++m;
    }
    return cur == va + bytes;
  }

  void do_unmap(std::uintptr_t va, std::size_t bytes) override {
    std::lock_guard lk(mu_);
    if (!whole_mappings(va, bytes)) throw invalid_argument("host_driver::unmap: range is not made of whole mappings");
    void* p = ::mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw cuda_error(errno_text("host_driver::unmap: mmap"));
    for (auto m = mappings_.find(va); m != mappings_.end() && m->first < va + bytes;) m = mappings_.erase(m);
  }

  void do_set_access(std::uintptr_t va, std::size_t bytes) override {
    std::lock_guard lk(mu_);
    // Access may be set on any run of whole mappings (CUDA accepts a sub-range of
    // mapped memory at granularity; we require whole mappings, the stricter rule).
    if (!whole_mappings(va, bytes)) throw invalid_argument("host_driver::set_access: range is not fully mapped");
    if (::mprotect(reinterpret_cast<void*>(va), bytes, PROT_READ | PROT_WRITE) != 0)
      throw cuda_error(errno_text("host_driver::set_access: mprotect"));
  }

  void* do_host_alloc(std::size_t bytes) override {
    const std::size_t rounded = (bytes + 4095) / 4096 * 4096;
    void* p = std::aligned_alloc(4096, rounded);
    if (p == nullptr) throw out_of_memory("host_driver::host_alloc: " + std::to_string(bytes) + " bytes");
    return p;
  }
  void do_host_free(void* p) noexcept override { std::free(p); }

  std::size_t granularity_;
  std::size_t capacity_;
  std::mutex mu_;
  std::size_t created_ = 0;
  std::map<std::uintptr_t, std::size_t> reservations_;
  std::map<std::uintptr_t, std::size_t> mappings_;
  std::map<chunk_handle, std::size_t> chunks_;
};

}  // namespace

std::shared_ptr<driver> make_host_driver(const host_driver_config& cfg) { return std::make_shared<host_driver>(cfg); }

}  // namespace deferalloc
