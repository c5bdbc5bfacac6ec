// Loss masks kept outside a dump, joined to the records they belong to: by row, as speculators
// pairs them, or by conversation id.
//
// speculators 0.9 keeps a conversation's loss mask in its prepared dataset folder (Arrow,
// column `loss_mask`), not in hidden_states/hs_{i}.safetensors; its trainer pairs row i with
// hs_{i}. scripts/speculators/loss_masks.py rewrites that column into one safetensors file
// (layout in that script and in docs/formats.md), which this reads: `row_offsets` I64 [N+1],
// `input_ids` I64 and `loss_mask` U8 of the rows back to back, metadata
// {"eaglekit": "speculators loss masks", "version": "1", "rows": "N"}.
//
// tools/python/eaglekit_masks.py computes masks from the conversations and the base's chat
// template (ModelOpt's rule or eaglekit_dump.py's) for dumps without one, e.g. ModelOpt's HF
// dumper's without --answer-only-loss. Its file is the same three tensors plus `id_offsets` I64
// [N+1] and `conversation_ids` U8 (the rows' ids, UTF-8, back to back), metadata
// {"eaglekit": "loss masks by conversation id", "version": "1", "rows": "N", "rule": ...}; a
// record takes the row of its conversation id.
//
// Thread safety: immutable after open(); apply() may run on many threads. The file's
// mapping lives as long as the object and any mask it handed out.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>

namespace eaglekit {

struct Record;
class SafetensorsFile;

class LossMasks {
 public:
  // Reads and checks the whole file (offsets rising from 0 to the token count, masks 0/1, ids
  // unique). Throws IoError, FormatError naming the file, the byte offset and the tensor.
  static LossMasks open(const std::string& path);

  const std::string& path() const;
  std::int64_t rows() const { return rows_; }
  bool by_conversation_id() const { return by_id_ != nullptr; }

  // Sets r.loss_mask to its row's mask. A speculators file: row i, where `source` (the
  // record's file) is named hs_{i}.safetensors, as speculators pairs them; UsageError when the
  // file name has no row number, or names a row past the end. A file by conversation id: the
  // row of r.conversation_id; FormatError naming the id and `source` when it has none. Both:
  // FormatError (naming this file, the row or id and the record's file) when the row's length
  // or token ids differ from the record's, or the record already holds a different mask.
  void apply(Record& r, const std::string& source) const;

 private:
  std::shared_ptr<const SafetensorsFile> file_;
  std::int64_t rows_ = 0;
  std::shared_ptr<const std::unordered_map<std::string, std::int64_t>> by_id_;  // null: by row
};

}  // namespace eaglekit
