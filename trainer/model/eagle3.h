// EAGLE-3 (docs/draft.md), the built-in draft architecture: fc over the k aux layers, a first
// Llama decoder layer whose q/k/v read cat(input_layernorm(emb), hidden_norm(h)), then
// num_hidden_layers - 1 plain Llama decoder layers on H (vLLM's multi-layer EAGLE-3), GQA with
// RoPE, SwiGLU MLPs, the final norm and lm_head over the draft vocabulary.
//
// Parameter names are the export names of docs/export.md ("fc.weight",
// "midlayer.self_attn.q_proj.weight", ...; "layers.{i}.*" instead of "midlayer.*" when there
// is more than one layer). Served as LlamaForCausalLMEagle3 by vLLM and SGLang.
//
// EAGLE 3.1 (the "eagle3.1" row) is the same network with the norms vLLM 0.32 and speculators
// 0.9 name fc_norm, norm_before_fc and norm_output (DraftConfig); both rows take
// norm_before_residual. One network computes both (eagle3_net.cpp), from the config's flags.
//
// The class is here, LibTorch-free, for variants to derive from; make_eagle3_net gives them
// the network to wrap.
//
// Thread safety: immutable. Errors: as DraftArchitecture's.
#pragma once

#include <memory>

#include "trainer/model/architecture.h"

namespace eaglekit::trainer {

class Eagle3Architecture : public DraftArchitecture {
 public:
  std::string_view name() const override { return "eagle3"; }
  std::string_view title() const override { return "EAGLE-3"; }
  // Every draft config.json without an EAGLE 3.1 key set (fc_norm, norm_before_fc at the top
  // or in eagle_config, norm_output: true, as vLLM 0.32 reads them).
  bool claims(const nlohmann::json& config) const override;
  void explain_unclaimed(const nlohmann::json& config, const std::string& where) const override;
  std::vector<ParameterShape> parameters(const DraftConfig& config) const override;
  nlohmann::ordered_json served_config(const DraftConfig& config, const std::string& weights_dtype) const override;
  // ModelOpt's norm form (DraftConfig::modelopt_norm), which no engine computes.
  std::optional<std::string> unservable(const DraftConfig& config) const override;
  // A draft of more than one layer: SGLang computes its extra layers differently.
  std::vector<std::string> serving_warnings(const DraftConfig& config) const override;
  std::shared_ptr<DraftNet> make_net(const DraftConfig& config) const override;
};

// EAGLE 3.1: EAGLE-3 with fc_norm (the EAGLE 3.1 paper's per-layer norm), or norm_before_fc
// (speculators' one norm over the concatenation), and/or norm_output. Served by vLLM 0.32 and
// later only (older versions and SGLang do not compute these norms).
class Eagle31Architecture final : public Eagle3Architecture {
 public:
  std::string_view name() const override { return "eagle3.1"; }
  std::string_view title() const override { return "EAGLE 3.1"; }
  bool claims(const nlohmann::json& config) const override;
  void explain_unclaimed(const nlohmann::json& config, const std::string& where) const override;
  std::vector<std::string> serving_warnings(const DraftConfig& config) const override;
};

// EAGLE-3's (and EAGLE 3.1's) network for `config` (weights not initialised).
std::shared_ptr<DraftNet> make_eagle3_net(const DraftConfig& config);

}  // namespace eaglekit::trainer
