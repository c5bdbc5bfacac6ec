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
// `eaglekit index --loss-masks FILE` joins such a file without converting: it finds each
// record's row and checks its length from the headers (check_length), and records the file
// in the index (formats/index_format.h IndexLossMasks); the loader opens it again
// (open_joined, which refuses a file moved or changed since) and applies each row as it
// reads the record (apply_prefix), where the token ids are checked.
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
struct IndexLossMasks;

class LossMasks {
 public:
  // Reads and checks the whole file (offsets rising from 0 to the token count, masks 0/1, ids
  // unique). Throws IoError, FormatError naming the file, the byte offset and the tensor.
  static LossMasks open(const std::string& path);
  // The file an index joined (DatasetIndex::loss_masks), opened after checking that it is
  // the file indexed (formats/index_format.h index_loss_masks_change); Error naming the
  // index and the file when it is not there or changed since.
  static LossMasks open_joined(const IndexLossMasks& recorded, const std::string& index_path);
  // Why the file an index joined cannot serve it ("" when it can): what open_joined throws.
  static std::string joined_problem(const IndexLossMasks& recorded, const std::string& index_path);

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

  // apply() for a record read as the first r.tokens() of its `tokens` rows
  // (RecordReader::read_prefix, as the loader reads): the row must hold `tokens`, and its
  // first r.tokens() ids and mask values are checked and taken.
  void apply_prefix(Record& r, const std::string& source, std::int64_t tokens) const;

  // From headers only (`eaglekit index`): the row of the record with this conversation id
  // in `source` holding `tokens` tokens, as apply() pairs them; throws what apply() throws
  // when there is none or its length differs (the ids are checked when the record is read).
  std::int64_t check_length(const std::string& conversation_id, const std::string& source,
                            std::int64_t tokens) const;

 private:
  struct Row {
    std::int64_t row = 0;
    std::string what;  // how errors name it: "row 3", "conversation 'a' (row 0)"
  };
  Row find_row(const std::string& conversation_id, const std::string& source) const;
  // Throws unless `row` holds `tokens` tokens; returns its first token's offset.
  std::int64_t check_row_length(const Row& row, const std::string& source, std::int64_t tokens) const;

  std::shared_ptr<const SafetensorsFile> file_;
  std::int64_t rows_ = 0;
  std::shared_ptr<const std::unordered_map<std::string, std::int64_t>> by_id_;  // null: by row
};

}  // namespace eaglekit
