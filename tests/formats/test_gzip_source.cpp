// gzip: multi-member streams round trip, and truncated or corrupt streams fail naming the
// file and the compressed offset. The .ckpt.gz record format on top of it is tested in
// tests/formats/test_pt_gzip_format.cpp.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <functional>

#include "formats/byte_source.h"
#include "formats/dtype.h"
#include "formats/error.h"
#include "formats/format.h"
#include "formats/gzip_source.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0;
}

}  // namespace

TEST_CASE("gzip: multi-megabyte and multi-member streams round trip") {
  // Larger than zlib's input slices, compressible like hidden states are (a little).
  std::vector<std::uint8_t> a(3u << 20), b(777);
  std::uint32_t s = 1;
  for (auto& x : a) {
    s = s * 1103515245u + 12345u;
    x = static_cast<std::uint8_t>((s >> 16) & 0x3f);
  }
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::uint8_t>(i * 7);
  const auto ga = gzip_bytes(a.data(), a.size(), 1);
  const auto gb = gzip_bytes(b.data(), b.size(), 9);
  CHECK(ga.size() < a.size());
  auto one = gunzip(*ByteSource::from_bytes(ga, "a.gz"), kDefaultGunzipLimit);
  CHECK(one->name() == "a.gz (decompressed)");
  REQUIRE(one->size() == a.size());
  CHECK(std::memcmp(one->data(), a.data(), a.size()) == 0);

  std::vector<std::uint8_t> both = ga;
  both.insert(both.end(), gb.begin(), gb.end());
  auto two = gunzip(*ByteSource::from_bytes(both, "ab.gz"), kDefaultGunzipLimit);
  REQUIRE(two->size() == a.size() + b.size());
  CHECK(std::memcmp(two->data() + a.size(), b.data(), b.size()) == 0);

  // An empty member is valid; the cap is inclusive.
  const auto empty = gzip_bytes(nullptr, 0);
  CHECK(gunzip(*ByteSource::from_bytes(empty, "e.gz"), 0)->size() == 0);
  CHECK(gunzip(*ByteSource::from_bytes(gb, "b.gz"), b.size())->size() == b.size());
  CHECK(error_of([&] { gunzip(*ByteSource::from_bytes(gb, "b.gz"), b.size() - 1); }) ==
        "b.gz: gzip stream at byte " + std::to_string(gb.size()) + ": decompresses to more than " +
            std::to_string(b.size() - 1) +
            " bytes, the in-memory limit (EAGLEKIT_GUNZIP_MAX_BYTES raises it)");
  CHECK_THROWS_AS(gunzip(*ByteSource::from_bytes(gb, "b.gz"), 100), UnsupportedError);

  // gzip_file streams a file through deflate; Python's gzip and ours agree on the bytes.
  test::TempDir d("gz");
  test::write_bytes(d / "a.bin", a);
  gzip_file(d / "a.bin", d / "a.bin.gz", 6);
  const auto py = test::python(
      "import gzip, sys\n"
      "assert gzip.open(sys.argv[1] + '.gz').read() == open(sys.argv[1], 'rb').read()\n",
      {d / "a.bin"});
  CHECK(py.exit_code == 0);
  auto back = gunzip_file(d / "a.bin.gz", kDefaultGunzipLimit);
  CHECK(back->size() == a.size());
}

TEST_CASE("gzip: truncated and corrupt streams name the file and the compressed offset") {
  test::TempDir d("gz");
  std::vector<std::uint8_t> plain(5000);
  for (std::size_t i = 0; i < plain.size(); ++i)
    plain[i] = static_cast<std::uint8_t>((i * i) % 251);
  const auto good = gzip_bytes(plain.data(), plain.size(), 6);
  const std::size_t n = good.size();
  auto variant = [&](const std::string& name, std::vector<std::uint8_t> bytes) {
    const std::string p = d / name;
    test::write_bytes(p, bytes);
    return p;
  };
  auto cut = [&](std::size_t keep) {
    return std::vector<std::uint8_t>(good.begin(), good.begin() + static_cast<long>(keep));
  };
  auto flip = [&](std::size_t at) {
    auto b = good;
    b[at] ^= 0x55;
    return b;
  };
  const std::string truncated =
      ": truncated: the input ends inside the gzip member that started at byte 0 (";
  for (std::size_t keep : {n / 2, n - 3, std::size_t{5}, std::size_t{2}}) {
    INFO("kept " << keep);
    const std::string p = variant("cut" + std::to_string(keep) + ".gz", cut(keep));
    const std::string err = error_of([&] { gunzip_file(p, 1u << 20); });
    CHECK(starts_with(err, p + ": gzip stream at byte " + std::to_string(keep) + truncated));
    CHECK_THROWS_AS(gunzip_file(p, 1u << 20), FormatError);
  }
  {
    const std::string p = variant("crc.gz", flip(n - 8));
    CHECK(error_of([&] { gunzip_file(p, 1u << 20); }) ==
          p + ": gzip trailer at byte " + std::to_string(n - 4) +
              ": CRC-32 of the member that started at byte 0 does not match its decompressed "
              "bytes (incorrect data check)");
    CHECK_THROWS_AS(gunzip_file(p, 1u << 20), ChecksumError);
  }
  {
    const std::string p = variant("len.gz", flip(n - 1));
    CHECK(error_of([&] { gunzip_file(p, 1u << 20); }) ==
          p + ": gzip trailer at byte " + std::to_string(n) +
              ": length of the member that started at byte 0 does not match its decompressed "
              "bytes (incorrect length check)");
    CHECK_THROWS_AS(gunzip_file(p, 1u << 20), ChecksumError);
  }
  {
    auto bytes = good;
    bytes.insert(bytes.end(), {'x', 'y', 'z'});
    const std::string p = variant("trailing.gz", bytes);
    CHECK(error_of([&] { gunzip_file(p, 1u << 20); }) ==
          p + ": gzip stream at byte " + std::to_string(n) +
              ": 3 bytes after the gzip member that started at byte 0 are not another gzip "
              "member");
  }
  {
    auto bytes = good;
    bytes[3] = 0xe0;  // reserved header flag bits
    const std::string p = variant("flags.gz", bytes);
    CHECK(starts_with(error_of([&] { gunzip_file(p, 1u << 20); }), p + ": gzip stream at byte "));
    CHECK_THROWS_AS(gunzip_file(p, 1u << 20), FormatError);
  }
  {
    const std::string p = variant("notgz.gz", {'P', 'K', 3, 4});
    CHECK(error_of([&] { gunzip_file(p, 1u << 20); }) ==
          p + ": gzip header at byte 0: not a gzip file (no 1f 8b magic)");
  }
  {
    // Damage inside the deflate data: either invalid codes or a CRC mismatch, never success.
    for (std::size_t at : {std::size_t{12}, n / 3, n / 2}) {
      const std::string p = variant("mid" + std::to_string(at) + ".gz", flip(at));
      CHECK_THROWS_AS(gunzip_file(p, 1u << 20), FormatError);
    }
  }
  // Through the registry, a truncated .ckpt.gz is a FormatError naming the file.
  {
    const std::string p = variant("0.ckpt.gz", cut(n / 2));
    CHECK(starts_with(error_of([&] { open_reader(p); }), p + ": gzip stream at byte "));
    CHECK_THROWS_AS(open_reader(p), FormatError);
  }
  // Decompressed bytes that are not a torch zip: the .pt reader's error, on the
  // decompressed source.
  {
    const std::string p = variant("1.ckpt.gz", good);
    CHECK(starts_with(error_of([&] { open_reader(p); }), p + " (decompressed): "));
  }
}
