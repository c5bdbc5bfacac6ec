#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/error.h"

using namespace eaglekit;

TEST_CASE("bytes: the writer lays fields out little-endian") {
  ByteWriter w;
  w.u8(0x01).u16(0x0302).u32(0x07060504).u64(0x0f0e0d0c0b0a0908ull).i64(-2);
  w.f32(1.0f).f64(-0.5).bytes("ab").fill(2, 'Z').align(8);
  const std::vector<std::uint8_t> want = {
      0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f,
      0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,  // -2
      0x00, 0x00, 0x80, 0x3f,                          // 1.0f
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xe0, 0xbf,  // -0.5
      'a',  'b',  'Z',  'Z',  0x00};  // aligned to 40
  REQUIRE(w.size() == want.size());
  CHECK(w.size() % 8 == 0);
  w.patch_u16(1, 0xbeef);
  w.patch_u32(3, 0xcafef00d);
  std::vector<std::uint8_t> patched = want;
  patched[1] = 0xef, patched[2] = 0xbe;
  patched[3] = 0x0d, patched[4] = 0xf0, patched[5] = 0xfe, patched[6] = 0xca;
  CHECK(std::vector<std::uint8_t>(w.data(), w.data() + w.size()) == patched);
  CHECK(w.release() == patched);
  CHECK(w.size() == 0);

  std::uint8_t b[8];
  store_le64(b, 0x0102030405060708ull);
  CHECK(load_le64(b) == 0x0102030405060708ull);
  CHECK(load_le32(b) == 0x05060708u);
  CHECK(load_le16(b) == 0x0708u);
}

TEST_CASE("bytes: the cursor reads in order and names the field that runs past the span") {
  ByteWriter w;
  w.u32(7).u16(9).u8(3).u64(11);
  const auto src = ByteSource::from_bytes(w.release(), "x.bin");
  ByteCursor c(*src, 4, 15, "header");  // the u16, the u8 and the u64
  CHECK(c.left() == 11);
  CHECK(c.u16("a") == 9);
  CHECK(c.u8("b") == 3);
  CHECK(c.pos() == 7);
  CHECK(c.i64("c") == 11);
  CHECK(c.left() == 0);
  std::string msg;
  try {
    c.u8("trailing byte");
  } catch (const FormatError& e) {
    msg = e.what();
    CHECK(e.offset() == 15);
    CHECK(e.field() == "trailing byte");
  }
  CHECK(msg == "x.bin: trailing byte at byte 15: needs 1 bytes but the header has 0 left "
               "(header corrupt)");

  ByteCursor d(*src, 10, 15, "index");
  d.skip(2, "pad");
  CHECK_THROWS_WITH_AS(d.u32("count"),
                       "x.bin: count at byte 12: needs 4 bytes but the index has 3 left "
                       "(index corrupt)",
                       FormatError);
  CHECK_THROWS_WITH_AS(ByteCursor(*src, 8, 16, "trailer"),
                       "x.bin: trailer at byte 8: span of bytes [8, 16) lies outside the "
                       "source's 15 bytes",
                       FormatError);
}
