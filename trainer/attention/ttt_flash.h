// TTT attention of one step in O(L) memory (docs/ttt.md, "Two implementations"): block 0
// (the shifted causal part of the mask) by a tiled online softmax that never holds more than
// one query tile x key tile of scores, the s draft-chain keys as per-row dot products, the
// two merged by log-sum-exp. Forward and backward are one autograd node that keeps only the
// inputs, the output and the per-row log-sum-exp, and recomputes the tile scores in backward.
// The block-0 tiles are trainer/attention/ttt_tiles.h's, which the CP ring uses per pair of chunks.
//
// CPU only in effect: the tiles are ATen matmuls, so the code runs on any device, but no
// fused GPU kernel is used (and none has been tested here). Not twice differentiable.
//
// Thread safety: a pure function; concurrent calls on different tensors are fine. Shape
// mismatches throw UsageError; LibTorch errors propagate as c10::Error.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "trainer/attention/inputs.h"

namespace eaglekit::trainer {

namespace tiles {
struct HostKeys;
}

// Tile sizes of ttt_attention_flash, in positions (a query tile holds that many positions of
// every head). 0: the default. The scores alive at once are B x heads x query_rows x key_rows.
struct TttFlashTiles {
  std::int64_t query_rows = 0;  // default kTttFlashQueryRows
  std::int64_t key_rows = 0;    // default kTttFlashKeyRows
};
// Chosen from bench/bench_ttt_attention (docs/benchmarks.md).
constexpr std::int64_t kTttFlashQueryRows = 128;
constexpr std::int64_t kTttFlashKeyRows = 256;
// On the CPU, SingleRankContext::attention uses ttt_attention_flash for rows of at least
// this many positions and ttt_attention_local below (where the local path is as fast or
// faster and its O(L^2) scores are small); docs/ttt.md, "Two implementations", has the
// measurements. On a GPU it keeps ttt_attention_local: the tile loop is not measured there.
constexpr std::int64_t kTttFlashMinLength = 512;

// The same inputs (trainer/attention/inputs.h), semantics and result as ttt_attention_local
// (trainer/unroll/ttt.h): q [B, heads, L, D], k_blocks / v_blocks [B, kv_heads, L, D] for
// blocks 0..step, key_valid [B, L] bool, document_ids [B, L] (packed rows) or undefined.
// A query with no visible key gets 0 and finite gradients.
// Computes in float32 whatever the inputs' dtype (also under autocast) and returns q's dtype.
// Differentiable in q and every k and v block; saves for backward the (detached) inputs, the
// float32 output and a [B, heads, L] log-sum-exp. host: key_valid and document_ids already
// read on the host (tiles::host_keys, trainer/attention/ttt_tiles.h; SingleRankContext reads them once
// per batch); null: this call reads them, once for its forward and backward.
at::Tensor ttt_attention_flash(const TttAttentionInputs& in, TttFlashTiles tiles = {},
                               const tiles::HostKeys* host = nullptr);

}  // namespace eaglekit::trainer
