// The arguments of one TTT attention call (docs/ttt.md, the mask), written once for every
// kernel that takes them: SequenceContext::attention, ttt_attention_dense / _local
// (trainer/unroll/ttt.h), ttt_attention_flash, ttt_attention_fused and ring_ttt_attention.
// Light: ATen's Tensor class only.
//
// Thread safety: a view of the caller's tensors for one call; build it in the call
// (kernel({q, k_blocks, v_blocks, key_valid, step, scale, document_ids})) and do not keep it:
// the first four members refer to the caller's objects.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace eaglekit::trainer {

// TTT attention of step `step` for the query rows q [B, heads, n, D] against the kept key
// and value blocks 0..step (k_blocks[i], v_blocks[i] [B, kv_heads, n, D]; GQA: query head h
// reads kv head h / (heads / kv_heads)); key_valid [B, n] bool marks real (non-padding) key
// positions; document_ids [B, n] (packed rows: a query sees only keys of its own document)
// or undefined (one document per row). scale multiplies the raw scores.
struct TttAttentionInputs {
  const at::Tensor& q;
  const std::vector<at::Tensor>& k_blocks;
  const std::vector<at::Tensor>& v_blocks;
  const at::Tensor& key_valid;
  std::int64_t step;
  double scale;
  at::Tensor document_ids = {};
};

}  // namespace eaglekit::trainer
