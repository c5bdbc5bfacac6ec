// The loss masks speculators keeps outside its dump, joined to the records it belongs to.
//
// speculators 0.9 keeps a conversation's loss mask in its prepared dataset folder (Arrow,
// column `loss_mask`), not in hidden_states/hs_{i}.safetensors; its trainer pairs row i with
// hs_{i}. scripts/speculators/loss_masks.py rewrites that column into one safetensors file
// (layout in that script and in docs/formats.md), which this reads: `row_offsets` I64 [N+1],
// `input_ids` I64 and `loss_mask` U8 of the rows back to back, metadata
// {"eaglekit": "speculators loss masks", "version": "1", "rows": "N"}.
//
// Thread safety: immutable after open(); apply() may run on many threads. The file's
// mapping lives as long as the object and any mask it handed out.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

namespace eaglekit {

struct Record;
class SafetensorsFile;

class LossMasks {
 public:
  // Reads and checks the whole file (offsets rising from 0 to the token count, masks 0/1).
  // Throws IoError, FormatError naming the file, the byte offset and the tensor.
  static LossMasks open(const std::string& path);

  const std::string& path() const;
  std::int64_t rows() const { return rows_; }

  // Sets r.loss_mask to row i's mask, where `source` (the record's file) is named
  // hs_{i}.safetensors, as speculators pairs them. Throws UsageError when the file name
  // has no row number, or names a row past the end; FormatError (naming this file, the
  // row and the record's file) when the row's length or token ids differ from the
  // record's, or the record already holds a different mask.
  void apply(Record& r, const std::string& source) const;

 private:
  std::shared_ptr<const SafetensorsFile> file_;
  std::int64_t rows_ = 0;
};

}  // namespace eaglekit
