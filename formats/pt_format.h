// The .pt format: torch.save zip archives (ModelOpt .pt, SpecForge .ckpt), read and written
// without Python or LibTorch.
//
// Layout (docs/formats.md has the full story): a ZIP of stored entries under one prefix
// directory of any name: PREFIX/data.pkl (a pickle, protocol 2 by default), PREFIX/data/KEY
// (raw little-endian storage bytes, 64-byte aligned since torch 1.6), PREFIX/version ("3"),
// and in newer files PREFIX/byteorder ("little"), PREFIX/.data/serialization_id,
// PREFIX/.format_version, PREFIX/.storage_alignment. Each tensor in data.pkl is
// torch._utils._rebuild_tensor_v2(persistent ('storage', XStorage, KEY, location, numel),
// storage_offset, size, stride, ...): several tensors may share one storage at different
// offsets, and strides may be non-contiguous.
//
// Reading maps the file; tensors are zero-copy views into the mapping (HostTensor::owner
// keeps it alive) with their storage offset, size and stride, except that a view whose
// address is not a multiple of its element size is copied when read. Every storage's byte
// size must match its numel and every tensor's extent must lie inside its storage
// ("wrong storage numel" errors otherwise). Refused: legacy non-zip files and big-endian
// archives (UnsupportedError), compressed entries, and any pickle global outside the
// whitelist of formats/pickle.h (FormatError).
//
// Thread safety: readers are immutable after construction; read from many threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "formats/format.h"
#include "formats/host_tensor.h"

namespace eaglekit {

class ByteSource;

// ---- Generic torch.save files (collated batches, d2t.pt, checkpoints) ----------------

// One leaf of a torch.save'd object. std::monostate is Python's None. Pass strings as
// std::string: a string literal would convert to bool.
using PtValue = std::variant<std::monostate, bool, std::int64_t, double, std::string, HostTensor>;

struct PtEntry {
  std::string name;
  PtValue value;
};

struct PtContents {
  // In pickle order. Nested dicts, lists and tuples are flattened with '.' between keys
  // ("model_state_dict.fc1.weight", "layers.0"); a bare tensor at the root is named "".
  std::vector<PtEntry> entries;

  const PtValue* find(std::string_view name) const;       // nullptr when absent
  const HostTensor* tensor(std::string_view name) const;  // nullptr when absent or not a tensor
};

// Reads every leaf of a torch.save file. Tensors are views into the mapping. Throws
// IoError, FormatError, UnsupportedError. Leaves other than tensors, numbers, strings,
// booleans and None (bytes, bare storages) are a FormatError naming them.
PtContents read_pt(const std::string& path);
PtContents read_pt(std::shared_ptr<const ByteSource> source);

struct PtWriteOptions {
  std::string archive_name = "archive";  // the zip's prefix directory
  bool force_zip64 = false;              // ZIP64 fields even for small files (tests)
};

// Writes a torch.save file holding one flat dict {name: value} in the given order, which
// torch.load (>= 1.6) reads back bit-exactly: protocol-2 pickle, tensors as
// _rebuild_tensor_v2 over their own contiguous storage, records data.pkl, byteorder,
// data/0.., version ("3"), .data/serialization_id; 64-byte aligned; atomic (temp file +
// rename). Throws IoError, UsageError (a name used twice, an unnamed entry).
void write_pt(const std::string& path, const std::vector<PtEntry>& entries,
              const PtWriteOptions& opts = {});

// ---- Records (docs/data.md, records) -------------------------------------------------

// One record per file. Accepts a dict, or a list/tuple holding one dict, with keys
// input_ids; hidden_states | hidden_state; aux_hidden_states | aux_hidden_state |
// hidden_state_features; loss_mask (optional); conversation_id (int or str; when absent
// the file stem: "a/b/123.pt" -> "123", "7.ckpt.gz" -> "7"); hidden_states_prenorm
// (optional: a bool, 0 / 1, or a one-element tensor of those; absent or None: not stated).
// A leading batch dimension of 1 is dropped. The record passes Record::check.
class PtReader final : public RecordReader {
 public:
  explicit PtReader(const std::string& path);
  // `id_path` gives the fallback conversation id (a decompressed .ckpt.gz, a test buffer).
  PtReader(std::shared_ptr<const ByteSource> source, const std::string& id_path);
  ~PtReader() override;

  Format format() const override { return Format::kPt; }
  const std::string& path() const override;
  std::size_t size() const override { return 1; }
  RecordInfo info(std::size_t i) const override;
  // Views of the first max_rows rows; touches no byte of the rows after them.
  Record read_prefix(std::size_t i, std::int64_t max_rows) const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The conversation id a file name implies: the name without folders, a trailing ".gz" and
// one more extension.
std::string conversation_id_from_path(const std::string& path);

// Writes one record per file in the ModelOpt schema (input_ids, hidden_states,
// aux_hidden_states, conversation_id as str, loss_mask and hidden_states_prenorm (a bool)
// when present), tensors as stored
// (dtype preserved). add() once, then finish().
class PtWriter final : public RecordWriter {
 public:
  explicit PtWriter(std::string path, PtWriteOptions opts = {});
  void add(const Record& r) override;
  void finish() override;

 private:
  std::string path_;
  PtWriteOptions opts_;
  std::optional<Record> record_;
  bool finished_ = false;
};

// Registry hooks (formats/registry.cpp).
std::unique_ptr<RecordReader> open_pt_reader(const std::string& path);
std::unique_ptr<RecordWriter> create_pt_writer(const std::string& path, const WriterOptions& opts);
// The refusal of a legacy (pre-1.6, non-zip) torch.save file: UnsupportedError saying how to
// re-save it. The pt reader throws it, and so does open_reader (its registry row).
[[noreturn]] void throw_torch_legacy(const std::string& path);

}  // namespace eaglekit
