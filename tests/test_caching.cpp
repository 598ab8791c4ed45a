// Caching allocator conformance (host driver everywhere, CUDA driver with label gpu):
// stream-ordered reuse, splitting and coalescing without overlap, empty_cache really
// returning memory, the memory fraction and OOM accounting, statistics with PyTorch's
// keys, tags (pause/resume with and without host backup, resident blocks, pooled
// chunks at resume) and every misuse as a typed error that changes nothing.
#include <deferalloc/caching/caching_allocator.hpp>

#include <algorithm>
#include <bit>
#include <map>
#include <set>
#include <thread>

#include "common.hpp"
#include "core/driver/fault_driver.hpp"
#include "core/log/log.hpp"
#include "log_probe.hpp"
#include "memory_checks.hpp"

using namespace deferalloc;
using namespace dfa_test;

namespace {

class caching : public ::testing::Test {
 protected:
  stack s{make_driver()};
  driver& d = *s.drv;
  std::size_t g = s.drv->granularity();
  std::unique_ptr<caching_allocator> a = std::make_unique<caching_allocator>(*s.mgr);
  stream_t s1 = d.create_stream();
  stream_t s2 = d.create_stream();
  void TearDown() override {
    d.synchronize_stream(s1);
    d.synchronize_stream(s2);
    a.reset();
    d.destroy_stream(s1);
    d.destroy_stream(s2);
  }
  std::int64_t stat(const char* k) const { return a->stat(k); }
  /// True when every granule under [p, p + n) is backed.
  bool backed(void* p, std::size_t n) const {
    const reservation_id id = *s.mgr->find(p);
    const auto base = reinterpret_cast<std::uintptr_t>(s.mgr->address(id));
    const auto q = reinterpret_cast<std::uintptr_t>(p);
    const std::size_t off = (q - base) / g * g;
    return s.mgr->is_backed(id, off, (q + n - base + g - 1) / g * g - off);
  }
};

}  // namespace

TEST_F(caching, freed_block_is_reused_at_once_on_its_stream) {
  void* p = a->allocate(1000, s1);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 512, 0u);
  a->deallocate(p, 1000, s1);
  EXPECT_EQ(a->allocate(1000, s1), p) << "a block freed on s1 must be handed out again on s1";
  a->deallocate(p, 1000, s1);
  void* big = a->allocate(40_MiB, s1);
  a->deallocate(big, 40_MiB, s1);
  EXPECT_EQ(a->allocate(40_MiB, s1), big);
  a->deallocate(big, 0, s1);
}

TEST_F(caching, another_stream_reuses_a_block_only_after_its_free_event) {
  void* p = a->allocate(8_MiB, s1);
  upload(d, p, random_bytes(8_MiB, 1));
  a->deallocate(p, 8_MiB, s1);
  // s2 has no blocks of its own: the allocator records an event on s1 and takes s1's
  // block once it completed, or takes fresh space; never an unfinished block.
  void* q = a->allocate(8_MiB, s2);
  if (q != p) {
    d.synchronize_stream(s1);
    a->deallocate(q, 8_MiB, s2);
    void* r = a->allocate(8_MiB, s2);
    EXPECT_TRUE(r == q || r == p);
    a->deallocate(r, 8_MiB, s2);
  } else {
    a->deallocate(q, 8_MiB, s2);
  }
  if (!d.asynchronous()) {
    // Events complete at once on the host driver: s1's block is taken, no new memory.
    void* x = a->allocate(4_MiB, s1);
    a->deallocate(x, 4_MiB, s1);
    const auto reserved = stat("reserved_bytes.all.current");
    void* y = a->allocate(4_MiB, s2);
    EXPECT_EQ(stat("reserved_bytes.all.current"), reserved) << "s2 should have reused s1's completed block";
    a->deallocate(y, 4_MiB, s2);
  }
}

TEST_F(caching, record_stream_defers_the_free_until_the_other_stream_is_done) {
  void* p = a->allocate(3_MiB, s1);
  a->record_stream(p, s2);
  a->deallocate(p, 3_MiB, s1);
  d.synchronize_stream(s2);
  d.synchronize_stream(s1);
  // Processed at the next allocation: the block is free again.
  void* q = a->allocate(3_MiB, s1);
  EXPECT_EQ(q, p);
  a->deallocate(q, 3_MiB, s1);
  EXPECT_EQ(stat("active_bytes.all.current"), 0);
}

TEST_F(caching, random_blocks_never_overlap_and_keep_their_contents) {
  std::mt19937_64 rng(7);
  std::map<std::uintptr_t, std::pair<std::size_t, std::uint64_t>> live;  // addr -> size, seed
  std::uint64_t seed = 100;
  const std::size_t cap = d.asynchronous() ? 2_GiB : 256_MiB;
  std::size_t live_bytes = 0;
  for (int i = 0; i < 600; ++i) {
    const bool alloc = live.empty() || (rng() % 100 < 60 && live_bytes < cap);
    if (alloc) {
      const std::size_t n = rng() % 4 == 0 ? 1 + rng() % (12_MiB) : 1 + rng() % (600_KiB);
      void* p = a->allocate(n, i % 3 == 0 ? s2 : s1);
      const auto q = reinterpret_cast<std::uintptr_t>(p);
      auto it = live.upper_bound(q);
      if (it != live.end()) ASSERT_LE(q + n, it->first) << "overlaps the next block";
      if (it != live.begin()) {
        --it;
        ASSERT_LE(it->first + it->second.first, q) << "overlaps the previous block";
      }
      upload(d, p, random_bytes(n, ++seed));
      live[q] = {n, seed};
      live_bytes += n;
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      const auto [n, sd] = it->second;
      ASSERT_EQ(download(d, reinterpret_cast<void*>(it->first), n), random_bytes(n, sd)) << "contents changed";
      a->deallocate(reinterpret_cast<void*>(it->first), n, s1);
      live_bytes -= n;
      live.erase(it);
    }
  }
  EXPECT_EQ(stat("allocation.all.current"), static_cast<std::int64_t>(live.size()));
  for (auto& [q, v] : live) a->deallocate(reinterpret_cast<void*>(q), v.first, s1);
  EXPECT_EQ(stat("allocated_bytes.all.current"), 0);
}

TEST_F(caching, empty_cache_returns_memory_to_the_device) {
  s.pool->trim();
  const auto before = d.get_memory_info().free_bytes;
  std::vector<void*> ps;
  for (int i = 0; i < 8; ++i) ps.push_back(a->allocate(5_MiB + 100, s1));
  void* keep = a->allocate(3000, s1);
  for (void* p : ps) a->deallocate(p, 0, s1);
  EXPECT_GT(stat("reserved_bytes.all.current"), 40 * (1 << 20)) << "freed blocks stay cached";
  const std::size_t released = a->empty_cache();
  EXPECT_GT(released, 0u);
  EXPECT_LE(stat("reserved_bytes.all.current"), static_cast<std::int64_t>(g)) << "only the granule of `keep` stays";
  // Only the granule of `keep` stays (the CUDA driver may add a little for new events).
  EXPECT_LE(before - d.get_memory_info().free_bytes, d.asynchronous() ? 4 * g : g);
  a->deallocate(keep, 3000, s1);
  EXPECT_GE(stat("num_device_free"), 1);
}

TEST_F(caching, memory_fraction_gives_out_of_memory_after_one_retry) {
  const std::size_t total = d.get_memory_info().total_bytes;
  EXPECT_THROW(a->set_memory_fraction(0.0), invalid_argument);
  EXPECT_THROW(a->set_memory_fraction(1.5), invalid_argument);
  a->set_memory_fraction(0.25);
  EXPECT_EQ(a->memory_fraction(), 0.25);
  EXPECT_EQ(a->config().memory_fraction, 0.25) << "config() shows set_memory_fraction (one source of truth)";
  void* p = a->allocate(total / 8, s1);
  upload(d, p, random_bytes(4096, 3));
  EXPECT_THROW(a->allocate(total / 5, s1), out_of_memory);
  EXPECT_EQ(stat("num_ooms"), 1);
  EXPECT_EQ(stat("num_alloc_retries"), 1);
  EXPECT_EQ(download(d, p, 4096), random_bytes(4096, 3)) << "a failed allocation touched a live block";
  a->deallocate(p, 0, s1);
  void* q = a->allocate(total / 5, s1);  // the cached block is released and re-used
  a->deallocate(q, 0, s1);
}

// Note [Logging outside locks]: a refusal's warn line reaches the log sink after the
// allocator's mutex is released (a sink that takes the GIL, the Python bridge, would
// otherwise deadlock against a thread that holds the GIL and waits for the allocator).
TEST_F(caching, log_lines_reach_the_sink_after_the_allocators_lock_is_released) {
  log_probe probe([&] { (void)a->memory_fraction(); });  // takes the allocator's mutex
  struct sink_scope {
    explicit sink_scope(log_probe& p) { detail::set_log_sink(&log_probe::fn, &p, log_level::warn); }
    ~sink_scope() { detail::set_log_sink(nullptr, nullptr, log_level::off); }
  } sink(probe);
  EXPECT_THROW(a->allocate(0, s1), invalid_argument);
  const tag_id t = a->register_tag("p");
  a->pause("p", keep_mode::discard, s1);
  EXPECT_THROW(a->allocate(100, s1, t), invalid_state);
  a->set_memory_fraction(0.25);
  EXPECT_THROW(a->allocate(d.get_memory_info().total_bytes / 2, s1), out_of_memory);
  ASSERT_EQ(probe.lines.size(), 3u) << "one warn line per refusal";
  EXPECT_EQ(probe.lines[1].rfind("deferalloc refused 100 bytes (100 B) in tag 'p': ", 0), 0u) << probe.lines[1];
  EXPECT_TRUE(probe.blocked.empty()) << probe.blocked.size() << " lines delivered under the lock, the first: "
                                     << probe.blocked.front();
}

TEST_F(caching, statistics_have_pytorch_keys_and_peaks_reset) {
  for (const char* k : {"allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
                        "reserved_bytes.all.peak", "active_bytes.large_pool.current", "requested_bytes.small_pool.peak",
                        "allocation.all.current", "segment.all.current", "num_alloc_retries", "num_ooms",
                        "num_device_alloc", "num_device_free", "deferalloc.pool.cached_bytes",
                        "deferalloc.pool.cache_limit_bytes", "deferalloc.manager.splits",
                        "deferalloc.driver_calls.map"})
    EXPECT_NO_THROW(a->stat(k)) << k;
  EXPECT_THROW(a->stat("allocated_bytes.all.nonsense"), invalid_argument);
  void* p = a->allocate(10_MiB, s1);
  void* q = a->allocate(1000, s1);
  EXPECT_EQ(stat("allocated_bytes.all.current"), static_cast<std::int64_t>(10_MiB + 1024));
  EXPECT_EQ(stat("allocated_bytes.large_pool.current"), static_cast<std::int64_t>(10_MiB));
  EXPECT_EQ(stat("allocated_bytes.small_pool.current"), 1024);
  EXPECT_EQ(stat("requested_bytes.small_pool.current"), 1000);
  a->deallocate(p, 10_MiB, s1);
  EXPECT_EQ(stat("allocated_bytes.all.peak"), static_cast<std::int64_t>(10_MiB + 1024));
  a->reset_peak_stats();
  EXPECT_EQ(stat("allocated_bytes.all.peak"), 1024);
  EXPECT_GE(stat("reserved_bytes.all.peak"), stat("reserved_bytes.all.current"));
  a->deallocate(q, 1000, s1);
  a->reset_accumulated_stats();
  EXPECT_EQ(stat("allocated_bytes.all.allocated"), 0);
}

TEST_F(caching, misuse_is_a_typed_error_that_changes_nothing) {
  void* p = a->allocate(4096, s1);
  const auto before = a->stats();
  int on_stack = 0;
  EXPECT_THROW(a->deallocate(&on_stack, 4, s1), invalid_argument) << "pointer we do not own";
  EXPECT_THROW(a->deallocate(static_cast<char*>(p) + 512, 0, s1), invalid_argument) << "interior pointer";
  EXPECT_THROW(a->deallocate(p, 12345, s1), invalid_argument) << "wrong size";
  EXPECT_THROW(a->record_stream(&on_stack, s2), invalid_argument);
  EXPECT_THROW(a->allocate(0, s1), invalid_argument);
  EXPECT_THROW(a->allocate(std::size_t{1} << 60, s1), invalid_argument);
  EXPECT_THROW(a->set_resident(&on_stack), invalid_argument);
  EXPECT_THROW(a->end_tag(), invalid_state);
  EXPECT_THROW(a->begin_tag(""), invalid_argument);
  EXPECT_EQ(a->stats(), before);
  a->deallocate(p, 4096, s1);
  EXPECT_THROW(a->deallocate(p, 4096, s1), invalid_argument) << "double free";
}

// The registry: one id per tag name; allocate(..., id) tags a block whatever region the
// thread is in, and pause releases it with the tag's other blocks.
TEST_F(caching, tag_registry_gives_ids_and_allocates_by_id) {
  const tag_id kv = a->register_tag("kv");
  EXPECT_NE(kv, tag_id::none);
  EXPECT_EQ(a->register_tag("kv"), kv) << "one id per name";
  const tag_id other = a->register_tag("other");
  EXPECT_NE(other, kv);
  EXPECT_THROW(a->register_tag(""), invalid_argument);
  EXPECT_THROW(a->register_tag(std::string(257, 'x')), invalid_argument);
  EXPECT_THROW(a->allocate(4096, s1, static_cast<tag_id>(99)), invalid_argument) << "an id it did not give";
  EXPECT_EQ(a->tags(), (std::vector<std::string>{"kv", "other"}));
  void* p = nullptr;
  {
    tag_scope region(*a, "other");
    p = a->allocate(3_MiB, s1, kv);  // the id wins over the thread's region
    EXPECT_EQ(a->current_tag(), "other");
  }
  void* q = a->allocate(3_MiB, s1, tag_id::none);
  const auto backed = stat("deferalloc.backed_bytes");
  a->pause("kv", keep_mode::discard, s1);
  EXPECT_LT(stat("deferalloc.backed_bytes"), backed) << "the block allocated by id belongs to kv";
  EXPECT_THROW(a->allocate(4096, s1, kv), invalid_state) << "kv is paused";
  a->resume("kv", s1);
  a->deallocate(p, 3_MiB, s1);
  a->deallocate(q, 3_MiB, s1);
}

TEST_F(caching, tag_pause_and_resume_keep_addresses_and_contents) {
  std::vector<std::pair<void*, std::size_t>> blocks;
  {
    tag_scope region(*a, "weights");
    EXPECT_EQ(a->current_tag(), "weights");
    for (std::size_t n : {700_KiB, 3_MiB + 5, 64_KiB, 9_MiB}) blocks.emplace_back(a->allocate(n, s1), n);
  }
  EXPECT_EQ(a->current_tag(), "");
  void* untagged = a->allocate(2_MiB, s1);
  upload(d, untagged, random_bytes(2_MiB, 99));
  for (std::size_t i = 0; i < blocks.size(); ++i) upload(d, blocks[i].first, random_bytes(blocks[i].second, i));
  // One cycle first: the first resume may back merged runs with larger chunks than the
  // ones that grew block by block; from then on the pool holds exactly what it needs.
  a->pause("weights", keep_mode::host, s1);
  a->resume("weights", s1);
  const auto backed_bytes = stat("deferalloc.backed_bytes");
  const auto creates = d.call_counts()[primitive::create];

  a->pause("weights", keep_mode::host, s1);
  EXPECT_TRUE(a->is_paused("weights"));
  EXPECT_LT(stat("deferalloc.backed_bytes"), backed_bytes - static_cast<std::int64_t>(12_MiB));
  for (auto& [p, n] : blocks) EXPECT_FALSE(backed(p, n));
  EXPECT_TRUE(backed(untagged, 2_MiB));
  EXPECT_GT(s.mgr->stats().backup_bytes, 0u);
  {
    tag_scope region(*a, "weights");
    EXPECT_THROW(a->allocate(100, s1), invalid_state) << "allocating in a paused tag";
  }
  a->resume("weights", s1);
  d.synchronize_stream(s1);
  EXPECT_EQ(stat("deferalloc.backed_bytes"), backed_bytes);
  EXPECT_EQ(d.call_counts()[primitive::create], creates) << "resume must reuse pooled chunks";
  for (std::size_t i = 0; i < blocks.size(); ++i)
    EXPECT_EQ(download(d, blocks[i].first, blocks[i].second), random_bytes(blocks[i].second, i)) << "block " << i;
  EXPECT_EQ(download(d, untagged, 2_MiB), random_bytes(2_MiB, 99)) << "an untagged block was touched";

  // Without backup: same addresses, memory back, contents undefined.
  a->pause("weights", keep_mode::discard, s1);
  a->resume("weights", s1);
  for (auto& [p, n] : blocks) EXPECT_TRUE(backed(p, n));
  for (auto& [p, n] : blocks) a->deallocate(p, n, s1);
  a->deallocate(untagged, 2_MiB, s1);
}

TEST_F(caching, resident_blocks_stay_backed_when_their_tag_pauses) {
  void* nccl = nullptr;
  void* other = nullptr;
  {
    tag_scope region(*a, "train");
    nccl = a->allocate(4_MiB, s1);
    other = a->allocate(6_MiB, s1);
  }
  void* far = nullptr;  // spans the end of the first growth step (16 MiB) into the next chunk
  {
    tag_scope region(*a, "train");
    far = a->allocate(20_MiB, s1);
  }
  a->set_resident(nccl);
  upload(d, nccl, random_bytes(4_MiB, 5));
  const auto splits = s.mgr->stats().splits;
  a->pause("train", keep_mode::discard, s1);
  EXPECT_TRUE(backed(nccl, 4_MiB));
  // Whole chunks only: `other` shares the resident block's chunk and stays backed; the
  // part of `far` in a chunk of its own is released.  Nothing is split (moved).
  EXPECT_TRUE(backed(other, 6_MiB)) << "a chunk under a resident block stays whole";
  EXPECT_FALSE(backed(static_cast<char*>(far) + 8_MiB, 8_MiB)) << "chunks without a resident block are released";
  EXPECT_EQ(s.mgr->stats().splits, splits);
  EXPECT_EQ(download(d, nccl, 4_MiB), random_bytes(4_MiB, 5));
  EXPECT_THROW(a->set_resident(other, false), invalid_state);
  a->resume("train", s1);
  EXPECT_TRUE(backed(far, 20_MiB));
  a->deallocate(nccl, 0, s1);
  a->deallocate(other, 0, s1);
  a->deallocate(far, 0, s1);
}

TEST_F(caching, tag_misuse_is_reported) {
  EXPECT_THROW(a->resume("never", s1), invalid_argument) << "resume of an unknown tag";
  EXPECT_THROW(a->pause("never", keep_mode::discard, s1), invalid_argument);
  void* p = nullptr;
  {
    tag_scope region(*a, "kv");
    p = a->allocate(1_MiB, s1);
    EXPECT_THROW(a->pause("kv", keep_mode::discard, s1), invalid_state) << "pause inside a region";
  }
  EXPECT_THROW(a->resume("kv", s1), invalid_state) << "resume of a tag that is not paused";
  a->pause("kv", keep_mode::discard, s1);
  EXPECT_THROW(a->pause("kv", keep_mode::discard, s1), invalid_state) << "double pause";
  a->deallocate(p, 1_MiB, s1);  // freeing while paused is fine
  a->resume("kv", s1);
  EXPECT_EQ(a->tags(), std::vector<std::string>{"kv"});
}

// With a pool cache that holds the paused bytes (pool_cache_mb at least the tag's size;
// on a GPU the tag below is 128 MiB, twice the default bound), resume creates nothing.
TEST_F(caching, pause_resume_cycles_reuse_chunks) {
  stack big(s.drv, chunk_pool_config{{}, 0, no_cache_limit});
  caching_allocator b(*big.mgr);
  std::vector<void*> ps;
  {
    tag_scope region(b, "cycle");
    for (int i = 0; i < 16; ++i) ps.push_back(b.allocate(4 * g, s1));
  }
  b.pause("cycle", keep_mode::discard, s1);
  b.resume("cycle", s1);
  const auto creates = d.call_counts()[primitive::create];
  for (int i = 0; i < 20; ++i) {
    b.pause("cycle", keep_mode::host, s1);
    b.resume("cycle", s1);
  }
  EXPECT_EQ(d.call_counts()[primitive::create], creates);
  for (void* p : ps) b.deallocate(p, 0, s1);
  d.synchronize_stream(s1);
}

TEST_F(caching, failed_materialize_rolls_back) {
  auto fd = std::make_shared<fault_driver>(make_driver());
  stack fs(fd);
  caching_allocator fa(*fs.mgr);
  void* p = fa.allocate(1_MiB, nullptr);
  const auto before = fa.stat("allocated_bytes.all.current");
  fd->fail_nth(primitive::map, 1);
  EXPECT_THROW(fa.allocate(20_MiB, nullptr), cuda_error);
  EXPECT_EQ(fa.stat("allocated_bytes.all.current"), before);
  void* q = fa.allocate(20_MiB, nullptr);  // works once the fault has fired
  fa.deallocate(q, 0, nullptr);
  fa.deallocate(p, 0, nullptr);
}

TEST_F(caching, threads_allocate_concurrently) {
  std::vector<std::thread> ts;
  std::atomic<int> errors{0};
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      std::vector<std::pair<void*, std::size_t>> mine;
      for (int i = 0; i < 2000; ++i) {
        if (mine.size() < 20 && rng() % 2 == 0) {
          const std::size_t n = 1 + rng() % 2_MiB;
          mine.emplace_back(a->allocate(n, t % 2 ? s1 : s2), n);
        } else if (!mine.empty()) {
          a->deallocate(mine.back().first, mine.back().second, t % 2 ? s1 : s2);
          mine.pop_back();
        }
      }
      for (auto& [p, n] : mine) a->deallocate(p, n, t % 2 ? s1 : s2);
      if (a->stat("allocation.all.current") < 0) ++errors;
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(stat("allocation.all.current"), 0);
}

// A growing heap backs memory in aligned steps (Note [Growth steps]): one chunk, one
// map and one set_access per step of at least 16 MiB in the large pool, not per block
// (cuMemSetAccess costs 26 us on H200), with at most one step unused at the heap's end.
// grow_bytes = 0 backs block by block.
TEST_F(caching, a_growing_heap_backs_memory_in_steps) {
  const std::size_t block = (std::size_t{1} << 20) + g + g / 2;  // large blocks (> 1 MiB), not granule multiples
  const std::size_t step = std::bit_floor(std::max((std::size_t{16} << 20) / g, std::size_t{1})) * g;
  const int n = 40;
  for (std::size_t grow : {std::size_t{0}, std::size_t{64} << 20}) {
    caching_allocator_config cfg;
    cfg.grow_bytes = grow;
    caching_allocator b(*s.mgr, cfg);
    const auto before = d.call_counts();
    std::vector<void*> ps;
    for (int i = 0; i < n; ++i) {
      ps.push_back(b.allocate(block, s1));
      ASSERT_TRUE(backed(ps.back(), block)) << "block " << i << " is not backed";
    }
    const auto after = d.call_counts();
    const auto calls = after[primitive::set_access] - before[primitive::set_access];
    const auto creates = after[primitive::create] - before[primitive::create];
    const auto reserved = static_cast<std::size_t>(b.stat("reserved_bytes.all.current"));
    if (grow == 0) {
      EXPECT_GE(calls, static_cast<std::uint64_t>(n) / 2) << "block by block";
    } else {
      EXPECT_LE(calls, (n * block + step - 1) / step) << "one call per step";
      EXPECT_EQ(creates, calls) << "aligned steps: one chunk each";
      EXPECT_LE(reserved, n * block + step) << "at most one step unused at the end";
      EXPECT_EQ(reserved % step, 0u);
    }
    EXPECT_GE(reserved, n * block);
    for (void* p : ps) b.deallocate(p, block, s1);
    b.empty_cache();
    EXPECT_EQ(b.stat("reserved_bytes.all.current"), 0) << "empty_cache returns the grown memory too";
  }
}

// ---- physical memory done right --------------------------------------------------------

namespace {
/// A host driver with a small capacity, a pool and an allocator: memory-cap tests run on
/// the host driver whatever DFA_TEST_DRIVER says.
struct capped {
  explicit capped(std::size_t capacity) : s(make_host_driver({64_KiB, capacity})), a(*s.mgr) {}
  stack s;
  caching_allocator a;
};
}  // namespace

// The short-memory case: 256 MiB of capacity, 33 MiB allocated, then 128 MiB: freeing cache
// must work when memory is short (no split needs new chunks first).
TEST(caching_cap, an_allocation_that_fits_after_empty_cache_succeeds) {
  capped c(256_MiB);
  void* p = c.a.allocate(33_MiB);
  std::memset(p, 0x5A, 33_MiB);
  // Fill the device with cached free blocks, some sharing a chunk with the live one.
  std::vector<void*> cached;
  while (c.s.drv->get_memory_info().free_bytes > 0 && cached.size() < 400) cached.push_back(c.a.allocate(2_MiB + 512));
  for (void* x : cached) c.a.deallocate(x, 0);
  ASSERT_EQ(c.s.drv->get_memory_info().free_bytes, 0u) << "the setup did not fill the device";
  void* q = c.a.allocate(128_MiB);  // the retry gives the free chunks back
  EXPECT_NE(q, nullptr);
  EXPECT_EQ(c.a.stat("num_ooms"), 0);
  for (std::size_t i = 0; i < 33_MiB; i += 4096) ASSERT_EQ(static_cast<unsigned char*>(p)[i], 0x5A);
  c.a.deallocate(q, 0);
  c.a.deallocate(p, 0);
  // The same after a free, with the freed memory cached.
  p = c.a.allocate(33_MiB);
  c.a.deallocate(p, 0);
  q = c.a.allocate(128_MiB);
  void* r = c.a.allocate(96_MiB);
  c.a.deallocate(q, 0);
  c.a.deallocate(r, 0);
  EXPECT_EQ(c.s.mgr->stats().splits, 0u);
  c.a.empty_cache();
  EXPECT_EQ(c.s.drv->get_memory_info().free_bytes, 256_MiB) << "empty_cache gives everything back";
}

namespace {
// After empty_cache only memory near live blocks stays backed: chunks are at most
// max(grow_bytes, 16 MiB) = 64 MiB and aligned (Note [Growth steps]), so every backed
// granule lies in a 64 MiB-aligned window that holds a live block, and no other segment
// keeps anything backed.
void only_live_windows_stay_backed(capped& c, const std::vector<std::pair<void*, std::size_t>>& live) {
  const std::size_t g = c.s.drv->granularity(), window = 64_MiB / g;
  std::map<reservation_id, std::set<std::size_t>> windows;
  for (const auto& [p, n] : live) {
    const reservation_id id = *c.s.mgr->find(p);
    const auto off = reinterpret_cast<std::uintptr_t>(p) - reinterpret_cast<std::uintptr_t>(c.s.mgr->address(id));
    for (std::size_t i = off / g; i <= (off + n - 1) / g; i += window) windows[id].insert(i / window);
    windows[id].insert((off + n - 1) / g / window);
  }
  std::size_t backed = 0;
  for (const auto& [id, ws] : windows) {
    const auto flags = c.s.mgr->backed_granules(id);
    for (std::size_t i = 0; i < flags.size(); ++i) {
      if (!flags[i]) continue;
      backed += g;
      ASSERT_TRUE(ws.count(i / window)) << "granule " << i << " stays backed with no live block in its 64 MiB window";
    }
  }
  EXPECT_EQ(c.s.mgr->stats().backed_bytes, backed) << "a segment without live blocks keeps memory backed";
  EXPECT_EQ(c.s.pool->stats().cached_bytes, 0u);
}
}  // namespace

// Randomized: whenever an allocation fails, empty_cache leaves too little free memory
// for it (the allocator already retried after giving back every whole free chunk), and
// only chunks under live blocks stay.
TEST(caching_cap, every_allocation_that_fits_after_empty_cache_succeeds) {
  capped c(256_MiB);
  const std::size_t g = c.s.drv->granularity();
  std::mt19937_64 rng(3);
  std::vector<std::pair<void*, std::size_t>> live;
  int failures = 0;
  for (int i = 0; i < 1500; ++i) {
    if (live.empty() || rng() % 100 < 55) {
      const std::size_t n = rng() % 3 == 0 ? 1 + rng() % 96_MiB : 1 + rng() % 2_MiB;
      try {
        live.emplace_back(c.a.allocate(n), n);
        std::memset(live.back().first, static_cast<int>(n & 0xFF), std::min<std::size_t>(n, 4096));
      } catch (const out_of_memory&) {
        ++failures;
        c.a.empty_cache();
        const std::size_t free = c.s.drv->get_memory_info().free_bytes;
        // A block of n bytes touches at most ceil(n / g) + 1 granules.
        ASSERT_LT(free, ((n + g - 1) / g + 1) * g) << "an allocation of " << n << " bytes failed with " << free
                                                   << " bytes free after empty_cache";
        ASSERT_NO_FATAL_FAILURE(only_live_windows_stay_backed(c, live)) << "after a failed allocation of " << n;
      }
    } else {
      const std::size_t k = rng() % live.size();
      c.a.deallocate(live[k].first, live[k].second);
      live[k] = live.back();
      live.pop_back();
    }
    ASSERT_EQ(c.s.mgr->stats().splits, 0u) << "the caching allocator split a chunk";
  }
  EXPECT_GT(failures, 0) << "the sequence never reached the cap: the test checks nothing";
  for (auto& [p, n] : live) c.a.deallocate(p, n);
}

// A failed request leaves nothing behind: no segment, no address space, no bookkeeping.
TEST(caching_cap, a_failed_huge_allocation_leaves_nothing_behind) {
  capped c(256_MiB);
  void* p = c.a.allocate(8_MiB);
  const auto address = c.a.stat("deferalloc.address_bytes");
  const auto segments = c.a.stat("segment.all.current");
  const auto reserved = c.s.mgr->stats().reserved_bytes;
  const std::size_t rss0 = rss_bytes();
  for (int i = 0; i < 8; ++i) EXPECT_THROW(c.a.allocate(513_GiB), out_of_memory);
  EXPECT_EQ(c.a.stat("deferalloc.address_bytes"), address);
  EXPECT_EQ(c.a.stat("segment.all.current"), segments);
  EXPECT_EQ(c.s.mgr->stats().reserved_bytes, reserved);
  EXPECT_EQ(c.s.mgr->stats().reservations, 1u);
  EXPECT_LT(rss_bytes() - std::min(rss_bytes(), rss0), 4_MiB);
  c.a.deallocate(p, 0);
}

// Tags own their segments: after cross-tag free and re-allocate, pausing one tag never
// unmaps (or changes) another tag's blocks.
TEST_F(caching, pausing_one_tag_never_unmaps_another_tags_blocks) {
  std::mt19937_64 rng(11);
  std::vector<std::pair<void*, std::size_t>> in_a, in_b;
  for (int round = 0; round < 4; ++round) {
    {
      tag_scope r(*a, "a");
      for (int i = 0; i < 6; ++i) in_a.emplace_back(a->allocate(1 + rng() % 6_MiB, s1), 0);
    }
    // Free half of a's blocks, then allocate b's blocks of the same sizes.
    for (int i = 0; i < 3; ++i) {
      const auto [p, n] = in_a.back();
      in_a.pop_back();
      std::size_t size = 0;
      a->base_allocation(p, &size);
      a->deallocate(p, 0, s1);
      tag_scope r(*a, "b");
      in_b.emplace_back(a->allocate(size, s1), size);
    }
  }
  std::vector<std::uint64_t> seeds;
  for (std::size_t i = 0; i < in_b.size(); ++i) {
    upload(d, in_b[i].first, random_bytes(in_b[i].second, 500 + i));
  }
  a->pause("a", keep_mode::discard, s1);
  for (std::size_t i = 0; i < in_b.size(); ++i) {
    EXPECT_TRUE(backed(in_b[i].first, in_b[i].second)) << "b's block " << i << " was unmapped by pause(a)";
    EXPECT_EQ(download(d, in_b[i].first, in_b[i].second), random_bytes(in_b[i].second, 500 + i));
  }
  for (auto& [p, n] : in_a) EXPECT_FALSE(backed(p, 1)) << "a's blocks are released";
  a->resume("a", s1);
  for (auto& [p, n] : in_a) a->deallocate(p, 0, s1);
  for (auto& [p, n] : in_b) a->deallocate(p, 0, s1);
}

// empty_cache never moves a live block: a thread writing and checking its block while
// another allocates, frees and empties the cache sees its bytes intact (splitting a
// chunk here would lose writes or fault).
TEST_F(caching, empty_cache_while_another_thread_writes_its_live_block) {
  const std::size_t n = 3_MiB;
  void* live = a->allocate(n, s1);
  std::atomic<bool> stop{false};
  std::atomic<int> corrupted{0};
  std::thread writer([&] {
    stream_t st = d.create_stream();
    std::vector<std::uint8_t> buf(n), back(n);
    for (std::uint8_t v = 1; !stop.load(); ++v) {
      std::fill(buf.begin(), buf.end(), v);
      d.copy_async(live, buf.data(), n, st);
      d.copy_async(back.data(), live, n, st);
      d.synchronize_stream(st);
      if (back != buf) corrupted.fetch_add(1);
    }
    d.destroy_stream(st);
  });
  std::mt19937_64 rng(5);
  const auto splits = s.mgr->stats().splits;
  for (int i = 0; i < 300; ++i) {
    std::vector<void*> ps;
    for (int k = 0; k < 4; ++k) ps.push_back(a->allocate(1 + rng() % 4_MiB, s2));
    for (void* p : ps) a->deallocate(p, 0, s2);
    a->empty_cache();
  }
  stop = true;
  writer.join();
  EXPECT_EQ(corrupted.load(), 0);
  EXPECT_EQ(s.mgr->stats().splits, splits) << "empty_cache split a chunk";
  EXPECT_EQ(a->stat("deferalloc.manager.splits"), static_cast<std::int64_t>(splits));
  a->deallocate(live, n, s1);
}

// The GPU acceptance scenario (scaled down on the host driver): a tag of 1,000 allocations
// (16 GiB on a GPU, 250 MiB on the host driver) is paused: all of it but at most the
// pool's cache bound shows free to the driver (cuMemGetInfo on the GPU: >= 99% of
// 16 GiB), and 10 pause/resume cycles (two with host backups, checked) never hold more
// than live + cache bound.
TEST_F(caching, pause_gives_the_memory_back_to_the_device) {
  const std::size_t each = d.asynchronous() ? 16_MiB : 256_KiB;
  const int count = 1000;
  a->empty_cache();
  const auto base = d.get_memory_info();
  const auto bound = static_cast<std::int64_t>(s.pool->cache_limit());
  std::vector<void*> ps;
  {
    tag_scope region(*a, "big");
    for (int i = 0; i < count; ++i) ps.push_back(a->allocate(each, s1));
  }
  for (int i = 0; i < count; i += 97) upload(d, ps[i], random_bytes(4096, 7000 + i));
  const std::int64_t live = held_since(d, base);
  ASSERT_GE(live, static_cast<std::int64_t>(each) * count);
  for (int cycle = 0; cycle < 10; ++cycle) {
    const bool kept = cycle == 1 || cycle == 9;  // two host-kept cycles: pinning 16 GiB costs seconds
    a->pause("big", kept ? keep_mode::host : keep_mode::discard, s1);
    const std::int64_t held = held_since(d, base);
    const auto pinned = [&] { const auto p = s.mgr->stats().pinned; return p.in_use_bytes + p.cached_bytes; };
    EXPECT_LE(held, bound + held_slack(d, pinned())) << "cycle " << cycle << ": the paused tag still holds memory";
    if (cycle == 0)
      std::printf("pause: %.2f%% of %.1f MiB shows free to the driver\n", 100.0 * static_cast<double>(live - held) / live,
                  static_cast<double>(live) / (1 << 20));
    a->resume("big", s1);
    d.synchronize_stream(s1);
    EXPECT_LE(held_since(d, base), static_cast<std::int64_t>(s.mgr->stats().backed_bytes) + bound + held_slack(d, pinned()))
        << "cycle " << cycle << " after resume";
    for (int i = 0; i < count; i += 97) {
      if (kept)
        EXPECT_EQ(download(d, ps[i], 4096), random_bytes(4096, 7000 + i)) << "allocation " << i << ", cycle " << cycle;
      else
        upload(d, ps[i], random_bytes(4096, 7000 + i));  // discarded: written again
    }
  }
  for (void* p : ps) a->deallocate(p, 0, s1);
}
