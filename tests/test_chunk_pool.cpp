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
  reservation_manager m(pool, d);
  auto id = m.reserve(56 * g + 5);
  m.materialize(id, 0, whole, fill_mode::zero);
  EXPECT_TRUE(m.is_backed(id));
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(m.address(id)) % (16 * g), 0u);
  m.free(id);
}

// Note [Physical memory policy]: chunks given back beyond the cache bound go back to the
// driver at once (largest first); what stays cached never exceeds the bound.
TEST(chunk_pool, chunks_beyond_the_cache_limit_are_released_at_once) {
  auto d = make_driver();
  const std::size_t g = d->granularity();
  chunk_pool p(d, {{}, 0, 3 * g});
  const auto free0 = d->get_memory_info().free_bytes;
  auto a = p.acquire(2 * g);
  auto b = p.acquire(2 * g);
  auto c = p.acquire(g);
  p.give_back(a);
  EXPECT_EQ(p.stats().cached_bytes, 2 * g);
  p.give_back(b);  // 4 granules > 3: one 2-granule chunk goes back to the driver
  EXPECT_EQ(p.stats().cached_bytes, 2 * g);
  EXPECT_EQ(p.stats().chunks_released, 1u);
  p.give_back(c);
  EXPECT_EQ(p.stats().cached_bytes, 3 * g);
  EXPECT_EQ(free0 - d->get_memory_info().free_bytes, 3 * g) << "held bytes = cached bytes, within the bound";
  p.trim();
  EXPECT_EQ(d->get_memory_info().free_bytes, free0);

  chunk_pool none(d, {{}, 0, 0});  // cache nothing
  none.give_back(none.acquire(g));
  EXPECT_EQ(none.stats().alive_bytes, 0u);
}

TEST(chunk_pool, try_reuse_takes_only_cached_chunks_in_the_order_asked) {
  auto d = make_driver();
  const std::size_t g = d->granularity();
  chunk_pool p(d);
  const std::vector<std::size_t> sizes{4 * g, g};
  EXPECT_FALSE(p.try_reuse(sizes).has_value()) << "nothing cached: nothing created either";
  EXPECT_EQ(p.stats().alive_bytes, 0u);
  auto small = p.acquire(g);
  auto big = p.acquire(4 * g);
  p.give_back(small);
  p.give_back(big);
  auto first = p.try_reuse(sizes);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->bytes, 4 * g);
  auto second = p.try_reuse(sizes);
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->bytes, g);
  EXPECT_FALSE(p.try_reuse(sizes).has_value());
  p.give_back(*first);
  p.give_back(*second);
  p.trim();
}

// The settings keys of the policy reach the pools that a context builds.
TEST(chunk_pool, settings_bound_the_pool_and_pinned_caches) {
  const settings defaults = parse_settings("");
  EXPECT_EQ(defaults.pool_cache, 64_MiB);
  EXPECT_EQ(defaults.pinned_cache, quarter_of_ram());
  EXPECT_GT(defaults.pinned_cache, 64_MiB);
  context ctx(parse_settings("driver:host,host_granularity_kb:64,host_capacity_mb:64,pool_cache_mb:1,pinned_cache_mb:0"));
  EXPECT_EQ(ctx.pool->cache_limit(), 1_MiB);
  EXPECT_THROW(parse_settings("pool_cache_mb:-1"), invalid_argument);
  auto& m = *ctx.reservations;
  auto id = m.reserve(4_MiB);
  m.materialize(id, 0, whole, fill_mode::zero);
  m.release(id, 0, whole, keep_mode::host);
  m.materialize(id, 0, whole, fill_mode::restore);
  m.release(id, 0, whole, keep_mode::discard);
  EXPECT_LE(m.stats().pool.cached_bytes, 1_MiB);
  EXPECT_EQ(m.stats().pinned.cached_bytes, 0u) << "pinned_cache_mb:0 keeps no pinned buffer";
  m.free(id);
}
