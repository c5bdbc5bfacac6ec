// NeMo AutoModel's EAGLE-3 offline target-output cache, format_version 2 (nemo-automodel 0.7.0
// on PyPI: nemo_automodel/components/datasets/llm/eagle3_cache.py and offline_cache.py own the
// format, components/speculative/precompute_eagle3.py writes it, CachedEagle3Dataset reads it).
// Read-only. Layout also in docs/formats.md.
//
//   manifest.json  JSON object (indent 2, sorted keys, written before the shards): format_version 2,
//                    num_samples, shard_size, seq_length S, dtype "bf16" | "fp16" | "fp32",
//                    aux_layer_ids (3 layer ids), aux_hidden_dim k*H, target_vocab_size V,
//                    draft_vocab_size Vd, selected_token_ids [Vd] (draft id i is target id
//                    selected_token_ids[i]), target_probs_topk (0: full distribution), and
//                    descriptive extras (target_model, input_data, split, shuffle_seed,
//                    mask_reasoning_content, mask_generation_prompt).
//   shard-NNNNNN.safetensors   six digits, 0 .. ceil(num_samples / shard_size) - 1; shard s holds
//                    samples [s*shard_size, ...), shard_size of them (the last: the rest), each
//                    tensor stacked on dim 0, every sample right-padded to S:
//                      input_ids          I64  [n, S]   the tokens shifted left by one (token t+1 at t,
//                                                        0 at the end): the first token is not stored
//                      attention_mask     I64  [n, S]   1 on the real tokens (a prefix), not shifted
//                      loss_mask          I64  [n, S]   shifted left by one like input_ids
//                      aux_hidden_states  dtype [n, S, k*H]  the 3 aux layers side by side, not shifted
//                      position_mask      BOOL [n, S, 1]  loss_mask and "the target's argmax is in
//                                                          the draft vocabulary"
//                      target_probs       dtype [n, S, Vd]  softmax of the target's logits at t+1 over
//                                                          the draft vocabulary (target_probs_topk 0), or
//                      target_probs_values dtype [n, S, k] + target_probs_indices I32 [n, S, k]
//                                          the top k of that, renormalised (0 < k < Vd)
//   target_embeddings.safetensors   "weight" F32 [V, H], the target's input embeddings.
//
// As a record (read / read_prefix): NeMo's cache holds no last hidden state; its training
// target is target_probs, which the record carries (Record::target_probs, hidden_states
// empty). NeMo's target_probs[t] is eaglekit's target p[t] (docs/ttt.md): the distribution of
// token t+2 read at position t+1, so it is carried row for row (a view of the shard; with
// top k, scattered to [T, Vd] as NeMo's reader does). The other fields are unshifted to
// eaglekit's layout, T = the attention mask's ones: input_ids[j] = the stored input_ids[j-1]
// (token j; input_ids[0], the first token, is not stored and reads 0: nothing trained reads
// it), loss_mask[j] = position_mask[j-1] (0 at j = 0), aux_hidden_states as stored. The draft
// vocabulary is selected_token_ids (d2t[i] = selected_token_ids[i] - i).
//
// Detection is by content: a JSON object of at most 16 MiB whose top level holds
// "format_version", "shard_size", "aux_hidden_dim" and "selected_token_ids". The shards and
// target_embeddings.safetensors beside such a manifest belong to it and are not record files of
// their own (is_nemo_cache_member).
//
// Opening parses the manifest and every shard's safetensors header and checks each tensor's
// name, dtype and shape against the manifest; a sample's masks are checked when it is read
// (info/sample), so a damaged sample fails alone, naming the shard, the byte offset and the field.
//
// Thread safety: immutable after open; info/read_prefix/sample/find may run concurrently.
// Errors: IoError (a file missing), FormatError, UnsupportedError (formats/error.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "formats/format.h"

namespace eaglekit {

class ByteSource;

// Whether `path` is a NeMo EAGLE-3 cache manifest (the content test above). Never throws.
bool is_nemo_cache_manifest(const std::string& path);
// Whether `path` is a shard-NNNNNN.safetensors or target_embeddings.safetensors beside a NeMo
// cache manifest. Never throws.
bool is_nemo_cache_member(const std::string& path);

// One sample as stored (views into the mapped shard), its masks checked.
struct NemoCacheSample {
  std::int64_t tokens = 0;      // T: the attention_mask's ones
  HostTensor input_ids;         // I64 [S], shifted left by one as stored
  HostTensor attention_mask;    // I64 [S]
  HostTensor loss_mask;         // I64 [S], shifted left by one as stored
  HostTensor aux_hidden_states; // [S, k*H]
  HostTensor position_mask;     // BOOL [S, 1]
  std::optional<HostTensor> target_probs;          // [S, Vd] (full)
  std::optional<HostTensor> target_probs_values;   // [S, k] (top-k)
  std::optional<HostTensor> target_probs_indices;  // I32 [S, k]
};

class NemoCacheReader final : public RecordReader {
 public:
  static std::unique_ptr<NemoCacheReader> open(const std::string& manifest_path);
  // The same from any bytes: the manifest's text and a function giving the source of a file
  // beside it ("shard-000000.safetensors").
  using FileSource = std::function<std::shared_ptr<const ByteSource>(const std::string& name)>;
  static std::unique_ptr<NemoCacheReader> open(const std::string& manifest_name, std::string_view manifest_text,
                                               const FileSource& file);
  ~NemoCacheReader() override;

  Format format() const override;
  const std::string& path() const override;
  std::size_t size() const override;
  RecordInfo info(std::size_t i) const override;
  // Sample i as a record of stored target distributions (above), its first max_rows rows.
  Record read_prefix(std::size_t i, std::int64_t max_rows) const override;
  std::optional<std::size_t> find(std::string_view conversation_id) const override;
  // aux_layer_ids + 1 (NeMo hooks layers[i]: HF hidden_states[i+1]) and the draft vocabulary
  // (selected_token_ids, target_vocab_size, target_probs_topk).
  FileFacts facts() const override;

  NemoCacheSample sample(std::size_t i) const;
  std::int64_t seq_length() const;
  std::int64_t hidden_size() const;  // aux_hidden_dim / len(aux_layer_ids)
  const std::vector<std::int64_t>& aux_layer_ids() const;
  const std::vector<std::int64_t>& selected_token_ids() const;
  std::int64_t target_probs_topk() const;  // 0 when the full distribution is stored
  std::int64_t target_vocab_size() const;  // V
  std::int64_t draft_vocab_size() const;   // Vd
  DType dtype() const;

 private:
  struct Impl;
  explicit NemoCacheReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

std::unique_ptr<RecordReader> open_nemo_cache_reader(const std::string& path);

}  // namespace eaglekit
