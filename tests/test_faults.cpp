// Fault injection at every driver call of materialize, release and reserve: each
// failure must leave the reservations exactly as before (same backed granules, same
// backups, same bytes), leak no chunk (pool accounting equals driver accounting), and
// the same call must succeed once the fault is gone.
#include "common.hpp"
#include "core/driver/fault_driver.hpp"

using namespace deferalloc;
using namespace dfa_test;

namespace {

struct world {
  std::shared_ptr<fault_driver> f;
  std::unique_ptr<stack> s;
  std::size_t g = 0;
  std::size_t free0 = 0;  // device free bytes with an empty pool
  std::vector<reservation_id> ids;
  std::vector<std::vector<std::uint8_t>> data;

  world() {
    f = std::make_shared<fault_driver>(make_driver());
    s = std::make_unique<stack>(f);
    g = f->granularity();
    free0 = f->get_memory_info().free_bytes;
    auto& m = *s->mgr;
    const std::size_t sizes[] = {6 * g, 3 * g, 9 * g, 7 * g};
    for (int i = 0; i < 4; ++i) {
      ids.push_back(m.reserve(sizes[i]));
      data.push_back(random_bytes(sizes[i], 40 + i));
      if (i == 3) continue;  // r3 stays unbacked
      m.materialize(ids[i], 0, whole, fill_mode::undefined);
      upload(*f, m.address(ids[i]), data[i]);
    }
    m.release(ids[1], 0, whole, keep_mode::host);  // r1 saved in a host backup
  }

  struct snapshot {
    std::vector<std::vector<bool>> backed;
    std::vector<std::size_t> backup;
    std::size_t reservations;
  };
  snapshot snap() const {
    snapshot x;
    for (auto id : ids) {
      x.backed.push_back(s->mgr->backed_granules(id));
      x.backup.push_back(s->mgr->info(id).backup_bytes);
    }
    x.reservations = s->mgr->stats().reservations;
    return x;
  }

  // No chunk leaked: every chunk taken from the pool is mapped, and the pool's count of
  // live chunks is what the driver sees.
  void verify_accounting(const std::string& where) {
    auto st = s->mgr->stats();
    EXPECT_EQ(st.pool.taken_bytes, st.backed_bytes) << where << ": chunks taken but not mapped (leak)";
    EXPECT_EQ(free0 - f->get_memory_info().free_bytes, st.pool.alive_bytes) << where << ": driver and pool disagree";
  }

  // Nothing changed, and everything that was backed or saved still holds its bytes.
  void verify(const snapshot& before, const std::string& where) {
    auto& m = *s->mgr;
    auto now = snap();
    EXPECT_EQ(now.backed, before.backed) << where;
    EXPECT_EQ(now.backup, before.backup) << where;
    EXPECT_EQ(now.reservations, before.reservations) << where;
    verify_accounting(where);
    f->clear();
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (before.backup[i] > 0) m.materialize(ids[i], 0, whole, fill_mode::restore);
      auto b = m.backed_granules(ids[i]);
      for (std::size_t gi = 0; gi < b.size(); ++gi) {
        if (!b[gi]) continue;  // an unbacked granule would fault
        const std::size_t lo = gi * g, hi = std::min(data[i].size(), lo + g);
        auto out = download(*f, static_cast<char*>(m.address(ids[i])) + lo, hi - lo);
        EXPECT_TRUE(std::equal(out.begin(), out.end(), data[i].begin() + lo))
            << where << ": reservation " << i << " granule " << gi << " lost its contents";
      }
    }
  }
};

using scenario = std::function<void(world&)>;

void run_all_faults(const char* name, const scenario& op) {
  const primitive prims[] = {primitive::reserve, primitive::create, primitive::map, primitive::set_access,
                             primitive::unmap, primitive::host_alloc};
  int fired_total = 0;
  for (primitive p : prims) {
    for (std::uint64_t n = 1;; ++n) {
      world w;
      auto before = w.snap();
      w.f->fail_nth(p, n);
      bool threw = false;
      try {
        op(w);
      } catch (const error&) {
        threw = true;
      }
      const std::string where = std::string(name) + ": fault at call " + std::to_string(n) + " of " + to_string(p);
      if (w.f->fired() == 0) {
        EXPECT_FALSE(threw) << where;
        w.f->clear();
        break;  // the scenario makes fewer than n calls of p
      }
      ++fired_total;
      if (!threw) {
        // Only an out-of-memory from create may be absorbed: the pool falls back to
        // smaller chunk classes, and the call succeeds.
        EXPECT_EQ(p, primitive::create) << where << ": the injected fault was swallowed";
        w.verify_accounting(where + " (absorbed)");
        continue;
      }
      w.verify(before, where);
      // Once the fault is gone the same call succeeds.
      EXPECT_NO_THROW(op(w)) << where;
      ASSERT_LT(n, 64u) << where;
    }
  }
  EXPECT_GT(fired_total, 0) << name << ": no fault was ever injected";
  std::printf("%s: %d injected faults rolled back\n", name, fired_total);
}

}  // namespace

TEST(faults, materialize_restore_batch) {
  run_all_faults("materialize(restore)", [](world& w) {
    std::vector<range> rs{{w.ids[1], 0, whole}, {w.ids[0], 0, whole}};
    w.s->mgr->materialize(rs, fill_mode::restore);
  });
}

TEST(faults, materialize_zero_multi_chunk) {
  run_all_faults("materialize(zero)", [](world& w) {
    std::vector<range> rs{{w.ids[3], 0, whole}, {w.ids[2], 0, whole}};
    w.s->mgr->materialize(rs, fill_mode::zero);
  });
}

TEST(faults, release_with_backup_and_split) {
  run_all_faults("release(host)", [](world& w) {
    std::vector<range> rs{{w.ids[0], w.g, 3 * w.g}, {w.ids[2], 0, whole}};
    w.s->mgr->release(rs, keep_mode::host);
  });
}

TEST(faults, release_discard) {
  run_all_faults("release(discard)", [](world& w) {
    std::vector<range> rs{{w.ids[0], 0, 2 * w.g}, {w.ids[2], 4 * w.g, 2 * w.g}};
    w.s->mgr->release(rs, keep_mode::discard);
  });
}

TEST(faults, reserve) {
  run_all_faults("reserve", [](world& w) {
    auto id = w.s->mgr->reserve(5 * w.g);
    w.s->mgr->free(id);
  });
}

// The caching allocator's way of giving memory back: whole chunks only, rolled back as
// release() is (the chunk cut by the first range stays mapped, untouched).
TEST(faults, release_whole_chunks_with_backup) {
  run_all_faults("release_whole_chunks(host)", [](world& w) {
    std::vector<range> rs{{w.ids[0], w.g, 5 * w.g}, {w.ids[2], 0, whole}};
    const auto done = w.s->mgr->release_whole_chunks(rs, keep_mode::host);
    EXPECT_EQ(w.s->mgr->stats().splits, 0u);
    EXPECT_FALSE(done.empty());
  });
}

// Each half of the driver is wrapped on its own: a pool on a fault_vmm and a manager whose
// streams are a fault_streams (both over one driver).  A failed map and a failed backup
// copy each leave the reservation as it was, and the same calls succeed afterwards.
TEST(faults, each_half_wrapped_on_its_own) {
  auto d = make_driver();
  auto v = std::make_shared<fault_vmm>(d);
  auto st = std::make_shared<fault_streams>(d);
  reservation_manager m(std::make_shared<chunk_pool>(v), st);
  const std::size_t g = v->granularity();
  auto id = m.reserve(4 * g);
  v->fail_nth(primitive::map, 1);
  EXPECT_THROW(m.materialize(id, 0, whole, fill_mode::zero), cuda_error);
  EXPECT_EQ(v->fired(), 1u);
  EXPECT_TRUE(m.backed_ranges(id).empty());
  m.materialize(id, 0, whole, fill_mode::undefined);
  const auto data = random_bytes(4 * g, 7);
  upload(*d, m.address(id), data);
  st->fail_nth_copy(1);
  EXPECT_THROW(m.release(id, 0, whole, keep_mode::host), cuda_error);  // the backup copy
  EXPECT_EQ(st->fired(), 1u);
  EXPECT_TRUE(m.is_backed(id));
  EXPECT_EQ(m.info(id).backup_bytes, 0u);
  EXPECT_EQ(download(*d, m.address(id), 4 * g), data);
  m.release(id, 0, whole, keep_mode::host);
  m.materialize(id, 0, whole, fill_mode::restore);
  EXPECT_EQ(download(*d, m.address(id), 4 * g), data);
  m.free(id);
}

// The pool's VMM half and the manager's streams serve one device: halves of two drivers
// are refused.
TEST(faults, halves_of_two_drivers_are_refused) {
  auto a = make_driver();
  auto b = std::make_shared<fault_driver>(a);  // a driver of its own over `a`
  EXPECT_THROW(reservation_manager(std::make_shared<chunk_pool>(a), b), invalid_argument);
  EXPECT_NO_THROW(reservation_manager(std::make_shared<chunk_pool>(b), b));
}
