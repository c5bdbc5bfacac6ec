// The dataset index file format: what every hidden-state record below some folders holds
// (conversation id, location, token count, dtypes, widths), gathered once from headers only
// (lib/index.h builds it), kept in one versioned binary file that loads by mmap with no
// per-record parsing. This file owns the bytes; docs/formats.md ("Dataset index") repeats
// the layout, all integers little-endian:
//
//   header (128 bytes)
//     0  magic "EKINDEX\0"        8  u32 version (3 or 4)   12 u32 header size (128)
//     16 u32 entry size (80)      20 u32 file entry size (48)
//     24 u64 entry count          32 u64 file count         40 u64 root count
//     48 u64 roots offset         56 u64 files offset       64 u64 entries offset
//     72 u64 sorted-ids offset    80 u64 strings offset     88 u64 strings size
//     96 u64 total file size      104 u64 bad entry count
//     112 u64 loss-mask file offset (version 4; 0: none)     120..127 zero
//   roots       root count x u64 string ref
//   files       file count x 48-byte file entry
//   entries     entry count x 80-byte entry, grouped by file, in file order
//   sorted ids  entry count x u32 entry number, sorted by conversation id (bytewise, stable)
//   loss-mask file (version 4, when the index joined one; 32 bytes): 0 path ref, 8 u64 size,
//               16 i64 mtime ns, 24 u64 XXH3-64 of its bytes, all as when indexed
//   strings     bytes, padded to 8
//   checksum    u64 XXH3-64 of every byte before it
//
//   file entry (48): 0 path ref, 8 error ref, 16 u64 size, 24 i64 mtime ns,
//     32 u32 first entry, 36 u32 entry count, 40 u8 format code, 41..47 zero
//   entry (80): 0 conversation id ref, 8 key ref, 16 codec ref, 24 error ref,
//     32 i64 tokens, 40 u64 byte offset, 48 u64 byte size, 56 u32 file, 60 u32 record,
//     64 u32 hidden size, 68 u32 aux width, 72 u8 format code, 73 u8 ids dtype code,
//     74 u8 hidden dtype code, 75 u8 flags (1 bad, 2 has loss mask, 4 id from file name,
//     8 norm form stated, 16 pre-norm: Record::hidden_states_prenorm, 32 norm form implied
//     by the layout, 64 pre-norm: Record::layout_prenorm, 128 loss mask joined from the
//     loss-mask file: version 4),
//     76 u8 error kind (EntryError), 77..79 zero
//
// A string ref is one u64: offset into the strings section in the low 40 bits, length in
// the high 24. File paths, roots and the loss-mask file below the index file's own folder are stored relative
// to that folder ("dumps/000/a.pt"), others absolute: an index moved together with its
// dumps, or moved alone, still finds them. Readers resolve relative paths against the folder
// the index is loaded from. Every section offset is 8-aligned. Loading checks the header, the section
// bounds and the checksum, nothing per entry; references inside entries are checked when
// an entry is decoded.
//
// Ownership: a DatasetIndex owns its mapping; the string_views in IndexEntry / IndexFile
// point into it and stay valid while the DatasetIndex lives (it is movable, not copyable).
// Thread safety: immutable after load; const access from many threads is fine.
//
// Throws: load() throws IoError when the file cannot be read and FormatError (a
// ChecksumError for a checksum mismatch) when its bytes are not an index of this version;
// accessors throw FormatError on an out-of-range reference inside the file and
// std::out_of_range on a bad argument.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "formats/dtype.h"
#include "formats/format.h"
#include "formats/record.h"

namespace eaglekit {

class ByteSource;

// Why an entry is bad, from the exception its reader threw (lib/index.h classify_error).
// The values are the file's error-kind codes (entry byte 76): never renumber them.
enum class EntryError : std::uint8_t {
  kNone = 0,         // ok
  kIo = 1,           // IoError: the OS refused (permissions, vanished file)
  kFormat = 2,       // FormatError: corrupt or truncated bytes
  kChecksum = 3,     // ChecksumError
  kUnsupported = 4,  // UnsupportedError: legacy torch, no reader built for the format
  kShape = 5,        // Record::check failed: tensors disagree on T, aux width not k*H, ...
  kOther = 6,        // anything else
};
std::string_view entry_error_name(EntryError e);  // "io", "format", "checksum", ...

// One record as the index knows it. A bad entry is a record (or a whole file) that could
// not be read; its metadata fields are zero and `error` says why.
struct IndexEntry {
  std::string_view conversation_id;  // "" when neither the record nor its file name gives one
  std::string_view key;              // locator inside the file ("" for single-record files)
  std::string_view codec;
  std::string_view error;            // "" when ok
  std::uint32_t file = 0;            // into the file table
  std::uint32_t record = 0;          // record number inside the file (RecordReader::read)
  std::int64_t tokens = 0;
  std::int64_t hidden_size = 0;
  std::int64_t aux_width = 0;        // k*H
  std::uint64_t byte_offset = 0;     // where the record starts in its file (0 if unknown)
  std::uint64_t byte_size = 0;       // bytes it takes on disk (0 if unknown)
  Format format = Format::kUnknown;
  DType ids_dtype = DType::kInt64;
  DType hidden_dtype = DType::kBFloat16;
  bool has_loss_mask = false;        // the record stores one
  // Its mask is the loss-mask file's (DatasetIndex::loss_masks): `eaglekit index --loss-masks`
  // found its row and checked the row's length against `tokens`; the loader applies it.
  bool joined_loss_mask = false;
  bool id_from_file_name = false;    // the record holds no id; it came from the file stem
  std::optional<bool> hidden_states_prenorm;  // as the record states it (nullopt: not stated)
  std::optional<bool> layout_prenorm;         // as its layout implies (Record::layout_prenorm)
  bool ok = true;
  EntryError error_kind = EntryError::kNone;
};

struct IndexFile {
  std::string_view path;      // absolute, lexically normal (a relative one resolved)
  std::uint64_t size = 0;     // bytes, when indexed
  std::int64_t mtime_ns = 0;  // modification time, when indexed
  Format format = Format::kUnknown;
  std::string_view error;     // "" unless the file could not be opened at all
  std::uint32_t first_entry = 0;  // its entries are [first_entry, first_entry + entry_count)
  std::uint32_t entry_count = 0;
};

// The loss-mask file an index joined to its records (`eaglekit index --loss-masks`, read by
// lib/loss_masks.h), as it was when indexed: a file moved or changed since is refused, not
// read as other masks.
struct IndexLossMasks {
  std::string path;          // absolute, lexically normal (a relative one resolved, as file paths)
  std::uint64_t size = 0;    // bytes
  std::int64_t mtime_ns = 0;
  std::uint64_t xxh3 = 0;    // XXH3-64 of its bytes
};

// A loss-mask file as an index records it: its absolute, lexically normal path, size and
// mtime (stat'ed before it is read, so a file changed while it is read looks changed next
// time) and the XXH3-64 of its bytes. Throws IoError.
IndexLossMasks index_loss_masks_of(const std::string& path);

// How the file at recorded.path differs from what the index recorded: "" when it is the same
// file (same size and mtime, or same size and bytes: a copy with new times is the same file),
// else a phrase for a message: "is not there (moved or deleted since indexing?)", "has 120
// bytes, 96 when indexed",
// "holds other bytes than when indexed (same size; XXH3-64 ... now, ... then)".
std::string index_loss_masks_change(const IndexLossMasks& recorded);

class DatasetIndex {
 public:
  // 2: entries carry the records' stated norm form (flags 8, 16). A version 1 index cannot
  // say it, so it is refused (rebuild it) rather than read as "not stated".
  // 3: paths below the index's folder are relative to it. Version 2 (all absolute) is read
  // too; an older build refuses version 3 instead of resolving its paths against the
  // working folder.
  // 4: the index may name a loss-mask file and mark the entries that take their mask from
  // it (header byte 112, entry flag 128). Only an index that names one is written as version
  // 4: an older build then refuses it instead of training on no mask; any other index is
  // written as version 3, byte for byte as before, which older builds keep reading.
  static constexpr std::uint32_t kVersion = 4;
  static constexpr std::uint32_t kOldestVersion = 2;

  static DatasetIndex load(const std::string& path);
  // Same, from bytes already in memory (name is used in messages).
  static DatasetIndex from_source(std::shared_ptr<const ByteSource> source);

  DatasetIndex(DatasetIndex&&) noexcept;
  DatasetIndex& operator=(DatasetIndex&&) noexcept;
  ~DatasetIndex();

  std::size_t size() const;  // entries
  IndexEntry entry(std::size_t i) const;
  // entry(i).conversation_id without decoding the rest (for hashing all ids quickly).
  std::string_view conversation_id(std::size_t i) const;
  std::size_t file_count() const;
  IndexFile file(std::size_t i) const;
  std::string_view file_path(std::size_t entry_index) const { return file(entry(entry_index).file).path; }
  // The folders the index was built from, as given to build_index (absolute; relative ones
  // resolved like file paths).
  std::vector<std::string> roots() const;
  const std::string& path() const;  // where it was loaded from
  std::uint32_t version() const;     // as the file states it
  // The loss-mask file the index joined; nullopt when none (always before version 4).
  const std::optional<IndexLossMasks>& loss_masks() const;

  // Every entry with this conversation id (ok or bad), in index order: empty when none,
  // more than one when the id is duplicated. O(log n) over the sorted id table.
  std::vector<std::size_t> find(std::string_view conversation_id) const;
  // Entry numbers sorted by conversation id (bytewise), ids "" first.
  std::size_t sorted_entry(std::size_t rank) const;
  // Ids held by more than one entry, sorted, each once.
  std::vector<std::string> duplicate_ids() const;
  std::size_t bad_count() const;  // entries that are not ok

 private:
  struct Impl;
  explicit DatasetIndex(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The owning form of an index, for writing one.
struct IndexedRecord {
  RecordInfo info;                  // info.conversation_id is the resolved id
  std::uint32_t record = 0;
  bool id_from_file_name = false;
  bool joined_loss_mask = false;    // takes its mask from write_index's loss_masks
  std::string error;                // non-empty: a bad entry
  EntryError error_kind = EntryError::kNone;  // set with error
};

struct IndexedFile {
  std::string path;
  std::uint64_t size = 0;
  std::int64_t mtime_ns = 0;
  Format format = Format::kUnknown;
  std::string error;                // non-empty: could not be opened (records holds one bad entry)
  std::vector<IndexedRecord> records;
};

// Writes an index file atomically (formats/atomic_file.h). Entries are stored in the order
// given (files in order, records in order); version 4 with `loss_masks`, else version 3.
// Throws IoError, or UsageError for more than 2^32 - 1 entries or files, a string longer
// than 16 MiB, or an entry joining a loss mask without `loss_masks`.
void write_index(const std::string& path, const std::vector<std::string>& roots,
                 const std::vector<IndexedFile>& files, const IndexLossMasks* loss_masks = nullptr);

}  // namespace eaglekit
