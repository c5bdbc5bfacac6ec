// The contract between the dataset index (lib/index.h) and the loader (lib/loader.h):
// conversations read from JSONL (SPEC.md section 2), the records matched to them by
// conversation id, and the reference train/eval split (SPEC.md section 4).
//
// Thread safety: plain values; const access from many threads is fine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace eaglekit {

class DatasetIndex;

struct Conversation {
  std::string id;      // conversation_id, else uuid, else id (decimal form for integers)
  std::string source;  // "FILE:LINE" (1-based) for messages
};

// --data: a .jsonl file, a folder (every *.jsonl in it, sorted by name, concatenated), or any
// other file holding one JSON array. Throws FormatError naming file and line for bad JSON
// or an object with no id.
std::vector<Conversation> load_conversations(const std::string& path);

// One trainable sample: a record located through the index.
struct SampleRef {
  std::string conversation_id;
  std::uint32_t file = 0;    // into Dataset::files
  std::uint32_t record = 0;  // record number inside that file (RecordReader::read(record))
  std::int64_t tokens = 0;
};

struct Dataset {
  std::vector<std::string> files;   // paths of record files
  std::vector<SampleRef> samples;   // matched records, in conversation order
  std::size_t conversations = 0;    // conversations read
  std::size_t quarantined = 0;      // matched but excluded by the quarantine list
};

// Records matched to conversations by id, in conversation order; bad index entries
// and quarantined ids are left out. Throws Error when nothing matched, saying what was
// expected.
Dataset match_dataset(const std::vector<Conversation>& conversations, const DatasetIndex& index,
                      const std::set<std::string>& quarantine = {});

// Reads a quarantine file (one conversation id per line, '#' comments allowed).
std::set<std::string> load_quarantine(const std::string& path);

struct Split {
  std::vector<SampleRef> train;
  std::vector<SampleRef> eval;
};
// The reference split: the first floor((1 - eval_fraction) * n) samples train, the rest eval.
Split split_dataset(const std::vector<SampleRef>& samples, double eval_fraction = 0.05);

}  // namespace eaglekit
