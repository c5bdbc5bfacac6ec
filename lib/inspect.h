// What `eaglekit inspect` shows about a record file: its format, and per record the
// conversation id, codec and each normalized tensor's dtype and shape, optionally with value
// statistics. Works on every format open_reader() knows; "FILE#conversation_id" picks one
// record of a multi-record file. With a loss-mask file (lib/loss_masks.h, as `convert` and
// `index --loss-masks` join it), a record shows the mask it takes from there.
//
// Thread safety: plain functions; statistics are computed in parallel (TBB) inside.
// Errors: IoError / FormatError from opening and reading; Error when FILE#id names no record.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "formats/dtype.h"
#include "formats/format.h"
#include "formats/host_tensor.h"
#include "formats/record.h"

namespace eaglekit {

// Over the finite values; NaN and +-Inf are only counted. min/max/mean/std are NaN when
// no value is finite.
struct TensorStats {
  std::int64_t count = 0;  // finite values
  double min = 0, max = 0, mean = 0, std = 0;  // std: population (divides by count)
  std::int64_t nan = 0, inf = 0;
};
TensorStats tensor_stats(const HostTensor& t);

struct TensorSummary {
  std::string name;  // input_ids, hidden_states, aux_hidden_states, loss_mask
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;
  std::optional<TensorStats> stats;
};

struct RecordSummary {
  RecordInfo info;                     // conversation id, codec, sizes, byte range
  std::vector<TensorSummary> tensors;  // empty in a listing of a multi-record file
  // With InspectOptions::loss_masks: the row its mask comes from (for one record, the mask
  // applied and checked: its tensors' loss_mask is that row's; in a listing, its length).
  std::optional<std::int64_t> loss_mask_row;
};

struct InspectOptions {
  bool stats = false;
  std::string loss_masks;  // a loss-mask file to join, as convert --loss-masks; "": none
};

struct InspectResult {
  std::string path;
  Format format = Format::kUnknown;
  std::size_t record_count = 0;
  // One record: its tensors. Several (a shard without #id): one summary per record, info only.
  std::vector<RecordSummary> records;
  std::string loss_masks;  // InspectOptions::loss_masks
  FileFacts facts;         // what the file states for all its records (RecordReader::facts)
  bool single() const { return records.size() == 1 && !records[0].tensors.empty(); }
};

// spec: "FILE" or "FILE#conversation_id".
InspectResult inspect(const std::string& spec, const InspectOptions& options = {});

// {"format": "pt", "path": ..., "conversation_id": ..., "tensors": {"input_ids":
//  {"dtype": "int64", "shape": [T]}, ...}, "codec": "raw"} for one record (tensors gain
// "min", "max", "mean", "std", "nan", "inf" with stats); for a listing
// {"format", "path", "records": [{"conversation_id", "tokens", "hidden_size", "aux_width",
// "dtype", "loss_mask", "codec", "byte_offset", "byte_size"}, ...]}. With a loss-mask file,
// "loss_masks": {"file", "row"} for one record, and "loss_mask_row" per listed record. A file
// that states facts adds "facts": {"aux_layer_ids": [...], "target_vocabulary": null |
// {"draft_vocab_size", "target_vocab_size", "topk"}} (absent when it states none).
// Pretty-printed.
std::string inspect_json(const InspectResult& r);
// The same for a person, one line per tensor or record.
std::string inspect_text(const InspectResult& r);

}  // namespace eaglekit
