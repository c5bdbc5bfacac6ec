// Little-endian integers in and out of bytes, the one encoding every binary format here
// (zip, .eks, safetensors, the dataset index, TensorBoard records) uses: loads and stores
// at a pointer, an appender that builds a buffer in memory, and a cursor that reads a span
// of a ByteSource and checks each read against what is left of it.
//
// Thread safety: ByteWriter and ByteCursor are plain values; use one from one thread.
// Lifetime: a ByteCursor refers to its ByteSource (and that source's name); keep the
// source alive while the cursor is used.
// Throws: ByteCursor throws FormatError (see its comments); ByteWriter only bad_alloc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

#include "formats/byte_source.h"

namespace eaglekit {

// Loads and stores at unaligned memory; the caller has checked the bounds.
inline std::uint16_t load_le16(const std::uint8_t* p) {
  return static_cast<std::uint16_t>(p[0] | (p[1] << 8));
}
inline std::uint32_t load_le32(const std::uint8_t* p) {
  return static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
         (static_cast<std::uint32_t>(p[2]) << 16) | (static_cast<std::uint32_t>(p[3]) << 24);
}
inline std::uint64_t load_le64(const std::uint8_t* p) {
  return static_cast<std::uint64_t>(load_le32(p)) |
         (static_cast<std::uint64_t>(load_le32(p + 4)) << 32);
}
inline void store_le16(std::uint8_t* p, std::uint16_t v) {
  p[0] = static_cast<std::uint8_t>(v);
  p[1] = static_cast<std::uint8_t>(v >> 8);
}
inline void store_le32(std::uint8_t* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
inline void store_le64(std::uint8_t* p, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}

// Appends fields to a growing buffer. Floats are stored as the little-endian bytes of
// their IEEE-754 bit pattern, whatever the host's byte order.
class ByteWriter {
 public:
  ByteWriter& u8(std::uint8_t v) {
    buf_.push_back(v);
    return *this;
  }
  ByteWriter& u16(std::uint16_t v) { return put(v, 2); }
  ByteWriter& u32(std::uint32_t v) { return put(v, 4); }
  ByteWriter& u64(std::uint64_t v) { return put(v, 8); }
  ByteWriter& i64(std::int64_t v) { return put(static_cast<std::uint64_t>(v), 8); }
  ByteWriter& f32(float v) { return u32(bits_of<std::uint32_t>(v)); }
  ByteWriter& f64(double v) { return u64(bits_of<std::uint64_t>(v)); }
  ByteWriter& bytes(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::uint8_t*>(p);
    buf_.insert(buf_.end(), b, b + n);
    return *this;
  }
  ByteWriter& bytes(std::string_view s) { return bytes(s.data(), s.size()); }
  ByteWriter& bytes(const ByteWriter& w) { return bytes(w.data(), w.size()); }
  // n copies of `byte`.
  ByteWriter& fill(std::size_t n, std::uint8_t byte = 0) {
    buf_.insert(buf_.end(), n, byte);
    return *this;
  }
  // Zero bytes up to the next multiple of `alignment` (a power of two) of size().
  ByteWriter& align(std::size_t alignment) {
    return fill((alignment - buf_.size() % alignment) % alignment);
  }
  // Overwrites bytes already written (a length or checksum known only later); [at, at + 2)
  // or [at, at + 4) must lie inside size().
  void patch_u16(std::size_t at, std::uint16_t v) { store_le16(buf_.data() + at, v); }
  void patch_u32(std::size_t at, std::uint32_t v) { store_le32(buf_.data() + at, v); }

  void reserve(std::size_t n) { buf_.reserve(n); }
  std::size_t size() const { return buf_.size(); }
  const std::uint8_t* data() const { return buf_.data(); }
  // Moves the bytes out; the writer is empty afterwards.
  std::vector<std::uint8_t> release() { return std::move(buf_); }

 private:
  template <class Bits, class Float>
  static Bits bits_of(Float v) {
    static_assert(sizeof(Bits) == sizeof(Float), "same width");
    Bits b;
    std::memcpy(&b, &v, sizeof b);
    return b;
  }
  ByteWriter& put(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) buf_.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
    return *this;
  }
  std::vector<std::uint8_t> buf_;
};

// Reads [begin, end) of a ByteSource front to back. Every read is checked against what is
// left of the span; running past its end throws
//   FormatError "NAME: FIELD at byte POS: needs N bytes but the REGION has M left (REGION corrupt)"
// where POS is the source offset of the read and REGION names the span ("index").
// Constructing one over a span that is not inside the source throws FormatError too.
class ByteCursor {
 public:
  ByteCursor(const ByteSource& src, std::uint64_t begin, std::uint64_t end,
             std::string_view region);

  const std::uint8_t* take(std::uint64_t n, std::string_view field) {
    if (n > end_ - pos_) overrun(n, field);
    const std::uint8_t* p = src_.data() + pos_;
    pos_ += n;
    return p;
  }
  void skip(std::uint64_t n, std::string_view field) { take(n, field); }
  std::uint8_t u8(std::string_view field) { return *take(1, field); }
  std::uint16_t u16(std::string_view field) { return load_le16(take(2, field)); }
  std::uint32_t u32(std::string_view field) { return load_le32(take(4, field)); }
  std::uint64_t u64(std::string_view field) { return load_le64(take(8, field)); }
  std::int64_t i64(std::string_view field) { return static_cast<std::int64_t>(u64(field)); }

  std::uint64_t pos() const { return pos_; }  // source offset of the next read
  std::uint64_t left() const { return end_ - pos_; }

 private:
  [[noreturn]] void overrun(std::uint64_t n, std::string_view field) const;

  const ByteSource& src_;
  std::uint64_t pos_;
  std::uint64_t end_;
  std::string_view region_;
};

}  // namespace eaglekit
