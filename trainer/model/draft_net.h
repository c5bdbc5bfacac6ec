// The network of a draft architecture, as its unroll drives it. A row of
// trainer/model/architecture.h makes one and names its unroll (DraftUnrollKind); the draft
// model (trainer/model/draft_model.h) holds it with the config and d2t. DraftNet is what
// every network has (parameters, device); TttNet is what the TTT unroll (trainer/unroll/ttt.h)
// talks to, BlockNet what the block-parallel unroll (trainer/unroll/dflash.h) talks to.
//
// TttNet, one TTT step: hidden = fc(aux hidden states) at step 0 (the previous step's output after:
// the last layer's, or its final_norm when norm_output()),
// then for each decoder layer qkv() -> the unroll's attention over the layer's kept keys and
// values of every step -> finish_layer(); the last layer's output goes through final_norm()
// and lm_head. The unroll owns the attention, so context parallelism and the fused kernels
// apply to every architecture. All tensors are [B, L, ...] batch-first.
//
// BlockNet (DFlash, docs/dflash.md): the context = hidden_norm(fc(aux hidden states)) once
// per batch; then each decoder layer takes the block tokens' hidden states and that context,
// attends from the block queries over [context keys, block keys] under the unroll's mask,
// and the last layer's output goes through final_norm() and the base's lm_head.
//
// Ownership: the net owns its weights; DraftModel copies share one net. Thread safety: none
// (one training loop drives a net). Shape errors throw c10::Error; a layer the net does not
// have throws UsageError.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "trainer/model/rotary.h"

namespace eaglekit::trainer {

// Projected attention inputs of one layer in one TTT step, RoPE applied.
struct Qkv {
  at::Tensor q;  // [B, num_attention_heads, L, head_dim]
  at::Tensor k;  // [B, num_key_value_heads, L, head_dim]
  at::Tensor v;  // [B, num_key_value_heads, L, head_dim]
};

class DraftNet {
 public:
  virtual ~DraftNet() = default;

  // Trainable parameters in the export order (DraftArchitecture::parameters names and
  // shapes them); the tensors share storage with the net.
  virtual std::vector<std::pair<std::string, at::Tensor>> named_parameters() const = 0;
  virtual void to(c10::Device device, c10::ScalarType dtype) = 0;
  virtual void train(bool on) = 0;

  virtual std::int64_t num_layers() const = 0;
};

class TttNet : public DraftNet {
 public:
  // The step-0 hidden input from the dump's aux hidden states: [B, L, k*Ht] -> [B, L, H].
  virtual at::Tensor fc(const at::Tensor& aux_hidden_states) const = 0;
  // The token embeddings as the layers read them (computed once per batch).
  virtual at::Tensor norm_embeddings(const at::Tensor& emb) const = 0;
  // q/k/v of `layer` from the normed embeddings and the layer's input `hidden`.
  virtual Qkv qkv(const at::Tensor& emb_normed, const at::Tensor& hidden, const RotaryTable& rope,
                  std::int64_t layer) const = 0;
  // The layer's output from its input and its attention [B, num_attention_heads, L, head_dim].
  virtual at::Tensor finish_layer(const at::Tensor& hidden, const at::Tensor& attn, std::int64_t layer) const = 0;
  // Before lm_head; a loss that applies lm_head in chunks (trainer/model/soft_ce.h) takes the
  // two halves.
  virtual at::Tensor final_norm(const at::Tensor& layer_out) const = 0;
  virtual const at::Tensor& lm_head_weight() const = 0;  // [Vd, H], the parameter itself
  // What the next TTT step takes as its hidden input: false, the last layer's output (the
  // residual stream, EAGLE-3); true, final_norm of it (EAGLE 3.1's norm_output).
  virtual bool norm_output() const { return false; }

  // lm_head(final_norm(x)): [B, L, Vd].
  at::Tensor logits(const at::Tensor& layer_out) const;
};

class BlockNet : public DraftNet {
 public:
  // The target's context features from the dump's aux hidden states: [B, L, k*Ht] -> [B, L, H].
  virtual at::Tensor context(const at::Tensor& aux_hidden_states) const = 0;
  // Decoder layer `layer`: x [B, Q, H] the hidden states of Q / block_size blocks of
  // block_size tokens each, context [B, C, H]. Queries: the Q block rows (rope_q, [B, Q,
  // head_dim] tables); keys and values: the context (rope_ctx, [B, C, head_dim]) and the
  // query's own block of input_layernorm(x) (at rope_q's positions); a query sees no other
  // block. allowed: bool [B, Q, C + block_size], columns C + j the own block's token j.
  // Returns the layer's output [B, Q, H].
  virtual at::Tensor layer(const at::Tensor& x, const at::Tensor& context, const RotaryTable& rope_q,
                           const RotaryTable& rope_ctx, const at::Tensor& allowed, std::int64_t block_size,
                           std::int64_t layer) const = 0;
  // The norm before the base's lm_head.
  virtual at::Tensor final_norm(const at::Tensor& x) const = 0;
};

}  // namespace eaglekit::trainer
