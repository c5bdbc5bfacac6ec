// Block 0 of the TTT attention (the shifted causal part of the mask, docs/ttt.md, "Two
// implementations") for one pair of a query chunk and a key chunk of a longer sequence, in
// tiles: a tiled online softmax forward that returns the pair's partial result with its
// log-sum-exp, and the flash-attention backward that recomputes the tiles from the final
// log-sum-exp. Never more than one query tile x key tile of scores is alive. Internal: the
// kernel under ttt_attention_flash (trainer/attention/ttt_flash.h: one pair, the whole sequence at
// offset 0) and under the CP ring's block-0 pairs (trainer/parallel/ring_attention.h,
// RingOptions::pair_kernel TttAttention::kTiled; docs/context-parallel.md, "Pair kernels").
//
// The pair: queries at global positions [qo, qo + nq), keys at [ko, ko + nk). Query q sees
// key j iff j <= q - step, key j is valid, and (packed rows) both have the same document.
// Tiles wholly past the shifted diagonal, and key tiles holding no valid key, are skipped.
//
// Layout. Query heads sharing a kv head are consecutive (h = kv * rep + r), and a query tile
// is the rows [q0, q0 + t) of all rep heads of a kv head: queries are held as
// [B, kv_heads, nq, rep, D] so that a tile is a view [B, kv_heads, t * rep, D] (row =
// position * rep + r) and its scores against a key tile come from one batched matmul over
// (B, kv_heads), without copying keys per head. Row statistics (log-sum-exp, rowsum(dO * O))
// are [B, kv_heads, nq, rep]. tiles_from_heads / tiles_to_heads convert.
//
// Thread safety: pure functions of their arguments; concurrent calls on different tensors
// are fine. Errors: shapes are the callers' to check (ttt_attention_flash and
// ring_ttt_attention throw UsageError); LibTorch errors propagate as c10::Error. Float32
// throughout; not differentiable through autograd (the callers' nodes call the backward).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "trainer/attention/inputs.h"

namespace eaglekit::trainer::tiles {

// The score of a masked pair and the log-sum-exp of a row with no key.
inline constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// The key validity and document ids of a chunk of keys, on the host: what decides which
// tiles (or, on the fused path, which kernel calls) a pair needs. Read once per batch by
// whoever holds the keys (SingleRankContext for all the TTT steps and layers of a forward
// and their backward, the CP ring once per call for every rank's chunk), so that no call,
// tile or step copies from the device again. Immutable once built; share it freely.
struct HostKeys {
  at::Tensor valid;  // [B, n] bool, CPU, contiguous
  at::Tensor docs;   // [B, n] int64, CPU, contiguous, or undefined (one document per row)
  // invalid_prefix[j]: the number of (row, key < j) pairs that are not valid, so that a key
  // tile is seen at a glance to be all valid (no mask) or all invalid (skipped).
  std::vector<std::int64_t> invalid_prefix;
};
// valid [B, n] (bool or integer), docs [B, n] or undefined: one device-to-host copy of both
// (none when they are on the CPU already).
std::shared_ptr<const HostKeys> host_keys(const at::Tensor& valid, const at::Tensor& docs);
// The same from a HostKeys' own valid and docs (CPU tensors, e.g. as an autograd node saved
// them): no copy, not counted below.
std::shared_ptr<const HostKeys> host_keys_of_host(const at::Tensor& host_valid, const at::Tensor& host_docs);
// How many times host_keys has read key tensors since the process started (tests check that
// a forward and backward read them once, not per call or per step).
std::int64_t host_keys_reads();

// The TTT step and the tile sizes in positions (both > 0).
struct TileShape {
  std::int64_t step = 0;
  std::int64_t query_rows = 0;
  std::int64_t key_rows = 0;
};

// A query chunk in the kernel's layout.
struct TileQueries {
  at::Tensor qs;            // q * scale, float32 [B, kv_heads, nq, rep, D], contiguous
  at::Tensor docs;          // document ids [B, nq] int64, or undefined (one document per row)
  std::int64_t offset = 0;  // global position of row 0 (qo)
  std::int64_t rows() const { return qs.size(2); }
};
// q [B, heads, nq, D] (any float dtype), heads a multiple of kv_heads.
TileQueries tile_queries(const at::Tensor& q, std::int64_t kv_heads, double scale, const at::Tensor& docs,
                         std::int64_t offset);

// A key chunk of block 0.
struct TileKeys {
  at::Tensor k, v;          // float32 [B, kv_heads, nk, D], contiguous
  at::Tensor valid;         // key validity [B, nk] bool
  at::Tensor docs;          // document ids [B, nk] int64, or undefined
  std::int64_t offset = 0;  // global position of row 0 (ko)
  std::shared_ptr<const HostKeys> host;  // valid and docs on the host
  std::int64_t rows() const { return k.size(2); }
};
// host: valid and docs already read (host_keys above); null: read them here.
TileKeys tile_keys(const at::Tensor& k, const at::Tensor& v, const at::Tensor& valid, const at::Tensor& docs,
                   std::int64_t offset, std::shared_ptr<const HostKeys> host = nullptr);

// Whether some query of [qo, qo + nq) may see some key of [ko, ko + nk) in block 0 (the
// shifted diagonal alone; validity and documents aside).
bool pair_reaches(std::int64_t qo, std::int64_t nq, std::int64_t ko, std::int64_t step);

// The block-0 attention of the pair: out [B, kv_heads, nq, rep, D] (0 for a row with no
// visible key) and lse [B, kv_heads, nq, rep] (-inf there), both float32.
struct TilePartial {
  at::Tensor out, lse;
};
TilePartial tile_forward(const TileShape& shape, const TileQueries& q, const TileKeys& k);

// The gradients through the pair's block-0 scores of a loss whose final attention output O
// (over every key of every pair and block) has log-sum-exp `lse` and gradient d_out, with
// delta = rowsum(d_out * O): P = exp(S - lse), dS = P * (d_out V^T - delta), and
//   dqs += dS K,  dk += dS^T Qs,  dv += P^T d_out
// (dqs: the gradient of q * scale, in the kernel layout; dk, dv: [B, kv_heads, nk, D]
// float32, possibly views; all accumulated in place). d_out [B, kv_heads, nq, rep, D];
// delta and lse [B, kv_heads, nq, rep] (-inf rows: no visible key, nothing added).
void tile_backward(const TileShape& shape, const TileQueries& q, const TileKeys& k, const at::Tensor& d_out,
                   const at::Tensor& delta, const at::Tensor& lse, at::Tensor& dqs, at::Tensor& dk, at::Tensor& dv);

// Helpers of the block-0 kernels (tiled here, fused in trainer/attention/ttt_fused.h):
// -inf (a row that has seen no allowed key) replaced by the lowest finite float, so that
// subtracting it is safe: the row's scores are all -inf and stay -inf (exp gives 0).
at::Tensor finite_or_lowest(const at::Tensor& m);
// Rows moved towards higher positions by `shift` along dim, the first `shift` rows zero
// (row q then holds the key of position q - shift); shift_up is its adjoint.
at::Tensor shift_down(const at::Tensor& x, std::int64_t shift, std::int64_t dim);
at::Tensor shift_up(const at::Tensor& x, std::int64_t shift, std::int64_t dim);
// The shapes of a TTT attention call (trainer/attention/inputs.h), or UsageError naming `who`.
void check_attention_args(const char* who, const TttAttentionInputs& in);

// [B, heads, n, D] -> [B, kv_heads, n, rep, D] and [B, heads, n] -> [B, kv_heads, n, rep]
// (contiguous copies), and back.
at::Tensor tiles_from_heads(const at::Tensor& x, std::int64_t kv_heads);
at::Tensor tiles_to_heads(const at::Tensor& x);

}  // namespace eaglekit::trainer::tiles
