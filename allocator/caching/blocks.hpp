// Blocks, size-class bins and the pointer map of the caching allocator.
//
// Bins are a two-level segregated fit (TLSF): a size, in units of 512 bytes, maps to
// one of 16 linear classes below 8 KiB and to 16 classes per power of two above; a
// bitmap finds the first non-empty class at or above a size in a few word scans.
// Free lists are intrusive (no heap allocation on the hot path), LIFO so that a block
// just freed is the next one handed out.  The pointer map is open addressing with
// linear probing and backward-shift deletion (no tombstones, no node allocations).
#pragma once
#include <deferalloc/core/driver.hpp>
#include <deferalloc/core/reservations.hpp>

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace deferalloc::detail {

inline constexpr std::size_t k_block_unit = 512;

struct segment;
struct stream_state;

struct block {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  std::size_t requested = 0;  // bytes asked for (allocated blocks)
  block* prev = nullptr;      // address neighbours in the segment
  block* next = nullptr;
  block* free_prev = nullptr;  // bin list
  block* free_next = nullptr;
  segment* seg = nullptr;
  stream_state* owner = nullptr;  // stream the block was allocated on / freed on
  std::uint64_t free_gen = 0;     // owner's generation at the free
  std::vector<stream_t>* users = nullptr;  // record_stream streams other than the owner
  int bin = -1;                   // class while in a free list
  bool allocated = false;
  bool pending = false;           // freed, waiting for events of other streams
  bool resident = false;
  bool small = false;             // counted in the small pool
  bool backed = false;            // every granule under the block is known to be backed
};

/// TLSF bins of one (group, stream) owner.
class bins {
 public:
  static constexpr int sl_bits = 4;
  static constexpr int classes = 16 + (48 - sl_bits) * 16;
  static constexpr int words = (classes + 63) / 64;

  /// Class of a block of `bytes` (round down: every block in it is >= the class size).
  static int class_down(std::size_t bytes) {
    const std::size_t u = bytes / k_block_unit;
    if (u < 16) return static_cast<int>(u);
    const int fl = 63 - std::countl_zero(u);
    return 16 + (fl - sl_bits) * 16 + static_cast<int>((u >> (fl - sl_bits)) & 15);
  }
  /// First class whose every block holds `bytes` (round up).
  static int class_up(std::size_t bytes) {
    std::size_t u = bytes / k_block_unit;
    if (u >= 16) {
      const int fl = 63 - std::countl_zero(u);
      u += (std::size_t{1} << (fl - sl_bits)) - 1;
    }
    return class_down(u * k_block_unit);
  }

  void insert(block* b) {
    const int c = class_down(b->size);
    b->bin = c;
    b->free_prev = nullptr;
    b->free_next = heads_[c];
    if (heads_[c] != nullptr) heads_[c]->free_prev = b;
    heads_[c] = b;
    bits_[c / 64] |= std::uint64_t{1} << (c % 64);
    ++count_;
    bytes_ += b->size;
  }
  void remove(block* b) {
    const int c = b->bin;
    if (b->free_prev != nullptr) b->free_prev->free_next = b->free_next;
    else heads_[c] = b->free_next;
    if (b->free_next != nullptr) b->free_next->free_prev = b->free_prev;
    if (heads_[c] == nullptr) bits_[c / 64] &= ~(std::uint64_t{1} << (c % 64));
    b->bin = -1;
    b->free_prev = b->free_next = nullptr;
    --count_;
    bytes_ -= b->size;
  }
  /// First non-empty class >= c, or -1.
  int first_at_least(int c) const {
    if (c >= classes) return -1;
    int w = c / 64;
    std::uint64_t m = bits_[w] & (~std::uint64_t{0} << (c % 64));
    while (m == 0) {
      if (++w == words) return -1;
      m = bits_[w];
    }
    return w * 64 + std::countr_zero(m);
  }
  block* head(int c) const { return heads_[c]; }
  /// A block of at least `bytes`: the exact class is searched first (best fit among
  /// few), then the first class that guarantees a fit.  nullptr when none.
  block* find(std::size_t bytes) const {
    const int down = class_down(bytes);
    int i = 0;
    for (block* b = heads_[down]; b != nullptr && i < 8; b = b->free_next, ++i)
      if (b->size >= bytes) return b;
    const int c = first_at_least(class_up(bytes) == down ? down + 1 : class_up(bytes));
    return c < 0 ? nullptr : heads_[c];
  }
  bool empty() const { return count_ == 0; }
  std::size_t bytes() const { return bytes_; }

 private:
  std::array<block*, classes> heads_{};
  std::array<std::uint64_t, words> bits_{};
  std::size_t count_ = 0;
  std::size_t bytes_ = 0;
};

/// Allocated blocks by start address.
class ptr_map {
 public:
  ptr_map() { slots_.resize(1024); }
  block* find(std::uintptr_t key) const {
    std::size_t i = slot(key);
    while (true) {
      const entry& e = slots_[i];
      if (e.key == key) return e.value;
      if (e.key == 0) return nullptr;
      i = (i + 1) & (slots_.size() - 1);
    }
  }
  void insert(std::uintptr_t key, block* value) {
    if ((size_ + 1) * 2 > slots_.size()) grow();
    put(key, value);
    ++size_;
  }
  /// Removes `key`; returns its value or nullptr.
  block* erase(std::uintptr_t key) {
    const std::size_t mask = slots_.size() - 1;
    std::size_t i = slot(key);
    while (slots_[i].key != key) {
      if (slots_[i].key == 0) return nullptr;
      i = (i + 1) & mask;
    }
    block* v = slots_[i].value;
    // Backward-shift: move later entries of the probe run into the hole.
    std::size_t hole = i;
    std::size_t j = (i + 1) & mask;
    while (slots_[j].key != 0) {
      const std::size_t home = slot(slots_[j].key);
      if (((j - home) & mask) >= ((j - hole) & mask)) {
        slots_[hole] = slots_[j];
        hole = j;
      }
      j = (j + 1) & mask;
    }
    slots_[hole] = {};
    --size_;
    return v;
  }
  std::size_t size() const { return size_; }
  template <typename F>
  void for_each(F&& f) const {
    for (const entry& e : slots_)
      if (e.key != 0) f(e.value);
  }

 private:
  struct entry {
    std::uintptr_t key = 0;
    block* value = nullptr;
  };
  std::size_t slot(std::uintptr_t key) const {
    return static_cast<std::size_t>(((key >> 9) * 0x9E3779B97F4A7C15ull) >> 20) & (slots_.size() - 1);
  }
  void put(std::uintptr_t key, block* value) {
    std::size_t i = slot(key);
    while (slots_[i].key != 0) i = (i + 1) & (slots_.size() - 1);
    slots_[i] = {key, value};
  }
  void grow() {
    std::vector<entry> old(slots_.size() * 2);
    old.swap(slots_);
    for (const entry& e : old)
      if (e.key != 0) put(e.key, e.value);
  }
  std::vector<entry> slots_;
  std::size_t size_ = 0;
};

}  // namespace deferalloc::detail
