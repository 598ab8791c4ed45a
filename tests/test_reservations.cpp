// Reservation conformance: stable addresses, exact physical accounting, backups,
// idempotence, one set_access per run, splits, bad input.
#include "common.hpp"

using namespace deferalloc;
using namespace dfa_test;

class reservations : public ::testing::Test {
 protected:
  stack s{make_driver()};
  reservation_manager& m = *s.mgr;
  driver& d = *s.drv;
  std::size_t g = s.drv->granularity();
  void* at(reservation_id id, std::size_t off = 0) { return static_cast<char*>(m.address(id)) + off; }
};

TEST_F(reservations, reserve_takes_no_physical_memory_and_materialize_takes_exactly_its_bytes) {
  s.pool->trim();
  const auto before = d.get_memory_info();
  auto id = m.reserve(64_GiB);
  EXPECT_EQ(d.get_memory_info().free_bytes, before.free_bytes) << "a 64 GiB reservation used physical memory";
  EXPECT_FALSE(m.is_backed(id, 0, g));
  const std::size_t n = 37 * g;  // not a power of two: several chunk classes
  m.materialize(id, 8 * g, n, fill_mode::zero);
  EXPECT_EQ(before.free_bytes - d.get_memory_info().free_bytes, n);
  EXPECT_TRUE(m.is_backed(id, 8 * g, n));
  EXPECT_FALSE(m.is_backed(id, 0, 9 * g));
  m.release(id, 8 * g, n, keep_mode::discard);
  EXPECT_EQ(before.free_bytes - d.get_memory_info().free_bytes, n) << "released chunks stay in the pool";
  s.pool->trim();
  EXPECT_EQ(d.get_memory_info().free_bytes, before.free_bytes);
  m.free(id);
}

TEST_F(reservations, address_is_stable_across_1000_cycles) {
  auto id = m.reserve(8 * g);
  void* const p = m.address(id);
  const auto creates_before = d.call_counts()[primitive::create];
  for (int i = 0; i < 1000; ++i) {
    m.materialize(id, 0, whole, fill_mode::undefined);
    ASSERT_EQ(m.address(id), p);
    ASSERT_TRUE(m.is_backed(id));
    m.release(id, 0, whole, keep_mode::discard);
    ASSERT_EQ(m.address(id), p);
  }
  // The pool served every cycle after the first.
  EXPECT_LE(d.call_counts()[primitive::create] - creates_before, 1u);
  m.free(id);
}

TEST_F(reservations, host_backup_restores_bit_exactly) {
  std::vector<reservation_id> ids;
  std::vector<std::vector<std::uint8_t>> data;
  for (int i = 0; i < 5; ++i) {
    const std::size_t bytes = (i + 1) * g + (i == 4 ? 12345 : 0);  // the last one ends mid-granule
    ids.push_back(m.reserve(bytes));
    m.materialize(ids.back(), 0, whole, fill_mode::undefined);
    data.push_back(random_bytes(bytes, 100 + i));
    upload(d, at(ids.back()), data.back());
  }
  std::vector<range> all;
  for (auto id : ids) all.push_back({id, 0, whole});
  m.release(all, keep_mode::host);
  EXPECT_EQ(m.stats().backed_bytes, 0u);
  EXPECT_GT(m.stats().backup_bytes, 0u);
  // Overwrite the physical chunks through another reservation, then restore.
  auto other = m.reserve(32 * g);
  m.materialize(other, 0, whole, fill_mode::undefined);
  upload(d, at(other), std::vector<std::uint8_t>(32 * g, 0xAB));
  m.release(other, 0, whole, keep_mode::discard);
  m.materialize(all, fill_mode::restore);
  d.synchronize_stream(nullptr);
  for (std::size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(download(d, at(ids[i]), data[i].size()), data[i]) << i;
  EXPECT_EQ(m.stats().backup_bytes, 0u);
  for (auto id : ids) m.free(id);
  m.free(other);
}

TEST_F(reservations, zero_fill_writes_zeros) {
  auto id = m.reserve(3 * g);
  m.materialize(id, 0, whole, fill_mode::undefined);
  upload(d, at(id), random_bytes(3 * g, 7));
  m.release(id, 0, whole, keep_mode::discard);
  m.materialize(id, 0, whole, fill_mode::zero);
  auto out = download(d, at(id), 3 * g);
  EXPECT_EQ(std::count(out.begin(), out.end(), 0), static_cast<long>(3 * g));
  m.free(id);
}

TEST_F(reservations, materialize_is_idempotent_and_sets_access_once_per_run) {
  auto id = m.reserve(16 * g);
  auto c0 = d.call_counts();
  m.materialize(id, 0, 5 * g, fill_mode::zero);  // 4 + 1 granules: two chunks, one run
  auto c1 = d.call_counts();
  EXPECT_EQ(c1[primitive::map] - c0[primitive::map], 2u);
  EXPECT_EQ(c1[primitive::set_access] - c0[primitive::set_access], 1u);
  m.materialize(id, 0, 5 * g, fill_mode::zero);  // no-op
  auto c2 = d.call_counts();
  EXPECT_EQ(c2[primitive::map], c1[primitive::map]);
  EXPECT_EQ(c2[primitive::set_access], c1[primitive::set_access]);
  // A range that overlaps backed granules backs only the rest: one more run.
  m.materialize(id, 3 * g, 4 * g, fill_mode::zero);
  auto c3 = d.call_counts();
  EXPECT_EQ(c3[primitive::set_access] - c2[primitive::set_access], 1u);
  EXPECT_TRUE(m.is_backed(id, 0, 7 * g));
  EXPECT_EQ(m.info(id).backed_bytes, 7 * g);
  m.free(id);
}

TEST_F(reservations, releasing_inside_a_chunk_splits_it_and_keeps_the_rest) {
  auto id = m.reserve(8 * g);
  m.materialize(id, 0, whole, fill_mode::undefined);  // one 8-granule chunk
  auto data = random_bytes(8 * g, 11);
  upload(d, at(id), data);
  m.release(id, 3 * g, 2 * g, keep_mode::host);
  EXPECT_EQ(m.stats().splits, 2u);
  auto backed = m.backed_granules(id);
  EXPECT_EQ(backed, (std::vector<bool>{true, true, true, false, false, true, true, true}));
  auto left = download(d, at(id), 3 * g);
  auto right = download(d, at(id, 5 * g), 3 * g);
  EXPECT_TRUE(std::equal(left.begin(), left.end(), data.begin()));
  EXPECT_TRUE(std::equal(right.begin(), right.end(), data.begin() + 5 * g));
  m.materialize(id, 3 * g, 2 * g, fill_mode::restore);
  EXPECT_EQ(download(d, at(id), 8 * g), data);
  m.free(id);
}

TEST_F(reservations, partial_restore_keeps_the_rest_of_the_backup) {
  auto id = m.reserve(4 * g);
  m.materialize(id, 0, whole, fill_mode::undefined);
  auto data = random_bytes(4 * g, 12);
  upload(d, at(id), data);
  m.release(id, 0, whole, keep_mode::host);
  m.materialize(id, g, g, fill_mode::restore);
  EXPECT_EQ(m.info(id).backup_bytes, 3 * g);
  m.materialize(id, 0, whole, fill_mode::restore);
  EXPECT_EQ(download(d, at(id), 4 * g), data);
  EXPECT_EQ(m.info(id).backup_bytes, 0u);
  m.free(id);
}

TEST_F(reservations, find_maps_pointers_to_reservations) {
  auto a = m.reserve(3 * g);
  auto b = m.reserve(g);
  EXPECT_EQ(m.find(at(a, 2 * g + 5)), a);
  EXPECT_EQ(m.find(at(b)), b);
  EXPECT_FALSE(m.find(reinterpret_cast<void*>(16)).has_value());
  m.free(a);
  m.free(b);
}

// Each bad input gets its typed error and leaves the manager as it was.
TEST_F(reservations, bad_input_table) {
  auto id = m.reserve(4 * g);
  m.materialize(id, 0, 2 * g, fill_mode::zero);
  const auto before = m.stats();
  const auto calls = d.call_counts();
  struct row {
    const char* what;
    std::function<void()> call;
    bool state_error;
  };
  const reservation_id unknown = 987654;
  const std::vector<row> table = {
      {"zero size", [&] { m.reserve(0); }, false},
      {"absurd size", [&] { m.reserve(std::size_t{1} << 60); }, false},
      {"unknown handle (materialize)", [&] { m.materialize(unknown, 0, g, fill_mode::zero); }, false},
      {"unknown handle (release)", [&] { m.release(unknown, 0, g, keep_mode::discard); }, false},
      {"unknown handle (free)", [&] { m.free(unknown); }, false},
      {"misaligned offset", [&] { m.materialize(id, 1, g, fill_mode::zero); }, false},
      {"misaligned length", [&] { m.materialize(id, 0, g + 1, fill_mode::zero); }, false},
      {"zero length", [&] { m.release(id, 0, 0, keep_mode::discard); }, false},
      {"offset out of range", [&] { m.materialize(id, 4 * g, g, fill_mode::zero); }, false},
      {"length out of range", [&] { m.materialize(id, 2 * g, 3 * g, fill_mode::zero); }, false},
      {"overflowing range", [&] { m.release(id, g, whole - 1, keep_mode::discard); }, false},
      {"overlapping batch", [&] {
         std::vector<range> rs{{id, 2 * g, 2 * g}, {id, 3 * g, g}};
         m.materialize(rs, fill_mode::zero);
       }, false},
      {"restore without a backup", [&] { m.materialize(id, 2 * g, 2 * g, fill_mode::restore); }, true},
      {"record_stream on unknown handle", [&] { m.record_stream(unknown, nullptr); }, false},
      {"info of unknown handle", [&] { m.info(unknown); }, false},
  };
  for (const auto& r : table) {
    if (r.state_error) EXPECT_THROW(r.call(), invalid_state) << r.what;
    else EXPECT_THROW(r.call(), invalid_argument) << r.what;
    const auto now = m.stats();
    EXPECT_EQ(now.backed_bytes, before.backed_bytes) << r.what;
    EXPECT_EQ(now.reserved_bytes, before.reserved_bytes) << r.what;
    EXPECT_EQ(now.reservations, before.reservations) << r.what;
    EXPECT_EQ(d.call_counts().calls, calls.calls) << r.what;
  }
  m.free(id);
  EXPECT_THROW(m.free(id), invalid_argument) << "double free";
}

// release_after waits for the caller's event only; the range is unbacked afterwards.
TEST_F(reservations, release_after_an_event) {
  auto id = m.reserve(4 * g);
  m.materialize(id, 0, whole, fill_mode::zero, nullptr);
  stream_t s = d.create_stream();
  event_t e = d.create_event();
  d.zero_async(m.address(id), 4 * g, s);
  d.record(e, s);
  std::vector<range> rs{{id, 0, 2 * g}};
  m.release_after(rs, keep_mode::discard, e);
  EXPECT_EQ(m.backed_granules(id), (std::vector<bool>{false, false, true, true}));
  std::vector<range> null_event{{id, 2 * g, 2 * g}};
  EXPECT_THROW(m.release_after(null_event, keep_mode::discard, nullptr), invalid_argument);
  d.destroy_event(e);
  d.destroy_stream(s);
  m.free(id);
}
