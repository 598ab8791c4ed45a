// The C ABI under 10 threads (the acceptance stress run), on the driver DEFERALLOC_CONF
// names: host in CI, CUDA on a GPU machine (DFA_STRESS_SECONDS=600 for the 10-minute run).
// The run lasts until its floors of verified blocks, pauses and empty_cache calls are
// reached and at least DFA_STRESS_SECONDS (default 3) have passed, with a time cap as a
// guard (Note [Stress runs end on counts]).
//
// Five workers malloc/fill/verify/free blocks of 512 B .. 4 MiB across 3 streams, hand
// some to another stream (dfa_record_stream_hook) whose read is still queued when the
// block is freed; two threads each own a tag, allocate in it, pause it with host backup,
// resume and verify every block; one thread loops dfa_empty_cache, one dfa_trim, one
// reads the statistics.  Every block holds one byte value from its fill to its free; a
// block that reads back anything else is corrupted.  The test fails on any corrupted
// block, and on any error other than out-of-memory.
#include <deferalloc/deferalloc.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "stress_budget.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

struct counters {
  std::atomic<std::uint64_t> corrupted{0};
  std::atomic<std::uint64_t> errors{0};
  std::atomic<std::uint64_t> ooms{0};
  std::atomic<std::uint64_t> mallocs{0};
  std::atomic<std::uint64_t> verified{0};
  std::atomic<std::uint64_t> pauses{0};
  std::atomic<std::uint64_t> empty_caches{0};
  std::mutex mu;
  std::string first_error;  // guarded by mu

  void error(const std::string& what) {
    errors.fetch_add(1);
    std::lock_guard lk(mu);
    if (first_error.empty()) first_error = what;
  }
};

// Host memory for reading blocks back: pinned on the CUDA driver, so that a copy on a
// stream stays queued (a copy to pageable memory returns only when done).
class host_buffer {
 public:
  explicit host_buffer(bool pinned) : pinned_(pinned) {}
  host_buffer(host_buffer&& o) noexcept : pinned_(o.pinned_), p_(o.p_), n_(o.n_), cap_(o.cap_) { o.p_ = nullptr; }
  host_buffer(const host_buffer&) = delete;
  host_buffer& operator=(const host_buffer&) = delete;
  host_buffer& operator=(host_buffer&& o) noexcept {
    std::swap(pinned_, o.pinned_);
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    std::swap(cap_, o.cap_);
    return *this;
  }
  ~host_buffer() { release(); }
  void resize(std::size_t n) {
    if (n > cap_) {
      release();
      if (pinned_) {
        if (cudaMallocHost(reinterpret_cast<void**>(&p_), n) != cudaSuccess) std::abort();
      } else {
        p_ = new unsigned char[n];
      }
      cap_ = n;
    }
    n_ = n;
  }
  unsigned char* data() const { return p_; }
  std::size_t size() const { return n_; }

 private:
  void release() noexcept {
    if (p_ == nullptr) return;
    if (pinned_)
      cudaFreeHost(p_);
    else
      delete[] p_;
    p_ = nullptr;
    cap_ = 0;
  }
  bool pinned_;
  unsigned char* p_ = nullptr;
  std::size_t n_ = 0;
  std::size_t cap_ = 0;
};

// Memory access on either driver: host memory on the host driver, device memory and real
// streams on the CUDA driver.
class memory_access {
 public:
  explicit memory_access(bool cuda) : cuda_(cuda) {
    for (int i = 0; i < 3; ++i) {
      if (cuda_) {
        cudaStream_t s = nullptr;
        if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) std::abort();
        streams_[i] = s;
      } else {
        streams_[i] = reinterpret_cast<void*>(std::uintptr_t{0x1000} * (i + 1));  // opaque on the host driver
      }
    }
  }
  ~memory_access() {
    if (cuda_)
      for (void* s : streams_) cudaStreamDestroy(static_cast<cudaStream_t>(s));
  }
  void* stream(int i) const { return streams_[i]; }
  host_buffer buffer() const { return host_buffer(cuda_); }

  // Fills p with v, ordered on `stream`; returns when the fill is complete.
  void fill(void* p, std::size_t n, unsigned char v, void* stream) const {
    if (!cuda_) {
      std::memset(p, v, n);
      return;
    }
    auto s = static_cast<cudaStream_t>(stream);
    if (cudaMemsetAsync(p, v, n, s) != cudaSuccess || cudaStreamSynchronize(s) != cudaSuccess) std::abort();
  }
  // Copies p to `out` on `stream`; host driver: at once.  `wait` waits for the copy.
  void read(const void* p, std::size_t n, host_buffer& out, void* stream, bool wait) const {
    out.resize(n);
    if (!cuda_) {
      std::memcpy(out.data(), p, n);
      return;
    }
    auto s = static_cast<cudaStream_t>(stream);
    if (cudaMemcpyAsync(out.data(), p, n, cudaMemcpyDeviceToHost, s) != cudaSuccess) std::abort();
    if (wait && cudaStreamSynchronize(s) != cudaSuccess) std::abort();
  }
  void wait(void* stream) const {
    if (cuda_ && cudaStreamSynchronize(static_cast<cudaStream_t>(stream)) != cudaSuccess) std::abort();
  }

 private:
  bool cuda_;
  void* streams_[3]{};
};

bool all_equal(const host_buffer& b, unsigned char v) {
  for (std::size_t i = 0; i < b.size(); ++i)
    if (b.data()[i] != v) return false;
  return true;
}

struct block {
  void* p;
  std::size_t n;
  unsigned char v;
  int si;  // its stream: mem.stream(si)
};

std::size_t random_size(std::mt19937_64& rng) {
  const unsigned k = static_cast<unsigned>(rng() % 100);
  if (k < 60) return 512 + rng() % (64 << 10);           // small pool
  if (k < 95) return (1 << 20) + rng() % (1 << 20);      // large, shares granules
  return (4 << 20) + rng() % (1 << 20);                  // several granules
}

void worker(int id, const memory_access& mem, counters& c, const std::atomic<bool>& stop) {
  std::mt19937_64 rng(1000 + id);
  std::vector<block> live;
  host_buffer buf = mem.buffer();
  std::vector<std::pair<block, host_buffer>> in_flight;  // read queued on another stream
  auto check = [&](const block& b, const host_buffer& got, const char* when) {
    c.verified.fetch_add(1);
    if (!all_equal(got, b.v)) {
      c.corrupted.fetch_add(1);
      c.error("worker " + std::to_string(id) + ": block " + std::to_string(reinterpret_cast<std::uintptr_t>(b.p)) +
              " of " + std::to_string(b.n) + " bytes corrupted " + when);
    }
  };
  while (!stop.load(std::memory_order_relaxed)) {
    const unsigned op = static_cast<unsigned>(rng() % 10);
    if (op < 5 || live.empty()) {
      block b{nullptr, random_size(rng), static_cast<unsigned char>(rng() | 1), static_cast<int>(rng() % 3)};
      b.p = dfa_malloc(b.n, 0, mem.stream(b.si));
      c.mallocs.fetch_add(1);
      if (b.p == nullptr) {
        const std::string e = dfa_last_error();
        if (e.find("out of memory") != std::string::npos || e.find("exhausted") != std::string::npos)
          c.ooms.fetch_add(1);
        else
          c.error("dfa_malloc: " + e);
        continue;
      }
      mem.fill(b.p, b.n, b.v, mem.stream(b.si));
      live.push_back(b);
    } else if (op < 8 || live.size() > 24) {
      const std::size_t i = rng() % live.size();
      block b = live[i];
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      mem.read(b.p, b.n, buf, mem.stream(b.si), true);
      check(b, buf, "before its free");
      dfa_free(b.p, b.n, 0, mem.stream(b.si));
    } else {
      // The block is read on another stream and freed while that read may still be queued:
      // the allocator must not hand it out before the read is done.
      const std::size_t i = rng() % live.size();
      block b = live[i];
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      const int other = (b.si + 1 + static_cast<int>(rng() % 2)) % 3;
      dfa_record_stream_hook(b.p, mem.stream(other));
      host_buffer out = mem.buffer();
      mem.read(b.p, b.n, out, mem.stream(other), false);
      dfa_free(b.p, b.n, 0, mem.stream(b.si));
      in_flight.emplace_back(block{b.p, b.n, b.v, other}, std::move(out));
      if (in_flight.size() > 4) {
        auto& [fb, fout] = in_flight.front();
        mem.wait(mem.stream(fb.si));
        check(fb, fout, "while read on another stream after its free");
        in_flight.erase(in_flight.begin());
      }
    }
  }
  for (auto& [fb, fout] : in_flight) {
    mem.wait(mem.stream(fb.si));
    check(fb, fout, "while read on another stream after its free");
  }
  for (const block& b : live) {
    mem.read(b.p, b.n, buf, mem.stream(b.si), true);
    check(b, buf, "at the end");
    dfa_free(b.p, b.n, 0, mem.stream(b.si));
  }
}

void tag_owner(const std::string& tag, const memory_access& mem, counters& c, const std::atomic<bool>& stop) {
  std::mt19937_64 rng(std::hash<std::string>{}(tag));
  std::vector<block> live;
  host_buffer buf = mem.buffer();
  void* s = mem.stream(0);
  while (!stop.load(std::memory_order_relaxed)) {
    if (dfa_tag_begin(tag.c_str()) != DFA_SUCCESS) c.error(dfa_last_error());
    for (int k = 0; k < 4; ++k) {
      block b{nullptr, random_size(rng), static_cast<unsigned char>(rng() | 1), 0};
      b.p = dfa_malloc(b.n, 0, s);
      if (b.p == nullptr) {
        const std::string e = dfa_last_error();
        if (e.find("out of memory") == std::string::npos) c.error("tagged dfa_malloc: " + e);
        continue;
      }
      mem.fill(b.p, b.n, b.v, s);
      live.push_back(b);
    }
    if (dfa_tag_end() != DFA_SUCCESS) c.error(dfa_last_error());
    while (live.size() > 12) {
      dfa_free(live.front().p, live.front().n, 0, s);
      live.erase(live.begin());
    }
    if (dfa_tag_pause(tag.c_str(), DFA_KEEP_HOST, s) != DFA_SUCCESS) {
      const std::string e = dfa_last_error();
      if (e.find("out of memory") == std::string::npos) c.error(e);
      continue;
    }
    c.pauses.fetch_add(1);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    while (dfa_tag_resume(tag.c_str(), s) != DFA_SUCCESS) {
      const std::string e = dfa_last_error();
      if (e.find("out of memory") == std::string::npos) {
        c.error(e);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    for (const block& b : live) {
      mem.read(b.p, b.n, buf, s, true);
      c.verified.fetch_add(1);
      if (!all_equal(buf, b.v)) {
        c.corrupted.fetch_add(1);
        c.error("tag " + tag + ": a block lost its contents across pause/resume");
      }
    }
  }
  for (const block& b : live) dfa_free(b.p, b.n, 0, s);
}

}  // namespace

TEST(c_api_stress, ten_threads_no_corrupted_block) {
  ASSERT_EQ(dfa_init(nullptr), DFA_SUCCESS) << dfa_last_error();
  const char* name = nullptr;
  ASSERT_EQ(dfa_driver_name(&name), DFA_SUCCESS);
  const bool cuda = std::string(name) == "cuda";
  {
    memory_access mem(cuda);
    counters c;
    dfa_test::stress_budget budget;
    budget.need("blocks verified", c.verified, 200);
    budget.need("pauses", c.pauses, 8);
    budget.need("empty_cache calls", c.empty_caches, 20);
    std::atomic<bool> stop{false};
    std::vector<std::thread> threads;
    for (int i = 0; i < 5; ++i) threads.emplace_back(worker, i, std::cref(mem), std::ref(c), std::cref(stop));
    threads.emplace_back(tag_owner, "stress-a", std::cref(mem), std::ref(c), std::cref(stop));
    threads.emplace_back(tag_owner, "stress-b", std::cref(mem), std::ref(c), std::cref(stop));
    threads.emplace_back([&] {
      while (!stop.load()) {
        size_t released = 0;
        if (dfa_empty_cache(0, &released) != DFA_SUCCESS) c.error(dfa_last_error());
        c.empty_caches.fetch_add(1);
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    });
    threads.emplace_back([&] {
      while (!stop.load()) {
        size_t released = 0;
        if (dfa_trim(0, &released) != DFA_SUCCESS) c.error(dfa_last_error());
        std::this_thread::sleep_for(std::chrono::microseconds(300));
      }
    });
    threads.emplace_back([&] {
      std::vector<char> text(1 << 16);
      while (!stop.load()) {
        dfa_stats st{};
        size_t needed = 0;
        int64_t v = 0;
        if (dfa_get_stats(&st) != DFA_SUCCESS || dfa_memory_stats(0, text.data(), text.size(), &needed) != DFA_SUCCESS ||
            dfa_memory_stat(0, "allocated_bytes.all.current", &v) != DFA_SUCCESS)
          c.error(dfa_last_error());
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    });
    ASSERT_EQ(threads.size(), 10u);
    while (budget.running() && c.errors.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    stop.store(true);
    for (auto& t : threads) t.join();
    std::printf("[stress] %s driver, %.1f s: %llu mallocs, %llu blocks verified, %llu pauses, %llu empty_cache, "
                "%llu OOM, %llu errors, %llu corrupted\n",
                name, budget.elapsed(), (unsigned long long)c.mallocs.load(), (unsigned long long)c.verified.load(),
                (unsigned long long)c.pauses.load(), (unsigned long long)c.empty_caches.load(),
                (unsigned long long)c.ooms.load(), (unsigned long long)c.errors.load(),
                (unsigned long long)c.corrupted.load());
    EXPECT_EQ(c.corrupted.load(), 0u) << c.first_error;
    EXPECT_EQ(c.errors.load(), 0u) << c.first_error;
    EXPECT_EQ(budget.shortfall(), "") << "the run must exercise what it names before its time cap";
    int64_t allocated = -1;
    ASSERT_EQ(dfa_memory_stat(0, "allocated_bytes.all.current", &allocated), DFA_SUCCESS);
    EXPECT_EQ(allocated, 0) << "every block was freed";
    std::fflush(stdout);
    // Shut down while the streams the allocator recorded still exist (streams outlive the
    // allocator that used them); destroying them first crashed the CUDA run at its end.
    EXPECT_EQ(dfa_shutdown(), DFA_SUCCESS) << dfa_last_error();
  }
}
