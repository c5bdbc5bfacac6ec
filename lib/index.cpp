// Dataset index file (layout in docs/formats.md, "Dataset index"), all integers
// little-endian:
//
//   header (128 bytes)
//     0  magic "EKINDEX\0"        8  u32 version (1)        12 u32 header size (128)
//     16 u32 entry size (80)      20 u32 file entry size (48)
//     24 u64 entry count          32 u64 file count         40 u64 root count
//     48 u64 roots offset         56 u64 files offset       64 u64 entries offset
//     72 u64 sorted-ids offset    80 u64 strings offset     88 u64 strings size
//     96 u64 total file size      104 u64 bad entry count   112..127 zero
//   roots       root count x u64 string ref
//   files       file count x 48-byte file entry
//   entries     entry count x 80-byte entry, grouped by file, in file order
//   sorted ids  entry count x u32 entry number, sorted by conversation id (bytewise, stable)
//   strings     bytes, padded to 8
//   checksum    u64 XXH3-64 of every byte before it
//
//   file entry (48): 0 path ref, 8 error ref, 16 u64 size, 24 i64 mtime ns,
//     32 u32 first entry, 36 u32 entry count, 40 u8 format code, 41..47 zero
//   entry (80): 0 conversation id ref, 8 key ref, 16 codec ref, 24 error ref,
//     32 i64 tokens, 40 u64 byte offset, 48 u64 byte size, 56 u32 file, 60 u32 record,
//     64 u32 hidden size, 68 u32 aux width, 72 u8 format code, 73 u8 ids dtype code,
//     74 u8 hidden dtype code, 75 u8 flags (1 bad, 2 has loss mask, 4 id from file name),
//     76 u8 error kind (EntryError), 77..79 zero
//
// A string ref is one u64: offset into the strings section in the low 40 bits, length in
// the high 24. Every section offset is 8-aligned. Loading checks the header, the section
// bounds and the checksum, nothing per entry; references inside entries are checked when
// an entry is decoded.
#include "lib/index.h"

#include <sys/stat.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include "formats/atomic_file.h"
#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/error.h"
#include "formats/file_walk.h"
#include "lib/progress.h"

namespace eaglekit {

namespace fs = std::filesystem;

namespace {

constexpr char kMagic[8] = {'E', 'K', 'I', 'N', 'D', 'E', 'X', '\0'};
constexpr std::uint32_t kHeaderSize = 128;
constexpr std::uint32_t kEntrySize = 80;
constexpr std::uint32_t kFileEntrySize = 48;
constexpr std::uint64_t kMaxStringLength = (1ull << 24) - 1;
constexpr std::uint64_t kMaxStringsSize = 1ull << 40;
constexpr std::size_t kMaxErrorLength = 4096;

// Entry flag bits.
constexpr std::uint8_t kFlagBad = 1;
constexpr std::uint8_t kFlagLossMask = 2;
constexpr std::uint8_t kFlagIdFromFileName = 4;

// Stable on-disk codes, independent of the enums' order in the headers.
std::uint8_t format_code(Format f) {
  switch (f) {
    case Format::kUnknown: return 0;
    case Format::kPt: return 1;
    case Format::kPtGzip: return 2;
    case Format::kSafetensors: return 3;
    case Format::kHdf5: return 4;
    case Format::kEks: return 5;
    case Format::kTorchLegacy: return 6;
  }
  return 0;
}

std::optional<Format> format_from_code(std::uint8_t c) {
  static const Format kFormats[] = {Format::kUnknown,     Format::kPt,   Format::kPtGzip,
                                    Format::kSafetensors, Format::kHdf5, Format::kEks,
                                    Format::kTorchLegacy};
  if (c < sizeof kFormats / sizeof kFormats[0]) return kFormats[c];
  return std::nullopt;
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

bool single_record_format(Format f) {
  return f == Format::kPt || f == Format::kPtGzip || f == Format::kSafetensors ||
         f == Format::kTorchLegacy;
}

std::string clip_error(std::string e) {
  if (e.size() > kMaxErrorLength) {
    e.resize(kMaxErrorLength);
    e += "...";
  }
  return e;
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

std::int64_t mtime_ns_of(const struct stat& st) {
  return static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000LL +
         static_cast<std::int64_t>(st.st_mtim.tv_nsec);
}

std::string absolute_path(const std::string& p) {
  std::error_code ec;
  fs::path a = fs::absolute(p, ec);
  if (ec) return p;
  return a.lexically_normal().string();
}

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
  const std::uint32_t version = load_le32(h + 8);
  if (version != kVersion)
    throw UnsupportedError(path, 8, "version",
                           "index version " + std::to_string(version) + "; this build reads " +
                               std::to_string(kVersion) + ": rebuild it with `eaglekit index`");
  if (load_le32(h + 12) != kHeaderSize || load_le32(h + 16) != kEntrySize ||
      load_le32(h + 20) != kFileEntrySize)
    throw FormatError(path, 12, "header",
                      "record sizes " + std::to_string(load_le32(h + 12)) + "/" +
                          std::to_string(load_le32(h + 16)) + "/" +
                          std::to_string(load_le32(h + 20)) + " differ from version 1's " +
                          std::to_string(kHeaderSize) + "/" + std::to_string(kEntrySize) + "/" +
                          std::to_string(kFileEntrySize));
  const std::uint64_t total = load_le64(h + 96);
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
  impl->entry_count = load_le64(h + 24);
  impl->file_count = load_le64(h + 32);
  impl->root_count = load_le64(h + 40);
  impl->roots_off = load_le64(h + 48);
  impl->files_off = load_le64(h + 56);
  impl->entries_off = load_le64(h + 64);
  impl->sorted_off = load_le64(h + 72);
  impl->strings_off = load_le64(h + 80);
  impl->strings_size = load_le64(h + 88);
  impl->bad_count = load_le64(h + 104);
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
  impl->base = h;
  impl->src = std::move(src);
  return DatasetIndex(std::move(impl));
}

std::size_t DatasetIndex::size() const { return static_cast<std::size_t>(impl_->entry_count); }
std::size_t DatasetIndex::file_count() const { return static_cast<std::size_t>(impl_->file_count); }
std::size_t DatasetIndex::bad_count() const { return static_cast<std::size_t>(impl_->bad_count); }
const std::string& DatasetIndex::path() const { return impl_->path; }

IndexEntry DatasetIndex::entry(std::size_t i) const {
  const Impl& m = *impl_;
  if (i >= m.entry_count)
    throw std::out_of_range("index entry " + std::to_string(i) + " of " +
                            std::to_string(m.entry_count));
  const std::uint64_t at = m.entries_off + i * kEntrySize;
  const std::uint8_t* p = m.base + at;
  IndexEntry e;
  e.conversation_id = m.str(load_le64(p), at, "entry conversation_id");
  e.key = m.str(load_le64(p + 8), at + 8, "entry key");
  e.codec = m.str(load_le64(p + 16), at + 16, "entry codec");
  e.error = m.str(load_le64(p + 24), at + 24, "entry error");
  e.tokens = static_cast<std::int64_t>(load_le64(p + 32));
  e.byte_offset = load_le64(p + 40);
  e.byte_size = load_le64(p + 48);
  e.file = load_le32(p + 56);
  e.record = load_le32(p + 60);
  e.hidden_size = load_le32(p + 64);
  e.aux_width = load_le32(p + 68);
  if (e.file >= m.file_count)
    throw FormatError(m.path, at + 56, "entry file",
                      "file number " + std::to_string(e.file) + " >= file count " +
                          std::to_string(m.file_count));
  const auto f = format_from_code(p[72]);
  const auto ids = dtype_from_code(p[73]);
  const auto hid = dtype_from_code(p[74]);
  if (!f || !ids || !hid)
    throw FormatError(m.path, at + 72, "entry codes",
                      "unknown format or dtype code " + std::to_string(p[72]) + "/" +
                          std::to_string(p[73]) + "/" + std::to_string(p[74]));
  e.format = *f;
  e.ids_dtype = *ids;
  e.hidden_dtype = *hid;
  e.ok = (p[75] & kFlagBad) == 0;
  e.has_loss_mask = (p[75] & kFlagLossMask) != 0;
  e.id_from_file_name = (p[75] & kFlagIdFromFileName) != 0;
  if (p[76] > static_cast<std::uint8_t>(EntryError::kOther))
    throw FormatError(m.path, at + 76, "entry error kind", "unknown code " + std::to_string(p[76]));
  e.error_kind = static_cast<EntryError>(p[76]);
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
  const std::uint8_t* p = m.base + at;
  IndexFile f;
  f.path = m.str(load_le64(p), at, "file path");
  f.error = m.str(load_le64(p + 8), at + 8, "file error");
  f.size = load_le64(p + 16);
  f.mtime_ns = static_cast<std::int64_t>(load_le64(p + 24));
  f.first_entry = load_le32(p + 32);
  f.entry_count = load_le32(p + 36);
  const auto fmt = format_from_code(p[40]);
  if (!fmt)
    throw FormatError(m.path, at + 40, "file format", "unknown format code " + std::to_string(p[40]));
  f.format = *fmt;
  if (f.first_entry > m.entry_count || f.entry_count > m.entry_count - f.first_entry)
    throw FormatError(m.path, at + 32, "file entries",
                      "entries [" + std::to_string(f.first_entry) + ", +" +
                          std::to_string(f.entry_count) + ") outside the " +
                          std::to_string(m.entry_count) + " entries");
  return f;
}

std::vector<std::string> DatasetIndex::roots() const {
  std::vector<std::string> out;
  for (std::uint64_t i = 0; i < impl_->root_count; ++i) {
    const std::uint64_t at = impl_->roots_off + i * 8;
    out.emplace_back(impl_->str(load_le64(impl_->base + at), at, "root"));
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
                 const std::vector<IndexedFile>& files) {
  constexpr std::uint64_t kMaxCount = std::numeric_limits<std::uint32_t>::max();
  std::uint64_t n_entries = 0;
  for (const auto& f : files) n_entries += f.records.size();
  if (n_entries > kMaxCount || files.size() > kMaxCount)
    throw UsageError("index: at most 2^32 - 1 entries and files (got " +
                     std::to_string(n_entries) + " entries in " + std::to_string(files.size()) +
                     " files)");

  StringTable strings;
  const std::uint64_t roots_off = kHeaderSize;
  const std::uint64_t files_off = align8(roots_off + roots.size() * 8);
  const std::uint64_t entries_off = align8(files_off + files.size() * kFileEntrySize);
  const std::uint64_t sorted_off = align8(entries_off + n_entries * kEntrySize);
  const std::uint64_t strings_off = align8(sorted_off + n_entries * 4);

  std::vector<std::uint8_t> buf(strings_off, 0);
  std::memcpy(buf.data(), kMagic, 8);
  for (std::size_t i = 0; i < roots.size(); ++i)
    store_le64(buf.data() + roots_off + i * 8, strings.intern(roots[i], "root path"));

  std::vector<std::string_view> ids;  // per entry, for sorting
  ids.reserve(static_cast<std::size_t>(n_entries));
  std::uint64_t bad = 0;
  std::uint32_t e = 0;
  for (std::size_t fi = 0; fi < files.size(); ++fi) {
    const IndexedFile& f = files[fi];
    std::uint8_t* fp = buf.data() + files_off + fi * kFileEntrySize;
    store_le64(fp, strings.add(f.path, "file path"));
    store_le64(fp + 8, strings.add(clip_error(f.error), "file error"));
    store_le64(fp + 16, f.size);
    store_le64(fp + 24, static_cast<std::uint64_t>(f.mtime_ns));
    store_le32(fp + 32, e);
    store_le32(fp + 36, static_cast<std::uint32_t>(f.records.size()));
    fp[40] = format_code(f.format);
    for (const IndexedRecord& r : f.records) {
      std::uint8_t* p = buf.data() + entries_off + std::uint64_t{e} * kEntrySize;
      const RecordInfo& info = r.info;
      const std::uint64_t id_ref = strings.add(info.conversation_id, "conversation id");
      store_le64(p, id_ref);
      // Shards key their records by conversation id: one copy serves both.
      store_le64(p + 8, info.key == info.conversation_id ? id_ref : strings.add(info.key, "record key"));
      store_le64(p + 16, strings.intern(info.codec, "codec"));
      store_le64(p + 24, strings.add(clip_error(r.error), "error"));
      store_le64(p + 32, static_cast<std::uint64_t>(info.tokens));
      store_le64(p + 40, info.byte_offset);
      store_le64(p + 48, info.byte_size);
      store_le32(p + 56, static_cast<std::uint32_t>(fi));
      store_le32(p + 60, r.record);
      auto narrow = [&](std::int64_t v, const char* what) {
        if (v < 0 || static_cast<std::uint64_t>(v) > kMaxCount)
          throw UsageError(f.path + ": " + what + " " + std::to_string(v) +
                           " does not fit the index (0 .. 2^32 - 1)");
        return static_cast<std::uint32_t>(v);
      };
      store_le32(p + 64, narrow(info.hidden_size, "hidden size"));
      store_le32(p + 68, narrow(info.aux_width, "aux width"));
      p[72] = format_code(f.format);
      p[73] = dtype_code(info.ids_dtype);
      p[74] = dtype_code(info.hidden_dtype);
      std::uint8_t flags = 0;
      if (!r.error.empty()) flags |= kFlagBad;
      if (info.has_loss_mask) flags |= kFlagLossMask;
      if (r.id_from_file_name) flags |= kFlagIdFromFileName;
      p[75] = flags;
      EntryError kind = r.error_kind;
      if (r.error.empty()) kind = EntryError::kNone;
      else if (kind == EntryError::kNone) kind = EntryError::kOther;
      p[76] = static_cast<std::uint8_t>(kind);
      if (!r.error.empty()) ++bad;
      ids.push_back(info.conversation_id);
      ++e;
    }
  }

  std::vector<std::uint32_t> order(static_cast<std::size_t>(n_entries));
  for (std::uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::uint32_t a, std::uint32_t b) { return ids[a] < ids[b]; });
  for (std::size_t i = 0; i < order.size(); ++i)
    store_le32(buf.data() + sorted_off + i * 4, order[i]);

  const auto& sbytes = strings.bytes();
  buf.insert(buf.end(), sbytes.begin(), sbytes.end());
  buf.resize(align8(buf.size()), 0);
  const std::uint64_t total = buf.size() + 8;

  std::uint8_t* h = buf.data();
  store_le32(h + 8, DatasetIndex::kVersion);
  store_le32(h + 12, kHeaderSize);
  store_le32(h + 16, kEntrySize);
  store_le32(h + 20, kFileEntrySize);
  store_le64(h + 24, n_entries);
  store_le64(h + 32, files.size());
  store_le64(h + 40, roots.size());
  store_le64(h + 48, roots_off);
  store_le64(h + 56, files_off);
  store_le64(h + 64, entries_off);
  store_le64(h + 72, sorted_off);
  store_le64(h + 80, strings_off);
  store_le64(h + 88, sbytes.size());
  store_le64(h + 96, total);
  store_le64(h + 104, bad);
  std::uint8_t sum[8];
  store_le64(sum, XXH3_64bits(buf.data(), buf.size()));

  AtomicFile out(path);
  out.write(buf.data(), buf.size());
  out.write(sum, 8);
  out.commit();
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

EntryError classify_error(const std::exception& e) {
  if (dynamic_cast<const IoError*>(&e)) return EntryError::kIo;
  if (dynamic_cast<const ChecksumError*>(&e)) return EntryError::kChecksum;
  if (dynamic_cast<const UnsupportedError*>(&e)) return EntryError::kUnsupported;
  if (const auto* f = dynamic_cast<const FormatError*>(&e)) {
    const std::string& field = f->field();
    if (!f->offset() && (field == "input_ids" || field == "hidden_states" ||
                         field == "aux_hidden_states" || field == "loss_mask"))
      return EntryError::kShape;
    return EntryError::kFormat;
  }
  return EntryError::kOther;
}

std::string file_stem_id(const std::string& path) {
  std::string name = fs::path(path).filename().string();
  static const char* kExtensions[] = {".ckpt.gz", ".pt.gz", ".safetensors", ".ckpt", ".pth", ".pt"};
  for (const char* ext : kExtensions) {
    const std::size_t n = std::strlen(ext);
    if (name.size() > n && name.compare(name.size() - n, n, ext) == 0)
      return name.substr(0, name.size() - n);
  }
  const auto dot = name.rfind('.');
  if (dot != std::string::npos && dot > 0) name.resize(dot);
  return name;
}

// ---------------------------------------------------------------------------------------
// Building

namespace {

// Reads one file's metadata. Never throws for a bad file: errors become bad entries.
// `format` is what detection said (kUnknown when the head could not be read).
IndexedFile index_one_file(const std::string& path, std::uint64_t size, std::int64_t mtime_ns,
                           Format format) {
  IndexedFile f;
  f.path = path;
  f.size = size;
  f.mtime_ns = mtime_ns;
  f.format = format;
  try {
    const auto reader = open_reader(path);
    f.format = reader->format();
    const std::size_t n = reader->size();
    if (n > std::numeric_limits<std::uint32_t>::max())
      throw FormatError(path, std::nullopt, "record count",
                        std::to_string(n) + " records exceed the index's 2^32 - 1 per file");
    f.records.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      IndexedRecord& r = f.records[i];
      r.record = static_cast<std::uint32_t>(i);
      try {
        r.info = reader->info(i);
      } catch (const std::exception& e) {
        // A record that cannot be described stays in the index as bad, with its error.
        r.info = RecordInfo{};
        r.error = e.what();
        r.error_kind = classify_error(e);
        if (r.error.empty()) r.error = "unreadable record";
        continue;
      }
      constexpr std::int64_t kMax = std::numeric_limits<std::uint32_t>::max();
      const RecordInfo& info = r.info;
      if (info.tokens < 0 || info.hidden_size < 0 || info.hidden_size > kMax ||
          info.aux_width < 0 || info.aux_width > kMax) {
        r.error = FormatError(path, std::nullopt, "record " + std::to_string(i),
                              "metadata out of range: tokens " + std::to_string(info.tokens) +
                                  ", hidden size " + std::to_string(info.hidden_size) +
                                  ", aux width " + std::to_string(info.aux_width))
                      .what();
        r.error_kind = EntryError::kFormat;
        const std::string id = info.conversation_id;
        r.info = RecordInfo{};
        r.info.conversation_id = id;
      }
    }
  } catch (const std::exception& e) {
    // Recorded as a bad entry (validate reports it); the run goes on.
    f.error = e.what();
    if (f.error.empty()) f.error = "unreadable file";
    f.records.assign(1, IndexedRecord{});
    f.records[0].error = f.error;
    f.records[0].error_kind = classify_error(e);
  }
  if (single_record_format(f.format) && f.records.size() == 1 &&
      f.records[0].info.conversation_id.empty()) {
    f.records[0].info.conversation_id = file_stem_id(path);
    f.records[0].id_from_file_name = true;
  }
  return f;
}

IndexedFile reuse_file(const DatasetIndex& prev, std::size_t fi, const std::string& path) {
  const IndexFile pf = prev.file(fi);
  IndexedFile f;
  f.path = path;
  f.size = pf.size;
  f.mtime_ns = pf.mtime_ns;
  f.format = pf.format;
  f.records.resize(pf.entry_count);
  for (std::uint32_t k = 0; k < pf.entry_count; ++k) {
    const IndexEntry e = prev.entry(pf.first_entry + k);
    IndexedRecord& r = f.records[k];
    r.record = e.record;
    r.id_from_file_name = e.id_from_file_name;
    r.info.conversation_id = std::string(e.conversation_id);
    r.info.key = std::string(e.key);
    r.info.codec = std::string(e.codec);
    r.info.tokens = e.tokens;
    r.info.hidden_size = e.hidden_size;
    r.info.aux_width = e.aux_width;
    r.info.ids_dtype = e.ids_dtype;
    r.info.hidden_dtype = e.hidden_dtype;
    r.info.has_loss_mask = e.has_loss_mask;
    r.info.byte_offset = e.byte_offset;
    r.info.byte_size = e.byte_size;
  }
  return f;
}

// A previous file is reused only when it is unchanged and was read cleanly: errors may
// have been transient (permissions, a file still being written).
bool reusable(const DatasetIndex& prev, std::size_t fi, std::uint64_t size, std::int64_t mtime) {
  const IndexFile pf = prev.file(fi);
  if (pf.size != size || pf.mtime_ns != mtime || !pf.error.empty()) return false;
  for (std::uint32_t k = 0; k < pf.entry_count; ++k)
    if (!prev.entry(pf.first_entry + k).ok) return false;
  return true;
}

}  // namespace

IndexReport build_index(const IndexOptions& opts) {
  if (opts.roots.empty()) throw UsageError("index: give at least one folder to index");
  if (opts.out.empty()) throw UsageError("index: --out INDEX is required");
  if (opts.jobs < 0) throw UsageError("index: --jobs must be >= 0");
  const auto start = std::chrono::steady_clock::now();
  IndexReport report;

  std::vector<std::string> roots;
  std::vector<std::string> paths;
  for (const auto& root : opts.roots) {
    roots.push_back(absolute_path(root));
    // Listed without reading a byte; format detection happens later, in parallel, and only
    // for files the previous index does not already know unchanged.
    for (auto& p : list_files_below(root)) paths.push_back(absolute_path(p));
  }
  // Overlapping roots name a file twice; it is one file.
  std::sort(paths.begin(), paths.end());
  paths.erase(std::unique(paths.begin(), paths.end()), paths.end());
  const std::string out_abs = absolute_path(opts.out);
  paths.erase(std::remove(paths.begin(), paths.end(), out_abs), paths.end());

  std::optional<DatasetIndex> prev;
  std::error_code ec;
  if (opts.incremental && fs::exists(opts.out, ec)) {
    try {
      prev = DatasetIndex::load(opts.out);
      report.had_previous = true;
    } catch (const Error& e) {
      report.previous_error = e.what();
    }
  }
  std::unordered_map<std::string_view, std::size_t> prev_files;
  if (prev) {
    prev_files.reserve(prev->file_count());
    for (std::size_t i = 0; i < prev->file_count(); ++i) prev_files.emplace(prev->file(i).path, i);
  }

  // One parallel pass per file: stat, then reuse the previous entries (unchanged files are
  // not even opened), or detect the format by magic bytes (skipping files that are not
  // records, as find_record_files does) and read every record's metadata.
  enum class Origin : std::uint8_t { kNew, kChanged, kUnchanged, kNotRecord };
  std::vector<IndexedFile> files(paths.size());
  std::vector<Origin> origin(paths.size(), Origin::kNew);
  {
    Progress progress("indexing files", static_cast<std::int64_t>(paths.size()), opts.progress);
    tbb::task_arena arena(opts.jobs > 0 ? opts.jobs : tbb::task_arena::automatic);
    arena.execute([&] {
      tbb::parallel_for(tbb::blocked_range<std::size_t>(0, paths.size(), 8),
                        [&](const tbb::blocked_range<std::size_t>& range) {
        for (std::size_t i = range.begin(); i != range.end(); ++i) {
          const std::string& path = paths[i];
          // Stat before reading: a file that changes while it is read gets a newer
          // mtime than the one recorded, so the next run reads it again.
          struct stat st {};
          const auto it = prev ? prev_files.find(path) : prev_files.end();
          const bool known = it != prev_files.end();
          if (::stat(path.c_str(), &st) != 0) {
            files[i].path = path;
            files[i].error = IoError::from_errno(path, "cannot stat", errno).what();
            files[i].records.assign(1, IndexedRecord{});
            files[i].records[0].error = files[i].error;
            files[i].records[0].error_kind = EntryError::kIo;
            origin[i] = known ? Origin::kChanged : Origin::kNew;
          } else {
            const auto size = static_cast<std::uint64_t>(st.st_size);
            const std::int64_t mtime = mtime_ns_of(st);
            if (known && reusable(*prev, it->second, size, mtime)) {
              files[i] = reuse_file(*prev, it->second, path);
              origin[i] = Origin::kUnchanged;
            } else if (const auto format = record_file_format(path)) {
              files[i] = index_one_file(path, size, mtime, *format);
              origin[i] = known ? Origin::kChanged : Origin::kNew;
            } else {
              origin[i] = Origin::kNotRecord;
            }
          }
          progress.add(1, 0);
        }
      });
    });
  }
  {
    std::size_t kept = 0;
    for (std::size_t i = 0; i < paths.size(); ++i) {
      if (origin[i] == Origin::kNotRecord) continue;
      if (kept != i) {
        files[kept] = std::move(files[i]);
        origin[kept] = origin[i];
        paths[kept] = std::move(paths[i]);
      }
      ++kept;
    }
    files.resize(kept);
    origin.resize(kept);
    paths.resize(kept);
  }

  for (Origin o : origin) {
    if (o == Origin::kNew) ++report.new_files;
    else if (o == Origin::kChanged) ++report.changed_files;
    else if (o == Origin::kUnchanged) ++report.unchanged_files;
  }
  if (prev) {
    std::unordered_map<std::string_view, bool> now;
    now.reserve(paths.size());
    for (const auto& p : paths) now.emplace(p, true);
    for (std::size_t i = 0; i < prev->file_count(); ++i)
      if (now.find(prev->file(i).path) == now.end()) ++report.gone_files;
  }

  write_index(opts.out, roots, files);

  std::unordered_map<std::string_view, std::size_t> id_count;
  for (const auto& f : files) {
    for (const auto& r : f.records) {
      ++report.records;
      if (!r.info.conversation_id.empty()) ++id_count[r.info.conversation_id];
      if (!r.error.empty()) {
        ++report.bad_records;
        std::string where = f.path;
        if (f.records.size() > 1) where += "#" + std::to_string(r.record);
        report.bad.push_back(r.error.compare(0, f.path.size(), f.path) == 0
                                 ? r.error
                                 : where + ": " + r.error);
      }
    }
  }
  for (const auto& [id, n] : id_count)
    if (n > 1) report.duplicate_ids.emplace_back(id);
  std::sort(report.duplicate_ids.begin(), report.duplicate_ids.end());
  report.files = files.size();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

// ---------------------------------------------------------------------------------------
// Printing

namespace {

std::string location(const DatasetIndex& index, const IndexEntry& e) {
  std::string loc(index.file(e.file).path);
  if (!e.key.empty()) loc += "#" + std::string(e.key);
  else if (index.file(e.file).entry_count > 1) loc += "#" + std::to_string(e.record);
  return loc;
}

}  // namespace

std::string index_to_text(const DatasetIndex& index) {
  std::ostringstream os;
  os << "index " << index.path() << ": version " << DatasetIndex::kVersion << ", "
     << index.size() << " records (" << index.bad_count() << " bad) in " << index.file_count()
     << " files\n";
  for (const auto& r : index.roots()) os << "root " << r << "\n";
  os << "conversation_id\ttokens\thidden\taux\tdtype\tformat\tcodec\tlocation\tstatus\n";
  for (std::size_t i = 0; i < index.size(); ++i) {
    const IndexEntry e = index.entry(i);
    os << (e.conversation_id.empty() ? std::string_view("-") : e.conversation_id) << "\t"
       << e.tokens << "\t" << e.hidden_size << "\t" << e.aux_width << "\t"
       << (e.ok ? dtype_name(e.hidden_dtype) : std::string_view("-")) << "\t"
       << format_name(e.format) << "\t" << (e.codec.empty() ? std::string_view("-") : e.codec)
       << "\t" << location(index, e) << "\t";
    if (e.ok) os << "ok";
    else os << "bad: " << e.error;
    os << "\n";
  }
  return os.str();
}

std::string index_to_json(const DatasetIndex& index) {
  using nlohmann::json;
  json j;
  j["path"] = index.path();
  j["version"] = DatasetIndex::kVersion;
  j["roots"] = index.roots();
  j["records"] = index.size();
  j["bad_records"] = index.bad_count();
  json files = json::array();
  for (std::size_t i = 0; i < index.file_count(); ++i) {
    const IndexFile f = index.file(i);
    json jf = {{"path", f.path},
               {"size", f.size},
               {"mtime_ns", f.mtime_ns},
               {"format", format_name(f.format)},
               {"first_entry", f.first_entry},
               {"entry_count", f.entry_count}};
    if (!f.error.empty()) jf["error"] = f.error;
    files.push_back(std::move(jf));
  }
  j["files"] = std::move(files);
  json entries = json::array();
  for (std::size_t i = 0; i < index.size(); ++i) {
    const IndexEntry e = index.entry(i);
    json je = {{"conversation_id", e.conversation_id},
               {"file", e.file},
               {"record", e.record},
               {"key", e.key},
               {"format", format_name(e.format)},
               {"ok", e.ok}};
    if (e.ok) {
      je["tokens"] = e.tokens;
      je["hidden_size"] = e.hidden_size;
      je["aux_width"] = e.aux_width;
      je["ids_dtype"] = dtype_name(e.ids_dtype);
      je["hidden_dtype"] = dtype_name(e.hidden_dtype);
      je["has_loss_mask"] = e.has_loss_mask;
      je["codec"] = e.codec;
      je["byte_offset"] = e.byte_offset;
      je["byte_size"] = e.byte_size;
    } else {
      je["error"] = e.error;
      je["error_kind"] = entry_error_name(e.error_kind);
    }
    if (e.id_from_file_name) je["id_from_file_name"] = true;
    entries.push_back(std::move(je));
  }
  j["entries"] = std::move(entries);
  // Paths, ids and error texts are bytes, not always UTF-8 (Linux file names): invalid
  // sequences print as U+FFFD instead of making dump() throw.
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

std::string index_report_to_text(const IndexReport& r, const std::string& out) {
  std::ostringstream os;
  os << "indexed " << r.records << " records in " << r.files << " files into " << out << " ("
     << std::fixed;
  os.precision(2);
  os << r.seconds << " s)\n";
  if (r.had_previous)
    os << "files: " << r.new_files << " new, " << r.changed_files << " changed, "
       << r.unchanged_files << " unchanged, " << r.gone_files << " gone\n";
  if (!r.previous_error.empty())
    os << "warning: the previous index could not be read, so every file was read again: "
       << r.previous_error << "\n";
  constexpr std::size_t kShow = 5;
  if (r.bad_records > 0) {
    os << "bad records: " << r.bad_records << " (kept in the index as bad; `eaglekit validate` "
       << "lists them all)\n";
    for (std::size_t i = 0; i < r.bad.size() && i < kShow; ++i) os << "  " << r.bad[i] << "\n";
    if (r.bad.size() > kShow) os << "  ... " << r.bad.size() - kShow << " more\n";
  }
  if (!r.duplicate_ids.empty()) {
    os << "duplicate conversation ids: " << r.duplicate_ids.size()
       << " (held by more than one record; training leaves them out until one copy is removed)\n";
    for (std::size_t i = 0; i < r.duplicate_ids.size() && i < kShow; ++i)
      os << "  " << r.duplicate_ids[i] << "\n";
    if (r.duplicate_ids.size() > kShow) os << "  ... " << r.duplicate_ids.size() - kShow << " more\n";
  }
  return os.str();
}

std::string index_report_to_json(const IndexReport& r, const std::string& out) {
  nlohmann::json j = {{"index", out},
                      {"files", r.files},
                      {"records", r.records},
                      {"bad_records", r.bad_records},
                      {"new_files", r.new_files},
                      {"changed_files", r.changed_files},
                      {"unchanged_files", r.unchanged_files},
                      {"gone_files", r.gone_files},
                      {"incremental", r.had_previous},
                      {"duplicate_ids", r.duplicate_ids},
                      {"bad", r.bad},
                      {"seconds", r.seconds}};
  if (!r.previous_error.empty()) j["previous_error"] = r.previous_error;
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

}  // namespace eaglekit
