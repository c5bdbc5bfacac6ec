// TTT attention of one step on LibTorch's fused scaled-dot-product kernels (docs/ttt.md,
// "Fused kernels"): block 0 (the shifted causal part of the mask) goes to the kernel as
// causal attention of the queries [s, L) against the keys [0, L - s), so that no mask
// tensor is built; the s draft-chain keys are per-row dot products; the two are merged by
// log-sum-exp. One autograd node: its backward calls the kernel's own backward with the
// merged output and log-sum-exp (so the kernel's probabilities are those of the softmax
// over every visible key) and adds the chain terms. Nothing O(L^2) is saved.
//
// Kernels: on the CPU at::_scaled_dot_product_flash_attention_for_cpu (any float dtype, GQA
// without copying keys); on CUDA the flash kernel for bf16/fp16 and the memory-efficient
// one for float32 (keys repeated per query head, as these kernels need equal head counts).
// Needs LibTorch >= 2.5; ttt_fused_available() says whether this build has it and why not.
//
// Padding and packed rows need no mask either: for each row, each document (the whole row
// without document ids) and each run of consecutive valid keys in it, the queries that see
// part of the run are one causal call on a square (plus, when the run starts before their
// first visible key, a plain call on the keys they all see), and those past the run one plain
// call on the whole run; calls that cover the same rows are merged by log-sum-exp. Equal rows
// share their calls (a batch without padding or documents is one call per kind). The layout
// of the calls is read on the host: once per batch when the caller passes the keys' host copy
// (SingleRankContext does, and the CP ring once per call), else once per call for its forward
// and backward (one device-to-host copy of key_valid and document_ids).
//
// The same pieces compute block 0 of one (query chunk, key chunk) pair of a longer sequence,
// as the context-parallel ring needs (fused::block0_forward / block0_backward below).
//
// Thread safety: a pure function; concurrent calls on different tensors are fine. Shape
// mismatches throw UsageError, a build without the kernels throws UsageError saying so;
// LibTorch errors propagate as c10::Error.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "trainer/attention/inputs.h"

namespace eaglekit::trainer {

namespace tiles {
struct HostKeys;
}

// Whether this build's LibTorch has the fused kernels (LibTorch >= 2.5); when not, and
// `why` is given, the reason in one sentence.
bool ttt_fused_available(std::string* why = nullptr);

// The same inputs (trainer/attention/inputs.h), semantics and result as ttt_attention_local /
// ttt_attention_flash: q
// [B, heads, L, D], k_blocks / v_blocks [B, kv_heads, L, D] for blocks 0..step, key_valid
// [B, L] bool, document_ids [B, L] or undefined. A query with no visible key gets 0 and
// finite gradients. The kernels compute in the inputs' dtype (float32 accumulation); the
// merge is float32; returns q's dtype. Differentiable in q and every k and v block. host:
// key_valid and document_ids already read on the host (tiles::host_keys, trainer/attention/ttt_tiles.h);
// null: this call reads them.
at::Tensor ttt_attention_fused(const TttAttentionInputs& in, const tiles::HostKeys* host = nullptr);

namespace fused {

// Block 0 of one pair: queries q [B, heads, nq, D] at global positions [qo, qo + nq), keys
// and values k, v [B, kv_heads, nk, D] at [ko, ko + nk), key_valid [B, nk] bool, and for
// packed rows docs_q [B, nq] and docs_k [B, nk] (both or neither). Query q sees key j iff
// j <= q - step, key j is valid, and both are of the same document. host_k: key_valid and
// docs_k on the host, host_q: docs_q there (its valid unused); null: read per call.
struct Pair {
  at::Tensor q, k, v, key_valid, docs_q, docs_k;
  std::int64_t qo = 0, ko = 0;
  std::shared_ptr<const tiles::HostKeys> host_q, host_k;
};

// The pair's block-0 attention: out [B, heads, nq, D] float32 (0 for a row that sees no key)
// and lse [B, heads, nq] float32 (-inf there). Not differentiable.
struct Partial {
  at::Tensor out, lse;
};
Partial block0_forward(const Pair& p, std::int64_t step, double scale);

// Adds to dq [B, heads, nq, D] and dk, dv [B, kv_heads, nk, D] (float32) the gradients
// through the pair's block-0 scores of a loss whose final attention output `out` (over every
// key of every pair and block; [B, heads, nq, D] float32) has log-sum-exp `lse` ([B, heads,
// nq], -inf for rows with no key at all) and gradient d_out.
void block0_backward(const Pair& p, std::int64_t step, double scale, const at::Tensor& d_out, const at::Tensor& out,
                     const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv);

}  // namespace fused

}  // namespace eaglekit::trainer
