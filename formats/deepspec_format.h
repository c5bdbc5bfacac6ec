// DeepSpec's target cache, version 2 (github.com/deepseek-ai/DeepSpec,
// deepspec/data/target_cache_dataset.py, as of commit afdfa7c): a folder that DeepSpec's
// scripts/data/prepare_target_cache.py writes and its CacheDataset reads. Read-only: DeepSpec
// is the only writer. Layout also in docs/formats.md.
//
//   manifest.json   JSON object (DeepSpec writes it last, atomically, sorted keys):
//                     version 2, num_samples, num_shards, target_layer_ids (sorted, non-empty;
//                     -1 is the embeddings), hidden_dtype "bfloat16", token_dtype "int32",
//                     mask_dtype "uint8", index_record_size 56, hidden_size H,
//                     shards [{shard_id 0.., file_name}], and descriptive extras
//                     (target_model_name_or_path, source_jsonl_paths, max_length, ...)
//   samples.idx     num_samples records of 56 bytes, little-endian "<QIIQQQQQ":
//                     0  u64 sample_id   == the record's position (dense from 0)
//                     8  u32 shard_id    < num_shards
//                     12 u32 seq_len     T > 0
//                     16 u64 input_ids_offset                 int32 [T]
//                     24 u64 attention_mask_offset            uint8 [T] (all ones; not read)
//                     32 u64 loss_mask_offset                 uint8 [T]
//                     40 u64 target_hidden_states_offset      bf16 [T, k*H], the k target
//                                                             layers of a token side by side
//                     48 u64 target_last_hidden_states_offset bf16 [T, H]
//                   offsets are byte offsets into the shard; DeepSpec writes the five arrays
//                   back to back in this order, samples back to back, no alignment.
//   shard-NNNNN.bin raw bytes, named by the manifest's shards[].file_name.
//
// Detection is by content: a JSON object of at most 16 MiB whose top level holds
// "index_record_size", "target_layer_ids" and "shards" is this format's manifest; the reader
// then refuses any other version, dtype or record size by name. samples.idx and the shards
// carry no magic and are not record files of their own.
//
// As a Record: conversation_id = the decimal sample_id; input_ids int32 [T] (copied: DeepSpec
// does not align them); hidden_states = target_last_hidden_states, which DeepSpec takes from
// AutoModel's last_hidden_state, after the base's final norm (Record::layout_prenorm = false);
// aux_hidden_states = target_hidden_states; loss_mask uint8 [T]. Views into the mapped shard
// otherwise.
//
// Opening maps the manifest's files and checks the manifest and samples.idx's size; each
// record's index entry and byte ranges are checked when it is read (info/read_prefix), so
// damage to one sample makes only that one fail, with an error naming samples.idx or the
// shard, the byte offset and the field.
//
// Thread safety: immutable after open; info/read_prefix/find may run concurrently.
// Errors: IoError (a file missing), FormatError, UnsupportedError (formats/error.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "formats/format.h"

namespace eaglekit {

class ByteSource;

inline constexpr std::uint64_t kDeepSpecIndexRecordSize = 56;

// Whether `path` is a DeepSpec target-cache manifest (the content test above). Reads the file
// only when it is small enough and starts with '{'; never throws.
bool is_deepspec_manifest(const std::string& path);

class DeepSpecReader final : public RecordReader {
 public:
  // `manifest_path` names manifest.json; samples.idx and the shards are beside it.
  static std::unique_ptr<DeepSpecReader> open(const std::string& manifest_path);
  // The same from any bytes: the manifest's text (named `manifest_name` in errors) and a
  // function that gives the source of a file beside it ("samples.idx", a shard's file_name).
  using FileSource = std::function<std::shared_ptr<const ByteSource>(const std::string& name)>;
  static std::unique_ptr<DeepSpecReader> open(const std::string& manifest_name, std::string_view manifest_text,
                                              const FileSource& file);
  ~DeepSpecReader() override;

  Format format() const override;
  const std::string& path() const override;
  std::size_t size() const override;
  RecordInfo info(std::size_t i) const override;
  Record read_prefix(std::size_t i, std::int64_t max_rows) const override;
  std::optional<std::size_t> find(std::string_view conversation_id) const override;
  // target_layer_ids + 1 (DeepSpec's -1 is the embeddings, i the output of layers[i]: HF
  // hidden_states[i+1]).
  FileFacts facts() const override;

  const std::vector<std::int64_t>& target_layer_ids() const;
  std::int64_t hidden_size() const;

 private:
  struct Impl;
  explicit DeepSpecReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

std::unique_ptr<RecordReader> open_deepspec_reader(const std::string& path);

}  // namespace eaglekit
