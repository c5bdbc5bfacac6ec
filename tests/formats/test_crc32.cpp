#include <doctest/doctest.h>
#include <zlib.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "formats/crc32.h"

using namespace eaglekit;

namespace {

std::uint32_t zlib_crc(std::uint32_t crc, const std::uint8_t* p, std::size_t n) {
  return static_cast<std::uint32_t>(::crc32(crc, p, static_cast<uInt>(n)));
}

}  // namespace

TEST_CASE("crc32: the standard check value") {
  const std::string s = "123456789";
  CHECK(crc32_update(0, s.data(), s.size()) == 0xCBF43926u);
  CHECK(crc32_update(0, nullptr, 0) == 0u);
}

TEST_CASE("crc32: equals zlib at every length class, alignment and running value") {
  // Lengths around the folding paths' edges: under 64 bytes (zlib only), 64 (one block, no
  // fold), every remainder mod 16 after the 16-byte tail blocks, 256 and up (the 512-bit
  // path: its 256-byte steps, then 64-byte steps, then 16-byte blocks), and a few large ones.
  std::mt19937 rng(11);
  std::vector<std::uint8_t> buf((3u << 20) + 64);
  for (auto& b : buf) b = static_cast<std::uint8_t>(rng());
  std::vector<std::size_t> lengths;
  for (std::size_t n = 0; n <= 300; ++n) lengths.push_back(n);
  for (std::size_t n = 301; n <= 1100; n += 7) lengths.push_back(n);
  for (std::size_t n : {1023u, 1024u, 4096u, 65536u + 13u, (1u << 20) + 37u, 3u << 20}) lengths.push_back(n);
  INFO("accelerated: " << crc32_accelerated());
  for (const std::size_t n : lengths) {
    for (const std::size_t off : {0u, 1u, 7u, 13u}) {
      if (off + n > buf.size()) continue;
      for (const std::uint32_t seed : {0u, 0xDEADBEEFu, 0xFFFFFFFFu}) {
        CAPTURE(n);
        CAPTURE(off);
        CAPTURE(seed);
        const std::uint8_t* p = buf.data() + off;
        const std::uint32_t want = zlib_crc(seed, p, n);
        REQUIRE(crc32_update(seed, p, n) == want);
        REQUIRE(crc32_update_portable(seed, p, n) == want);
        // Each path, whichever crc32_update picks on this CPU.
        REQUIRE(crc32_update_path(Crc32Path::kClmul, seed, p, n) == want);
        REQUIRE(crc32_update_path(Crc32Path::kVpclmul, seed, p, n) == want);
      }
    }
  }
}

TEST_CASE("crc32: a running CRC over pieces equals the whole, and one flipped bit changes it") {
  std::mt19937 rng(5);
  std::vector<std::uint8_t> buf(100000);
  for (auto& b : buf) b = static_cast<std::uint8_t>(rng());
  const std::uint32_t whole = crc32_update(0, buf.data(), buf.size());
  std::uint32_t run = 0;
  for (std::size_t at = 0, k = 1; at < buf.size(); at += k, k = k * 3 + 1)
    run = crc32_update(run, buf.data() + at, std::min(k, buf.size() - at));
  CHECK(run == whole);
  for (const std::size_t bit : {0u, 8u * 777u + 3u, 8u * 99999u + 7u}) {
    buf[bit / 8] ^= static_cast<std::uint8_t>(1u << (bit % 8));
    CHECK(crc32_update(0, buf.data(), buf.size()) != whole);
    buf[bit / 8] ^= static_cast<std::uint8_t>(1u << (bit % 8));
  }
}
