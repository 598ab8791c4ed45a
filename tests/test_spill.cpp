// dfa_spill_save / dfa_spill_load (Note [Disk spills] in allocator/core/files/spill.cpp)
// through the C ABI, on the driver under test: round trips bit for bit with chunks
// smaller and larger than a range, a corrupted, truncated or swapped file refused before
// wrong bytes count, mismatched ranges, a killed writer's temporary file never taken for
// a spill, the directory and file checks, a full disk leaving no file, a header's count
// refused before it sizes a buffer, the page cache dropped after a save and a load.
#include <deferalloc/deferalloc.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "common.hpp"

using namespace dfa_test;

namespace {

class Spill : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string conf = "driver:" + driver_name() + (driver_name() == "host" ? ",host_granularity_kb:64" : "");
    ASSERT_EQ(dfa_init(conf.c_str()), DFA_SUCCESS) << dfa_last_error();
    drv = make_driver();
  }
  void TearDown() override { EXPECT_EQ(dfa_shutdown(), DFA_SUCCESS); }

  // A backed reservation of `bytes` filled with random bytes of `seed`.
  void* range(std::size_t bytes, std::uint64_t seed) {
    dfa_reservation r = 0;
    void* p = nullptr;
    EXPECT_EQ(dfa_reserve(bytes, &r, &p), DFA_SUCCESS) << dfa_last_error();
    EXPECT_EQ(dfa_materialize(r, 0, DFA_WHOLE, DFA_FILL_ZERO, nullptr), DFA_SUCCESS) << dfa_last_error();
    upload(*drv, p, random_bytes(bytes, seed));
    return p;
  }
  void scribble(void* p, std::size_t bytes) { upload(*drv, p, std::vector<std::uint8_t>(bytes, 0xEE)); }
  bool holds(void* p, std::size_t bytes, std::uint64_t seed) { return download(*drv, p, bytes) == random_bytes(bytes, seed); }

  dfa_status save(const std::string& path, std::vector<void*> ptrs, std::vector<size_t> sizes, size_t chunk) {
    return dfa_spill_save(path.c_str(), -1, ptrs.size(), ptrs.data(), sizes.data(), chunk, nullptr);
  }
  dfa_status load(const std::string& path, std::vector<void*> ptrs, std::vector<size_t> sizes, size_t chunk) {
    return dfa_spill_load(path.c_str(), -1, ptrs.size(), ptrs.data(), sizes.data(), chunk, nullptr);
  }
  static std::vector<std::string> entries(const std::string& dir) {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(dir)) out.push_back(e.path().filename().string());
    return out;
  }
  static void flip_byte(const std::string& path, std::uint64_t off) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(off));
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x01);
    f.seekp(static_cast<std::streamoff>(off));
    f.write(&c, 1);
  }

  std::shared_ptr<deferalloc::driver> drv;
  temp_dir dir;
};

TEST_F(Spill, RoundTripsWithChunksSmallerAndLargerThanARange) {
  const std::size_t a = 3_MiB + 12345, b = 100, c = 1_MiB;  // a tail shorter than a block, a tiny range
  void* pa = range(a, 1);
  void* pb = range(b, 2);
  void* pc = range(c, 3);
  for (std::size_t chunk : {std::size_t{1}, 64_KiB, 1_MiB, 256_MiB}) {
    const std::string path = dir.path + "/s" + std::to_string(chunk);
    ASSERT_EQ(save(path, {pa, pb, pc}, {a, b, c}, chunk), DFA_SUCCESS) << dfa_last_error();
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_EQ(entries(dir.path).size(), 1u) << "a temporary file stayed";
    scribble(pa, a);
    scribble(pb, b);
    scribble(pc, c);
    for (std::size_t load_chunk : {std::size_t{64_KiB}, std::size_t{4_MiB}}) {  // any staging size reads it
      ASSERT_EQ(load(path, {pa, pb, pc}, {a, b, c}, load_chunk), DFA_SUCCESS) << dfa_last_error();
      EXPECT_TRUE(holds(pa, a, 1) && holds(pb, b, 2) && holds(pc, c, 3)) << chunk << " " << load_chunk;
    }
    scribble(pa, a);  // a range at null (a segment freed meanwhile): verified, not copied
    ASSERT_EQ(load(path, {nullptr, pb, pc}, {a, b, c}, 1_MiB), DFA_SUCCESS) << dfa_last_error();
    EXPECT_EQ(download(*drv, pa, a), std::vector<std::uint8_t>(a, 0xEE));
    EXPECT_TRUE(holds(pb, b, 2) && holds(pc, c, 3));
    upload(*drv, pa, random_bytes(a, 1));
    std::filesystem::remove(path);
  }
  ASSERT_EQ(save(dir.path + "/empty", {}, {}, 1_MiB), DFA_SUCCESS) << dfa_last_error();  // no ranges: a header
  EXPECT_EQ(load(dir.path + "/empty", {}, {}, 1_MiB), DFA_SUCCESS) << dfa_last_error();
}

TEST_F(Spill, ACorruptedBlockIsRefusedNamingTheFileAndOffset) {
  const std::size_t a = 512_KiB;
  void* pa = range(a, 7);
  const std::string path = dir.path + "/s";
  ASSERT_EQ(save(path, {pa}, {a}, 128_KiB), DFA_SUCCESS) << dfa_last_error();
  // The data begins at 4096 (one header page); flip a byte of the third block.
  flip_byte(path, 4096 + 2 * 64_KiB + 10);
  scribble(pa, a);
  EXPECT_EQ(load(path, {pa}, {a}, 64_KiB), DFA_ERROR_CORRUPT);
  const std::string msg = dfa_last_error();
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("data offset 131072"), std::string::npos) << msg;
  // The blocks before it were verified; the corrupted block never reached the range.
  const auto got = download(*drv, pa, a);
  const auto want = random_bytes(a, 7);
  EXPECT_TRUE(std::equal(got.begin(), got.begin() + 128_KiB, want.begin()));
  EXPECT_TRUE(std::all_of(got.begin() + 128_KiB, got.end(), [](std::uint8_t v) { return v == 0xEE; }));
  flip_byte(path, 4096 + 2 * 64_KiB + 10);  // repaired: loads
  EXPECT_EQ(load(path, {pa}, {a}, 64_KiB), DFA_SUCCESS) << dfa_last_error();
  EXPECT_TRUE(holds(pa, a, 7));
  flip_byte(path, 20);  // the header
  EXPECT_EQ(load(path, {pa}, {a}, 64_KiB), DFA_ERROR_CORRUPT);
  EXPECT_NE(std::string(dfa_last_error()).find("header"), std::string::npos) << dfa_last_error();
  flip_byte(path, 20);
  flip_byte(path, std::filesystem::file_size(path) - 3);  // the table's checksum
  EXPECT_EQ(load(path, {pa}, {a}, 64_KiB), DFA_ERROR_CORRUPT);
  EXPECT_NE(std::string(dfa_last_error()).find("checksum table"), std::string::npos) << dfa_last_error();
}

TEST_F(Spill, TruncatedOrForeignFilesAreCorruptBeforeAnyCopy) {
  const std::size_t a = 256_KiB;
  void* pa = range(a, 9);
  const std::string path = dir.path + "/s";
  ASSERT_EQ(save(path, {pa}, {a}, 64_KiB), DFA_SUCCESS) << dfa_last_error();
  scribble(pa, a);
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 100);
  EXPECT_EQ(load(path, {pa}, {a}, 64_KiB), DFA_ERROR_CORRUPT);
  EXPECT_NE(std::string(dfa_last_error()).find("truncated"), std::string::npos) << dfa_last_error();
  EXPECT_NE(std::string(dfa_last_error()).find(path), std::string::npos) << dfa_last_error();
  std::filesystem::resize_file(path, 10);
  EXPECT_EQ(load(path, {pa}, {a}, 64_KiB), DFA_ERROR_CORRUPT);
  const auto got = download(*drv, pa, a);
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](std::uint8_t v) { return v == 0xEE; }))
      << "a truncated file reached the range";
  { std::ofstream(dir.path + "/foreign") << std::string(8192, 'x'); }
  EXPECT_EQ(load(dir.path + "/foreign", {pa}, {a}, 64_KiB), DFA_ERROR_CORRUPT);
  EXPECT_NE(std::string(dfa_last_error()).find("not a deferalloc disk spill"), std::string::npos) << dfa_last_error();
}

// The pages of `path` in the page cache (mincore of a mapping, which faults nothing in).
std::size_t cached_pages(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  const auto bytes = static_cast<std::size_t>(std::filesystem::file_size(path));
  void* m = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) return 0;
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in((bytes + page - 1) / page);
  const int rc = ::mincore(m, bytes, in.data());
  ::munmap(m, bytes);
  if (rc != 0) return 0;
  return static_cast<std::size_t>(std::count_if(in.begin(), in.end(), [](unsigned char v) { return (v & 1) != 0; }));
}

TEST_F(Spill, ThePageCacheIsDroppedAfterASaveAndALoad) {
  const std::size_t a = 1_MiB;
  void* pa = range(a, 5);
  const std::string path = dir.path + "/s";
  ASSERT_EQ(save(path, {pa}, {a}, 256_KiB), DFA_SUCCESS) << dfa_last_error();
  EXPECT_EQ(cached_pages(path), 0u) << "the page cache kept the file after the save";
  {
    std::ifstream f(path, std::ios::binary);  // read in through the cache
    std::vector<char> all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  }
  if (cached_pages(path) == 0) GTEST_SKIP() << "the file system of " << dir.path << " keeps no page cache";
  ASSERT_EQ(load(path, {pa}, {a}, 256_KiB), DFA_SUCCESS) << dfa_last_error();
  EXPECT_TRUE(holds(pa, a, 5));
  EXPECT_EQ(cached_pages(path), 0u) << "the page cache kept the file after the load";
}

TEST_F(Spill, AHeadersCountIsCheckedBeforeItSizesABuffer) {
  const std::size_t a = 256_KiB;
  void* pa = range(a, 11);
  const std::string path = dir.path + "/s";
  ASSERT_EQ(save(path, {pa}, {a}, 64_KiB), DFA_SUCCESS) << dfa_last_error();
  // A count that the file's size allows but the data's offset does not match: refused from
  // the fixed header, before a buffer of that many sizes is read and checksummed.
  std::uint64_t count = 1000;
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(16);  // magic (8), version (4), block bytes (4), then the count
    f.write(reinterpret_cast<const char*>(&count), sizeof count);
  }
  EXPECT_EQ(load(path, {pa}, {a}, 64_KiB), DFA_ERROR_CORRUPT);
  const std::string msg = dfa_last_error();
  EXPECT_NE(msg.find("has a damaged header"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("checksum mismatch"), std::string::npos) << "the count sized a buffer first: " << msg;
}

TEST_F(Spill, RangesOtherThanTheFilesAreRefused) {
  void* pa = range(128_KiB, 1);
  void* pb = range(128_KiB, 2);
  const std::string path = dir.path + "/s";
  ASSERT_EQ(save(path, {pa, pb}, {128_KiB, 64_KiB}, 64_KiB), DFA_SUCCESS) << dfa_last_error();
  EXPECT_EQ(load(path, {pa}, {128_KiB}, 64_KiB), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dfa_last_error()).find("holds 2 ranges, 1 given"), std::string::npos) << dfa_last_error();
  EXPECT_EQ(load(path, {pa, pb}, {128_KiB, 128_KiB}, 64_KiB), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dfa_last_error()).find("holds 65536 bytes for range 1, 131072 given"), std::string::npos)
      << dfa_last_error();
  EXPECT_NE(std::string(dfa_last_error()).find(path), std::string::npos) << dfa_last_error();
  EXPECT_EQ(load(path, {pa, pb}, {128_KiB, 64_KiB}, 0), DFA_ERROR_INVALID_ARGUMENT);  // chunk 0
  EXPECT_EQ(save(path, {nullptr}, {64_KiB}, 64_KiB), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(dfa_spill_save(path.c_str(), -1, 1, nullptr, nullptr, 64_KiB, nullptr), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(dfa_spill_load(nullptr, -1, 0, nullptr, nullptr, 64_KiB, nullptr), DFA_ERROR_INVALID_ARGUMENT);
}

TEST_F(Spill, AKilledWritersTemporaryFileIsNoSpill) {
  void* pa = range(128_KiB, 4);
  const std::string path = dir.path + "/s";
  // What a writer killed before its rename leaves: a temporary file, no final name.
  ASSERT_EQ(save(path, {pa}, {128_KiB}, 64_KiB), DFA_SUCCESS) << dfa_last_error();
  std::filesystem::rename(path, path + ".tmp-0123456789abcdef");
  std::filesystem::resize_file(path + ".tmp-0123456789abcdef", 5000);
  EXPECT_EQ(load(path, {pa}, {128_KiB}, 64_KiB), DFA_ERROR_IO);
  EXPECT_NE(std::string(dfa_last_error()).find("cannot open " + path), std::string::npos) << dfa_last_error();
  // A new save beside it writes its own temporary file and publishes whole.
  ASSERT_EQ(save(path, {pa}, {128_KiB}, 64_KiB), DFA_SUCCESS) << dfa_last_error();
  scribble(pa, 128_KiB);
  ASSERT_EQ(load(path, {pa}, {128_KiB}, 64_KiB), DFA_SUCCESS) << dfa_last_error();
  EXPECT_TRUE(holds(pa, 128_KiB, 4));
}

TEST_F(Spill, DirectoriesAndFilesAreChecked) {
  void* pa = range(64_KiB, 5);
  int in_memory = -1;
  const std::string sub = dir.path + "/made";
  ASSERT_EQ(dfa_spill_check_dir(sub.c_str(), &in_memory), DFA_SUCCESS) << dfa_last_error();
  struct stat st {};
  ASSERT_EQ(::stat(sub.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_TRUE(in_memory == 0 || in_memory == 1);
  const std::string link = dir.path + "/link";
  std::filesystem::create_directory_symlink(sub, link);
  EXPECT_EQ(dfa_spill_check_dir(link.c_str(), nullptr), DFA_ERROR_IO);
  EXPECT_NE(std::string(dfa_last_error()).find("symbolic link"), std::string::npos) << dfa_last_error();
  EXPECT_EQ(save(link + "/s", {pa}, {64_KiB}, 64_KiB), DFA_ERROR_IO);
  EXPECT_NE(std::string(dfa_last_error()).find("symbolic link"), std::string::npos) << dfa_last_error();
  if (::geteuid() != 0) {  // root owns /
    EXPECT_EQ(save("/s-" + std::to_string(::getpid()), {pa}, {64_KiB}, 64_KiB), DFA_ERROR_IO);
    EXPECT_NE(std::string(dfa_last_error()).find("not by this user"), std::string::npos) << dfa_last_error();
  }
  ASSERT_EQ(save(sub + "/s", {pa}, {64_KiB}, 64_KiB), DFA_SUCCESS) << dfa_last_error();
  std::filesystem::create_symlink(sub + "/s", sub + "/alias");
  EXPECT_EQ(load(sub + "/alias", {pa}, {64_KiB}, 64_KiB), DFA_ERROR_IO);
  EXPECT_NE(std::string(dfa_last_error()).find("symbolic link"), std::string::npos) << dfa_last_error();
}

TEST_F(Spill, AFullDiskLeavesNoFile) {
  // A save reserves its file's whole size before the first write: ranges whose total no
  // disk holds fail there (ENOSPC or EFBIG), the temporary file removed, no final name.
  {
    const std::string probe = dir.path + "/probe";
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
    ASSERT_GE(fd, 0);
    const bool has_fallocate = ::fallocate(fd, 0, 0, 4096) == 0;
    ::close(fd);
    std::filesystem::remove(probe);
    if (!has_fallocate) GTEST_SKIP() << "the file system of " << dir.path << " has no fallocate";
  }
  void* pa = range(64_KiB, 6);
  std::vector<void*> ptrs(4096, pa);
  std::vector<size_t> sizes(4096, std::size_t{1} << 40);  // 4 PiB: refused before any copy
  const std::string path = dir.path + "/full";
  EXPECT_EQ(save(path, ptrs, sizes, 64_KiB), DFA_ERROR_IO);
  const std::string msg = dfa_last_error();
  EXPECT_NE(msg.find("cannot reserve"), std::string::npos) << msg;
  EXPECT_NE(msg.find(path + ".tmp-"), std::string::npos) << msg;
  EXPECT_TRUE(entries(dir.path).empty()) << "a full disk left a file";
}

}  // namespace
