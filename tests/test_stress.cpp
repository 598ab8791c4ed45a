// Eight threads run mixed operations on one manager; every reservation's bytes are
// checked after each restore, and the accounting must balance at the end.
#include <thread>

#include "common.hpp"

using namespace deferalloc;
using namespace dfa_test;

TEST(stress, eight_threads_mixed_operations) {
  stack s(make_driver());
  auto& m = *s.mgr;
  const std::size_t g = s.drv->granularity();
  const int iterations = dfa_test::driver_name() == "cuda" ? 150 : 300;
  std::atomic<int> failures{0};
  auto worker = [&](int t) {
    std::mt19937 rng(1000 + t);
    struct own {
      reservation_id id;
      std::vector<std::uint8_t> data;
      bool backed;
    };
    std::vector<own> mine;
    stream_t stream = s.drv->create_stream();
    for (int i = 0; i < iterations; ++i) {
      const int op = static_cast<int>(rng() % 6);
      if (mine.size() < 2 || op == 0) {
        const std::size_t bytes = (1 + rng() % 6) * g - (rng() % 2 ? 0 : 100);
        own o{m.reserve(bytes), random_bytes(bytes, rng()), true};
        m.materialize(o.id, 0, whole, fill_mode::undefined, stream);
        s.drv->copy_async(m.address(o.id), o.data.data(), bytes, stream);
        s.drv->synchronize_stream(stream);
        mine.push_back(std::move(o));
        continue;
      }
      own& o = mine[rng() % mine.size()];
      if (op == 1 && o.backed) {
        m.release(o.id, 0, whole, keep_mode::host, stream);
        o.backed = false;
      } else if (op == 2 && !o.backed) {
        m.materialize(o.id, 0, whole, fill_mode::restore, stream);
        o.backed = true;
        std::vector<std::uint8_t> out(o.data.size());
        s.drv->copy_async(out.data(), m.address(o.id), out.size(), stream);
        s.drv->synchronize_stream(stream);
        if (out != o.data) failures.fetch_add(1);
      } else if (op == 3) {
        m.free(o.id, stream);
        std::swap(o, mine.back());
        mine.pop_back();
      } else if (op == 4) {
        // Another thread's addresses never alias ours.
        auto found = m.find(m.address(o.id));
        if (!found || *found != o.id) failures.fetch_add(1);
      } else {
        s.pool->trim(8 * g);
      }
    }
    for (auto& o : mine) m.free(o.id, stream);
    s.drv->destroy_stream(stream);
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  auto st = m.stats();
  EXPECT_EQ(st.reservations, 0u);
  EXPECT_EQ(st.backed_bytes, 0u);
  EXPECT_EQ(st.backup_bytes, 0u);
  EXPECT_EQ(st.pool.taken_bytes, 0u);
}
