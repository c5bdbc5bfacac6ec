// The EAGLE-3 draft (docs/draft.md) as a LibTorch module behind a small interface:
// fc, a first decoder layer whose q/k/v read cat(input_layernorm(emb), hidden_norm(h)), then
// num_hidden_layers - 1 plain Llama decoder layers on H (vLLM's multi-layer EAGLE-3), GQA
// with RoPE, SwiGLU MLPs, final norm and an lm_head over the draft vocabulary, plus the
// d2t map. The forward pass is exposed in pieces so that the TTT unroll (trainer/unroll/ttt.h)
// owns the attention and can swap in a context-parallel one.
//
// Parameter names are the export names of docs/export.md ("fc.weight",
// "midlayer.self_attn.q_proj.weight", ...; "layers.{i}.*" instead of "midlayer.*" when
// there is more than one layer). d2t/t2d are not module buffers: Module::to()
// would cast them to the float dtype.
//
// Ownership: copies of a DraftModel share the same weights (like torch module holders).
// Thread safety: none; one training loop drives a model. Shape errors throw c10::Error.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "trainer/model/config.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

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

// Projected attention inputs of one TTT step, RoPE applied.
struct Qkv {
  at::Tensor q;  // [B, num_attention_heads, L, head_dim]
  at::Tensor k;  // [B, num_key_value_heads, L, head_dim]
  at::Tensor v;  // [B, num_key_value_heads, L, head_dim]
};

class DraftModel {
 public:
  // A fresh draft. Linear weights ~ N(0, 0.02) drawn on the CPU from `seed` (so equal on
  // every device), norms 1. lm_head starts as the rows i + d2t[i] of `base_lm_head`
  // [V, H] when that is defined, else random. d2t: [Vd] int64 (docs/draft.md). The
  // model lives on the CPU in float32 until to().
  DraftModel(const DraftConfig& config, const at::Tensor& d2t, const at::Tensor& base_lm_head,
             std::uint64_t seed = 0);
  ~DraftModel();
  DraftModel(const DraftModel&);
  DraftModel& operator=(const DraftModel&);

  const DraftConfig& config() const;
  const at::Tensor& d2t() const;          // [Vd] int64, on the model's device
  at::Tensor draft_to_target() const;     // [Vd] int64: target id of draft id i = i + d2t[i]
  at::Tensor t2d() const;                 // [V] bool: target token present in the draft vocab

  // Trainable parameters in a fixed order (the export order); tensors share storage with
  // the module.
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  std::vector<at::Tensor> parameters() const;
  torch::nn::Module& module();

  // Copies values into the parameter `name` (shape must match; dtype/device converted).
  // Throws UsageError for an unknown name or a shape mismatch.
  void load_parameter(const std::string& name, const at::Tensor& value);
  // Replaces d2t ([Vd] int64, each i + d2t[i] in [0, V)); throws UsageError otherwise.
  void set_d2t(const at::Tensor& d2t);

  void to(c10::Device device, c10::ScalarType dtype);
  c10::Device device() const;
  c10::ScalarType dtype() const;
  void train(bool on = true);

  // --- forward pieces, all [B, L, ...] batch-first ---
  // One TTT step runs layer 0 on (emb, h), then layer i on layer i-1's output; each layer
  // attends over its own kept keys/values. The last output (before the final norm) is the
  // next step's h.
  std::int64_t num_layers() const;                           // config().num_hidden_layers
  at::Tensor fc(const at::Tensor& aux_hidden_states) const;  // [B, L, k*Ht] -> [B, L, H]
  at::Tensor norm_embeddings(const at::Tensor& emb) const;   // layer 0's input_layernorm(emb)
  // Layer 0: q/k/v of cat(emb_normed, hidden_norm(h)) (ModelOpt form:
  // hidden_norm(input_layernorm(h))). Layer i > 0: q/k/v of input_layernorm(hidden), and
  // emb_normed is not used. UsageError for a layer the draft does not have.
  Qkv qkv(const at::Tensor& emb_normed, const at::Tensor& hidden, const RotaryTable& rope,
          std::int64_t layer = 0) const;
  // o_proj(attn) + hidden, then the MLP block: the layer's output (the residual stream).
  // attn: [B, num_attention_heads, L, head_dim].
  at::Tensor finish_layer(const at::Tensor& hidden, const at::Tensor& attn, std::int64_t layer = 0) const;
  at::Tensor logits(const at::Tensor& layer_out) const;  // lm_head(norm(x)): [B, L, Vd]
  // The two halves of logits(), for a loss that applies lm_head in chunks (trainer/model/soft_ce.h).
  at::Tensor final_norm(const at::Tensor& layer_out) const;  // norm(x): [B, L, H]
  const at::Tensor& lm_head_weight() const;                 // [Vd, H], the parameter itself

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace eaglekit::trainer
