// The dataset index: what every hidden-state record below some folders holds (conversation
// id, location, token count, dtypes, widths), gathered once from headers only, kept in one
// versioned binary file that loads by mmap with no per-record parsing. The byte layout is
// in docs/formats.md ("Dataset index").
//
// Ownership: a DatasetIndex owns its mapping; the string_views in IndexEntry / IndexFile
// point into it and stay valid while the DatasetIndex lives (it is movable, not copyable).
// Thread safety: immutable after load; const access from many threads is fine.
// Throws: load() throws IoError when the file cannot be read and FormatError (a
// ChecksumError for a checksum mismatch) when its bytes are not an index of this version;
// accessors throw FormatError on an out-of-range reference inside the file and
// std::out_of_range on a bad argument.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
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

// Why an entry is bad, from the exception its reader threw.
enum class EntryError : std::uint8_t {
  kNone,         // ok
  kIo,           // IoError: the OS refused (permissions, vanished file)
  kFormat,       // FormatError: corrupt or truncated bytes
  kChecksum,     // ChecksumError
  kUnsupported,  // UnsupportedError: legacy torch, no reader built for the format
  kShape,        // Record::check failed: tensors disagree on T, aux width not k*H, ...
  kOther,        // anything else
};
std::string_view entry_error_name(EntryError e);  // "io", "format", "checksum", ...
// Classifies an exception a reader threw (a FormatError with no byte offset naming a
// record tensor is a shape error: that is what Record::check throws).
EntryError classify_error(const std::exception& e);

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
  bool has_loss_mask = false;
  bool id_from_file_name = false;    // the record holds no id; it came from the file stem
  bool ok = true;
  EntryError error_kind = EntryError::kNone;
};

struct IndexFile {
  std::string_view path;      // absolute, lexically normal
  std::uint64_t size = 0;     // bytes, when indexed
  std::int64_t mtime_ns = 0;  // modification time, when indexed
  Format format = Format::kUnknown;
  std::string_view error;     // "" unless the file could not be opened at all
  std::uint32_t first_entry = 0;  // its entries are [first_entry, first_entry + entry_count)
  std::uint32_t entry_count = 0;
};

class DatasetIndex {
 public:
  static constexpr std::uint32_t kVersion = 1;

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
  // The folders the index was built from, as given to build_index (absolute).
  std::vector<std::string> roots() const;
  const std::string& path() const;  // where it was loaded from

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
// given (files in order, records in order). Throws IoError, or UsageError for more than
// 2^32 - 1 entries or files or a string longer than 16 MiB.
void write_index(const std::string& path, const std::vector<std::string>& roots,
                 const std::vector<IndexedFile>& files);

// The conversation id a file name gives ("data/7/abc.pt" -> "abc"): the name without its
// record-format extension (.pt, .pth, .ckpt, .ckpt.gz, .pt.gz, .safetensors, else the last).
std::string file_stem_id(const std::string& path);

struct IndexOptions {
  std::vector<std::string> roots;  // folders (or single files) to walk
  std::string out;                 // index file to write
  int jobs = 0;                    // threads; 0: all cores
  bool incremental = true;         // reuse entries of an existing `out` whose file is unchanged
  int progress = -1;               // -1: a progress line when stderr is a terminal; 0 off; 1 on
};

struct IndexReport {
  std::size_t files = 0;
  std::size_t records = 0;          // entries written (ok + bad)
  std::size_t bad_records = 0;
  std::size_t new_files = 0;        // not in the previous index
  std::size_t changed_files = 0;    // size or mtime differ (or had errors before: read again)
  std::size_t unchanged_files = 0;  // entries reused
  std::size_t gone_files = 0;       // in the previous index, not found now
  bool had_previous = false;        // a previous index was read and used
  std::string previous_error;       // a previous index existed but could not be read (ignored)
  std::vector<std::string> duplicate_ids;     // ids held by more than one record
  std::vector<std::string> bad;               // "PATH: ERROR" of each bad entry, in order
  double seconds = 0;
};

// Walks the roots and finds record files by magic bytes (the rules of formats/format.h
// find_record_files, with detection done in parallel and skipped for files the previous
// index knows unchanged), reads each record's metadata (RecordReader::info, never tensor
// data) in parallel over files, and writes opts.out. A
// file or record that cannot be read becomes a bad entry; it never stops the run. Throws
// IoError when a root does not exist or the output cannot be written, UsageError on bad
// options.
IndexReport build_index(const IndexOptions& opts);

// `eaglekit index --show`: the whole index as text (one line per entry) or JSON.
std::string index_to_text(const DatasetIndex& index);
std::string index_to_json(const DatasetIndex& index);
// The build summary, as text or JSON.
std::string index_report_to_text(const IndexReport& report, const std::string& out);
std::string index_report_to_json(const IndexReport& report, const std::string& out);

}  // namespace eaglekit
