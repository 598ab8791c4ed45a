// Chunk pool: size classes, reuse without driver calls, budget, trim.
#include "common.hpp"

using namespace deferalloc;
using namespace dfa_test;

TEST(chunk_pool, default_classes_are_powers_of_two_from_the_granularity) {
  auto d = make_driver();
  chunk_pool p(d);
  const auto& c = p.classes();
  ASSERT_FALSE(c.empty());
  EXPECT_EQ(c.front(), d->granularity());
  EXPECT_EQ(c.back(), 1_GiB);
  for (std::size_t i = 1; i < c.size(); ++i) EXPECT_EQ(c[i], 2 * c[i - 1]);
}

TEST(chunk_pool, rejects_a_class_off_the_granularity) {
  auto d = make_driver();
  EXPECT_THROW(chunk_pool(d, {{d->granularity() + 1}, 0}), invalid_argument);
}

TEST(chunk_pool, reuses_released_chunks_without_driver_calls) {
  auto d = make_driver();
  chunk_pool p(d);
  const std::size_t g = d->granularity();
  auto a = p.acquire(4 * g);
  p.give_back(a);
  const auto creates = d->call_counts()[primitive::create];
  auto b = p.acquire(4 * g);
  EXPECT_EQ(d->call_counts()[primitive::create], creates);
  EXPECT_EQ(b.handle, a.handle);
  p.give_back(b);
  auto s = p.stats();
  EXPECT_EQ(s.cached_bytes, 4 * g);
  EXPECT_EQ(s.taken_bytes, 0u);
  EXPECT_EQ(s.chunks_reused, 1u);
  EXPECT_EQ(p.trim(), 4 * g);
  EXPECT_EQ(p.stats().alive_bytes, 0u);
}

TEST(chunk_pool, budget_bounds_alive_bytes_and_trim_makes_room) {
  auto d = make_driver();
  const std::size_t g = d->granularity();
  chunk_pool p(d, {{}, 4 * g});
  auto a = p.acquire(2 * g);
  auto b = p.acquire(2 * g);
  EXPECT_FALSE(p.try_acquire(g).has_value());
  EXPECT_THROW(p.acquire(g), out_of_memory);
  p.give_back(a);
  // A cached 2-granule chunk is trimmed to make room for a 1-granule chunk.
  auto c = p.acquire(g);
  EXPECT_EQ(p.stats().alive_bytes, 3 * g);
  p.give_back(b);
  p.give_back(c);
  p.trim();
}

// Classes need not be powers of two (the optimizer uses one per piece shape); the
// reservations built on such a pool still get a power-of-two alignment.
TEST(chunk_pool, non_power_of_two_classes_serve_reservations) {
  auto d = make_driver();
  const std::size_t g = d->granularity();
  auto pool = std::make_shared<chunk_pool>(d, chunk_pool_config{{28 * g}, 0});
  reservation_manager m(pool);
  auto id = m.reserve(56 * g + 5);
  m.materialize(id, 0, whole, fill_mode::zero);
  EXPECT_TRUE(m.is_backed(id));
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(m.address(id)) % (16 * g), 0u);
  m.free(id);
}
