// The record formats, one row each: every fact about a format outside its own reader and
// writer. Detection, format_name / parse_format, the dataset index's format codes, open_reader
// / create_writer, convert's --format choices, output extensions and help, and the index's
// ids from file names all read these rows. Adding a format = its own header and source (reader,
// writer), one enumerator in formats/format.h and one row in formats/registry.cpp.
// Thread safety: the rows are immutable, built on first use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "formats/format.h"

namespace eaglekit {

struct FormatRow {
  Format format;
  std::string_view name;                     // format_name(); the canonical --format spelling
  std::vector<std::string_view> aliases;     // more spellings parse_format takes ("ckpt")
  // File name endings, lower case (".ckpt.gz"). Never used to detect a file (magic does that):
  // they name outputs (the first: the files of a folder output) and strip ids from file names.
  std::vector<std::string_view> extensions;
  // The format's code in dataset index files (formats/index_format.h). On disk: a code is
  // never renumbered or reused, or old .eki files would read as another format. 0 is unknown.
  std::uint8_t index_code;
  bool one_record;      // a file holds one record (a file name gives an id); else a shard
  bool convert_output;  // `eaglekit convert` writes it (lib/convert.h)
  // How "not a record file (expected ...)" names it; empty: not named (refused formats).
  std::string_view noun;
  // Whether a file's first bytes (16, or the whole file when shorter) are this format's.
  bool (*magic)(const std::uint8_t* head, std::size_t n);
  std::unique_ptr<RecordReader> (*open)(const std::string& path);
  // null: read-only.
  std::unique_ptr<RecordWriter> (*create)(const std::string& path, const WriterOptions& opts);
  // What the format's producer always writes as the last layer where a layout fixes it (its
  // reader sets Record::layout_prenorm for such records), in words for a run's plan; empty:
  // nothing fixed. docs/data.md, pre- and post-norm dumps.
  std::string_view norm_fact = {};
  // A second test on the whole file, for a format whose first bytes say too little (a JSON
  // manifest): the file is this format's when magic and claims both pass. Never throws.
  // null: magic alone decides. detect_format (head only) skips rows that have one.
  bool (*claims)(const std::string& path) = nullptr;
  // The records' bytes lie in files beside the one found and indexed (DeepSpec: shards beside
  // its manifest.json), so `stats` counts each record's RecordInfo::byte_size, not the file's.
  bool records_beside = false;
  // Its files may state facts for all their records (RecordReader::facts: a cache's manifest,
  // an .eks shard's facts block), so a run's plan opens them to read those.
  bool states_facts = false;
};

// Every row, in the order detection tries them and help lists them.
const std::vector<FormatRow>& format_rows();

// f's row; nullptr for Format::kUnknown.
const FormatRow* format_row(Format f);

// Every spelling parse_format takes, for a --format choice: the writable formats' names in
// row order, then their aliases.
std::vector<std::pair<Format, std::string_view>> format_spellings();

// Text for help and errors: `field` (&FormatRow::name, &FormatRow::noun) of every row `keep`
// accepts, in row order, as "a, b, c" with `last` before the final item ("a, b or c").
std::string format_list(std::string_view FormatRow::*field, bool (*keep)(const FormatRow&),
                        std::string_view separator, std::string_view last);

}  // namespace eaglekit
