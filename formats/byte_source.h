// All input bytes come through a ByteSource: a read-only, contiguous view of a file
// (mmap) or of memory. Every reader checks offsets with at() before touching bytes, so a
// corrupt count or offset becomes a FormatError naming the file, offset and field.
//
// Thread safety: immutable after construction; share freely across threads.
// Lifetime: views into data() stay valid while any shared_ptr to the source lives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace eaglekit {

class ByteSource {
 public:
  virtual ~ByteSource() = default;
  ByteSource(const ByteSource&) = delete;
  ByteSource& operator=(const ByteSource&) = delete;

  const std::uint8_t* data() const { return data_; }
  std::uint64_t size() const { return size_; }
  // The path it came from, or a label for memory ("<memory>", "x.ckpt.gz (decompressed)").
  const std::string& name() const { return name_; }

  // Checked access: [offset, offset + len) must lie inside the source, else a FormatError
  // "NAME: FIELD at byte OFFSET: needs LEN bytes but the source has SIZE".
  const std::uint8_t* at(std::uint64_t offset, std::uint64_t len, const char* field) const;
  bool contains(std::uint64_t offset, std::uint64_t len) const {
    return offset <= size_ && len <= size_ - offset;
  }

  // Maps a whole file read-only (an empty file gives an empty source). Throws IoError.
  static std::shared_ptr<const ByteSource> open_file(const std::string& path);
  // Owns the bytes.
  static std::shared_ptr<const ByteSource> from_bytes(std::vector<std::uint8_t> bytes,
                                                      std::string name);
  // A window into another source (kept alive by the window).
  static std::shared_ptr<const ByteSource> slice(std::shared_ptr<const ByteSource> parent,
                                                 std::uint64_t offset, std::uint64_t len,
                                                 std::string name);

 protected:
  ByteSource(const std::uint8_t* data, std::uint64_t size, std::string name)
      : data_(data), size_(size), name_(std::move(name)) {}

 private:
  const std::uint8_t* data_;
  std::uint64_t size_;
  std::string name_;
};

// Reads at most max_bytes from the start of a file (format detection without mmap).
std::vector<std::uint8_t> read_file_head(const std::string& path, std::size_t max_bytes);

}  // namespace eaglekit
