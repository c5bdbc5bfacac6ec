// The TTT loss of one step without its [rows, Vd] logits (docs/ttt.md, loss per step):
// lm_head and the soft cross-entropy against the base distribution applied a chunk of rows
// at a time, forward and backward, as one autograd node. It saves its inputs and one
// log-sum-exp per row, so a step keeps O(rows) for backward beyond the target distribution
// the unroll holds anyway, where lm_head + log_softmax keep two [rows, Vd] float32 tensors per
// step; the backward recomputes each chunk's logits (one more [chunk, H] x [H, Vd] matmul).
//
// Thread safety: none beyond LibTorch's; shape mismatches throw UsageError.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>

namespace eaglekit::trainer {

struct SoftCeResult {
  at::Tensor ce_sum;  // scalar float32: sum_t w[t] * (lse_t * sum_v p[t, v] - sum_v p[t, v] * logits[t, v])
  at::Tensor argmax;  // [rows] int64: argmax_v logits[t, v] (not differentiable)
};

// x [rows, H] (the final norm's output; differentiable), weight [Vd, H] (lm_head;
// differentiable), p [rows, Vd] float32 target probabilities and w [rows] float32 weights
// (neither differentiable). logits = x weight^T are computed in `compute` (float32, or bf16 as
// autocast would) and reduced in float32, `chunk` rows at a time (chunk >= 1).
SoftCeResult chunked_soft_ce(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& p, const at::Tensor& w,
                             std::int64_t chunk, c10::ScalarType compute);

// Throws UsageError, naming `what`, unless x [N, H], weight [Vd, H], p [N, Vd] and w [N]
// (the shapes both soft cross-entropy implementations take: this one and cpu_kernels.h's).
void check_soft_ce_shapes(const char* what, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& p,
                          const at::Tensor& w);

// The chunk the unroll uses when --loss-chunk-tokens is auto: 0 (no chunking) while one
// step's logits stay under 2^26 float32 values (256 MiB), else the rows that fill that many.
std::int64_t auto_loss_chunk_rows(std::int64_t rows, std::int64_t vocab);

}  // namespace eaglekit::trainer
