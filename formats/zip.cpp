#include "formats/zip.h"

#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>

#include "formats/atomic_file.h"
#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/crc32.h"
#include "formats/error.h"

namespace eaglekit {

namespace {

constexpr std::uint32_t kLocalSig = 0x04034b50;    // "PK\3\4"
constexpr std::uint32_t kCentralSig = 0x02014b50;  // "PK\1\2"
constexpr std::uint32_t kEndSig = 0x06054b50;      // "PK\5\6"
constexpr std::uint32_t kEnd64Sig = 0x06064b50;    // "PK\6\6"
constexpr std::uint32_t kLocatorSig = 0x07064b50;  // "PK\6\7"
constexpr std::uint64_t kLocalSize = 30;
constexpr std::uint64_t kCentralSize = 46;
constexpr std::uint64_t kEndSize = 22;
constexpr std::uint64_t kEnd64Size = 56;
constexpr std::uint64_t kLocatorSize = 20;
constexpr std::uint64_t kMaxComment = 0xffff;
constexpr std::uint16_t kZip64ExtraId = 0x0001;
constexpr std::uint16_t kPadExtraId = 0x4246;  // "FB", torch's alignment padding
constexpr std::uint32_t kMax32 = 0xffffffffu;
constexpr std::uint16_t kMax16 = 0xffff;

std::uint32_t crc_update(std::uint32_t crc, const void* data, std::size_t n) {
  return crc32_update(crc, data, n);
}

}  // namespace

ZipArchive::ZipArchive(std::shared_ptr<const ByteSource> source) : source_(std::move(source)) {
  read_directory();
}

const std::string& ZipArchive::name() const { return source_->name(); }

void ZipArchive::read_directory() {
  const ByteSource& src = *source_;
  const std::uint64_t size = src.size();
  const std::string& path = src.name();
  if (size < kEndSize)
    throw FormatError(path, 0, "zip end of central directory",
                      "file is " + std::to_string(size) +
                          " bytes, too short for a zip archive (truncated?)");

  // Backwards scan for the end record; accept the last one whose comment fits the file.
  const std::uint64_t last = size - kEndSize;
  const std::uint64_t first = last > kMaxComment ? last - kMaxComment : 0;
  std::optional<std::uint64_t> end_pos;
  for (std::uint64_t pos = last + 1; pos-- > first;) {
    const std::uint8_t* p = src.data() + pos;
    if (load_le32(p) != kEndSig) continue;
    if (pos + kEndSize + load_le16(p + 20) <= size) {
      end_pos = pos;
      break;
    }
  }
  if (!end_pos)
    throw FormatError(path, first, "zip end of central directory",
                      "signature PK\\5\\6 not found in the last " + std::to_string(size - first) +
                          " bytes (not a zip archive, or truncated)");
  const std::uint8_t* e = src.data() + *end_pos;
  if (load_le16(e + 4) != 0 || load_le16(e + 6) != 0)
    throw UnsupportedError(path, *end_pos, "zip end of central directory",
                           "multi-disk (split) archives are not supported");
  std::uint64_t count = load_le16(e + 10);
  std::uint64_t cd_size = load_le32(e + 12);
  std::uint64_t cd_offset = load_le32(e + 16);
  std::uint64_t cd_limit = *end_pos;  // the directory must end before the end records

  const bool has_locator =
      *end_pos >= kLocatorSize && load_le32(src.data() + *end_pos - kLocatorSize) == kLocatorSig;
  if (has_locator) {
    const std::uint64_t loc_pos = *end_pos - kLocatorSize;
    const std::uint64_t z64 = load_le64(src.data() + loc_pos + 8);
    if (z64 > loc_pos || loc_pos - z64 < kEnd64Size)
      throw FormatError(path, loc_pos, "zip64 end of central directory locator",
                        "points to byte " + std::to_string(z64) +
                            ", which leaves no room for the 56-byte zip64 end record before it");
    const std::uint8_t* r = src.at(z64, kEnd64Size, "zip64 end of central directory");
    if (load_le32(r) != kEnd64Sig)
      throw FormatError(path, z64, "zip64 end of central directory",
                        "bad signature (expected PK\\6\\6)");
    count = load_le64(r + 32);
    cd_size = load_le64(r + 40);
    cd_offset = load_le64(r + 48);
    cd_limit = z64;
    zip64_ = true;
  } else if (count == kMax16 || cd_size == kMax32 || cd_offset == kMax32) {
    throw FormatError(path, *end_pos, "zip end of central directory",
                      "fields are saturated (ZIP64) but there is no zip64 locator before it");
  }

  if (cd_offset > cd_limit || cd_size > cd_limit - cd_offset)
    throw FormatError(path, *end_pos, "zip central directory",
                      "offset " + std::to_string(cd_offset) + " + size " +
                          std::to_string(cd_size) + " runs past the end records at byte " +
                          std::to_string(cd_limit) + " (truncated or corrupt)");
  if (count > cd_size / kCentralSize)
    throw FormatError(path, cd_offset, "zip central directory",
                      "entry count " + std::to_string(count) + " does not fit in " +
                          std::to_string(cd_size) + " directory bytes");

  entries_.reserve(static_cast<std::size_t>(count));
  const std::uint64_t cd_end = cd_offset + cd_size;
  std::uint64_t p = cd_offset;
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::string field = "zip central directory entry " + std::to_string(i);
    if (cd_end - p < kCentralSize)
      throw FormatError(path, p, field, "runs past the end of the central directory");
    ByteCursor c(src, p, cd_end, "zip central directory");
    if (c.u32(field) != kCentralSig)
      throw FormatError(path, p, field, "bad signature (expected PK\\1\\2)");
    ZipEntry z;
    c.skip(4, field);  // versions made by and needed
    z.flags = c.u16(field);
    z.method = c.u16(field);
    c.skip(4, field);  // time and date
    z.crc32 = c.u32(field);
    z.compressed_size = c.u32(field);
    z.size = c.u32(field);
    const std::uint64_t name_len = c.u16(field);
    const std::uint64_t extra_len = c.u16(field);
    const std::uint64_t comment_len = c.u16(field);
    const std::uint16_t disk = c.u16(field);
    c.skip(6, field);  // internal and external attributes
    z.local_header_offset = c.u32(field);
    if (c.left() < name_len + extra_len + comment_len)
      throw FormatError(path, p, field,
                        "name/extra/comment lengths run past the end of the central directory");
    z.name.assign(reinterpret_cast<const char*>(c.take(name_len, field)), name_len);

    // ZIP64 extended information: present fields follow in a fixed order, only for the
    // 32-bit fields that are saturated.
    const std::uint8_t* x = c.take(extra_len, field);
    std::uint64_t xo = 0;
    bool saw_zip64 = false;
    while (xo + 4 <= extra_len) {
      const std::uint16_t id = load_le16(x + xo);
      const std::uint16_t len = load_le16(x + xo + 2);
      if (xo + 4 + len > extra_len)
        throw FormatError(path, p + kCentralSize + name_len + xo, field,
                          "extra field " + std::to_string(id) + " of " + std::to_string(len) +
                              " bytes runs past the extra area of entry " + squote(z.name));
      if (id == kZip64ExtraId) {
        saw_zip64 = true;
        const std::uint8_t* f = x + xo + 4;
        std::uint64_t left = len;
        auto take = [&](std::uint64_t& v, const char* what) {
          if (left < 8)
            throw FormatError(path, p + kCentralSize + name_len + xo, field,
                              std::string("zip64 extra field of ") + squote(z.name) +
                                  " lacks the " + what);
          v = load_le64(f);
          f += 8;
          left -= 8;
        };
        if (z.size == kMax32) take(z.size, "uncompressed size");
        if (z.compressed_size == kMax32) take(z.compressed_size, "compressed size");
        if (z.local_header_offset == kMax32) take(z.local_header_offset, "local header offset");
      }
      xo += 4 + len;
    }
    if (!saw_zip64 &&
        (z.size == kMax32 || z.compressed_size == kMax32 || z.local_header_offset == kMax32))
      throw FormatError(path, p, field,
                        "sizes are saturated but entry " + squote(z.name) +
                            " has no zip64 extra field");
    if (disk != 0 && disk != kMax16)
      throw UnsupportedError(path, p, field, "entry on disk " + std::to_string(disk));
    if (z.flags & 1u)
      throw UnsupportedError(path, p, field, "entry " + squote(z.name) + " is encrypted");
    if (z.method == 0 && z.compressed_size != z.size)
      throw FormatError(path, p, field,
                        "stored entry " + squote(z.name) + " has compressed size " +
                            std::to_string(z.compressed_size) + " != size " +
                            std::to_string(z.size));

    // The local header decides where the data starts (its extra field holds the padding).
    const std::string lfield = "zip local header of " + squote(z.name);
    if (z.local_header_offset > cd_offset || cd_offset - z.local_header_offset < kLocalSize)
      throw FormatError(path, z.local_header_offset, lfield,
                        "offset lies inside or past the central directory at byte " +
                            std::to_string(cd_offset));
    const std::uint8_t* l = src.at(z.local_header_offset, kLocalSize, lfield.c_str());
    if (load_le32(l) != kLocalSig)
      throw FormatError(path, z.local_header_offset, lfield, "bad signature (expected PK\\3\\4)");
    const std::uint64_t lname = load_le16(l + 26);
    const std::uint64_t lextra = load_le16(l + 28);
    z.data_offset = z.local_header_offset + kLocalSize + lname + lextra;
    if (z.data_offset > cd_offset || z.compressed_size > cd_offset - z.data_offset)
      throw FormatError(path, z.local_header_offset, lfield,
                        "data of " + std::to_string(z.compressed_size) + " bytes from byte " +
                            std::to_string(z.data_offset) +
                            " runs into the central directory at byte " +
                            std::to_string(cd_offset) + " (truncated or corrupt)");
    if (lname != name_len ||
        std::memcmp(l + kLocalSize, z.name.data(), static_cast<std::size_t>(name_len)) != 0)
      throw FormatError(path, z.local_header_offset, lfield,
                        "name differs from the central directory's");
    c.skip(comment_len, field);
    entries_.push_back(std::move(z));
    p = c.pos();
  }

  by_name_.resize(entries_.size());
  for (std::size_t i = 0; i < by_name_.size(); ++i) by_name_[i] = i;
  std::sort(by_name_.begin(), by_name_.end(),
            [&](std::size_t a, std::size_t b) { return entries_[a].name < entries_[b].name; });
  for (std::size_t i = 1; i < by_name_.size(); ++i)
    if (entries_[by_name_[i]].name == entries_[by_name_[i - 1]].name)
      throw FormatError(path, entries_[by_name_[i]].local_header_offset, "zip central directory",
                        "duplicate entry " + squote(entries_[by_name_[i]].name));
}

const ZipEntry* ZipArchive::find(std::string_view name) const {
  auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                             [&](std::size_t i, std::string_view n) { return entries_[i].name < n; });
  if (it == by_name_.end() || entries_[*it].name != name) return nullptr;
  return &entries_[*it];
}

const std::uint8_t* ZipArchive::data(const ZipEntry& e) const {
  if (e.method != 0)
    throw UnsupportedError(name(), e.local_header_offset, "zip entry " + squote(e.name),
                           "compressed with method " + std::to_string(e.method) +
                               (e.method == 8 ? " (deflate)" : "") +
                               "; only stored entries are read (torch.save never compresses; "
                               "was the archive re-zipped?)");
  return source_->at(e.data_offset, e.size, "zip entry data");
}

void ZipArchive::verify_crc(const ZipEntry& e) const {
  const std::uint8_t* p = data(e);
  const std::uint32_t crc = crc_update(static_cast<std::uint32_t>(::crc32(0, nullptr, 0)), p,
                                       static_cast<std::size_t>(e.size));
  if (crc != e.crc32) {
    char buf[160];
    std::snprintf(buf, sizeof buf,
                  "CRC-32 stored %08x, computed %08x: the bytes changed after the archive was "
                  "written (a damaged copy or disk)",
                  e.crc32, crc);
    throw ChecksumError(name(), e.data_offset, "zip entry " + squote(e.name), buf);
  }
}

std::string_view ZipArchive::text(const ZipEntry& e) const {
  return std::string_view(reinterpret_cast<const char*>(data(e)), static_cast<std::size_t>(e.size));
}

// ---------------------------------------------------------------------------------------

ZipWriter::ZipWriter(const std::string& path, ZipWriterOptions opts)
    : file_(std::make_unique<AtomicFile>(path)), opts_(opts) {
  if (opts_.alignment == 0 || (opts_.alignment & (opts_.alignment - 1)) != 0)
    throw UsageError("zip alignment must be a power of two, got " +
                     std::to_string(opts_.alignment));
}

ZipWriter::~ZipWriter() = default;

void ZipWriter::add(std::string_view name, const void* data, std::size_t n) {
  begin_entry(name, n);
  write(data, n);
  end_entry();
}

void ZipWriter::begin_entry(std::string_view name, std::uint64_t size) {
  if (in_entry_ || finished_) throw Error("ZipWriter::begin_entry: previous entry still open");
  if (name.size() > kMax16) throw UsageError("zip entry name too long: " + std::string(name));
  const std::uint64_t offset = file_->tell();
  const bool z64 = opts_.force_zip64 || size >= kMax32;
  ByteWriter h;
  h.u32(kLocalSig);
  h.u16(z64 ? 45 : 20);  // version needed
  h.u16(0x0800);         // names are UTF-8
  h.u16(0);              // stored
  h.u16(0);              // time 00:00
  h.u16(0x21);           // date 1980-01-01
  h.u32(0);              // CRC, patched by end_entry()
  h.u32(z64 ? kMax32 : static_cast<std::uint32_t>(size));
  h.u32(z64 ? kMax32 : static_cast<std::uint32_t>(size));
  h.u16(static_cast<std::uint16_t>(name.size()));
  const std::size_t extra_len_at = h.size();
  h.u16(0);  // extra length, set below
  h.bytes(name);
  const std::size_t extra_begin = h.size();
  if (z64) {
    h.u16(kZip64ExtraId);
    h.u16(16);
    h.u64(size);
    h.u64(size);
  }
  if (opts_.alignment > 1) {
    const std::uint64_t end = offset + h.size() + 4;
    const std::uint64_t pad = (opts_.alignment - end % opts_.alignment) % opts_.alignment;
    h.u16(kPadExtraId);
    h.u16(static_cast<std::uint16_t>(pad));
    h.fill(static_cast<std::size_t>(pad), 'Z');
  }
  h.patch_u16(extra_len_at, static_cast<std::uint16_t>(h.size() - extra_begin));
  file_->write(h.data(), h.size());
  crc_offset_ = offset + 14;
  crc_ = static_cast<std::uint32_t>(::crc32(0, nullptr, 0));
  entry_remaining_ = size;
  in_entry_ = true;
  done_.push_back(Written{std::string(name), 0, size, offset});
}

void ZipWriter::write(const void* data, std::size_t n) {
  if (!in_entry_) throw Error("ZipWriter::write outside an entry");
  if (n > entry_remaining_)
    throw Error("ZipWriter::write: entry '" + done_.back().name + "' gets more bytes than declared");
  crc_ = crc_update(crc_, data, n);
  file_->write(data, n);
  entry_remaining_ -= n;
}

void ZipWriter::end_entry() {
  if (!in_entry_) throw Error("ZipWriter::end_entry outside an entry");
  if (entry_remaining_ != 0)
    throw Error("ZipWriter::end_entry: entry '" + done_.back().name + "' is " +
                std::to_string(entry_remaining_) + " bytes short");
  std::uint8_t b[4];
  store_le32(b, crc_);
  file_->pwrite(b, 4, crc_offset_);
  done_.back().crc32 = crc_;
  in_entry_ = false;
}

void ZipWriter::finish() {
  if (in_entry_) throw Error("ZipWriter::finish with an entry still open");
  if (finished_) return;
  const std::uint64_t cd_offset = file_->tell();
  ByteWriter cd;
  for (const auto& w : done_) {
    const bool size64 = opts_.force_zip64 || w.size >= kMax32;
    const bool off64 = opts_.force_zip64 || w.local_header_offset >= kMax32;
    cd.u32(kCentralSig);
    cd.u16((size64 || off64) ? 45 : 20);  // version made by (MS-DOS, spec 4.5 / 2.0)
    cd.u16((size64 || off64) ? 45 : 20);  // version needed
    cd.u16(0x0800);
    cd.u16(0);
    cd.u16(0);
    cd.u16(0x21);
    cd.u32(w.crc32);
    cd.u32(size64 ? kMax32 : static_cast<std::uint32_t>(w.size));
    cd.u32(size64 ? kMax32 : static_cast<std::uint32_t>(w.size));
    cd.u16(static_cast<std::uint16_t>(w.name.size()));
    const std::uint16_t xlen = static_cast<std::uint16_t>((size64 || off64) ? 4 + (size64 ? 16 : 0) + (off64 ? 8 : 0) : 0);
    cd.u16(xlen);
    cd.u16(0);  // comment
    cd.u16(0);  // disk
    cd.u16(0);  // internal attributes
    cd.u32(0);  // external attributes
    cd.u32(off64 ? kMax32 : static_cast<std::uint32_t>(w.local_header_offset));
    cd.bytes(w.name);
    if (xlen) {
      cd.u16(kZip64ExtraId);
      cd.u16(static_cast<std::uint16_t>(xlen - 4));
      if (size64) {
        cd.u64(w.size);
        cd.u64(w.size);
      }
      if (off64) cd.u64(w.local_header_offset);
    }
  }
  const std::uint64_t cd_size = cd.size();
  const std::uint64_t end64 = cd_offset + cd_size;
  const std::uint64_t n = done_.size();
  // ZIP64 end record + locator always, as torch writes them.
  cd.u32(kEnd64Sig);
  cd.u64(kEnd64Size - 12);
  cd.u16(45);
  cd.u16(45);
  cd.u32(0);
  cd.u32(0);
  cd.u64(n);
  cd.u64(n);
  cd.u64(cd_size);
  cd.u64(cd_offset);
  cd.u32(kLocatorSig);
  cd.u32(0);
  cd.u64(end64);
  cd.u32(1);
  cd.u32(kEndSig);
  cd.u16(0);
  cd.u16(0);
  cd.u16(static_cast<std::uint16_t>(std::min<std::uint64_t>(n, kMax16)));
  cd.u16(static_cast<std::uint16_t>(std::min<std::uint64_t>(n, kMax16)));
  cd.u32(static_cast<std::uint32_t>(std::min<std::uint64_t>(cd_size, kMax32)));
  cd.u32(static_cast<std::uint32_t>(std::min<std::uint64_t>(cd_offset, kMax32)));
  cd.u16(0);
  file_->write(cd.data(), cd.size());
  file_->commit();
  finished_ = true;
}

}  // namespace eaglekit
