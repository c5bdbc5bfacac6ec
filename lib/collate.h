// Collation: records (already read and truncated) -> one Batch of LibTorch tensors, with
// the reference semantics (docs/data.md, DataCollatorForOffline) in pad mode and two
// faster modes, `longest` and `pack`. Records are copied straight into preallocated batch
// tensors (one copy from the file mapping to the batch); padding is written as zeros.
//
// Reference semantics, exactly (pad mode): each row holds one sample cut to max_length;
// input_ids, hidden_states, aux_hidden_states as stored (ids widened to int64), zero
// padded to exactly max_length; attention_mask = 1 and loss_mask = 1 (or the stored
// mask) on tokens, 0 on padding; labels = -100 on tokens and 0 on padding (the reference
// pads labels with zeros like every other key).
//
// Thread safety: collate() may run on many threads at once (distinct outputs); it uses TBB
// inside. BatchMemory is thread-safe. Throws UsageError for bad options, FormatError for
// a record that does not fit the batch (shape or dtype).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "formats/host_tensor.h"
#include "formats/record.h"
#include "lib/data_options.h"
#include "lib/sampler.h"

namespace eaglekit {

std::string_view collate_mode_name(CollateMode m);  // kCollateModeNames (lib/data_options.h)
std::optional<CollateMode> parse_collate_mode(std::string_view name);

struct CollateOptions {
  CollateMode mode = CollateMode::kPad;
  std::int64_t max_length = 2048;
  std::int64_t pad_multiple = 8;  // longest: batch length rounded up to this (capped at max_length)
  // Token window held of every row: columns [first_token, last_token) of the row's full
  // length L (last_token < 0: L; both clamped to L). For context parallelism, cp_size > 1
  // instead gives rank cp_rank the chunk [r*L/c, (r+1)*L/c) (docs/context-parallel.md).
  std::int64_t first_token = 0;
  std::int64_t last_token = -1;
  int cp_rank = 0;
  int cp_size = 1;
  // Take the norm form a record's layout implies (Record::layout_prenorm) where it states
  // none; off when --hidden-states-norm names the form of such records (trainer/run/run_setup.h).
  bool layout_norm = true;
  void check() const;  // throws UsageError
};

// One batch, as the trainer consumes it. B rows, W = last_token - first_token columns.
struct Batch {
  at::Tensor input_ids;          // [B, W] int64
  at::Tensor attention_mask;     // [B, W] int64: 1 on tokens, 0 on padding
  at::Tensor loss_mask;          // [B, W] int64: stored mask (else 1) on tokens, 0 on padding
  at::Tensor labels;             // [B, W] int64: -100 on tokens, 0 on padding
  at::Tensor hidden_states;      // [B, W, H], dtype as stored; undefined when target_probs is
  at::Tensor aux_hidden_states;  // [B, W, k*H], dtype as stored
  // Records of stored target distributions (Record::target_probs, NeMo's cache) instead of
  // hidden states: [B, W, Vd], dtype as stored, row t the target p[t] itself (docs/ttt.md);
  // zeros on padding. Undefined for records of hidden states.
  at::Tensor target_probs;
  // pack mode only (undefined otherwise):
  at::Tensor document_ids;  // [B, W] int64: 0, 1, ... per document of a row; -1 on padding
  at::Tensor position_ids;  // [B, W] int64: restarts at 0 for each document; 0 on padding
  // Each token's known norm form (stated, else its layout's: CollateOptions::layout_norm), [B, W] int8: 1 pre-norm,
  // 0 post-norm, -1 not stated (and padding). Undefined when no record of the batch states
  // one. Per token, not per row, because a packed row may mix records of both forms.
  at::Tensor hidden_states_prenorm;

  CollateMode mode = CollateMode::kPad;
  std::int64_t length = 0;       // L: full row length (max_length; longest: this batch's)
  std::int64_t first_token = 0;  // the window [first_token, last_token) of each row held here
  std::int64_t last_token = 0;
  std::vector<std::string> conversation_ids;  // samples collated, in row order
  std::vector<std::int64_t> sample_rows;      // row of each of those samples
  std::vector<std::int64_t> sample_documents; // document id of each in its row (document_ids; 0 unless pack)
  std::int64_t tokens = 0;                    // sum of attention_mask
  std::int64_t skipped = 0;                   // bad records left out of this batch
  std::uint64_t bytes = 0;                    // record bytes copied into the batch
  std::uint64_t epoch = 0;
  std::uint64_t step = 0;
  SamplerState state;  // restore this to continue right after this batch

  std::int64_t rows() const { return input_ids.defined() ? input_ids.size(0) : 0; }
  // The tensors in the reference's key order (pack adds document_ids, position_ids; a
  // batch with stated norm forms adds hidden_states_prenorm; one of stored target
  // distributions has target_probs in hidden_states' place).
  std::vector<std::pair<std::string, at::Tensor>> named_tensors() const;
};

// Row length of a batch whose longest sample has `longest` tokens (after truncation).
std::int64_t batch_length(const CollateOptions& opts, std::int64_t longest);
// The window of columns held for a row of length L: {first, last}.
std::pair<std::int64_t, std::int64_t> token_window(const CollateOptions& opts, std::int64_t length);

// Greedy deterministic packing of samples (in `order`) into rows of max_length: each sample
// (its length cut to max_length) goes into the first of the last kPackWindow open rows
// with room, else opens a new row; rows are emitted in the order they were opened.
// lengths[i] is sample i's token count.
constexpr std::size_t kPackWindow = 16;
std::vector<std::vector<std::size_t>> pack_rows(const std::vector<std::size_t>& order,
                                                const std::vector<std::int64_t>& lengths,
                                                std::int64_t max_length);

// Batch memory. On CPU: slabs recycled once the consumer has dropped every tensor of an
// earlier batch (fresh pages would cost a page fault per 4 KiB); big slabs are mapped from
// the kernel already populated. With CUDA present:
// pinned tensors from LibTorch's caching host allocator, which tracks in-flight
// non_blocking copies before reuse. Thread-safe.
class BatchMemory {
 public:
  // keep: slabs kept for reuse; pinned: 1 / 0 / -1 = when CUDA is available.
  explicit BatchMemory(std::size_t keep = 4, int pinned = -1);
  ~BatchMemory();
  BatchMemory(const BatchMemory&) = delete;
  BatchMemory& operator=(const BatchMemory&) = delete;
  bool pinned() const;
  // Batches given fresh memory so far, not a reused slab (telemetry, tests); pinned: every
  // batch (LibTorch's caching host allocator may still reuse its blocks).
  std::uint64_t slabs_allocated() const;
  // Uninitialized tensors of these shapes and types, carved from one slab (CPU) or
  // allocated pinned. The slab returns to the pool when every tensor (and view) is gone.
  // *zeroed (when given) tells whether every byte is known to be 0: a fresh slab from the
  // kernel, on its first use.
  std::vector<at::Tensor> allocate(
      const std::vector<std::pair<std::vector<std::int64_t>, at::ScalarType>>& specs,
      bool* zeroed = nullptr);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Layout of a record stream: fixed for a run; a record that differs is a bad record.
struct RecordShape {
  std::int64_t hidden = 0;     // H
  std::int64_t aux_width = 0;  // k*H
  DType dtype = DType::kBFloat16;
  // Vd when the records carry stored target distributions instead of hidden states
  // (Record::target_probs); 0 for records of hidden states. A run holds one kind.
  std::int64_t target_probs_width = 0;
  static RecordShape of(const Record& r);
  static RecordShape of(const RecordInfo& info);
};

// One sample placed in a batch: its row, its first column in the full row, the record
// cut to at most the columns it needs (views are fine), and its document index in the row.
struct Placement {
  std::int64_t row = 0;
  std::int64_t offset = 0;
  std::int64_t document = 0;
  std::string conversation_id;
  std::optional<Record> record;  // nullopt: a bad record (skipped)
};

// Collates placed records into a batch of `rows` rows. `length` is L (ignored in pad/pack
// mode, where it is max_length; in longest mode 0 = from the records). Pad/longest: rows
// whose sample is bad are dropped (later rows move up); pack: a bad sample leaves masked
// padding in its row. `parallel`: copy records on TBB threads. Throws FormatError (naming
// the conversation) when a record's shape or dtype differs from `shape` (default: the
// first record's).
Batch collate(std::vector<Placement>& placements, std::int64_t rows, std::int64_t length,
              const CollateOptions& opts, std::optional<RecordShape> shape = std::nullopt,
              BatchMemory* memory = nullptr, bool parallel = true);

// Collation one placement at a time, for a caller that copies each record as soon as it has
// read it, while its bytes are still in the CPU's cache (the loader): the constructor takes
// the batch memory for all `rows` rows of the plan, place() copies one placement into its
// row, finish() drops the rows no sample was placed in (pad / longest: later rows move up;
// pack: they stay masked padding), writes the padding and the batch's bookkeeping. The
// batch equals collate()'s for the same placements (collate() is these three steps).
// `length` as collate's (longest mode: the caller's, not derived from records).
// Thread safety: place() may run on many threads at once for distinct placements; the
// constructor and finish() on one. place() throws FormatError for a record that does not
// fit `shape` (nothing is written then) and UsageError for an index or row out of range.
class BatchBuilder {
 public:
  BatchBuilder(std::size_t placements, std::int64_t rows, std::int64_t length, const CollateOptions& opts,
               const RecordShape& shape, BatchMemory* memory = nullptr);
  ~BatchBuilder();
  BatchBuilder(const BatchBuilder&) = delete;
  BatchBuilder& operator=(const BatchBuilder&) = delete;
  std::int64_t length() const;
  // Placement i of the batch; one without a record (bad) is left out. The record is not
  // kept: its mapping may be dropped as soon as this returns.
  void place(std::size_t i, const Placement& p);
  // Once, after every place(): `placements` are the ones given to place(), by index
  // (their records are not read again).
  Batch finish(const std::vector<Placement>& placements, bool parallel = true);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The simplest use: one row per record (pad / longest), or records packed with pack_rows.
Batch collate_records(const std::vector<Record>& records, const CollateOptions& opts);

// A host view of a CPU tensor (any layout made contiguous first); the view keeps the
// tensor alive. For writing batches with the format writers.
HostTensor to_host_tensor(const at::Tensor& t);
at::ScalarType to_scalar_type(DType t);
DType to_dtype(at::ScalarType t);  // throws UnsupportedError for types records never hold

}  // namespace eaglekit
