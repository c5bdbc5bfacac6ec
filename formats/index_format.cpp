// The dataset index file format; the byte layout is in formats/index_format.h.
#include "formats/index_format.h"

#include <sys/stat.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <new>
#include <stdexcept>
#include <unordered_map>

#include "formats/atomic_file.h"
#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/error.h"
#include "formats/registry.h"

namespace eaglekit {

namespace {

constexpr char kMagic[8] = {'E', 'K', 'I', 'N', 'D', 'E', 'X', '\0'};
constexpr std::uint32_t kHeaderSize = 128;
constexpr std::uint32_t kEntrySize = 80;
constexpr std::uint32_t kFileEntrySize = 48;
constexpr std::uint32_t kLossMasksSize = 32;       // the loss-mask file's block (version 4)
constexpr std::uint32_t kVersionWithoutLossMasks = 3;
constexpr std::uint64_t kMaxStringLength = (1ull << 24) - 1;
constexpr std::uint64_t kMaxStringsSize = 1ull << 40;
constexpr std::size_t kMaxErrorLength = 4096;

// Entry flag bits.
constexpr std::uint8_t kFlagBad = 1;
constexpr std::uint8_t kFlagLossMask = 2;
constexpr std::uint8_t kFlagIdFromFileName = 4;
constexpr std::uint8_t kFlagNormStated = 8;   // the record states its norm form (version 2)
constexpr std::uint8_t kFlagPrenorm = 16;     // ... and it is pre-norm
// Its layout implies a norm form (Record::layout_prenorm), and which. Version 3 written by an
// older build leaves both clear: those records' form is measured, as for any unknown one.
constexpr std::uint8_t kFlagLayoutNorm = 32;
constexpr std::uint8_t kFlagLayoutPrenorm = 64;
constexpr std::uint8_t kFlagJoinedLossMask = 128;  // its mask is the loss-mask file's (version 4)

// Stable on-disk codes, independent of the enums' order in the headers: formats'
// from their rows (FormatRow::index_code), 0 for unknown (a file that could not be read).
std::uint8_t format_code(Format f) {
  const FormatRow* row = format_row(f);
  return row ? row->index_code : 0;
}

std::optional<Format> format_from_code(std::uint8_t c) {
  static const std::array<std::optional<Format>, 256> kFormats = [] {
    std::array<std::optional<Format>, 256> by_code;
    by_code[0] = Format::kUnknown;
    for (const FormatRow& row : format_rows()) by_code[row.index_code] = row.format;
    return by_code;
  }();
  return kFormats[c];
}

std::uint8_t dtype_code(DType t) {
  switch (t) {
    case DType::kBool: return 0;
    case DType::kUInt8: return 1;
    case DType::kInt8: return 2;
    case DType::kInt16: return 3;
    case DType::kInt32: return 4;
    case DType::kInt64: return 5;
    case DType::kFloat16: return 6;
    case DType::kBFloat16: return 7;
    case DType::kFloat32: return 8;
    case DType::kFloat64: return 9;
  }
  return 0;
}

std::optional<DType> dtype_from_code(std::uint8_t c) {
  static const DType kTypes[] = {DType::kBool,    DType::kUInt8,    DType::kInt8,
                                 DType::kInt16,   DType::kInt32,    DType::kInt64,
                                 DType::kFloat16, DType::kBFloat16, DType::kFloat32,
                                 DType::kFloat64};
  if (c < sizeof kTypes / sizeof kTypes[0]) return kTypes[c];
  return std::nullopt;
}

std::uint64_t align8(std::uint64_t v) { return (v + 7) & ~std::uint64_t{7}; }

std::string clip_error(std::string e) {
  if (e.size() > kMaxErrorLength) {
    e.resize(kMaxErrorLength);
    e += "...";
  }
  return e;
}

// The absolute, lexically normal folder holding the index file `path`.
std::string folder_of(const std::string& path) {
  std::error_code ec;
  std::filesystem::path a = std::filesystem::absolute(path, ec);
  if (ec) a = path;
  return a.lexically_normal().parent_path().string();
}

// How a path is stored: relative to `dir` when it lies below it, else as given.
std::string_view stored_path(std::string_view p, const std::string& dir) {
  if (dir.size() <= 1 || p.size() <= dir.size() + 1 || p.compare(0, dir.size(), dir) != 0 ||
      p[dir.size()] != '/')
    return p;
  return p.substr(dir.size() + 1);
}

// The strings section. Paths, ids and errors are mostly unique and go in as they come;
// only strings that repeat by nature (codecs, roots) are interned.
class StringTable {
 public:
  std::uint64_t add(std::string_view s, const char* what) {
    check(s, what);
    if (s.empty()) return 0;
    const std::uint64_t off = bytes_.size();
    bytes_.insert(bytes_.end(), s.begin(), s.end());
    if (bytes_.size() > kMaxStringsSize) throw UsageError("index: strings exceed 1 TiB");
    return off | (static_cast<std::uint64_t>(s.size()) << 40);
  }
  std::uint64_t intern(std::string_view s, const char* what) {
    check(s, what);
    if (s.empty()) return 0;
    const auto it = seen_.find(std::string(s));
    if (it != seen_.end()) return it->second;
    const std::uint64_t ref = add(s, what);
    seen_.emplace(std::string(s), ref);
    return ref;
  }
  const std::vector<std::uint8_t>& bytes() const { return bytes_; }

 private:
  static void check(std::string_view s, const char* what) {
    if (s.size() > kMaxStringLength)
      throw UsageError(std::string("index: ") + what + " is " + std::to_string(s.size()) +
                       " bytes; the index stores at most 16 MiB per string");
  }
  std::vector<std::uint8_t> bytes_;
  std::unordered_map<std::string, std::uint64_t> seen_;
};

}  // namespace

// ---------------------------------------------------------------------------------------
// Loading

struct DatasetIndex::Impl {
  std::shared_ptr<const ByteSource> src;
  std::string path;
  const std::uint8_t* base = nullptr;
  std::uint64_t entry_count = 0, file_count = 0, root_count = 0;
  std::uint64_t roots_off = 0, files_off = 0, entries_off = 0, sorted_off = 0;
  std::uint64_t strings_off = 0, strings_size = 0, bad_count = 0;
  std::uint32_t version = 0;
  std::optional<IndexLossMasks> loss_masks;
  // Version 3 stores paths below the index's folder relative to it: their absolute forms,
  // per file and root ("" where the stored path is absolute; empty vectors when none is).
  std::vector<std::string> resolved_files, resolved_roots;

  std::string_view str(std::uint64_t ref, std::uint64_t at, const char* field) const {
    const std::uint64_t off = ref & ((1ull << 40) - 1);
    const std::uint64_t len = ref >> 40;
    if (len == 0) return {};
    if (off > strings_size || len > strings_size - off)
      throw FormatError(path, at, field,
                        "string reference (offset " + std::to_string(off) + ", length " +
                            std::to_string(len) + ") outside the strings section of " +
                            std::to_string(strings_size) + " bytes");
    return {reinterpret_cast<const char*>(base + strings_off + off), static_cast<std::size_t>(len)};
  }

  // The string whose ref is the cursor's next u64.
  std::string_view next_str(ByteCursor& c, const char* field) const {
    const std::uint64_t at = c.pos();
    return str(c.u64(field), at, field);
  }

  std::string_view entry_id(std::size_t i) const {
    const std::uint64_t at = entries_off + i * kEntrySize;
    return str(load_le64(base + at), at, "entry conversation_id");
  }

  std::size_t sorted(std::size_t rank) const {
    const std::uint64_t at = sorted_off + rank * 4;
    const std::uint32_t e = load_le32(base + at);
    if (e >= entry_count)
      throw FormatError(path, at, "sorted ids",
                        "entry number " + std::to_string(e) + " >= entry count " +
                            std::to_string(entry_count));
    return e;
  }
};

DatasetIndex::DatasetIndex(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DatasetIndex::DatasetIndex(DatasetIndex&&) noexcept = default;
DatasetIndex& DatasetIndex::operator=(DatasetIndex&&) noexcept = default;
DatasetIndex::~DatasetIndex() = default;

DatasetIndex DatasetIndex::load(const std::string& path) {
  return from_source(ByteSource::open_file(path));
}

DatasetIndex DatasetIndex::from_source(std::shared_ptr<const ByteSource> src) {
  auto impl = std::make_unique<Impl>();
  const std::string& path = src->name();
  impl->path = path;
  const std::uint64_t size = src->size();
  if (size < 8)
    throw FormatError(path, 0, "magic",
                      "file is " + std::to_string(size) +
                          " bytes, too short to be an eaglekit dataset index (truncated?)");
  if (std::memcmp(src->data(), kMagic, 8) != 0)
    throw FormatError(path, 0, "magic",
                      "not an eaglekit dataset index (expected \"EKINDEX\"); build one with "
                      "`eaglekit index DIR --out FILE`");
  if (size < kHeaderSize + 8)
    throw FormatError(path, 0, "header",
                      "file is " + std::to_string(size) + " bytes, shorter than the " +
                          std::to_string(kHeaderSize + 8) + " of an empty index (truncated)");
  const std::uint8_t* h = src->data();
  ByteCursor c(*src, 8, kHeaderSize, "index header");
  const std::uint32_t version = c.u32("version");
  const std::uint32_t header_size = c.u32("header size");
  const std::uint32_t entry_size = c.u32("entry size");
  const std::uint32_t file_entry_size = c.u32("file entry size");
  impl->entry_count = c.u64("entry count");
  impl->file_count = c.u64("file count");
  impl->root_count = c.u64("root count");
  impl->roots_off = c.u64("roots offset");
  impl->files_off = c.u64("files offset");
  impl->entries_off = c.u64("entries offset");
  impl->sorted_off = c.u64("sorted-ids offset");
  impl->strings_off = c.u64("strings offset");
  impl->strings_size = c.u64("strings size");
  const std::uint64_t total = c.u64("total size");
  impl->bad_count = c.u64("bad count");
  const std::uint64_t loss_masks_off = c.u64("loss-mask file offset");
  if (version < kOldestVersion || version > kVersion)
    throw UnsupportedError(path, 8, "version",
                           "index version " + std::to_string(version) + "; this build reads " +
                               std::to_string(kOldestVersion) + " to " + std::to_string(kVersion) +
                               ": rebuild it with `eaglekit index`");
  impl->version = version;
  if (header_size != kHeaderSize || entry_size != kEntrySize || file_entry_size != kFileEntrySize)
    throw FormatError(path, 12, "header",
                      "record sizes " + std::to_string(header_size) + "/" +
                          std::to_string(entry_size) + "/" + std::to_string(file_entry_size) +
                          " differ from version " + std::to_string(version) + "'s " +
                          std::to_string(kHeaderSize) + "/" + std::to_string(kEntrySize) + "/" +
                          std::to_string(kFileEntrySize));
  if (total != size)
    throw FormatError(path, 96, "total size",
                      "header says " + std::to_string(total) + " bytes but the file has " +
                          std::to_string(size) + (size < total ? " (truncated)" : ""));
  const std::uint64_t stored = load_le64(h + size - 8);
  const std::uint64_t computed = XXH3_64bits(h, static_cast<std::size_t>(size - 8));
  if (stored != computed) {
    char buf[80];
    std::snprintf(buf, sizeof buf, "stored %016llx, computed %016llx",
                  static_cast<unsigned long long>(stored), static_cast<unsigned long long>(computed));
    throw ChecksumError(path, size - 8, "checksum",
                        std::string(buf) + ": the index is corrupt; rebuild it with `eaglekit index`");
  }
  const std::uint64_t body_end = size - 8;
  constexpr std::uint64_t kMaxCount = std::numeric_limits<std::uint32_t>::max();
  struct Section {
    const char* name;
    std::uint64_t header_at, off, count, elem;
  };
  const Section sections[] = {
      {"roots", 48, impl->roots_off, impl->root_count, 8},
      {"files", 56, impl->files_off, impl->file_count, kFileEntrySize},
      {"entries", 64, impl->entries_off, impl->entry_count, kEntrySize},
      {"sorted ids", 72, impl->sorted_off, impl->entry_count, 4},
      {"strings", 80, impl->strings_off, impl->strings_size, 1},
  };
  for (const auto& s : sections) {
    if (s.count > (s.elem == 1 ? kMaxStringsSize : kMaxCount))
      throw FormatError(path, s.header_at, s.name, "count " + std::to_string(s.count) + " is too large");
    const std::uint64_t len = s.count * s.elem;
    if (s.off < kHeaderSize || s.off % 8 != 0 || s.off > body_end || len > body_end - s.off)
      throw FormatError(path, s.header_at, s.name,
                        "section at byte " + std::to_string(s.off) + " of " +
                            std::to_string(len) + " bytes lies outside the file's " +
                            std::to_string(body_end) + " bytes");
  }
  if (impl->bad_count > impl->entry_count)
    throw FormatError(path, 104, "bad count",
                      std::to_string(impl->bad_count) + " bad entries but only " +
                          std::to_string(impl->entry_count) + " entries");
  // Before version 4 the bytes were written zero and mean nothing.
  const bool has_loss_masks = version >= 4 && loss_masks_off != 0;
  if (has_loss_masks && (loss_masks_off < kHeaderSize || loss_masks_off % 8 != 0 || loss_masks_off > body_end ||
                         kLossMasksSize > body_end - loss_masks_off))
    throw FormatError(path, 112, "loss-mask file",
                      "block at byte " + std::to_string(loss_masks_off) + " of " + std::to_string(kLossMasksSize) +
                          " bytes lies outside the file's " + std::to_string(body_end) + " bytes");
  impl->base = h;
  impl->src = std::move(src);
  if (has_loss_masks) {
    ByteCursor lm(*impl->src, loss_masks_off, loss_masks_off + kLossMasksSize, "index loss-mask file");
    IndexLossMasks m;
    const std::string_view p = impl->next_str(lm, "loss-mask file path");
    if (p.empty()) throw FormatError(path, loss_masks_off, "loss-mask file path", "is empty");
    m.path = p.front() == '/' ? std::string(p) : folder_of(path) + "/" + std::string(p);
    m.size = lm.u64("loss-mask file size");
    m.mtime_ns = lm.i64("loss-mask file mtime");
    m.xxh3 = lm.u64("loss-mask file hash");
    impl->loss_masks = std::move(m);
  }
  if (version >= 3) {
    const std::string dir = folder_of(path);
    auto resolve = [&](std::uint64_t table, std::uint64_t count, std::uint64_t stride, const char* field,
                       std::vector<std::string>& out) {
      for (std::uint64_t i = 0; i < count; ++i) {
        const std::uint64_t at = table + i * stride;
        const std::string_view p = impl->str(load_le64(h + at), at, field);
        if (p.empty() || p.front() == '/') continue;
        out.resize(static_cast<std::size_t>(count));
        out[static_cast<std::size_t>(i)] = dir + "/" + std::string(p);
      }
    };
    resolve(impl->files_off, impl->file_count, kFileEntrySize, "file path", impl->resolved_files);
    resolve(impl->roots_off, impl->root_count, 8, "root", impl->resolved_roots);
  }
  return DatasetIndex(std::move(impl));
}

std::size_t DatasetIndex::size() const { return static_cast<std::size_t>(impl_->entry_count); }
std::size_t DatasetIndex::file_count() const { return static_cast<std::size_t>(impl_->file_count); }
std::size_t DatasetIndex::bad_count() const { return static_cast<std::size_t>(impl_->bad_count); }
const std::string& DatasetIndex::path() const { return impl_->path; }
std::uint32_t DatasetIndex::version() const { return impl_->version; }
const std::optional<IndexLossMasks>& DatasetIndex::loss_masks() const { return impl_->loss_masks; }

IndexEntry DatasetIndex::entry(std::size_t i) const {
  const Impl& m = *impl_;
  if (i >= m.entry_count)
    throw std::out_of_range("index entry " + std::to_string(i) + " of " +
                            std::to_string(m.entry_count));
  const std::uint64_t at = m.entries_off + i * kEntrySize;
  ByteCursor c(*m.src, at, at + kEntrySize, "index entry");
  IndexEntry e;
  e.conversation_id = m.next_str(c, "entry conversation_id");
  e.key = m.next_str(c, "entry key");
  e.codec = m.next_str(c, "entry codec");
  e.error = m.next_str(c, "entry error");
  e.tokens = c.i64("entry tokens");
  e.byte_offset = c.u64("entry byte offset");
  e.byte_size = c.u64("entry byte size");
  e.file = c.u32("entry file");
  e.record = c.u32("entry record");
  e.hidden_size = c.u32("entry hidden size");
  e.aux_width = c.u32("entry aux width");
  if (e.file >= m.file_count)
    throw FormatError(m.path, at + 56, "entry file",
                      "file number " + std::to_string(e.file) + " >= file count " +
                          std::to_string(m.file_count));
  const std::uint8_t format = c.u8("entry format");
  const std::uint8_t ids_dtype = c.u8("entry ids dtype");
  const std::uint8_t hidden_dtype = c.u8("entry hidden dtype");
  const std::uint8_t flags = c.u8("entry flags");
  const std::uint8_t kind = c.u8("entry error kind");
  const auto f = format_from_code(format);
  const auto ids = dtype_from_code(ids_dtype);
  const auto hid = dtype_from_code(hidden_dtype);
  if (!f || !ids || !hid)
    throw FormatError(m.path, at + 72, "entry codes",
                      "unknown format or dtype code " + std::to_string(format) + "/" +
                          std::to_string(ids_dtype) + "/" + std::to_string(hidden_dtype));
  e.format = *f;
  e.ids_dtype = *ids;
  e.hidden_dtype = *hid;
  e.ok = (flags & kFlagBad) == 0;
  e.has_loss_mask = (flags & kFlagLossMask) != 0;
  e.id_from_file_name = (flags & kFlagIdFromFileName) != 0;
  e.joined_loss_mask = (flags & kFlagJoinedLossMask) != 0;
  if (e.joined_loss_mask && !m.loss_masks)
    throw FormatError(m.path, at + 75, "entry flags", "the entry joins a loss mask, but the index names no loss-mask file");
  if ((flags & kFlagNormStated) != 0) e.hidden_states_prenorm = (flags & kFlagPrenorm) != 0;
  if ((flags & kFlagLayoutNorm) != 0) e.layout_prenorm = (flags & kFlagLayoutPrenorm) != 0;
  if (kind > static_cast<std::uint8_t>(EntryError::kOther))
    throw FormatError(m.path, at + 76, "entry error kind", "unknown code " + std::to_string(kind));
  e.error_kind = static_cast<EntryError>(kind);
  if (e.ok != (e.error_kind == EntryError::kNone))
    throw FormatError(m.path, at + 75, "entry flags", "status and error kind disagree");
  return e;
}

IndexFile DatasetIndex::file(std::size_t i) const {
  const Impl& m = *impl_;
  if (i >= m.file_count)
    throw std::out_of_range("index file " + std::to_string(i) + " of " +
                            std::to_string(m.file_count));
  const std::uint64_t at = m.files_off + i * kFileEntrySize;
  ByteCursor c(*m.src, at, at + kFileEntrySize, "index file entry");
  IndexFile f;
  f.path = m.next_str(c, "file path");
  if (!m.resolved_files.empty() && !m.resolved_files[i].empty()) f.path = m.resolved_files[i];
  f.error = m.next_str(c, "file error");
  f.size = c.u64("file size");
  f.mtime_ns = c.i64("file mtime");
  f.first_entry = c.u32("file first entry");
  f.entry_count = c.u32("file entry count");
  const std::uint8_t format = c.u8("file format");
  const auto fmt = format_from_code(format);
  if (!fmt)
    throw FormatError(m.path, at + 40, "file format", "unknown format code " + std::to_string(format));
  f.format = *fmt;
  if (f.first_entry > m.entry_count || f.entry_count > m.entry_count - f.first_entry)
    throw FormatError(m.path, at + 32, "file entries",
                      "entries [" + std::to_string(f.first_entry) + ", +" +
                          std::to_string(f.entry_count) + ") outside the " +
                          std::to_string(m.entry_count) + " entries");
  return f;
}

std::vector<std::string> DatasetIndex::roots() const {
  const Impl& m = *impl_;
  ByteCursor c(*m.src, m.roots_off, m.roots_off + m.root_count * 8, "index roots");
  std::vector<std::string> out;
  for (std::uint64_t i = 0; i < m.root_count; ++i) {
    out.emplace_back(m.next_str(c, "root"));
    if (!m.resolved_roots.empty() && !m.resolved_roots[i].empty()) out.back() = m.resolved_roots[i];
  }
  return out;
}

std::string_view DatasetIndex::conversation_id(std::size_t i) const {
  if (i >= impl_->entry_count)
    throw std::out_of_range("index entry " + std::to_string(i) + " of " +
                            std::to_string(impl_->entry_count));
  return impl_->entry_id(i);
}

std::size_t DatasetIndex::sorted_entry(std::size_t rank) const {
  if (rank >= impl_->entry_count)
    throw std::out_of_range("sorted rank " + std::to_string(rank) + " of " +
                            std::to_string(impl_->entry_count));
  return impl_->sorted(rank);
}

std::vector<std::size_t> DatasetIndex::find(std::string_view id) const {
  const Impl& m = *impl_;
  std::size_t lo = 0, hi = static_cast<std::size_t>(m.entry_count);
  while (lo < hi) {
    const std::size_t mid = lo + (hi - lo) / 2;
    if (m.entry_id(m.sorted(mid)) < id) lo = mid + 1;
    else hi = mid;
  }
  std::vector<std::size_t> out;
  for (std::size_t r = lo; r < m.entry_count; ++r) {
    const std::size_t e = m.sorted(r);
    if (m.entry_id(e) != id) break;
    out.push_back(e);
  }
  return out;  // the table is stably sorted, so these are in index order
}

std::vector<std::string> DatasetIndex::duplicate_ids() const {
  const Impl& m = *impl_;
  std::vector<std::string> out;
  std::string_view prev;
  bool have_prev = false, reported = false;
  for (std::size_t r = 0; r < m.entry_count; ++r) {
    const std::string_view id = m.entry_id(m.sorted(r));
    if (id.empty()) continue;
    if (have_prev && id == prev) {
      if (!reported) out.emplace_back(id);
      reported = true;
    } else {
      prev = id;
      have_prev = true;
      reported = false;
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Writing

void write_index(const std::string& path, const std::vector<std::string>& roots,
                 const std::vector<IndexedFile>& files, const IndexLossMasks* loss_masks) {
  constexpr std::uint64_t kMaxCount = std::numeric_limits<std::uint32_t>::max();
  std::uint64_t n_entries = 0;
  for (const auto& f : files) n_entries += f.records.size();
  if (n_entries > kMaxCount || files.size() > kMaxCount)
    throw UsageError("index: at most 2^32 - 1 entries and files (got " +
                     std::to_string(n_entries) + " entries in " + std::to_string(files.size()) +
                     " files)");

  // The sections are built apart (the strings section fills while the others are), then
  // written out behind the header in layout order.
  StringTable strings;
  ByteWriter roots_w, files_w, entries_w, sorted_w;
  const std::string dir = folder_of(path);
  for (const auto& root : roots) roots_w.u64(strings.intern(stored_path(root, dir), "root path"));

  std::vector<std::string_view> ids;  // per entry, for sorting
  ids.reserve(static_cast<std::size_t>(n_entries));
  entries_w.reserve(static_cast<std::size_t>(n_entries * kEntrySize));
  std::uint64_t bad = 0;
  std::uint32_t e = 0;
  for (std::size_t fi = 0; fi < files.size(); ++fi) {
    const IndexedFile& f = files[fi];
    const std::uint64_t path_ref = strings.add(stored_path(f.path, dir), "file path");
    const std::uint64_t file_error_ref = strings.add(clip_error(f.error), "file error");
    files_w.u64(path_ref).u64(file_error_ref).u64(f.size).i64(f.mtime_ns);
    files_w.u32(e).u32(static_cast<std::uint32_t>(f.records.size()));
    files_w.u8(format_code(f.format)).fill(7);
    for (const IndexedRecord& r : f.records) {
      const RecordInfo& info = r.info;
      const std::uint64_t id_ref = strings.add(info.conversation_id, "conversation id");
      // Shards key their records by conversation id: one copy serves both.
      const std::uint64_t key_ref =
          info.key == info.conversation_id ? id_ref : strings.add(info.key, "record key");
      const std::uint64_t codec_ref = strings.intern(info.codec, "codec");
      const std::uint64_t error_ref = strings.add(clip_error(r.error), "error");
      auto narrow = [&](std::int64_t v, const char* what) {
        if (v < 0 || static_cast<std::uint64_t>(v) > kMaxCount)
          throw UsageError(f.path + ": " + what + " " + std::to_string(v) +
                           " does not fit the index (0 .. 2^32 - 1)");
        return static_cast<std::uint32_t>(v);
      };
      const std::uint32_t hidden_size = narrow(info.hidden_size, "hidden size");
      const std::uint32_t aux_width = narrow(info.aux_width, "aux width");
      std::uint8_t flags = 0;
      if (!r.error.empty()) flags |= kFlagBad;
      if (info.has_loss_mask) flags |= kFlagLossMask;
      if (r.id_from_file_name) flags |= kFlagIdFromFileName;
      if (r.joined_loss_mask) {
        if (loss_masks == nullptr)
          throw UsageError("index: " + f.path + " record " + std::to_string(r.record) +
                           " joins a loss mask, but no loss-mask file is given");
        flags |= kFlagJoinedLossMask;
      }
      if (info.hidden_states_prenorm) flags |= kFlagNormStated | (*info.hidden_states_prenorm ? kFlagPrenorm : 0);
      if (info.layout_prenorm) flags |= kFlagLayoutNorm | (*info.layout_prenorm ? kFlagLayoutPrenorm : 0);
      EntryError kind = r.error_kind;
      if (r.error.empty()) kind = EntryError::kNone;
      else if (kind == EntryError::kNone) kind = EntryError::kOther;
      entries_w.u64(id_ref).u64(key_ref).u64(codec_ref).u64(error_ref);
      entries_w.i64(info.tokens).u64(info.byte_offset).u64(info.byte_size);
      entries_w.u32(static_cast<std::uint32_t>(fi)).u32(r.record).u32(hidden_size).u32(aux_width);
      entries_w.u8(format_code(f.format)).u8(dtype_code(info.ids_dtype));
      entries_w.u8(dtype_code(info.hidden_dtype)).u8(flags).u8(static_cast<std::uint8_t>(kind));
      entries_w.fill(3);
      if (!r.error.empty()) ++bad;
      ids.push_back(info.conversation_id);
      ++e;
    }
  }

  std::vector<std::uint32_t> order(static_cast<std::size_t>(n_entries));
  for (std::uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::uint32_t a, std::uint32_t b) { return ids[a] < ids[b]; });
  for (const std::uint32_t i : order) sorted_w.u32(i);

  ByteWriter masks_w;
  if (loss_masks != nullptr) {
    if (loss_masks->path.empty()) throw UsageError("index: the loss-mask file's path is empty");
    masks_w.u64(strings.add(stored_path(loss_masks->path, dir), "loss-mask file path"));
    masks_w.u64(loss_masks->size).i64(loss_masks->mtime_ns).u64(loss_masks->xxh3);
  }

  const auto& sbytes = strings.bytes();
  const std::uint64_t roots_off = kHeaderSize;
  const std::uint64_t files_off = align8(roots_off + roots_w.size());
  const std::uint64_t entries_off = align8(files_off + files_w.size());
  const std::uint64_t sorted_off = align8(entries_off + entries_w.size());
  const std::uint64_t masks_off = align8(sorted_off + sorted_w.size());
  const std::uint64_t strings_off = align8(masks_off + masks_w.size());
  const std::uint64_t total = align8(strings_off + sbytes.size()) + 8;

  ByteWriter h;
  h.bytes(kMagic, 8).u32(loss_masks != nullptr ? DatasetIndex::kVersion : kVersionWithoutLossMasks);
  h.u32(kHeaderSize).u32(kEntrySize).u32(kFileEntrySize);
  h.u64(n_entries).u64(files.size()).u64(roots.size());
  h.u64(roots_off).u64(files_off).u64(entries_off).u64(sorted_off);
  h.u64(strings_off).u64(sbytes.size()).u64(total).u64(bad);
  h.u64(loss_masks != nullptr ? masks_off : 0);
  h.fill(kHeaderSize - h.size());

  // Each piece goes to the file and into the checksum; sections start 8-aligned.
  AtomicFile out(path);
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr) throw std::bad_alloc();
  const std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> owner(state, XXH3_freeState);
  XXH3_64bits_reset(state);
  std::uint64_t at = 0;
  auto emit = [&](const void* p, std::size_t n) {
    if (n == 0) return;
    XXH3_64bits_update(state, p, n);
    out.write(p, n);
    at += n;
  };
  auto section = [&](const void* p, std::size_t n) {
    static constexpr std::uint8_t kZeros[8] = {};
    emit(kZeros, static_cast<std::size_t>(align8(at) - at));
    emit(p, n);
  };
  emit(h.data(), h.size());
  section(roots_w.data(), roots_w.size());
  section(files_w.data(), files_w.size());
  section(entries_w.data(), entries_w.size());
  section(sorted_w.data(), sorted_w.size());
  section(masks_w.data(), masks_w.size());
  section(sbytes.data(), sbytes.size());
  section(nullptr, 0);
  std::uint8_t sum[8];
  store_le64(sum, XXH3_64bits_digest(state));
  out.write(sum, 8);
  out.commit();
}

IndexLossMasks index_loss_masks_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw IoError::from_errno(path, "cannot stat", errno);
  IndexLossMasks m;
  std::error_code ec;
  const std::filesystem::path a = std::filesystem::absolute(path, ec);
  m.path = ec ? path : a.lexically_normal().string();
  m.size = static_cast<std::uint64_t>(st.st_size);
  m.mtime_ns = static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000LL + static_cast<std::int64_t>(st.st_mtim.tv_nsec);
  const auto src = ByteSource::open_file(path);
  m.xxh3 = XXH3_64bits(src->data(), static_cast<std::size_t>(src->size()));
  return m;
}

std::string index_loss_masks_change(const IndexLossMasks& recorded) {
  struct stat st {};
  if (::stat(recorded.path.c_str(), &st) != 0)
    return errno == ENOENT ? std::string("is not there (moved or deleted since indexing?)")
                           : std::string("cannot be stat'ed: ") + std::strerror(errno);
  if (static_cast<std::uint64_t>(st.st_size) != recorded.size)
    return "has " + std::to_string(st.st_size) + " bytes, " + std::to_string(recorded.size) + " when indexed";
  const std::int64_t mtime =
      static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000LL + static_cast<std::int64_t>(st.st_mtim.tv_nsec);
  if (mtime == recorded.mtime_ns) return "";
  const IndexLossMasks now = index_loss_masks_of(recorded.path);
  if (now.size == recorded.size && now.xxh3 == recorded.xxh3) return "";
  char buf[128];
  std::snprintf(buf, sizeof buf, "holds other bytes than when indexed (same size; XXH3-64 %016llx now, %016llx then)",
                static_cast<unsigned long long>(now.xxh3), static_cast<unsigned long long>(recorded.xxh3));
  return buf;
}

std::string_view entry_error_name(EntryError e) {
  switch (e) {
    case EntryError::kNone: return "none";
    case EntryError::kIo: return "io";
    case EntryError::kFormat: return "format";
    case EntryError::kChecksum: return "checksum";
    case EntryError::kUnsupported: return "unsupported";
    case EntryError::kShape: return "shape";
    case EntryError::kOther: return "other";
  }
  return "other";
}

}  // namespace eaglekit
