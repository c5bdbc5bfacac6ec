// The normalized hidden-state record every format reads into and writes from
// (docs/data.md, records), and the metadata an index keeps about one.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "formats/host_tensor.h"

namespace eaglekit {

struct Record {
  std::string conversation_id;
  HostTensor input_ids;          // [T] int64 or int32
  // [T, H] bf16 / fp16 / fp32. Empty (dim 0) in a record that carries target_probs instead.
  HostTensor hidden_states;
  HostTensor aux_hidden_states;  // [T, k*H], floating; may differ from hidden_states' dtype
  std::optional<HostTensor> loss_mask;  // [T] int64 / bool / uint8; absent = all ones
  // The target's distribution over the draft vocabulary as a producer stored it, instead of
  // the last hidden state (NeMo AutoModel's EAGLE-3 cache): [T, Vd], floating, in the dtype
  // of aux_hidden_states. Row t is the trainer's target p[t] itself (docs/ttt.md): the base's
  // distribution of token t+2, read at position t+1, over the draft vocabulary (draft id i is
  // target id i + d2t[i]). Present: hidden_states is empty and target_hidden_size gives H.
  std::optional<HostTensor> target_probs;
  std::int64_t target_hidden_size = 0;  // H of a record with target_probs (the aux layers' width)
  // Whether hidden_states were taken before the base's final norm, as the producer stated
  // it (ModelOpt's `hidden_states_prenorm`; docs/data.md, pre- and post-norm dumps):
  // true pre-norm, false post-norm, nullopt when the record does not say.
  std::optional<bool> hidden_states_prenorm;
  // The form the record's layout implies where its producer always writes one form, and the
  // record states none itself (the format row's FormatRow::norm_fact, set by its reader):
  // speculators' stacked [T, k+1, H] layout, whose last slice vLLM captures before the
  // final norm, is pre-norm. nullopt: the layout implies nothing (or the record states it).
  std::optional<bool> layout_prenorm;

  // The form known without measuring: the stated one, else the layout's; nullopt: neither.
  std::optional<bool> known_prenorm() const { return hidden_states_prenorm ? hidden_states_prenorm : layout_prenorm; }

  std::int64_t tokens() const { return input_ids.shape.empty() ? 0 : input_ids.shape[0]; }
  std::int64_t hidden_size() const {
    return target_probs ? target_hidden_size : hidden_states.dim() == 2 ? hidden_states.shape[1] : 0;
  }
  // Vd of target_probs; 0 for a record of hidden states.
  std::int64_t target_probs_width() const { return target_probs && target_probs->dim() == 2 ? target_probs->shape[1] : 0; }
  // The dtype the record's floating tensors are read in: hidden_states', or with target_probs
  // aux_hidden_states' (which target_probs shares).
  DType stored_dtype() const { return target_probs ? aux_hidden_states.dtype : hidden_states.dtype; }
  std::int64_t aux_width() const {
    return aux_hidden_states.dim() == 2 ? aux_hidden_states.shape[1] : 0;
  }
  // Every per-token tensor cut to its first n rows (views).
  Record prefix(std::int64_t n) const;
  // Checks ranks, dtypes and that all per-token tensors have T rows and aux width is a
  // multiple of H. Throws FormatError naming `where` and the offending field.
  void check(const std::string& where) const;
  // The record with hidden_states and aux_hidden_states both in common_hidden_dtype()
  // (copies of the tensors that need widening; the same views when they already agree).
  // Readers hand out records in this form, so batches hold one dtype.
  Record with_common_hidden_dtype() const;
};

// The dtype a record whose hidden_states and aux_hidden_states are stored in different
// float types is read as: the narrowest into which both convert exactly (fp16 and bf16:
// float32; anything with float64: float64). Equal dtypes stay as they are.
DType common_hidden_dtype(DType hidden, DType aux);
// `t` as a contiguous tensor of floating dtype `to`, element by element (exact when `to`
// is at least as wide).
HostTensor widened(const HostTensor& t, DType to);

// What an index or `inspect` needs without reading tensor bytes.
struct RecordInfo {
  std::string conversation_id;
  std::string key;                 // locator inside the file ("" for single-record files)
  std::int64_t tokens = 0;
  std::int64_t hidden_size = 0;
  std::int64_t aux_width = 0;      // k*H
  std::int64_t target_probs_width = 0;  // Vd of a record that stores target_probs (Record::target_probs); else 0
  DType ids_dtype = DType::kInt64;
  DType hidden_dtype = DType::kBFloat16;  // of both hidden and aux, as read (common_hidden_dtype)
  bool has_loss_mask = false;
  std::optional<bool> hidden_states_prenorm;  // as Record::hidden_states_prenorm
  std::optional<bool> layout_prenorm;         // as Record::layout_prenorm
  std::string codec = "raw";       // "raw", "zstd", "fp8", "gzip", "hdf5-gzip", ...
  std::uint64_t byte_offset = 0;   // where the record starts in its file (0 if unknown)
  std::uint64_t byte_size = 0;     // bytes it takes on disk (0 if unknown)
};

RecordInfo info_of(const Record& r);

}  // namespace eaglekit
