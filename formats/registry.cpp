#include "formats/registry.h"

#include <cstring>

#include "formats/bytes.h"
#include "formats/deepspec_format.h"
#include "formats/eks_format.h"
#include "formats/hdf5_format.h"
#include "formats/nemo_cache_format.h"
#include "formats/pt_format.h"
#include "formats/pt_gzip_format.h"
#include "formats/safetensors_format.h"

namespace eaglekit {

namespace {

// ZIP local file header "PK\3\4" (torch.save zip). An empty zip would start "PK\5\6".
bool zip_magic(const std::uint8_t* h, std::size_t n) {
  return n >= 4 && h[0] == 'P' && h[1] == 'K' && h[2] == 3 && h[3] == 4;
}

bool gzip_magic(const std::uint8_t* h, std::size_t n) {
  return n >= 2 && h[0] == 0x1f && h[1] == 0x8b;
}

// Pickle PROTO 2 then LONG1 of the 10-byte magic number 0x1950a86a20f9469cfc6c.
bool torch_legacy_magic(const std::uint8_t* h, std::size_t n) {
  return n >= 4 && h[0] == 0x80 && h[1] == 0x02 && h[2] == 0x8a && h[3] == 0x0a;
}

// u64 header length, then '{'. The weakest test: any head with a '{' at byte 8 and zeros in
// bytes 5..7 passes, a legacy torch head too, so its row comes after every row whose magic
// can share such a head (HDF5's byte 7 and .eks's byte 5 are not zero).
bool safetensors_magic(const std::uint8_t* h, std::size_t n) {
  if (n < 9 || h[8] != '{') return false;
  const std::uint64_t len = load_le64(h);
  return len >= 2 && len < (1ull << 40);
}

bool hdf5_magic(const std::uint8_t* h, std::size_t n) {
  static const std::uint8_t kHdf5Magic[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};
  return n >= 8 && std::memcmp(h, kHdf5Magic, 8) == 0;
}

bool eks_magic(const std::uint8_t* h, std::size_t n) {
  return n >= 8 && std::memcmp(h, "EKSHARD1", 8) == 0;
}

// A JSON object's first byte; the row's content test (is_deepspec_manifest) does the rest.
bool json_object_magic(const std::uint8_t* h, std::size_t n) { return n >= 1 && h[0] == '{'; }

std::unique_ptr<RecordReader> refuse_torch_legacy(const std::string& path) {
  throw_torch_legacy(path);
}

}  // namespace

const std::vector<FormatRow>& format_rows() {
  static const std::vector<FormatRow> kRows = {
      // format, name, aliases, extensions, index code, one record, convert writes it, noun,
      // magic, reader, writer, norm fact
      {Format::kPt, "pt", {"ckpt"}, {".pt", ".ckpt", ".pth"}, 1, true, true, "a torch.save zip",
       zip_magic, open_pt_reader, create_pt_writer, {}},
      {Format::kPtGzip, "pt.gz", {"ckpt.gz"}, {".pt.gz", ".ckpt.gz"}, 2, true, false, ".ckpt.gz",
       gzip_magic, open_pt_gzip_reader, create_pt_gzip_writer, {}},
      // Detected only to refuse it clearly.
      {Format::kTorchLegacy, "torch-legacy", {}, {}, 6, true, false, "", torch_legacy_magic,
       refuse_torch_legacy, nullptr, {}},
      {Format::kSafetensors, "safetensors", {}, {".safetensors"}, 3, true, true, "safetensors",
       safetensors_magic, open_safetensors_reader, create_safetensors_writer,
       "safetensors' stacked layout (token_ids + hidden_states [T, k+1, H]: vLLM's hidden-state extraction, "
       "speculators' hs_{i}.safetensors) holds the last layer before the base's final norm: vLLM captures every "
       "layer as hidden_states + residual and runs the norm after its loop"},
      {Format::kHdf5, "hdf5", {"h5"}, {".h5", ".hdf5"}, 4, false, true, "HDF5", hdf5_magic,
       open_hdf5_reader, create_hdf5_writer, {}},
      {Format::kEks, "eks", {}, {".eks"}, 5, false, true, ".eks shard", eks_magic, open_eks_reader,
       create_eks_writer, {}, nullptr, false, /*states_facts=*/true},
      // A folder; its manifest.json is the file found and indexed (formats/deepspec_format.h).
      {Format::kDeepSpec, "deepspec", {}, {}, 7, false, false, "DeepSpec manifest.json", json_object_magic,
       open_deepspec_reader, nullptr,
       "DeepSpec's target cache stores target_last_hidden_states, AutoModel's last_hidden_state: after the "
       "base's final norm",
       is_deepspec_manifest, /*records_beside=*/true, /*states_facts=*/true},
      // A folder; its manifest.json is the file found and indexed (formats/nemo_cache_format.h).
      // Its records hold the target's stored distribution instead of a last hidden state.
      {Format::kNemoCache, "nemo", {}, {}, 8, false, false, "NeMo cache manifest.json", json_object_magic,
       open_nemo_cache_reader, nullptr, {}, is_nemo_cache_manifest, /*records_beside=*/true,
       /*states_facts=*/true},
  };
  return kRows;
}

const FormatRow* format_row(Format f) {
  for (const FormatRow& row : format_rows())
    if (row.format == f) return &row;
  return nullptr;
}

std::vector<std::pair<Format, std::string_view>> format_spellings() {
  std::vector<std::pair<Format, std::string_view>> out;
  for (const FormatRow& row : format_rows())
    if (row.create) out.emplace_back(row.format, row.name);
  for (const FormatRow& row : format_rows())
    if (row.create)
      for (std::string_view alias : row.aliases) out.emplace_back(row.format, alias);
  return out;
}

std::string format_list(std::string_view FormatRow::*field, bool (*keep)(const FormatRow&),
                        std::string_view separator, std::string_view last) {
  std::vector<std::string_view> items;
  for (const FormatRow& row : format_rows())
    if (keep(row)) items.push_back(row.*field);
  std::string out;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += i + 1 == items.size() ? last : separator;
    out += items[i];
  }
  return out;
}

}  // namespace eaglekit
