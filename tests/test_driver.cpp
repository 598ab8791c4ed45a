// Driver conformance: the primitives behave alike on the host and CUDA drivers.
#include <sys/mman.h>

#include "common.hpp"
#include "core/driver/fault_driver.hpp"

using namespace deferalloc;
using namespace dfa_test;

class driver_conformance : public ::testing::Test {
 protected:
  std::shared_ptr<driver> d = make_driver();
};

TEST_F(driver_conformance, granularity_is_a_power_of_two) {
  const std::size_t g = d->granularity();
  EXPECT_GT(g, 0u);
  EXPECT_EQ(g & (g - 1), 0u);
}

TEST_F(driver_conformance, contents_survive_unmap_and_remap) {
  const std::size_t g = d->granularity();
  auto va = d->reserve(4 * g, g);
  ASSERT_NE(va, 0u);
  EXPECT_EQ(va % g, 0u);
  auto h = d->create(2 * g);
  d->map(va, 2 * g, h);
  d->set_access(va, 2 * g);
  auto data = random_bytes(2 * g, 1);
  upload(*d, reinterpret_cast<void*>(va), data);
  d->unmap(va, 2 * g);
  // Map the same chunk at another place of the reservation: same bytes.
  d->map(va + 2 * g, 2 * g, h);
  d->set_access(va + 2 * g, 2 * g);
  EXPECT_EQ(download(*d, reinterpret_cast<void*>(va + 2 * g), 2 * g), data);
  d->unmap(va + 2 * g, 2 * g);
  d->release(h);
  d->free_reservation(va, 4 * g);
  auto c = d->call_counts();
  EXPECT_EQ(c[primitive::map], 2u);
  EXPECT_EQ(c[primitive::set_access], 2u);
  EXPECT_EQ(c[primitive::unmap], 2u);
}

TEST_F(driver_conformance, unmap_must_cover_whole_mappings) {
  const std::size_t g = d->granularity();
  auto va = d->reserve(2 * g, g);
  auto h = d->create(2 * g);
  d->map(va, 2 * g, h);
  EXPECT_ANY_THROW(d->unmap(va, g));
  d->unmap(va, 2 * g);
  d->release(h);
  d->free_reservation(va, 2 * g);
}

TEST_F(driver_conformance, create_uses_memory_and_release_returns_it) {
  const std::size_t g = d->granularity();
  const auto before = d->get_memory_info();
  auto h = d->create(16 * g);
  const auto during = d->get_memory_info();
  d->release(h);
  const auto after = d->get_memory_info();
  EXPECT_EQ(before.total_bytes, during.total_bytes);
  EXPECT_EQ(before.free_bytes - during.free_bytes, 16 * g);
  EXPECT_EQ(after.free_bytes, before.free_bytes);
}

TEST_F(driver_conformance, stream_ordered_copy_and_zero) {
  const std::size_t g = d->granularity();
  auto va = d->reserve(g, g);
  auto h = d->create(g);
  d->map(va, g, h);
  d->set_access(va, g);
  // An ordinary stream and a priority one (the optimizer's kernels) behave alike.
  for (stream_t s : {d->create_stream(), d->create_priority_stream()}) {
    event_t e = d->create_event();
    auto data = random_bytes(g, 2);
    d->copy_async(reinterpret_cast<void*>(va), data.data(), g, s);
    d->zero_async(reinterpret_cast<void*>(va), g / 2, s);
    d->record(e, s);
    d->synchronize(e);
    EXPECT_TRUE(d->query(e));
    auto out = download(*d, reinterpret_cast<void*>(va), g);
    EXPECT_EQ(std::count(out.begin(), out.begin() + g / 2, 0), static_cast<long>(g / 2));
    EXPECT_TRUE(std::equal(out.begin() + g / 2, out.end(), data.begin() + g / 2));
    d->destroy_event(e);
    d->destroy_stream(s);
  }
  d->unmap(va, g);
  d->release(h);
  d->free_reservation(va, g);
}

// A touch of an unbacked granule faults, as a kernel's access would on the GPU.
TEST(host_driver_death, touching_unbacked_memory_faults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto d = make_host_driver({64_KiB, 64_MiB});
  auto va = d->reserve(2 * 64_KiB, 64_KiB);
  EXPECT_DEATH(*reinterpret_cast<volatile char*>(va) = 1, "");
  auto h = d->create(64_KiB);
  d->map(va, 64_KiB, h);
  // Mapped but no access yet: still faults.
  EXPECT_DEATH(*reinterpret_cast<volatile char*>(va) = 1, "");
  d->set_access(va, 64_KiB);
  *reinterpret_cast<volatile char*>(va) = 1;
  d->unmap(va, 64_KiB);
  EXPECT_DEATH(*reinterpret_cast<volatile char*>(va) = 1, "");
  d->release(h);
  d->free_reservation(va, 2 * 64_KiB);
}

TEST(host_driver, capacity_makes_out_of_memory_reachable) {
  auto d = make_host_driver({64_KiB, 4 * 64_KiB});
  auto a = d->create(3 * 64_KiB);
  EXPECT_THROW(d->create(2 * 64_KiB), out_of_memory);
  auto b = d->create(64_KiB);
  d->release(a);
  d->release(b);
}

TEST(fault_driver, fails_the_nth_call) {
  auto f = std::make_shared<fault_driver>(make_host_driver({64_KiB, 64_MiB}));
  f->fail_nth(primitive::create, 2);
  auto a = f->create(64_KiB);
  EXPECT_THROW(f->create(64_KiB), out_of_memory);
  auto b = f->create(64_KiB);
  EXPECT_EQ(f->fired(), 1u);
  f->release(a);
  f->release(b);
  f->fail_nth(primitive::map, 1);
  auto va = f->reserve(64_KiB, 64_KiB);
  auto h = f->create(64_KiB);
  EXPECT_THROW(f->map(va, 64_KiB, h), cuda_error);
  f->release(h);
  f->free_reservation(va, 64_KiB);
  // Copies: the second throws, the others copy.
  char src[4] = {1, 2, 3, 4}, dst[4] = {};
  f->fail_nth_copy(2);
  f->copy_async(dst, src, 2, nullptr);
  EXPECT_THROW(f->copy_async(dst + 2, src + 2, 2, nullptr), cuda_error);
  f->copy_async(dst + 2, src + 2, 2, nullptr);
  f->synchronize_stream(nullptr);
  EXPECT_EQ(std::memcmp(dst, src, 4), 0);
  EXPECT_EQ(f->fired(), 3u);
}

// driver::kind() tells what a driver is, also through a wrapper whose name differs.
TEST(fault_driver, reports_the_inner_kind) {
  auto h = make_host_driver({64_KiB, 64_MiB});
  EXPECT_EQ(h->kind(), driver_kind::host);
  fault_driver f(h);
  EXPECT_EQ(f.name(), "fault(host)");
  EXPECT_EQ(f.kind(), driver_kind::host);
  fault_driver ff(std::make_shared<fault_driver>(h));
  EXPECT_EQ(ff.kind(), driver_kind::host);
  if (driver_name() == "cuda") EXPECT_EQ(fault_driver(make_driver()).kind(), driver_kind::cuda);
}

// Shareable chunks (Note [Shareable chunks]): the host driver's never are; on CUDA,
// `none` never asks for a handle type, `posix_fd` either gets one or refuses, and a
// chunk created and mapped under each holds data (the handle type changes nothing else).
TEST(shareable_handles, as_the_setting_says) {
  EXPECT_FALSE(make_host_driver({64_KiB, 64_MiB})->shareable());
  EXPECT_FALSE(fault_driver(make_host_driver({64_KiB, 64_MiB})).shareable());
  if (driver_name() != "cuda") GTEST_SKIP() << "the handle types need the CUDA driver (DFA_TEST_DRIVER=cuda)";
  EXPECT_FALSE(make_cuda_driver(0, shareable_handle::none)->shareable());
  std::shared_ptr<driver> fd;
  try {
    fd = make_cuda_driver(0, shareable_handle::posix_fd);
  } catch (const invalid_argument& e) {
    GTEST_SKIP() << "device 0 has no POSIX fd handles: " << e.what();
  }
  EXPECT_TRUE(fd->shareable());
  EXPECT_TRUE(make_cuda_driver(0)->shareable()) << "auto asks for POSIX fd handles where the device supports them";
  for (const auto& d : {fd, make_cuda_driver(0, shareable_handle::none)}) {
    const std::size_t g = d->granularity();
    const auto va = d->reserve(g, g);
    const auto h = d->create(g);
    d->map(va, g, h);
    d->set_access(va, g);
    std::vector<std::uint8_t> in = random_bytes(4096, 7), out(4096);
    d->copy_async(reinterpret_cast<void*>(va), in.data(), in.size(), nullptr);
    d->copy_async(out.data(), reinterpret_cast<void*>(va), out.size(), nullptr);
    d->synchronize_stream(nullptr);
    EXPECT_EQ(in, out);
    d->unmap(va, g);
    d->release(h);
    d->free_reservation(va, g);
  }
}

// Streams and events are distinct types: swapped arguments, or a raw pointer where a
// handle is expected, do not compile (checked here at compile time).
template <class D>
concept records_swapped = requires(D& d, stream_t s, event_t e) { d.record(s, e); };
template <class D>
concept waits_swapped = requires(D& d, stream_t s, event_t e) { d.stream_wait(e, s); };
static_assert(!records_swapped<driver>);
static_assert(!waits_swapped<driver>);
static_assert(!std::is_convertible_v<stream_t, event_t> && !std::is_convertible_v<event_t, stream_t>);
static_assert(!std::is_convertible_v<void*, stream_t> && std::is_convertible_v<std::nullptr_t, stream_t>);

TEST(typed_handles, keep_the_native_pointer) {
  int x = 0;
  const stream_t s{&x};
  EXPECT_EQ(s.get(), &x);
  EXPECT_TRUE(static_cast<bool>(s));
  EXPECT_EQ(stream_t{}, nullptr);
  EXPECT_NE(s, stream_t{});
  EXPECT_EQ(std::hash<stream_t>{}(s), std::hash<void*>{}(&x));
}
