// ZIP archives as torch.save writes them: a reader for STORED (uncompressed) entries over a
// ByteSource, and a writer that aligns every entry's data like torch does.
//
// Layout read (APPNOTE 6.3): [local header "PK\3\4" + name + extra, data, optional data
// descriptor "PK\7\8"]... central directory ["PK\1\2" + name + extra + comment]...,
// optional ZIP64 end record "PK\6\6" + its locator "PK\6\7", end record "PK\5\6" + comment.
// The end record is found by a backwards scan bounded to 64 KiB + 22 bytes (the largest
// comment). ZIP64 sizes and offsets come from the end record and from the 0x0001 extra
// field of each central entry. Every count, size and offset is checked against the source
// size before it is used or anything is allocated for it; a violation is a FormatError
// naming the source, the byte offset and the field. Only method 0 (stored) entries can be
// read: torch never compresses, so a deflated entry is an UnsupportedError when read.
// CRCs are not verified by data(): that would touch every byte and defeat zero-copy views
// and prefix reads (torch.load does not verify them either when it maps a file); callers
// that read an entry whole call verify_crc (the .pt record reader does, formats/pt_format.h).
//
// Writer: each entry's data starts at a multiple of `alignment` (64, like torch >= 1.6),
// reached by padding the local header's extra field with an "FB" block of 'Z' bytes, the
// way torch's PyTorchStreamWriter does. Sizes and CRC-32 (zlib) go in the local header
// (no data descriptors). ZIP64 fields are written for any entry or offset that needs them
// (or for all, with force_zip64); the ZIP64 end record and locator are always written, as
// torch does. Output goes through AtomicFile: nothing appears under the final name before
// finish().
//
// Thread safety: a ZipArchive is immutable after open(); share it freely. A ZipWriter is
// single-threaded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace eaglekit {

class ByteSource;
class AtomicFile;

struct ZipEntry {
  std::string name;
  std::uint16_t method = 0;        // 0 stored, 8 deflate, ...
  std::uint16_t flags = 0;
  std::uint32_t crc32 = 0;
  std::uint64_t compressed_size = 0;
  std::uint64_t size = 0;          // uncompressed
  std::uint64_t local_header_offset = 0;
  std::uint64_t data_offset = 0;   // first byte of the entry's data in the source
};

class ZipArchive {
 public:
  // Parses the directory and every local header. Throws FormatError (not a zip, truncated,
  // offsets past the end, duplicate names, encrypted entries).
  explicit ZipArchive(std::shared_ptr<const ByteSource> source);

  const std::vector<ZipEntry>& entries() const { return entries_; }
  // nullptr when absent.
  const ZipEntry* find(std::string_view name) const;
  // The entry's bytes in the source (a view; valid while the source lives). Throws
  // UnsupportedError for compressed entries.
  const std::uint8_t* data(const ZipEntry& e) const;
  std::string_view text(const ZipEntry& e) const;
  // Reads the entry's every byte and compares their CRC-32 with the directory's. Throws
  // ChecksumError naming the entry and both values, UnsupportedError for compressed entries.
  void verify_crc(const ZipEntry& e) const;
  const std::shared_ptr<const ByteSource>& source() const { return source_; }
  const std::string& name() const;
  bool zip64() const { return zip64_; }

 private:
  void read_directory();
  std::shared_ptr<const ByteSource> source_;
  std::vector<ZipEntry> entries_;
  std::vector<std::size_t> by_name_;  // indices into entries_, sorted by name
  bool zip64_ = false;
};

struct ZipWriterOptions {
  std::uint64_t alignment = 64;  // power of two, >= 1
  bool force_zip64 = false;      // ZIP64 extra fields on every entry (tests, interop)
};

class ZipWriter {
 public:
  explicit ZipWriter(const std::string& path, ZipWriterOptions opts = {});
  ~ZipWriter();  // an unfinished archive's temp file is removed; never throws
  ZipWriter(const ZipWriter&) = delete;
  ZipWriter& operator=(const ZipWriter&) = delete;

  // One whole entry.
  void add(std::string_view name, const void* data, std::size_t n);
  // An entry written in pieces: exactly `size` bytes must follow through write().
  void begin_entry(std::string_view name, std::uint64_t size);
  void write(const void* data, std::size_t n);
  void end_entry();
  // Writes the central directory and end records, then commits. Throws IoError.
  void finish();
  // CRC-32 of the last finished entry.
  std::uint32_t last_crc32() const { return done_.empty() ? 0 : done_.back().crc32; }

 private:
  struct Written {
    std::string name;
    std::uint32_t crc32;
    std::uint64_t size;
    std::uint64_t local_header_offset;
  };
  std::unique_ptr<AtomicFile> file_;
  ZipWriterOptions opts_;
  std::vector<Written> done_;
  bool in_entry_ = false;
  bool finished_ = false;
  std::uint64_t entry_remaining_ = 0;
  std::uint64_t crc_offset_ = 0;  // where the open entry's CRC goes
  std::uint32_t crc_ = 0;
};

}  // namespace eaglekit
