#include "formats/format.h"

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "formats/byte_source.h"
#include "formats/error.h"
#include "formats/file_walk.h"
#include "formats/registry.h"

namespace eaglekit {

namespace fs = std::filesystem;

std::string_view format_name(Format f) {
  const FormatRow* row = format_row(f);
  return row ? row->name : "unknown";
}

std::optional<Format> parse_format(std::string_view n) {
  for (const auto& [format, spelling] : format_spellings())
    if (spelling == n) return format;
  return std::nullopt;
}

Format detect_format(const std::uint8_t* h, std::size_t n) {
  for (const FormatRow& row : format_rows())
    if (!row.claims && row.magic(h, n)) return row.format;
  return Format::kUnknown;
}

Format detect_file_format(const std::string& path) {
  const auto head = read_file_head(path, 16);
  for (const FormatRow& row : format_rows())
    if (row.magic(head.data(), head.size()) && (!row.claims || row.claims(path))) return row.format;
  return Format::kUnknown;
}

std::optional<std::size_t> RecordReader::find(std::string_view id) const {
  for (std::size_t i = 0; i < size(); ++i)
    if (info(i).conversation_id == id) return i;
  return std::nullopt;
}

std::vector<std::string> RecordWriter::set_facts(const FileFacts& facts) {
  std::vector<std::string> dropped;
  if (!facts.aux_layer_ids.empty()) dropped.emplace_back(kFactAuxLayerIds);
  if (facts.target_vocabulary) dropped.emplace_back(kFactTargetVocabulary);
  return dropped;
}

std::unique_ptr<RecordReader> open_reader(const std::string& path) {
  const FormatRow* row = format_row(detect_file_format(path));
  if (!row) {
    const auto named = [](const FormatRow& r) { return !r.noun.empty(); };
    throw FormatError(path, 0, "magic",
                      "not a record file (expected " +
                          format_list(&FormatRow::noun, named, ", ", " or ") + ")");
  }
  if (!row->open)
    throw UnsupportedError(path, 0, "magic",
                           "no reader is built for format " + std::string(row->name));
  return row->open(path);
}

std::unique_ptr<RecordWriter> create_writer(const std::string& path, const WriterOptions& opts) {
  const FormatRow* row = format_row(opts.format);
  if (!row || !row->create)
    throw UsageError("cannot write format " + std::string(format_name(opts.format)));
  return row->create(path, opts);
}

RecordSpec parse_record_spec(const std::string& spec) {
  RecordSpec r;
  const auto hash = spec.rfind('#');
  // A '#' that is part of an existing file name is the file name.
  std::error_code ec;
  if (hash == std::string::npos || fs::exists(spec, ec)) {
    r.path = spec;
    return r;
  }
  r.path = spec.substr(0, hash);
  r.conversation_id = spec.substr(hash + 1);
  return r;
}

std::vector<std::string> find_record_files(const std::string& root) {
  std::vector<std::string> out;
  for (auto& p : list_files_below(root))
    if (record_file_format(p)) out.push_back(std::move(p));  // unreadable: the caller reports it
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace eaglekit
