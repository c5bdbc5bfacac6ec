// safetensors (https://github.com/huggingface/safetensors): one reader and one writer for
// model weights (a Hugging Face folder, sharded or not) and for hidden-state records
// (vLLM speculators dumps, or files that use our record key names).
//
// Layout (all integers little-endian):
//
//   [0, 8)          u64 N: length of the JSON header in bytes
//   [8, 8+N)        UTF-8 JSON object, padded with spaces (0x20) to N bytes:
//                     {"__metadata__": {"key": "value", ...},          (optional, strings only)
//                      "NAME": {"dtype": "BF16", "shape": [T, H],
//                               "data_offsets": [BEGIN, END]}, ...}
//   [8+N, EOF)      the data buffer; a tensor occupies [8+N+BEGIN, 8+N+END), row-major,
//                   END - BEGIN = numel * dtype size
//
// dtypes: BOOL U8 I8 I16 I32 I64 F16 BF16 F32 F64 map to eaglekit's DType; F8_E5M2,
// F8_E4M3, F8_E8M0, U16, U32, U64 and C64 are parsed (so that a model folder holding them
// opens) but a tensor of those types cannot be read (UnsupportedError), except an FP8
// record's hidden_states, which the record view dequantises (below).
//
// The reader checks every offset before anything is touched: header length against the
// file size, each data_offsets pair against its dtype and shape and against the data
// buffer, and that no two tensors overlap. It tolerates gaps between tensors and trailing
// bytes (the reference library refuses both); the writer never produces them. Tensors are
// zero-copy views into the mapping and keep it alive.
//
// The writer produces exactly what the reference library (safetensors.torch.save_file)
// writes for the same tensors: compact JSON with "__metadata__" first and tensors in data
// order; tensors sorted by the reference dtype order, largest alignment first (U64 I64 F64
// F32 U32 I32 BF16 F16 U16 I16 ... I8 U8 BOOL), then by name; tiling the data buffer
// without gaps; header padded with spaces to a multiple of 8 bytes. Written atomically.
//
// Thread safety: SafetensorsFile is immutable after parse; SafetensorsWeights::get may be
// called from many threads (shards are opened lazily under a lock). Everything throws
// IoError / FormatError / UnsupportedError with the path and the field in the message.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "formats/format.h"
#include "formats/host_tensor.h"

namespace eaglekit {

class ByteSource;

using SafetensorsMetadata = std::map<std::string, std::string>;

// One tensor of a safetensors header.
struct SafetensorsEntry {
  std::string name;
  std::string dtype_code;      // as the header spells it: "BF16", "F8_E4M3", ...
  std::optional<DType> dtype;  // nullopt: a dtype eaglekit cannot hold (F8, unsigned > 8 bit)
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;     // data_offsets, relative to the start of the data buffer
  std::uint64_t end = 0;
};

// A parsed and validated safetensors file (header + the mapping its tensors view).
class SafetensorsFile {
 public:
  // Maps and validates a file. Throws IoError, FormatError.
  static std::shared_ptr<const SafetensorsFile> open(const std::string& path);
  // Validates bytes already in a source (the source's name is used in messages).
  static std::shared_ptr<const SafetensorsFile> parse(std::shared_ptr<const ByteSource> source);

  const std::string& path() const;
  // In data order (by data_offsets).
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  // The "__metadata__" object; empty when absent.
  const SafetensorsMetadata& metadata() const { return metadata_; }
  // File offset of the data buffer (8 + header length).
  std::uint64_t data_start() const { return data_start_; }
  const std::shared_ptr<const ByteSource>& source() const { return source_; }

  const SafetensorsEntry* find(std::string_view name) const;
  // A zero-copy view of the tensor; nullopt when the name is absent. Throws
  // UnsupportedError for a dtype eaglekit cannot hold.
  std::optional<HostTensor> get(std::string_view name) const;
  HostTensor tensor(const SafetensorsEntry& entry) const;

 private:
  SafetensorsFile() = default;
  std::shared_ptr<const ByteSource> source_;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::size_t, std::less<>> by_name_;
  SafetensorsMetadata metadata_;
  std::uint64_t data_start_ = 0;
};

struct NamedTensor {
  std::string name;
  HostTensor tensor;  // any strides; written row-major
};

// What safetensors.torch.save_file writes by default.
SafetensorsMetadata default_safetensors_metadata();  // {"format": "pt"}

// The file bytes (header and data) for these tensors, in the reference order. Throws
// UsageError for duplicate names, an empty name or the name "__metadata__".
std::vector<std::uint8_t> serialize_safetensors(
    const std::vector<NamedTensor>& tensors,
    const SafetensorsMetadata& metadata = default_safetensors_metadata());
// The same, streamed to `path` atomically (temp file + rename). Throws IoError, UsageError.
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const SafetensorsMetadata& metadata = default_safetensors_metadata());

// The weights of a Hugging Face model folder: `model.safetensors`, or the shards that
// `model.safetensors.index.json` ("weight_map": name -> file) names. Only the shard that
// holds a requested tensor is opened; nothing else is read. Copies share state.
class SafetensorsWeights {
 public:
  // DIR holding model.safetensors.index.json or model.safetensors (index first), or a path
  // to one .safetensors file. Throws IoError (nothing there), FormatError (bad index or
  // header).
  static SafetensorsWeights open_folder(const std::string& dir);

  // A zero-copy view; nullopt when no tensor has this name. Throws FormatError when the
  // index names a shard that lacks the tensor or cannot be parsed.
  std::optional<HostTensor> get(std::string_view name) const;
  bool contains(std::string_view name) const;
  // Every tensor name, sorted.
  std::vector<std::string> names() const;
  // The file that holds `name` (empty when absent).
  std::string file_of(std::string_view name) const;
  const std::string& path() const;

 private:
  struct State;
  explicit SafetensorsWeights(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

// Record form (Format::kSafetensors). One record per file:
//  - speculators: token_ids [T], hidden_states [T, k+1, H] (k aux layers, then the last
//    layer): aux_hidden_states is the zero-copy strided view [T, k*H] (strides [(k+1)*H, 1])
//    and hidden_states the view [T, H] at column k*H;
//  - our names: input_ids [T], hidden_states [T, H], aux_hidden_states [T, k*H]
//    (aliases hidden_state, aux_hidden_state, hidden_state_features);
//  - speculators FP8 (hs_connectors' FP8HiddenStatesConnector, speculators PR 1028): the
//    stacked layout with hidden_states float8_e4m3fn [T, L, H] and hidden_states_scales
//    float32, one per token over all L*H values (scale = amax / 448; [T, 1, 1], [T, 1] or
//    [T]) or one per tensor ([1]): dequantised to float32 as fp8 * scale (the producer's
//    dequantize_fp8_tensor with dtype float32, bit for bit), only the rows read; codec "fp8".
//    A scale that is not finite and > 0 is a FormatError naming its byte offset;
//  - either: optional loss_mask [T]; a leading batch dimension of 1 is dropped.
// The conversation id is __metadata__["conversation_id"], else the file stem;
// __metadata__["hidden_states_prenorm"] ("true" / "false"; absent: not stated) is
// Record::hidden_states_prenorm. The stacked layout sets Record::layout_prenorm (pre-norm):
// vLLM captures each layer, the last included, as hidden_states + residual after that layer,
// and runs the final norm after its loop (vLLM 0.32 model_executor/models/llama.py).
std::unique_ptr<RecordReader> open_safetensors_reader(const std::string& path);
// Writes our key names plus {"format": "pt", "conversation_id": ID} metadata (and
// "hidden_states_prenorm" when the record states it); takes exactly one add().
std::unique_ptr<RecordWriter> create_safetensors_writer(const std::string& path,
                                                        const WriterOptions& opts);
// The record a parsed file holds (views into it), cut to max_rows rows (< 0: all).
Record safetensors_record(const SafetensorsFile& file, std::int64_t max_rows = -1);

}  // namespace eaglekit
