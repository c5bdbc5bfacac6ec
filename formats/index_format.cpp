// The dataset index file format; the byte layout is in formats/index_format.h.
#include "formats/index_format.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <unordered_map>

#include "formats/atomic_file.h"
#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/error.h"

namespace eaglekit {

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

}  // namespace eaglekit
