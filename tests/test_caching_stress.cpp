// Ten threads on one caching allocator (the acceptance stress run, at the C++ level):
//  - six workers allocate, fill with a pattern, hand blocks to other streams
//    (record_stream) and free them across three streams, checking every block's bytes
//    before its free;
//  - two tag owners each allocate blocks in their own tag, fill them, pause the tag with
//    a host backup, resume it and check every byte;
//  - one maintainer loops empty_cache, pool trims and both statistics calls;
//  - one more worker allocates small blocks only (the small pool churns meanwhile).
// Zero corrupted blocks, no chunk split by the allocator, and the accounting balances
// at the end.  The run lasts until the floors of checked blocks, pauses and empty_cache
// calls are reached and at least DFA_STRESS_SECONDS (default 3; the lead runs 600 on a
// GPU) have passed (Note [Stress runs end on counts]); tests/tsan runs the same file under
// ThreadSanitizer on the host driver.
#include <deferalloc/caching/caching_allocator.hpp>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <thread>

#include "common.hpp"
#include "memory_checks.hpp"
#include "stress_budget.hpp"

using namespace deferalloc;
using namespace dfa_test;

namespace {

/// The pattern of block `seed`: 64-bit words seed * K + i, cheap to write and check.
void fill_pattern(std::vector<std::uint64_t>& buf, std::size_t bytes, std::uint64_t seed) {
  buf.resize((bytes + 7) / 8);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = seed * 0x9E3779B97F4A7C15ull + i;
}

struct block_ref {
  void* p = nullptr;
  std::size_t bytes = 0;
  std::uint64_t seed = 0;
  stream_t stream = nullptr;
};

}  // namespace

TEST(caching_stress, ten_threads_with_pause_empty_cache_and_trim_corrupt_nothing) {
  stack s(make_driver());
  driver& d = *s.drv;
  caching_allocator a(*s.mgr);
  stream_t streams[3] = {d.create_stream(), d.create_stream(), d.create_stream()};
  std::atomic<int> corrupted{0}, errors{0};
  std::atomic<long> blocks_checked{0}, pauses{0}, empties{0};
  stress_budget budget;
  budget.need("blocks checked", blocks_checked, 400);
  budget.need("pauses", pauses, 8);
  budget.need("empty_cache calls", empties, 20);
  auto running = [&] { return budget.running() && errors.load() == 0; };
  std::atomic<std::uint64_t> next_seed{1};
  // Other memory held by the allocator keeps within the host driver's 1 GiB.
  const std::size_t large = d.asynchronous() ? 64_MiB : 8_MiB;

  auto upload_pattern = [&](const block_ref& b, std::vector<std::uint64_t>& buf) {
    fill_pattern(buf, b.bytes, b.seed);
    d.copy_async(b.p, buf.data(), b.bytes, b.stream);
    d.synchronize_stream(b.stream);
  };
  auto check_pattern = [&](const block_ref& b, stream_t on, std::vector<std::uint64_t>& want,
                           std::vector<std::uint64_t>& got) {
    fill_pattern(want, b.bytes, b.seed);
    got.assign(want.size(), 0);
    d.copy_async(got.data(), b.p, b.bytes, on);
    d.synchronize_stream(on);
    if (std::memcmp(got.data(), want.data(), b.bytes) != 0) corrupted.fetch_add(1);
    blocks_checked.fetch_add(1);
  };

  // Checks block k of `mine`, frees it and drops it from the list.
  auto free_one = [&](std::vector<block_ref>& mine, std::size_t k, std::vector<std::uint64_t>& want,
                      std::vector<std::uint64_t>& got) {
    check_pattern(mine[k], mine[k].stream, want, got);
    a.deallocate(mine[k].p, mine[k].bytes, mine[k].stream);
    mine[k] = mine.back();
    mine.pop_back();
  };
  // Runs a thread's body; an exception is a failure of the test, named by `who`.
  auto guarded = [&](const std::string& who, const std::function<void()>& body) {
    try {
      body();
    } catch (const std::exception& e) {
      ADD_FAILURE() << who << ": " << e.what();
      errors.fetch_add(1);
    }
  };

  auto worker = [&](int t, bool small_only) {
    std::mt19937_64 rng(100 + t);
    std::vector<block_ref> mine;
    std::vector<std::uint64_t> buf, want, got;
    guarded("worker " + std::to_string(t), [&] {
      while (running()) {
        if (mine.size() < 12 && (mine.empty() || rng() % 100 < 55)) {
          block_ref b;
          b.bytes = small_only || rng() % 4 != 0 ? 1 + rng() % 700_KiB : 1_MiB + rng() % large;
          b.stream = streams[rng() % 3];
          b.seed = next_seed.fetch_add(1);
          try {
            b.p = a.allocate(b.bytes, b.stream);
          } catch (const out_of_memory&) {
            continue;  // the others hold the memory now; not an error
          }
          upload_pattern(b, buf);
          if (rng() % 3 == 0) {  // another stream reads it, then the free waits for that stream too
            stream_t other = streams[rng() % 3];
            check_pattern(b, other, want, got);
            a.record_stream(b.p, other);
          }
          mine.push_back(b);
        } else {
          free_one(mine, rng() % mine.size(), want, got);
        }
      }
      while (!mine.empty()) free_one(mine, mine.size() - 1, want, got);
    });
  };

  auto tag_owner = [&](int t) {
    const std::string tag = "tag" + std::to_string(t);
    std::mt19937_64 rng(200 + t);
    std::vector<block_ref> mine;
    std::vector<std::uint64_t> buf, want, got;
    guarded("tag owner " + std::to_string(t), [&] {
      while (running()) {
        {
          tag_scope region(a, tag);
          while (mine.size() < 10) {
            block_ref b;
            b.bytes = 1 + rng() % (rng() % 2 ? 3_MiB : 64_KiB);
            b.stream = streams[rng() % 3];
            b.seed = next_seed.fetch_add(1);
            try {
              b.p = a.allocate(b.bytes, b.stream);
            } catch (const out_of_memory&) {
              break;
            }
            upload_pattern(b, buf);
            mine.push_back(b);
          }
        }
        stream_t st = streams[rng() % 3];
        try {
          a.pause(tag, keep_mode::host, st);
        } catch (const out_of_memory&) {
          continue;  // backup memory short: the tag stays resident, try again
        }
        pauses.fetch_add(1);
        if (!a.is_paused(tag)) errors.fetch_add(1);
        for (;;) {
          try {
            a.resume(tag, st);
            break;
          } catch (const out_of_memory&) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));  // others hold the memory
          }
        }
        d.synchronize_stream(st);
        for (const auto& b : mine) check_pattern(b, b.stream, want, got);
        for (int k = 0; k < 4 && !mine.empty(); ++k) free_one(mine, rng() % mine.size(), want, got);
      }
      while (!mine.empty()) free_one(mine, mine.size() - 1, want, got);
    });
  };

  auto maintainer = [&] {
    std::mt19937_64 rng(300);
    guarded("maintainer", [&] {
      while (running()) {
        switch (rng() % 4) {
          case 0: a.empty_cache(); empties.fetch_add(1); break;
          case 1: s.pool->trim(rng() % 2 ? 0 : 16_MiB); break;
          case 2:
            if (a.stats().at("allocation.all.current") < 0) errors.fetch_add(1);
            break;
          default:
            if (s.mgr->stats().backed_bytes > d.get_memory_info().total_bytes) errors.fetch_add(1);
            break;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    });
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) threads.emplace_back(worker, t, false);
  threads.emplace_back(worker, 6, true);
  threads.emplace_back(tag_owner, 7);
  threads.emplace_back(tag_owner, 8);
  threads.emplace_back(maintainer);
  for (auto& th : threads) th.join();

  EXPECT_EQ(corrupted.load(), 0) << "of " << blocks_checked.load() << " blocks checked";
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(budget.shortfall(), "") << "the run must exercise what it names before its time cap";
  EXPECT_EQ(s.mgr->stats().splits, 0u) << "the caching allocator split a chunk";
  EXPECT_EQ(a.stat("allocation.all.current"), 0);
  EXPECT_EQ(a.stat("allocated_bytes.all.current"), 0);
  const auto st = s.mgr->stats();
  EXPECT_LE(st.pool.cached_bytes, s.pool->cache_limit());
  a.empty_cache();
  EXPECT_EQ(s.mgr->stats().backed_bytes, 0u);
  EXPECT_EQ(s.mgr->stats().pool.alive_bytes, 0u) << "empty_cache with nothing allocated gives every chunk back";
  std::printf("stress: %ld blocks checked, %ld pauses, %ld empty_cache calls in %.1f s\n", blocks_checked.load(),
              pauses.load(), empties.load(), budget.elapsed());
  for (stream_t st2 : streams) {
    d.synchronize_stream(st2);
    d.destroy_stream(st2);
  }
}
