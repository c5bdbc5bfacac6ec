// RoPE as tensors (docs/rope.md): the cos/sin table of a set of positions after the
// configured scaling (trainer/model/rope.h computes the frequencies) and its application to
// q or k, in the Hugging Face rotate_half layout. Every draft architecture's attention takes
// it; the TTT unroll builds one table per batch.
//
// Thread safety: free functions. Errors: shape errors throw c10::Error.
#pragma once

#include <ATen/core/Tensor.h>

#include "trainer/model/draft_config.h"

namespace eaglekit::trainer {

// cos/sin of RoPE for a set of positions, [L, head_dim] float32, in the Hugging Face
// rotate_half layout (frequencies repeated twice).
struct RotaryTable {
  at::Tensor cos;
  at::Tensor sin;
};

// Inverse frequencies [head_dim / 2] (float64) after the configured scaling
// (trainer/model/rope.h: default, linear, dynamic, llama3, yarn, longrope), as transformers does.
at::Tensor rope_inv_freq(const DraftConfig& config);
// The table for int64 `positions` [L] (global positions: 0..L-1 on a single rank, the
// chunk's own range under context parallelism) or [B, L] (per-row positions of packed
// rows), on the positions' device: [L, head_dim] or [B, L, head_dim]. cos and sin carry the
// variant's attention factor (1 but for yarn and longrope).
RotaryTable rope_table(const DraftConfig& config, const at::Tensor& positions);
// x [B, heads, L, head_dim] rotated; computed in float32, returned in x's dtype.
at::Tensor apply_rope(const at::Tensor& x, const RotaryTable& table);

}  // namespace eaglekit::trainer
