// Building the dataset index (formats/index_format.h holds its file format): walking
// folders for record files, reading each record's metadata in parallel, reusing what an
// earlier index knows unchanged, and reporting the result.
//
// Thread safety: build_index() runs its own threads; the functions share no state.
// Throws: see each function.
#pragma once

#include <cstddef>
#include <exception>
#include <string>
#include <vector>

#include "formats/index_format.h"

namespace eaglekit {

// Classifies an exception a reader threw (a FormatError with no byte offset naming a
// record tensor is a shape error: that is what Record::check throws).
EntryError classify_error(const std::exception& e);

// The conversation id a file name gives ("data/7/abc.pt" -> "abc"): the name without the
// longest record-format extension it ends with (formats/registry.h's rows: ".ckpt.gz",
// ".pt", ".safetensors", ...; case as written), else without its last extension.
std::string file_stem_id(const std::string& path);

struct IndexOptions {
  std::vector<std::string> roots;  // folders (or single files) to walk
  std::string out;                 // index file to write
  int jobs = 0;                    // threads; 0: all cores
  bool incremental = true;         // reuse entries of an existing `out` whose file is unchanged
  int progress = -1;               // -1: redrawn on a terminal, plain lines in a log (lib/progress.h); 0 off; 1 on
  // A loss-mask file (lib/loss_masks.h: speculators' by row, or by conversation id) whose
  // masks the records take, as `convert --loss-masks` gives them; "": the previous index's
  // when `incremental` and it joined one, else none. See build_index.
  std::string loss_masks;
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
  // vLLM's hidden-state connector (ExampleHiddenStatesConnector, vLLM 0.32) writes FILE.lock
  // beside each FILE.safetensors and holds an exclusive flock on it while FILE is written;
  // such companions (a "*.lock" that is not a record file) are skipped, not indexed.
  std::size_t lock_files = 0;
  // Of those, the ones whose flock was held while indexing: their record was still being
  // written, so it may be indexed half written (as a bad record) or not yet exist. Sorted.
  std::vector<std::string> held_locks;
  // With a loss-mask file (IndexOptions::loss_masks): its absolute path ("" when none),
  // whether it came from the previous index, the records that take their mask from it, the
  // bad records (no mask: they are not trained), its rows and those no record took.
  std::string loss_masks;
  bool loss_masks_kept = false;
  std::size_t loss_masks_joined = 0;
  std::size_t loss_masks_bad_records = 0;
  std::size_t loss_masks_rows = 0;
  std::size_t loss_masks_unused_rows = 0;
  bool loss_masks_by_id = false;
  double seconds = 0;
};

// Walks the roots and finds record files by magic bytes (the rules of formats/format.h
// find_record_files, with detection done in parallel and skipped for files the previous
// index knows unchanged), reads each record's metadata (RecordReader::info, never tensor
// data) in parallel over files, and writes opts.out. A
// file or record that cannot be read becomes a bad entry; it never stops the run. Throws
// IoError when a root does not exist or the output cannot be written, UsageError on bad
// options.
//
// With a loss-mask file, every readable record must find its mask there, as `convert
// --loss-masks` pairs them (speculators' file: hs_{i}.safetensors takes row i; a file by
// conversation id: the record's id), of its token count; the file is opened and checked
// whole first, and the records are checked from their headers (the loader checks the token
// ids as it reads). Otherwise nothing is written: the error is the first record's, as
// convert's would be (UsageError for a file name without a row or a row past the end, else
// Error), with how many records do not fit. The index records the file (its path, size,
// mtime, hash: formats/index_format.h IndexLossMasks) and flags the records; reused entries
// are joined again, from the headers the index keeps, so an incremental run re-reads no record.
IndexReport build_index(const IndexOptions& opts);

// `eaglekit index --show`: the whole index as text (one line per entry) or JSON.
std::string index_to_text(const DatasetIndex& index);
std::string index_to_json(const DatasetIndex& index);
// The build summary, as text or JSON.
std::string index_report_to_text(const IndexReport& report, const std::string& out);
std::string index_report_to_json(const IndexReport& report, const std::string& out);

}  // namespace eaglekit
