// checksum64 (durable_files.hpp): the checksum of the library's files.
#include <cstdint>
#include <cstring>

#include "durable_files.hpp"

namespace deferalloc::detail {

namespace {
std::uint64_t rotl(std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
}  // namespace

std::uint64_t checksum64(const void* data, std::size_t bytes, std::uint64_t seed) {
  // Four independent lanes of multiply-rotate over 8-byte words, then a final mix.
  constexpr std::uint64_t p1 = 0x9E3779B185EBCA87ull, p2 = 0xC2B2AE3D27D4EB4Full;
  std::uint64_t h[4] = {seed + p1 + p2, seed + p2, seed, seed - p1};
  const auto* b = static_cast<const unsigned char*>(data);
  std::size_t i = 0;
  for (; i + 32 <= bytes; i += 32)
    for (int l = 0; l < 4; ++l) {
      std::uint64_t w;
      std::memcpy(&w, b + i + 8 * l, 8);
      h[l] = rotl(h[l] + w * p2, 31) * p1;
    }
  std::uint64_t r = rotl(h[0], 1) + rotl(h[1], 7) + rotl(h[2], 12) + rotl(h[3], 18) + bytes;
  for (; i < bytes; ++i) r = rotl(r ^ (b[i] * p1), 11) * p2;
  r ^= r >> 33;
  r *= p2;
  r ^= r >> 29;
  return r;
}

}  // namespace deferalloc::detail
