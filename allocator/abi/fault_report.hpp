// A named failure for touching released memory on the host driver (used by the C ABI).
//
// Note [Released-memory faults]: on the host driver an unbacked granule is PROT_NONE,
// so a touch of released memory raises SIGSEGV, as it faults on the GPU.  Without help
// the process dies with no word of why.  The C ABI installs, once per process and only
// when an instance runs on the host driver, a SIGSEGV handler that looks the faulting
// address up in a lock-free table of the reservations the ABI knows (those of
// dfa_reserve, and the caching allocator's segments, recorded when a dfa_malloc first
// lands in one), writes one line to stderr naming the reservation, its address, the
// offset and "touched while released", and then hands the signal on: to the handler
// that was installed before (chained), or, when that was the default action, by
// restoring it and returning so that the access faults again and the process ends with
// SIGSEGV as it would have.  Faults outside every known reservation are handed on
// without a word.
// Limits: the table holds k_slots entries (later reservations fault unnamed); a
// segment that the caching allocator freed stays listed until dfa_shutdown; the
// handler uses only async-signal-safe calls (atomics, write, sigaction).
#pragma once
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unistd.h>

namespace deferalloc::detail {

class fault_table {
 public:
  static constexpr std::size_t k_slots = 4096;

  /// Lists [base, base + size) as reservation `id` (id != 0).  Full table: not listed.
  void add(std::uint64_t id, std::uintptr_t base, std::size_t size) noexcept {
    for (std::size_t i = 0; i < k_slots; ++i) {
      std::uint64_t expected = 0;
      if (!slots_[i].id.compare_exchange_strong(expected, id, std::memory_order_acq_rel)) continue;
      slots_[i].size.store(size, std::memory_order_relaxed);
      slots_[i].base.store(base, std::memory_order_release);
      std::size_t high = high_.load(std::memory_order_relaxed);
      while (high < i + 1 && !high_.compare_exchange_weak(high, i + 1, std::memory_order_release)) {
      }
      return;
    }
  }
  void remove(std::uint64_t id) noexcept {
    const std::size_t n = high_.load(std::memory_order_acquire);
    for (std::size_t i = 0; i < n; ++i)
      if (slots_[i].id.load(std::memory_order_acquire) == id) {
        slots_[i].base.store(0, std::memory_order_release);
        slots_[i].size.store(0, std::memory_order_relaxed);
        slots_[i].id.store(0, std::memory_order_release);
        return;
      }
  }
  void clear() noexcept {
    const std::size_t n = high_.load(std::memory_order_acquire);
    for (std::size_t i = 0; i < n; ++i) {
      slots_[i].base.store(0, std::memory_order_release);
      slots_[i].id.store(0, std::memory_order_release);
    }
  }
  /// True when `addr` lies in a listed range; its id, base and size then.  Signal-safe.
  bool lookup(std::uintptr_t addr, std::uint64_t* id, std::uintptr_t* base, std::size_t* size) const noexcept {
    const std::size_t n = high_.load(std::memory_order_acquire);
    for (std::size_t i = 0; i < n; ++i) {
      const std::uintptr_t b = slots_[i].base.load(std::memory_order_acquire);
      const std::size_t s = slots_[i].size.load(std::memory_order_relaxed);
      if (b != 0 && addr >= b && addr - b < s) {
        *id = slots_[i].id.load(std::memory_order_relaxed);
        *base = b;
        *size = s;
        return true;
      }
    }
    return false;
  }
  /// True when `addr` lies in a listed range.
  bool contains(std::uintptr_t addr) const noexcept {
    std::uint64_t id = 0;
    std::uintptr_t b = 0;
    std::size_t s = 0;
    return lookup(addr, &id, &b, &s);
  }

 private:
  struct slot {
    std::atomic<std::uintptr_t> base{0};
    std::atomic<std::size_t> size{0};
    std::atomic<std::uint64_t> id{0};
  };
  slot slots_[k_slots];
  std::atomic<std::size_t> high_{0};
};

/// The process's table (never destroyed: Note [Process lifetime] in process_state.cpp).
inline fault_table& faults() {
  static fault_table& t = *new fault_table;
  return t;
}

namespace fault_impl {
using sigaction_t = struct sigaction;
inline sigaction_t& previous() {
  static sigaction_t& p = *new sigaction_t{};
  return p;
}

// A fixed buffer filled with async-signal-safe formatting only.
struct line {
  char buf[512];
  std::size_t n = 0;
  void text(const char* s) noexcept {
    while (*s != '\0' && n < sizeof buf - 1) buf[n++] = *s++;
  }
  void number(std::uint64_t v, unsigned radix) noexcept {
    char tmp[24];
    std::size_t k = 0;
    do {
      const unsigned d = static_cast<unsigned>(v % radix);
      tmp[k++] = static_cast<char>(d < 10 ? '0' + d : 'a' + d - 10);
      v /= radix;
    } while (v != 0 && k < sizeof tmp);
    if (radix == 16) text("0x");
    while (k > 0 && n < sizeof buf - 1) buf[n++] = tmp[--k];
  }
};

inline void on_sigsegv(int sig, siginfo_t* info, void* uctx) {
  const int saved_errno = errno;
  std::uint64_t id = 0;
  std::uintptr_t base = 0;
  std::size_t size = 0;
  const auto addr = reinterpret_cast<std::uintptr_t>(info != nullptr ? info->si_addr : nullptr);
  if (faults().lookup(addr, &id, &base, &size)) {
    line l;
    l.text("[deferalloc] SIGSEGV at ");
    l.number(addr, 16);
    l.text(": reservation ");
    l.number(id, 10);
    l.text(" (address ");
    l.number(base, 16);
    l.text(", ");
    l.number(size, 10);
    l.text(" bytes), offset ");
    l.number(addr - base, 10);
    l.text(", touched while released (not materialized, paused, or freed)\n");
    ssize_t ignored = ::write(STDERR_FILENO, l.buf, l.n);
    (void)ignored;
  }
  errno = saved_errno;
  const struct sigaction& prev = previous();
  if ((prev.sa_flags & SA_SIGINFO) != 0 && prev.sa_sigaction != nullptr) {
    prev.sa_sigaction(sig, info, uctx);
    return;
  }
  if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN && prev.sa_handler != nullptr) {
    prev.sa_handler(sig);
    return;
  }
  // The default action: restore it and return; the access faults again and ends the process.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(sig, &dfl, nullptr);
}
}  // namespace fault_impl

/// Installs the SIGSEGV reporter once per process (later calls do nothing).  Cost: one sigaction.
inline void install_fault_reporter() noexcept {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = &fault_impl::on_sigsegv;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGSEGV, &sa, &fault_impl::previous());
  });
}

}  // namespace deferalloc::detail
