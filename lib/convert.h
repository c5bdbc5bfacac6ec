// `eaglekit convert`: any record file(s) to any record format, values preserved exactly
// (tensors are passed through in their dtype; nothing is cast). A norm form the source's
// layout implies (Record::layout_prenorm: speculators' stacked layout is pre-norm) is
// written as the output's stated form, since the output's layout implies none.
//
// SRC is a record file, "FILE#conversation_id" (one record of a shard), or a folder (every
// record file below it, recursively, sorted; records in file order). The output format is
// options.format, else DST's extension (.pt/.ckpt, .safetensors, .h5/.hdf5, .eks), else pt.
// The formats it writes are the rows of formats/registry.h marked convert_output:
//  - Shard formats (hdf5, eks): DST is one file holding every record.
//  - One-record formats (pt, safetensors): DST is a file when SRC yields exactly one record
//    and DST is not a folder (no trailing '/', not an existing folder); otherwise DST is a
//    folder and record C goes to DST/C.pt (or .safetensors: the row's first extension).
// Every output file is written atomically (temp file + rename), so an interrupted run leaves
// no file that looks complete. Records are read (and one-record outputs written) in
// parallel on options.jobs threads; shard writers receive records in order.
//
// With options.loss_masks, each record's loss mask comes from speculators' prepared dataset
// (lib/loss_masks.h), matched by the record file's row number and checked against its tokens.
//
// File facts (formats/format.h FileFacts: the aux layer ids, the target vocabulary of stored
// distributions) go from each source reader to its output writer (RecordWriter::set_facts).
// Sources that go into one shard must state the same facts. A target vocabulary the output
// format cannot keep (.pt, safetensors, HDF5: NeMo's cache to anything but .eks) is refused:
// its records would read back without the distribution or the tokens it is over. Aux layer
// ids it cannot keep are dropped and said (ConvertResult::notes).
//
// Errors: UsageError (DST is SRC, a shard format asked for a folder output, sources of one
// shard stating different facts...), UnsupportedError (a target vocabulary the output format
// drops), Error (two records with the same conversation id for a folder output, an empty
// SRC), IoError / FormatError from reading and writing.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "formats/format.h"

namespace eaglekit {

struct FormatRow;

struct ConvertOptions {
  std::optional<Format> format;  // nullopt: from DST's extension, else pt
  WriterOptions writer;          // codec / level for eks; format is overridden
  int jobs = 0;                  // 0: all cores
  bool progress = false;         // progress on stderr (lib/progress.h: a terminal, or plain lines in a log)
  // A file of speculators' loss masks (lib/loss_masks.h); empty: none. Every record then
  // takes the mask of the dataset row its file name hs_{i}.safetensors names.
  std::string loss_masks;
};

struct ConvertResult {
  Format format = Format::kUnknown;
  std::int64_t records = 0;
  std::int64_t files_written = 0;
  std::int64_t bytes_written = 0;
  bool folder_output = false;
  std::int64_t loss_masks_joined = 0;  // records that took a mask from options.loss_masks
  std::string output;  // DST
  double seconds = 0;
  // The facts the output keeps: a shard's, as its sources state them (empty: none stated, or
  // a format that keeps none).
  FileFacts facts;
  // Aux layer ids sources state that the output format has no field for, each list once.
  std::vector<std::vector<std::int64_t>> dropped_aux_layer_ids;
  // What the output does not keep and what to do about it, one sentence each, for a person.
  std::vector<std::string> notes;
};

ConvertResult convert_records(const std::string& src, const std::string& dst,
                              const ConvertOptions& options = {});

// The format a path's last extension names, in any case, among the rows' extensions
// (".pt", ".ckpt", ".safetensors", ".h5", ".hdf5", ".eks"; not ".ckpt.gz", which is two);
// nullopt otherwise.
std::optional<Format> format_from_extension(const std::string& path);

// Whether convert writes a row's format: marked convert_output, with a writer and an
// extension. For format_list: the help's and errors' lists of output formats.
bool convert_writes(const FormatRow& row);


}  // namespace eaglekit
