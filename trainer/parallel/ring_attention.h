// Context parallelism for the TTT unroll (docs/context-parallel.md): a SequenceContext whose
// sequence dimension is split into contiguous chunks over the ranks of a cp group, with
// ring attention over c10d send/recv for the TTT mask, one-row boundary exchanges for the
// rolls, and the loss normalizer summed over every rank that shares it.
//
// Layout (docs/context-parallel.md, and the loader's token window): with C ranks and a global
// length L >= C, cp rank r holds rows [r*L/C, (r+1)*L/C) (integer division) of every
// per-token tensor. Lengths that are not a multiple of C are not padded: chunk sizes differ
// by at most one row, and the ring sends each chunk at its own size.
//
// Ring attention: at ring iteration i a rank holds the keys/values of every step block of
// rank (r - i) mod C, attends to them with the TTT mask restricted to those global indices,
// and merges the partial result by log-sum-exp; pairs whose mask is empty (every chunk
// after the rank's own) are skipped, and rows with no visible key produce 0, never NaN.
// Backward recomputes each pair (nothing O(L^2) is saved) and sends the key/value gradients
// around the ring back to their owners. Block 0 of a pair (the shifted causal part) goes
// through the tiles of ttt_attention_flash (trainer/attention/ttt_tiles.h, TttAttention::kTiled, the
// default): memory per rank is the saved q/k/v/out/lse of its own chunk and the chunk in
// flight, O(L/C), plus one query tile x key tile of scores at a time. TttAttention::kFused
// runs it on LibTorch's fused kernels instead (trainer/attention/ttt_fused.h, fused::block0_forward /
// block0_backward; LibTorch >= 2.5), also O(L/C). TttAttention::kLocal keeps the per-pair
// score matrix, O(heads * (L/C)^2), as the reference (docs/context-parallel.md, "Pair kernels").
//
// Thread safety: a RingContext serves one training loop; every rank of the cp group must
// run the same sequence of forward/backward calls. Communication failures throw
// dist::DistributedError; shape errors UsageError.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "trainer/attention/ttt_flash.h"
#include "trainer/parallel/distributed.h"
#include "trainer/unroll/ttt.h"

namespace eaglekit::trainer {

// The rows of a sequence of `length` that cp rank `cp_rank` of `cp_size` holds. Throws
// UsageError when length < cp_size (a rank would hold nothing).
struct SequenceChunk {
  std::int64_t begin = 0;  // first global row
  std::int64_t end = 0;    // one past the last
  std::int64_t size() const { return end - begin; }
};
SequenceChunk cp_chunk(std::int64_t length, int cp_size, int cp_rank);

// This rank's chunk of a whole collated batch (every per-token tensor sliced along dim 1).
// For tests, benches, and loaders that read whole rows.
TttBatch shard_batch(const TttBatch& full, int cp_size, int cp_rank);

enum class KvExchange {
  kRing,       // send/recv to the ring neighbours, overlapped with compute (the default)
  kAllGather,  // every rank gathers all chunks at once: fewer, larger messages, O(L) memory
};

// The pair kernel that carries out --ttt-attention on a cp group: fused for fused, and for
// auto where this build has the kernels; tiled otherwise, local included (local's O(L^2)
// scores per pair are never what a context-parallel run wants). Never kAuto or kLocal.
TttAttention ring_pair_kernel(TttAttention attention);

struct RingOptions {
  KvExchange exchange = KvExchange::kRing;
  // How one (query chunk, key chunk) pair computes its block-0 scores; the chain keys of
  // blocks 1..s are per-row dot products either way (docs/context-parallel.md, "Pair kernels"):
  //   kTiled  tiled online softmax, flash backward (trainer/attention/ttt_tiles.h): O(L/C) memory
  //   kLocal  one masked score matrix per pair, autograd backward: O(heads * (L/C)^2), the reference
  //   kFused  LibTorch's fused kernels per pair (trainer/attention/ttt_fused.h; LibTorch >= 2.5): O(L/C)
  //   kAuto   ring_pair_kernel(kAuto): kFused where this build has the kernels, else kTiled
  TttAttention pair_kernel = TttAttention::kTiled;
  // kTiled: the tile sizes (0: kTttFlashQueryRows x kTttFlashKeyRows, as ttt_attention_flash).
  TttFlashTiles tiles;
  // kLocal: the diagonal pair (this rank's queries against its own keys) is computed in
  // chunks of this many query rows, each against only the keys it can see; 0:
  // ttt_query_chunk_rows of the rank's rows. kTiled skips tiles past the diagonal instead.
  std::int64_t query_chunk_rows = 0;
};

// TTT attention of step `step` for this rank's query rows against every rank's chunks of
// the step blocks 0..step (inputs as SequenceContext::attention, all local rows; the
// sequence is `length` rows long in all, laid out by cp_chunk). Differentiable in q,
// k_blocks and v_blocks; returns [B, heads, n, D] in q's dtype.
at::Tensor ring_ttt_attention(const dist::Group& cp, std::int64_t length, const TttAttentionInputs& in,
                              const RingOptions& options = {});

// y[:, t] = x[:, t - shift] over the global sequence (shift = +1: right, -1: left), zero
// where t - shift falls outside [0, L); exchanges one row with the neighbour rank.
// Differentiable for floating-point x.
at::Tensor cp_shift(const dist::Group& cp, const at::Tensor& x, int shift);

// The SequenceContext for a cp group. Passing it to TttUnroll::forward runs the unroll on
// this rank's chunk; a cp group of size 1 behaves exactly as SingleRankContext (used for
// pure data parallelism, where only the loss normalizer crosses ranks).
class RingContext final : public SequenceContext {
 public:
  // cp: the ranks that share each sequence, chunks in cp-rank order. normalizer: the ranks
  // whose tokens share one loss normalizer (the whole world under data parallelism).
  RingContext(dist::Group cp, dist::Group normalizer, RingOptions options = {});
  explicit RingContext(const dist::Mesh& mesh, RingOptions options = {});

  // The global length L of the coming batch's rows (lib/collate.h Batch::length). Needed
  // before TttUnroll::forward, which asks for global_offset() before it sees a tensor;
  // forward then throws UsageError when it was not set or a tensor's rows are not this
  // rank's chunk of L.
  void set_global_length(std::int64_t length);

  std::int64_t global_offset() const override;
  std::int64_t global_length(std::int64_t local_length) const override;
  at::Tensor shift_right(const at::Tensor& x) override;
  at::Tensor shift_left(const at::Tensor& x) override;
  at::Tensor attention(const TttAttentionInputs& in) override;
  at::Tensor sum_across(const at::Tensor& x) override;

  const dist::Group& cp() const { return cp_; }

 private:
  dist::Group cp_, normalizer_;
  RingOptions options_;
  SingleRankContext local_;
  std::int64_t length_ = -1;
  std::int64_t chunk_rows(std::int64_t local_length) const;  // checks, returns the chunk size
};

}  // namespace eaglekit::trainer
