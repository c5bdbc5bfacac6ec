// DFlash (docs/dflash.md), the block-parallel drafter: one draft forward fills a block of
// block_size tokens after an anchor (the anchor's own token, then block_size - 1 positions
// fed mask_token_id), attending over the target's context features up to the anchor and,
// without a causal mask, over the whole block. Qwen3-style decoder layers (q_norm, k_norm);
// the context is hidden_norm(fc(k target layers)); the embeddings and lm_head are the base's,
// frozen, so the draft predicts over the whole vocabulary and has no d2t of its own.
//
// Parameter names are those ModelOpt 0.47's exporter writes and vLLM 0.32's
// DFlashDraftModel (model_executor/models/qwen3_dflash.py) loads: fc.weight,
// hidden_norm.weight, layers.{i}.self_attn.{q,k,v,o}_proj.weight,
// layers.{i}.self_attn.{q,k}_norm.weight, layers.{i}.mlp.*, layers.{i}.*_layernorm.weight,
// norm.weight. Driven by the block unroll (trainer/unroll/dflash.h).
//
// Thread safety: immutable. Errors: as DraftArchitecture's.
#pragma once

#include "trainer/model/architecture.h"

namespace eaglekit::trainer {

class DFlashArchitecture final : public DraftArchitecture {
 public:
  std::string_view name() const override { return "dflash"; }
  std::string_view title() const override { return "DFlash"; }
  DraftUnrollKind unroll() const override { return DraftUnrollKind::kBlock; }
  // A config.json naming DFlashDraftModel in `architectures`, or carrying dflash_config.
  bool claims(const nlohmann::json& config) const override;
  std::vector<ParameterShape> parameters(const DraftConfig& config) const override;
  nlohmann::ordered_json served_config(const DraftConfig& config, const std::string& weights_dtype) const override;
  std::vector<std::string> serving_warnings(const DraftConfig& config) const override;
  std::shared_ptr<DraftNet> make_net(const DraftConfig& config) const override;
};

// ModelOpt's default choice of the base layers that feed a DFlash draft of `num_draft_layers`
// layers (build_target_layer_ids in modelopt/torch/speculative/plugins/modeling_dflash.py):
// one layer in the middle for a one-layer draft, else num_draft_layers layers spread
// uniformly over [1, num_target_layers - 3], rounded half to even. Base layer indices (HF
// hidden_states index minus one). UsageError when the base has fewer layers than the draft.
std::vector<std::int64_t> dflash_default_target_layers(std::int64_t num_target_layers, std::int64_t num_draft_layers);

}  // namespace eaglekit::trainer
