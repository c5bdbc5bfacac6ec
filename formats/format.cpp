#include "formats/format.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "formats/byte_source.h"
#include "formats/bytes.h"
#include "formats/error.h"
#include "formats/file_walk.h"
#include "formats/registry.h"

namespace eaglekit {

namespace fs = std::filesystem;

std::string_view format_name(Format f) {
  switch (f) {
    case Format::kUnknown: return "unknown";
    case Format::kPt: return "pt";
    case Format::kPtGzip: return "pt.gz";
    case Format::kSafetensors: return "safetensors";
    case Format::kHdf5: return "hdf5";
    case Format::kEks: return "eks";
    case Format::kTorchLegacy: return "torch-legacy";
  }
  return "unknown";
}

std::optional<Format> parse_format(std::string_view n) {
  if (n == "pt" || n == "ckpt") return Format::kPt;
  if (n == "pt.gz" || n == "ckpt.gz") return Format::kPtGzip;
  if (n == "safetensors") return Format::kSafetensors;
  if (n == "hdf5" || n == "h5") return Format::kHdf5;
  if (n == "eks") return Format::kEks;
  return std::nullopt;
}

Format detect_format(const std::uint8_t* h, std::size_t n) {
  // ZIP local file header "PK\3\4" (torch.save zip). An empty zip would start "PK\5\6".
  if (n >= 4 && h[0] == 'P' && h[1] == 'K' && h[2] == 3 && h[3] == 4) return Format::kPt;
  if (n >= 2 && h[0] == 0x1f && h[1] == 0x8b) return Format::kPtGzip;
  static const std::uint8_t kHdf5Magic[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};
  if (n >= 8 && std::memcmp(h, kHdf5Magic, 8) == 0) return Format::kHdf5;
  if (n >= 8 && std::memcmp(h, "EKSHARD1", 8) == 0) return Format::kEks;
  // Legacy torch: pickle PROTO 2 then LONG1 of the 10-byte magic number 0x1950a86a20f9469cfc6c.
  if (n >= 4 && h[0] == 0x80 && h[1] == 0x02 && h[2] == 0x8a && h[3] == 0x0a)
    return Format::kTorchLegacy;
  // safetensors: u64 header length, then '{'.
  if (n >= 9 && h[8] == '{') {
    const std::uint64_t len = load_le64(h);
    if (len >= 2 && len < (1ull << 40)) return Format::kSafetensors;
  }
  return Format::kUnknown;
}

Format detect_file_format(const std::string& path) {
  const auto head = read_file_head(path, 16);
  return detect_format(head.data(), head.size());
}

std::optional<std::size_t> RecordReader::find(std::string_view id) const {
  for (std::size_t i = 0; i < size(); ++i)
    if (info(i).conversation_id == id) return i;
  return std::nullopt;
}

std::unique_ptr<RecordReader> open_reader(const std::string& path) {
  const Format f = detect_file_format(path);
  if (f == Format::kTorchLegacy)
    throw UnsupportedError(path, 0, "magic",
                           "legacy (pre-1.6, non-zip) torch.save file; re-save it with "
                           "torch.save(obj, path) from torch >= 1.6");
  if (f == Format::kUnknown)
    throw FormatError(path, 0, "magic",
                      "not a record file (expected a torch.save zip, .ckpt.gz, safetensors, "
                      "HDF5 or .eks shard)");
  for (const auto& entry : format_registry())
    if (entry.format == f && entry.open) return entry.open(path);
  throw UnsupportedError(path, 0, "magic",
                         std::string("no reader is built for format ") +
                             std::string(format_name(f)));
}

std::unique_ptr<RecordWriter> create_writer(const std::string& path, const WriterOptions& opts) {
  for (const auto& entry : format_registry())
    if (entry.format == opts.format && entry.create) return entry.create(path, opts);
  throw UsageError("cannot write format " + std::string(format_name(opts.format)));
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
