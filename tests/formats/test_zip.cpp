#include <doctest/doctest.h>

#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "formats/byte_source.h"
#include "formats/error.h"
#include "formats/zip.h"
#include "tests/formats/zip_regions.h"
#include "tests/support.h"

using namespace eaglekit;

namespace {

std::shared_ptr<const ByteSource> mem(std::vector<std::uint8_t> b, const std::string& name = "m.zip") {
  return ByteSource::from_bytes(std::move(b), name);
}

std::string entry_text(const ZipArchive& z, const std::string& name) {
  const ZipEntry* e = z.find(name);
  REQUIRE(e != nullptr);
  return std::string(z.text(*e));
}

// Writes a small archive with entries of sizes 0, 5 and 300.
std::string write_sample(const test::TempDir& d, bool zip64, const std::string& name = "s.zip") {
  const std::string path = d / name;
  ZipWriterOptions o;
  o.force_zip64 = zip64;
  ZipWriter w(path, o);
  w.add("arc/empty", "", 0);
  w.add("arc/hello", "hello", 5);
  std::string big(300, 'x');
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>('a' + i % 26);
  w.begin_entry("arc/big", big.size());
  w.write(big.data(), 100);
  w.write(big.data() + 100, 200);
  w.end_entry();
  w.finish();
  return path;
}

std::size_t find_sig(const std::vector<std::uint8_t>& b, const char* sig, std::size_t from = 0) {
  for (std::size_t i = from; i + 4 <= b.size(); ++i)
    if (std::memcmp(b.data() + i, sig, 4) == 0) return i;
  return std::string::npos;
}

void put_le(std::vector<std::uint8_t>& b, std::size_t at, std::uint64_t v, int bytes) {
  for (int k = 0; k < bytes; ++k) b[at + k] = static_cast<std::uint8_t>(v >> (8 * k));
}

template <class E>
std::string error_of(std::vector<std::uint8_t> bytes) {
  try {
    ZipArchive z(mem(std::move(bytes)));
    for (const auto& e : z.entries()) (void)z.data(e);
  } catch (const E& e) {
    return e.what();
  }
  return "<no error>";
}

}  // namespace

TEST_CASE("zip: writer output reads back, data 64-byte aligned") {
  test::TempDir d("zip");
  for (bool z64 : {false, true}) {
    CAPTURE(z64);
    const std::string path = write_sample(d, z64);
    ZipArchive z(ByteSource::open_file(path));
    REQUIRE(z.entries().size() == 3);
    CHECK(z.zip64());  // the zip64 end record is always written, as torch does
    CHECK(entry_text(z, "arc/empty").empty());
    CHECK(entry_text(z, "arc/hello") == "hello");
    const std::string big = entry_text(z, "arc/big");
    REQUIRE(big.size() == 300);
    CHECK(big[27] == 'b');
    for (const auto& e : z.entries()) {
      CHECK(e.data_offset % 64 == 0);
      CHECK(e.method == 0);
    }
    CHECK(z.find("arc/missing") == nullptr);
    CHECK(z.find("arc/hello")->crc32 == 0x3610a686u);  // crc32("hello")
  }
}

TEST_CASE("zip: Python's zipfile reads our archives and their CRCs (zip64 forced too)") {
  test::require_python("zipfile");
  test::TempDir d("zip");
  const std::string plain = write_sample(d, false, "plain.zip");
  const std::string z64 = write_sample(d, true, "z64.zip");
  const auto r = test::python(R"(
import sys, zipfile
for p in sys.argv[1:]:
    z = zipfile.ZipFile(p)
    assert z.testzip() is None, p
    infos = z.infolist()
    assert [i.filename for i in infos] == ['arc/empty', 'arc/hello', 'arc/big'], infos
    assert z.read('arc/hello') == b'hello'
    assert z.read('arc/big') == bytes((ord('a') + i % 26) for i in range(300))
    assert all(i.compress_type == zipfile.ZIP_STORED for i in infos)
print('ok')
)",
                              {plain, z64});
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK(r.out == "ok\n");
}

TEST_CASE("zip: archives made by Python's zipfile (comment, zip64, deflate)") {
  test::require_python("zipfile");
  test::TempDir d("zip");
  const auto r = test::python(R"(
import sys, zipfile
d = sys.argv[1]
with zipfile.ZipFile(d + '/stored.zip', 'w', zipfile.ZIP_STORED) as z:
    z.writestr('p/a', b'alpha')
    z.writestr('p/b', b'')
    z.comment = b'a trailing comment ' * 100
with zipfile.ZipFile(d + '/z64.zip', 'w', zipfile.ZIP_STORED) as z:
    with z.open('p/a', 'w', force_zip64=True) as f:
        f.write(b'zip64 entry')
with zipfile.ZipFile(d + '/deflated.zip', 'w', zipfile.ZIP_DEFLATED) as z:
    z.writestr('p/a', b'squeeze me ' * 50)
)",
                              {d.path()});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);

  ZipArchive stored(ByteSource::open_file(d / "stored.zip"));
  CHECK(entry_text(stored, "p/a") == "alpha");
  CHECK(entry_text(stored, "p/b").empty());

  ZipArchive z64(ByteSource::open_file(d / "z64.zip"));
  CHECK(entry_text(z64, "p/a") == "zip64 entry");

  ZipArchive deflated(ByteSource::open_file(d / "deflated.zip"));
  const ZipEntry* e = deflated.find("p/a");
  REQUIRE(e != nullptr);
  CHECK(e->method == 8);
  try {
    (void)deflated.data(*e);
    FAIL("deflated entry was read");
  } catch (const UnsupportedError& err) {
    const std::string m = err.what();
    CHECK(m.find("deflated.zip: zip entry 'p/a' at byte 0: compressed with method 8 (deflate)") !=
          std::string::npos);
  }
}

// Floors of the flipped-byte test per region (see there): the least share refused over four
// masks less the spread between them (max - min), rounded down, as measured when written:
// local headers 45-47 of 187, central directory 103-106 of 163, end records 45-46 of 98.
constexpr double kZipFloorLocal = 0.22, kZipFloorCentral = 0.61, kZipFloorEnd = 0.44;

TEST_CASE("zip: corruption table") {
  test::TempDir d("zip");
  const auto good = test::read_bytes(write_sample(d, false));
  const std::size_t cd = find_sig(good, "PK\1\2");
  const std::size_t end64 = find_sig(good, "PK\6\6");
  const std::size_t end = find_sig(good, "PK\5\6");
  REQUIRE(cd != std::string::npos);
  REQUIRE(end64 != std::string::npos);
  REQUIRE(end != std::string::npos);

  SUBCASE("too short") {
    CHECK(error_of<FormatError>({'P', 'K'}) ==
          "m.zip: zip end of central directory at byte 0: file is 2 bytes, too short for a zip "
          "archive (truncated?)");
  }
  SUBCASE("no end record") {
    std::vector<std::uint8_t> b(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(end));
    b.resize(b.size() + 30, 0);
    CHECK(error_of<FormatError>(b).find("signature PK\\5\\6 not found") != std::string::npos);
  }
  SUBCASE("central directory past the end") {
    auto b = good;
    put_le(b, end64 + 48, 1u << 20, 8);  // zip64 cd offset
    const std::string m = error_of<FormatError>(b);
    CHECK(m.find("m.zip: zip central directory at byte " + std::to_string(end) + ": offset 1048576") !=
          std::string::npos);
    CHECK(m.find("runs past the end records") != std::string::npos);
  }
  SUBCASE("oversized entry count") {
    auto b = good;
    put_le(b, end64 + 32, 1ull << 60, 8);
    CHECK(error_of<FormatError>(b).find("entry count 1152921504606846976 does not fit") !=
          std::string::npos);
  }
  SUBCASE("oversized name length") {
    auto b = good;
    put_le(b, cd + 28, 0xffff, 2);
    CHECK(error_of<FormatError>(b) ==
          "m.zip: zip central directory entry 0 at byte " + std::to_string(cd) +
              ": name/extra/comment lengths run past the end of the central directory");
  }
  SUBCASE("oversized entry size") {
    auto b = good;
    const std::size_t cd1 = find_sig(good, "PK\1\2", cd + 4);
    put_le(b, cd1 + 20, 0x7fffffff, 4);
    put_le(b, cd1 + 24, 0x7fffffff, 4);
    const std::string m = error_of<FormatError>(b);
    CHECK(m.find("zip local header of 'arc/hello'") != std::string::npos);
    CHECK(m.find("data of 2147483647 bytes from byte 128 runs into the central directory") !=
          std::string::npos);
  }
  SUBCASE("local header offset inside the directory") {
    auto b = good;
    put_le(b, cd + 42, static_cast<std::uint32_t>(cd + 10), 4);
    CHECK(error_of<FormatError>(b).find("offset lies inside or past the central directory") !=
          std::string::npos);
  }
  SUBCASE("bad local signature") {
    auto b = good;
    b[0] = 'X';
    CHECK(error_of<FormatError>(b) ==
          "m.zip: zip local header of 'arc/empty' at byte 0: bad signature (expected PK\\3\\4)");
  }
  SUBCASE("duplicate names") {
    auto b = good;
    const std::size_t cd1 = find_sig(good, "PK\1\2", cd + 4);
    // "arc/hello" -> "arc/empty" in both headers of entry 1 (same length)
    const std::size_t local1 = find_sig(good, "PK\3\4", 4);
    std::memcpy(b.data() + cd1 + 46, "arc/empty", 9);
    std::memcpy(b.data() + local1 + 30, "arc/empty", 9);
    CHECK(error_of<FormatError>(b).find("duplicate entry 'arc/empty'") != std::string::npos);
  }
  SUBCASE("every truncation is a FormatError") {
    for (std::size_t cut = 0; cut < good.size(); ++cut) {
      CAPTURE(cut);
      std::vector<std::uint8_t> b(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(cut));
      CHECK(error_of<FormatError>(b) != "<no error>");
    }
  }
  SUBCASE("every flipped byte is a FormatError naming the file, or a clean read") {
    // Any other exception escapes and fails the case. Counted per region of the archive, for
    // four flip masks: a floor on the whole file would pass with one region's detection lost.
    const auto region = test::zip_regions(good, [](const std::string&) { return std::string("payload"); });
    // The payload reads clean: data() does not check the CRC-32 (verify does).
    const std::map<std::string, double> floor = {{"local headers", kZipFloorLocal},
                                                 {"central directory", kZipFloorCentral},
                                                 {"end records", kZipFloorEnd},
                                                 {"payload", 0.0}};
    for (const std::uint8_t mask : {0xa5, 0x01, 0x80, 0xff}) {
      CAPTURE(int(mask));
      std::map<std::string, test::RegionCounts> counts;
      std::size_t clean = 0;
      for (std::size_t i = 0; i < good.size(); ++i) {
        CAPTURE(i);
        auto b = good;
        b[i] ^= mask;
        test::RegionCounts& c = counts[region[i]];
        ++c.total;
        try {
          ZipArchive z(mem(b, "flip.zip"));
          for (const auto& e : z.entries()) (void)z.data(e);
          ++clean;
        } catch (const FormatError& e) {
          ++c.refused;
          CHECK(e.path() == "flip.zip");
          CHECK_MESSAGE(std::string(e.what()).rfind("flip.zip: ", 0) == 0, e.what());
        }
      }
      std::ostringstream said;
      for (const auto& [name, c] : counts) {
        said << "; " << name << " " << c.refused << " of " << c.total;
        REQUIRE_MESSAGE(floor.count(name), name);
        CHECK_MESSAGE(c.share() >= floor.at(name), "mask " << int(mask) << ": " << name << " refused " << c.refused
                                                             << " of " << c.total << ", floor " << floor.at(name));
      }
      MESSAGE("mask " << int(mask) << ": " << good.size() - clean << " of " << good.size() << " refused" << said.str());
      CHECK(counts.size() == floor.size());
      CHECK(clean > 0);
    }
  }
}

TEST_CASE("zip: writer rejects misuse") {
  test::TempDir d("zip");
  ZipWriter w(d / "x.zip");
  w.begin_entry("a/x", 4);
  w.write("ab", 2);
  CHECK_THROWS_AS(w.write("abc", 3), Error);
  CHECK_THROWS_AS(w.end_entry(), Error);
  CHECK_THROWS_AS(ZipWriter(d / "y.zip", ZipWriterOptions{48, false}), UsageError);
}
