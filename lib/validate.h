// `eaglekit validate`: checks an index's records against the conversations
// (docs/data.md) and against each other before training starts, so that a bad dump is found in
// seconds rather than hours into a run.
//
// What is a warning and what is fatal follows one rule: a problem the loader skips by
// itself (match_dataset leaves out conversations without a record, duplicated ids, records
// the index marks bad, records under 2 tokens) is a warning; a problem in a record it would
// train on (mixed hidden sizes or dtypes, NaN/Inf, a record --deep cannot read, a file moved
// or changed since indexing) makes the dataset not trainable as is, and so does matching
// nothing. --quarantine writes the ids of every problem record; the loader takes it too.
//
// Thread safety: validate_dataset is reentrant; --deep reads records in parallel (TBB).
// Throws: what load_conversations and DatasetIndex::load throw (IoError, FormatError),
// UsageError for bad options, IoError when the quarantine file cannot be written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "formats/dtype.h"
#include "formats/index_format.h"
#include "lib/dataset.h"

namespace eaglekit {

// SpecForge pads each record to its dump batch's longest sample: after the last real token
// come input_ids 0 with loss_mask 0 (its collator's zeros; docs/data.md, SpecForge
// padding). Such records train correctly (the mask keeps the padding out of the loss) but
// carry tokens that cost compute. A record counts as padded when it ends in at least one
// token with input_id 0 and loss_mask 0; the padding is that trailing run.
struct PaddedRecord {
  std::string id;
  std::int64_t tokens = 0;   // the record's, padding included
  std::int64_t padding = 0;  // trailing tokens with input_id 0 and loss_mask 0
};
struct PaddingReport {
  std::size_t scanned = 0;         // records read for it
  std::int64_t scanned_tokens = 0;
  std::int64_t padding_tokens = 0;
  std::vector<PaddedRecord> padded;  // in index order
  std::vector<std::string> unreadable;  // records that could not be read ("PATH: error")
};
// Reads index entries `entries` (those with a loss mask; others cannot be told) on `jobs`
// threads (0: all cores) and measures their trailing padding. `name(i)` names entry i.
PaddingReport scan_padding(const DatasetIndex& index, const std::vector<std::size_t>& entries,
                           const std::function<std::string(std::size_t)>& name, int jobs = 0);
// The entries scan_padding reads by default: ok records with a loss mask in the torch.save
// formats (SpecForge writes .ckpt and .ckpt.gz), where reading costs little more than the
// index did. `all_formats`: every format (validate --deep, which reads records anyway).
bool padding_candidate(const IndexEntry& e, bool all_formats);
// The text section both `stats` and `validate` print ("" when nothing is padded), and the
// JSON object both carry: {"scanned", "scanned_tokens", "padded_records", "padding_tokens",
// "records": [{"id", "tokens", "padding"}], "unreadable"}.
std::string padding_text(const PaddingReport& p);
std::string padding_to_json(const PaddingReport& p);

struct ValidateOptions {
  std::string data;         // conversations: .jsonl, folder of them, or a JSON array file;
                            // empty: every usable record of the index (lib/dataset.h)
  std::string index;        // built by `eaglekit index`
  bool deep = false;        // read every value of every matched record (NaN/Inf, checksums)
  std::int64_t max_length = 0;  // > 0: report what truncation to this many tokens drops
  // Non-empty: write the ids to exclude here. When the file already exists, its ids are left
  // out first (as every other command's --quarantine does) and written again with the new
  // problems, so that a dataset fixed by quarantining validates as trainable.
  std::string quarantine;
  MatchBy match_by = MatchBy::kAuto;  // with data: by id, by row (lib/dataset.h)
  int jobs = 0;             // threads for --deep; 0: all cores
  int progress = -1;        // -1: redrawn on a terminal, plain lines in a log (lib/progress.h)
};

// One problem record. `id` is its conversation id, or "PATH" / "PATH#RECORD" when it has
// none; `detail` says what is wrong in words.
struct Problem {
  std::string id;
  std::string detail;
};

struct UnreadableRecord {
  std::string path;            // file, "#RECORD" appended inside multi-record files
  std::string error;
  std::string conversation_id; // "" when unknown
};

struct ValidateReport {
  bool ok = false;                  // trainable as is
  std::size_t conversations = 0;
  std::size_t records = 0;          // index entries, ok and bad
  std::size_t matched = 0;          // samples the loader would train on
  std::string matched_by = "id";    // "id", "row", or "index" (no conversations)
  std::vector<BadConversation> bad_conversations;  // lines of --data that cannot be read (no id, bad JSON)
  std::size_t quarantine_read = 0;        // ids of an existing --quarantine file left out
  std::vector<std::string> missing;       // conversation ids with no record
  std::vector<std::string> orphans;       // records with no conversation (id, or path)
  std::vector<std::string> duplicate_ids; // twice in the conversations or in the records
  std::vector<UnreadableRecord> unreadable;
  std::vector<Problem> shape_mismatch;
  std::vector<Problem> dtype_mismatch;
  std::vector<Problem> nonfinite;         // only with deep
  std::vector<Problem> too_short;
  // The dataset's shape: the most common among matched records (all records when none
  // matched); 0 / kBFloat16 when there are none.
  std::int64_t hidden_size = 0;
  std::int64_t aux_width = 0;
  DType dtype = DType::kBFloat16;
  bool deep = false;
  std::size_t deep_records = 0;     // records read in full
  // With max_length > 0: matched records longer than it, and the tokens cut.
  std::int64_t max_length = 0;
  std::size_t truncated_records = 0;
  std::int64_t truncated_tokens = 0;
  std::int64_t matched_tokens = 0;
  PaddingReport padding;            // over the matched records (padding_candidate)
  std::string no_loss_mask;         // lib/dataset.h no_loss_mask_line over the matched records ("" when one has one)
  // lib/dataset.h joined_loss_mask_line over the matched records ("" when none takes its mask
  // from the index's loss-mask file). That file moved or changed since indexing is fatal
  // (the loader refuses it); with deep, each such record read is checked against its row.
  std::string joined_loss_masks;
  bool loss_masks_fatal = false;    // one of `fatal` is that file's (no quarantine leaves it out)
  std::vector<std::string> fatal;   // why the dataset is not trainable (empty when ok)
  std::string quarantine_path;      // written when non-empty
  std::size_t quarantined = 0;      // ids written to it
  // The ids a quarantine file gets, by category (duplicate_ids, unreadable,
  // shape_mismatch, dtype_mismatch, nonfinite, too_short); filled whether or not one is
  // written, so that a caller can add categories of its own (validate --base).
  std::vector<std::pair<std::string, std::vector<std::string>>> quarantine_groups;

  int exit_code() const { return ok ? 0 : 1; }
};

ValidateReport validate_dataset(const ValidateOptions& opts);

// Writes report.quarantine_groups to `path` (atomically) and records it in the report.
void write_validate_quarantine(ValidateReport& report, const std::string& path);

// {"ok", "conversations", "records", "matched", "missing", "orphans", "duplicate_ids",
//  "unreadable": [{"path", "error"}], "shape_mismatch", "dtype_mismatch", "nonfinite",
//  "too_short"} (lists of ids), "bad_conversations": [{"line", "error"}], "quarantine_read",
// "no_loss_mask" (lib/dataset.h no_loss_mask_line, null when some record has a mask),
// "joined_loss_masks" (lib/dataset.h joined_loss_mask_line, null when none is joined),
// plus "truncation" with --max-length and "quarantine" when one was written.
std::string validate_report_to_json(const ValidateReport& report);
// Counts, the first few of each problem and a hint of what to do.
std::string validate_report_to_text(const ValidateReport& report);

}  // namespace eaglekit
