// The contract between the dataset index (lib/index.h) and the loader (lib/loader.h):
// conversations read from JSONL, the records matched to them by conversation id, and the
// reference train/eval split (docs/data.md).
//
// Duplicates are never resolved by picking one: an id that appears more than once in the
// conversations or in the index is left out of the dataset and listed in
// Dataset::duplicate_ids, so the caller can say so (validate lists them too).
//
// Thread safety: plain values; const access from many threads is fine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "formats/index_format.h"

namespace eaglekit {

class DatasetIndex;

struct Conversation {
  std::string id;      // conversation_id, else uuid, else id (decimal form for integers)
  std::string source;  // "FILE:LINE" (1-based) for messages
};

// --data: a .jsonl file, a folder (every *.jsonl in it, sorted by name, concatenated), or any
// other file holding one JSON array. Throws FormatError naming file and line for bad JSON
// or an object with no id.
//
// An id key holding null counts as absent (as in the reference); one holding anything but
// a string or an integer, or an empty string, is an error. Blank lines in JSONL are skipped.
// Throws IoError when the path cannot be read, Error when a folder has no *.jsonl.
std::vector<Conversation> load_conversations(const std::string& path);
// The same, collecting instead of throwing for conversations that cannot be read (bad JSON,
// no id): each goes to `bad` as {"FILE:LINE", why} and is left out (validate reports them
// all). IoError and a folder without *.jsonl still throw.
struct BadConversation {
  std::string source;  // "FILE:LINE"
  std::string error;
};
std::vector<Conversation> load_conversations(const std::string& path, std::vector<BadConversation>* bad);

// One trainable sample: a record located through the index.
struct SampleRef {
  std::string conversation_id;
  std::uint32_t file = 0;    // into Dataset::files
  std::uint32_t record = 0;  // record number inside that file (RecordReader::read(record))
  std::int64_t tokens = 0;
  std::optional<bool> hidden_states_prenorm;  // as the record states it (index entry)
  std::optional<bool> layout_prenorm;         // as its layout implies (index entry; Record::layout_prenorm)
  bool has_loss_mask = false;                 // the record stores a loss mask (index entry)
  // Its mask is the index's loss-mask file's (`eaglekit index --loss-masks`; index entry):
  // the loader applies it (Dataset::loss_masks).
  bool joined_loss_mask = false;
};

// One line when none of `samples` has a loss mask, stored in the record or joined from the
// index's loss-mask file: every token is then trained (the loss weighs position t by
// mask[t + 1], all ones), with the share of the tokens read (each record cut at
// `max_length`; <= 0: whole) that is; "" when some record has one. Said once by train,
// evaluate and validate, since a chat dump usually trains only the assistant's replies and
// some producers keep the mask outside the dump (speculators: its prepared dataset folder).
std::string no_loss_mask_line(const std::vector<SampleRef>& samples, std::int64_t max_length);

// One line when some of `samples` take their mask from the loss-mask file the index joined
// (Dataset::loss_masks): which file, how many, and how many store their own or have none;
// "" when none does. Said by train, evaluate, validate and stats where no_loss_mask_line is.
std::string joined_loss_mask_line(const std::optional<IndexLossMasks>& loss_masks,
                                  const std::vector<SampleRef>& samples);

struct Dataset {
  std::vector<std::string> files;   // paths of record files
  std::vector<Format> file_formats; // their formats as indexed (parallel to files; empty when not filled)
  std::vector<SampleRef> samples;   // matched records, in conversation order
  std::size_t conversations = 0;    // conversations read
  std::size_t quarantined = 0;      // has a record but excluded by the quarantine list
  // What else was left out, so that the caller can tell the user. Counts are of
  // conversations, each under the first reason that applies in this order: missing,
  // quarantined, duplicates, unreadable, too_short.
  std::size_t missing = 0;          // no record at all in the index
  std::size_t duplicates = 0;       // id not unique in the conversations or in the index
  std::size_t unreadable = 0;       // its record is marked bad in the index
  std::size_t too_short = 0;        // its record has fewer than 2 tokens (nothing to predict)
  std::vector<std::string> duplicate_ids;  // sorted; ids left out for not being unique
  // How samples were found: "id", "row" (auto-detected or asked for), or "index" (no
  // conversations: every record).
  std::string matched_by = "id";
  // The loss-mask file the index joined (DatasetIndex::loss_masks), whose rows the samples
  // with joined_loss_mask take, and the index's path for messages.
  std::optional<IndexLossMasks> loss_masks;
  std::string index_path;
};

// How records find their conversation (docs/data.md, matching):
// - kId: the record's id (the conversation_id or id it stores, else its file name) equals
//   the conversation's id;
// - kRow: producers that name records by row (SpecForge data_{i}.ckpt, vLLM/speculators
//   hs_{i}.safetensors) hold no id: record row i is the i-th conversation (0-based, in
//   --data order);
// - kAuto: by id when any record matches by id, else by row when every record's id has the
//   row form, else by id (and the error says so).
enum class MatchBy { kAuto, kId, kRow };

// The row of a row-named record id: "data_12" -> 12, "hs_3" -> 3 (any prefix ending in '_'
// followed by decimal digits only, without leading zeros); nullopt otherwise.
std::optional<std::int64_t> row_of(std::string_view record_id);

// Records matched to conversations, in conversation order; bad index entries and
// quarantined ids are left out. Throws Error when nothing matched, saying what was
// expected.
Dataset match_dataset(const std::vector<Conversation>& conversations, const DatasetIndex& index,
                      const std::set<std::string>& quarantine = {}, MatchBy by = MatchBy::kAuto);

// match_dataset without the throw: an empty Dataset::samples when nothing matched.
Dataset match_records(const std::vector<Conversation>& conversations, const DatasetIndex& index,
                      const std::set<std::string>& quarantine = {}, MatchBy by = MatchBy::kId);

// Without conversations: every usable record of the index is a sample, in index order, or
// in row order when every record's id has the row form (data_2 before data_10). The same
// exclusions as matching (quarantined, duplicate ids, unreadable, fewer than 2 tokens);
// Dataset::conversations counts the records considered. Throws Error when none is usable.
Dataset index_dataset(const DatasetIndex& index, const std::set<std::string>& quarantine = {});

// Reads a quarantine file (one conversation id per line, '#' comments allowed).
// A line whose first non-blank character is '#' is a comment; ids are trimmed of
// surrounding blanks. Throws IoError when the file cannot be read.
std::set<std::string> load_quarantine(const std::string& path);

// Writes ids in the form load_quarantine reads, atomically. `groups` pairs a comment
// (written as "# COMMENT") with the ids under it; an id is written once. Throws Error for
// an id that would not read back the same (empty, surrounding blanks, leading '#', newline).
void write_quarantine(const std::string& path,
                      const std::vector<std::pair<std::string, std::vector<std::string>>>& groups);

struct Split {
  std::vector<SampleRef> train;
  std::vector<SampleRef> eval;
};
// The reference split: the first floor((1 - eval_fraction) * n) samples train, the rest eval.
// Throws UsageError when eval_fraction is outside [0, 1].
Split split_dataset(const std::vector<SampleRef>& samples, double eval_fraction = 0.05);

}  // namespace eaglekit
