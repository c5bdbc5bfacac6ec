// The region of a zip archive (a .pt file) that each byte belongs to, read from the archive's
// own directory: the flipped-byte tests count refusals per region, so that losing detection
// in one region (the local headers, the central directory, the pickle) fails the test even
// when the whole file's count still clears a floor. Test-only: assumes a well-formed archive
// (it is only ever given the good file) and REQUIREs what it reads.
#pragma once

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace eaglekit::test {

struct RegionCounts {
  std::size_t refused = 0, total = 0;
  double share() const { return total ? static_cast<double>(refused) / static_cast<double>(total) : 0.0; }
};

inline std::uint64_t zip_le(const std::vector<std::uint8_t>& b, std::size_t at, int bytes) {
  REQUIRE(at + static_cast<std::size_t>(bytes) <= b.size());
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | b[at + static_cast<std::size_t>(i)];
  return v;
}

// Per byte: "local headers" (each entry's local header, and a data descriptor after its
// data), "central directory", "end records" (zip64 end record, locator, end of central
// directory), or the entry's region as `entry_region` names it from the entry's name.
template <class EntryRegion>
std::vector<std::string> zip_regions(const std::vector<std::uint8_t>& b, EntryRegion entry_region) {
  std::vector<std::string> out(b.size(), "local headers");
  std::size_t eocd = std::string::npos;
  for (std::size_t i = b.size() >= 22 ? b.size() - 22 : 0; i + 4 <= b.size(); --i) {
    if (std::memcmp(b.data() + i, "PK\5\6", 4) == 0) {
      eocd = i;
      break;
    }
    if (i == 0) break;
  }
  REQUIRE(eocd != std::string::npos);
  std::uint64_t cd_offset = zip_le(b, eocd + 16, 4), cd_size = zip_le(b, eocd + 12, 4);
  if (cd_offset == 0xffffffffu || cd_size == 0xffffffffu) {
    REQUIRE(eocd >= 20);
    REQUIRE(std::memcmp(b.data() + eocd - 20, "PK\6\7", 4) == 0);
    const std::size_t z64 = static_cast<std::size_t>(zip_le(b, eocd - 20 + 8, 8));
    REQUIRE(std::memcmp(b.data() + z64, "PK\6\6", 4) == 0);
    cd_size = zip_le(b, z64 + 40, 8);
    cd_offset = zip_le(b, z64 + 48, 8);
  }
  const std::size_t cd_end = static_cast<std::size_t>(cd_offset + cd_size);
  for (std::size_t i = static_cast<std::size_t>(cd_offset); i < cd_end; ++i) out[i] = "central directory";
  for (std::size_t i = cd_end; i < b.size(); ++i) out[i] = "end records";
  for (std::size_t at = static_cast<std::size_t>(cd_offset); at < cd_end;) {
    REQUIRE(std::memcmp(b.data() + at, "PK\1\2", 4) == 0);
    const std::size_t n = zip_le(b, at + 28, 2), m = zip_le(b, at + 30, 2), k = zip_le(b, at + 32, 2);
    const std::string name(reinterpret_cast<const char*>(b.data() + at + 46), n);
    std::uint64_t size = zip_le(b, at + 20, 4), local = zip_le(b, at + 42, 4);
    // zip64 extra field (id 1): the sizes and offset that are 0xffffffff above, in order.
    for (std::size_t e = at + 46 + n; e + 4 <= at + 46 + n + m;) {
      const std::size_t id = zip_le(b, e, 2), len = zip_le(b, e + 2, 2);
      if (id == 1) {
        std::size_t f = e + 4;
        if (zip_le(b, at + 24, 4) == 0xffffffffu) f += 8;  // uncompressed size comes first
        if (size == 0xffffffffu) size = zip_le(b, f, 8), f += 8;
        if (local == 0xffffffffu) local = zip_le(b, f, 8);
      }
      e += 4 + len;
    }
    const std::size_t lh = static_cast<std::size_t>(local);
    REQUIRE(std::memcmp(b.data() + lh, "PK\3\4", 4) == 0);
    const std::size_t data = lh + 30 + zip_le(b, lh + 26, 2) + zip_le(b, lh + 28, 2);
    REQUIRE(data + size <= b.size());
    const std::string region = entry_region(name);
    for (std::size_t i = data; i < data + size; ++i) out[i] = region;
    at += 46 + n + m + k;
  }
  return out;
}

}  // namespace eaglekit::test
