#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "formats/stream_copy.h"

using namespace eaglekit;

namespace {

// Guard bytes on both sides of every destination catch a copy that writes past its range.
constexpr std::size_t kGuard = 64;

}  // namespace

TEST_CASE("stream_copy: equals memcpy at every size class and alignment, and stays in range") {
  const std::vector<std::size_t> sizes = {0,          1,          63,         kStreamMin - 1,
                                          kStreamMin, kStreamMin + 1, kStreamMin + 17,
                                          (1u << 20) + 37};
  std::mt19937 rng(7);
  std::vector<std::uint8_t> src((1u << 20) + 64 + 8);
  for (auto& b : src) b = static_cast<std::uint8_t>(rng());
  for (const std::size_t n : sizes) {
    for (const std::size_t dst_off : {0u, 1u, 8u, 15u}) {
      for (const std::size_t src_off : {0u, 3u}) {
        CAPTURE(n);
        CAPTURE(dst_off);
        CAPTURE(src_off);
        std::vector<std::uint8_t> got(n + 2 * kGuard + 16, 0xAB);
        std::vector<std::uint8_t> want = got;
        std::memcpy(want.data() + kGuard + dst_off, src.data() + src_off, n);
        stream_copy(got.data() + kGuard + dst_off, src.data() + src_off, n);
        CHECK(got == want);

        std::vector<std::uint8_t> zero_got = got, zero_want = got;
        std::memset(zero_want.data() + kGuard + dst_off, 0, n);
        stream_zero(zero_got.data() + kGuard + dst_off, n);
        CHECK(zero_got == zero_want);
      }
    }
  }
}
