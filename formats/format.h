// One reader interface and one writer interface for every on-disk record format, and
// detection by magic bytes (never by file name).
//
// Readers: size() records, read(i) / read_prefix(i, n) / info(i). A reader is immutable
// after open and safe to call from many threads at once (formats that wrap a non
// thread-safe library serialize internally). Records it returns may be views into the
// file mapping; they keep the mapping alive on their own.
//
// Writers: add() then finish(). The output appears under its final name only when
// finish() returns (temp file + rename); a writer destroyed before finish() removes its
// temp file and never throws.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "formats/record.h"

namespace eaglekit {

class ByteSource;

enum class Format {
  kUnknown,
  kPt,           // torch.save zip (ModelOpt .pt, SpecForge .ckpt)
  kPtGzip,       // gzip of a torch.save zip (SpecForge .ckpt.gz)
  kSafetensors,  // safetensors (speculators, or our key names)
  kHdf5,         // HDF5: eaglekit shard or group-per-conversation
  kEks,          // eaglekit zstd shard
  kTorchLegacy,  // pre-1.6 torch pickle: detected to refuse it clearly
  kDeepSpec,     // DeepSpec's target cache v2 (its manifest.json; read-only)
  kNemoCache,    // NeMo AutoModel's EAGLE-3 offline cache v2 (its manifest.json; read-only)
};

std::string_view format_name(Format f);  // "pt", "pt.gz", "safetensors", "hdf5", "eks", ...
std::optional<Format> parse_format(std::string_view name);

// Looks at the first bytes of a file. kUnknown when nothing matches. Formats whose row has a
// content test (FormatRow::claims) need the file: detect_format never names them,
// detect_file_format does.
Format detect_format(const std::uint8_t* head, std::size_t n);
Format detect_file_format(const std::string& path);

// The draft vocabulary a file's records of stored target distributions are over
// (Record::target_probs; NeMo's cache states it in its manifest).
struct TargetVocabulary {
  std::vector<std::int64_t> selected;  // draft id i is target id selected[i]; size Vd
  std::int64_t target_vocab_size = 0;  // V of the target model
  std::int64_t topk = 0;               // the producer kept the top k per position (0: all)
  bool operator==(const TargetVocabulary& o) const {
    return selected == o.selected && target_vocab_size == o.target_vocab_size && topk == o.topk;
  }
};

// What a file states once for all of its records, beside their tensors (a cache's manifest).
struct FileFacts {
  // The base's layers aux_hidden_states holds, side by side, as HF hidden_states indices
  // (0 the embeddings, i the output of decoder layer i: what eaglekit's --aux-layer-ids and
  // the engines' eagle_aux_hidden_state_layer_ids count). Empty: not stated.
  std::vector<std::int64_t> aux_layer_ids;
  std::optional<TargetVocabulary> target_vocabulary;  // present iff records carry target_probs
  bool empty() const { return aux_layer_ids.empty() && !target_vocabulary; }
  bool operator==(const FileFacts& o) const {
    return aux_layer_ids == o.aux_layer_ids && target_vocabulary == o.target_vocabulary;
  }
  bool operator!=(const FileFacts& o) const { return !(*this == o); }
};

inline constexpr const char* kFactAuxLayerIds = "aux layer ids";
inline constexpr const char* kFactTargetVocabulary = "target vocabulary";

class RecordReader {
 public:
  virtual ~RecordReader() = default;
  virtual Format format() const = 0;
  virtual const std::string& path() const = 0;
  virtual std::size_t size() const = 0;
  // Metadata only; never decodes tensor data.
  virtual RecordInfo info(std::size_t i) const = 0;
  // The first max_rows rows of every per-token tensor (max_rows < 0: all), touching only
  // the bytes those rows need where the format allows. Throws FormatError on bad bytes.
  virtual Record read_prefix(std::size_t i, std::int64_t max_rows) const = 0;
  Record read(std::size_t i) const { return read_prefix(i, -1); }
  // Index of the record with this conversation id, if any (linear by default).
  virtual std::optional<std::size_t> find(std::string_view conversation_id) const;
  // What the file states for all its records (none by default: most formats state nothing).
  virtual FileFacts facts() const { return {}; }
};

struct WriterOptions {
  Format format = Format::kPt;
  std::string codec = "zstd";  // eks: "zstd" or "fp8"
  int level = 3;               // eks: zstd level
  bool overwrite = true;
};

class RecordWriter {
 public:
  virtual ~RecordWriter() = default;
  virtual void add(const Record& r) = 0;
  virtual void finish() = 0;
  // Takes the source's file facts, before the first add(); a writer that keeps them writes
  // them so that its reader's facts() returns them. Returns the names of the facts its
  // format has no field for (kFactAuxLayerIds, kFactTargetVocabulary), for the caller to say
  // they are dropped or to refuse. The default keeps none.
  virtual std::vector<std::string> set_facts(const FileFacts& facts);
};

// Opens any supported file, detected by magic bytes. Throws IoError / FormatError /
// UnsupportedError (legacy torch, big-endian) with the path in the message.
std::unique_ptr<RecordReader> open_reader(const std::string& path);

// Single-record formats (pt) take exactly one add(); shard formats take many.
std::unique_ptr<RecordWriter> create_writer(const std::string& path, const WriterOptions& opts);

// "FILE" or "FILE#conversation_id": a record inside a multi-record file.
struct RecordSpec {
  std::string path;
  std::optional<std::string> conversation_id;
};
RecordSpec parse_record_spec(const std::string& spec);

// Every file below `root` (recursively, sorted) whose magic bytes name a record format.
// Symlinked folders are not followed (no cycles). Unreadable files are included, so that
// the caller reports them.
std::vector<std::string> find_record_files(const std::string& root);

}  // namespace eaglekit
