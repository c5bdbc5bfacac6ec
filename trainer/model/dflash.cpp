#include "trainer/model/dflash.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "formats/error.h"
#include "trainer/model/config.h"
#include "trainer/model/draft_config.h"

// DFlash's row without LibTorch (what the config readers and the fuzz build need); its
// network and make_net are in dflash_net.cpp.

namespace eaglekit::trainer {

bool DFlashArchitecture::claims(const nlohmann::json& config) const {
  if (const auto it = config.find("dflash_config"); it != config.end() && it->is_object()) return true;
  const auto a = config.find("architectures");
  if (a == config.end() || !a->is_array()) return false;
  return std::any_of(a->begin(), a->end(),
                     [](const nlohmann::json& v) { return v.is_string() && v.get<std::string>() == "DFlashDraftModel"; });
}

// The module's registration order, which is ModelOpt's: fc, hidden_norm, then per layer the
// attention (q/k/v/o, q_norm, k_norm), the MLP and the two layer norms, then the final norm.
std::vector<ParameterShape> DFlashArchitecture::parameters(const DraftConfig& c) const {
  const std::int64_t h = c.hidden_size, qd = c.num_attention_heads * c.head_dim, kvd = c.num_key_value_heads * c.head_dim;
  std::vector<ParameterShape> out;
  out.push_back({"fc.weight", {h, c.aux_width()}});
  out.push_back({"hidden_norm.weight", {h}});
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    out.push_back({p + "self_attn.q_proj.weight", {qd, h}});
    out.push_back({p + "self_attn.k_proj.weight", {kvd, h}});
    out.push_back({p + "self_attn.v_proj.weight", {kvd, h}});
    out.push_back({p + "self_attn.o_proj.weight", {h, qd}});
    out.push_back({p + "self_attn.q_norm.weight", {c.head_dim}});
    out.push_back({p + "self_attn.k_norm.weight", {c.head_dim}});
    out.push_back({p + "mlp.gate_proj.weight", {c.intermediate_size, h}});
    out.push_back({p + "mlp.up_proj.weight", {c.intermediate_size, h}});
    out.push_back({p + "mlp.down_proj.weight", {h, c.intermediate_size}});
    out.push_back({p + "input_layernorm.weight", {h}});
    out.push_back({p + "post_attention_layernorm.weight", {h}});
  }
  out.push_back({"norm.weight", {h}});
  return out;
}

// The keys ModelOpt 0.47's DFlashExporter writes (z-lab's format), which vLLM 0.32 reads.
nlohmann::ordered_json DFlashArchitecture::served_config(const DraftConfig& c, const std::string& weights_dtype) const {
  c.check();
  if (c.aux_layer_ids.empty())
    throw UsageError(
        "the base layers feeding the DFlash draft are unknown: declare the dump's layers with --aux-layer-ids "
        "(Hugging Face hidden_states indices)");
  std::vector<std::int64_t> target_ids;
  for (auto id : c.aux_layer_ids) target_ids.push_back(id - 1);
  nlohmann::ordered_json j;
  j["architectures"] = {"DFlashDraftModel"};
  j["model_type"] = "qwen3";
  j["block_size"] = c.block_size;
  j["dflash_config"] = {{"mask_token_id", c.mask_token_id}, {"target_layer_ids", target_ids}};
  j["hidden_size"] = c.hidden_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["intermediate_size"] = c.intermediate_size;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["vocab_size"] = c.vocab_size;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["rope_theta"] = c.rope_theta;
  j["rope_scaling"] = rope_scaling_json(c.rope_scaling);
  j["tie_word_embeddings"] = false;
  j["torch_dtype"] = weights_dtype.empty() ? c.torch_dtype : weights_dtype;
  j["target_hidden_size"] = c.target_hidden_size;
  j["eaglekit_num_aux_layers"] = c.num_aux_layers;
  j["eaglekit_serving_dtype"] = c.torch_dtype;
  return j;
}

std::vector<std::string> DFlashArchitecture::serving_warnings(const DraftConfig&) const {
  return {"a DFlash draft is served by vLLM 0.32 and later (speculative method \"dflash\"); SGLang and older vLLM "
          "versions do not serve it (docs/dflash.md)"};
}

std::vector<std::int64_t> dflash_default_target_layers(std::int64_t num_target_layers, std::int64_t num_draft_layers) {
  if (num_draft_layers < 1 || num_target_layers < num_draft_layers)
    throw UsageError("a DFlash draft of " + std::to_string(num_draft_layers) + " layers takes as many base layers, and the base has " +
                     std::to_string(num_target_layers));
  if (num_draft_layers == 1) return {num_target_layers / 2};
  const std::int64_t start = std::min<std::int64_t>(1, num_target_layers - 1);
  const std::int64_t end = std::max(start, num_target_layers - 3);
  std::vector<std::int64_t> out;
  for (std::int64_t i = 0; i < num_draft_layers; ++i) {
    // Python's round(): half to even, as ModelOpt computes it.
    const double x = static_cast<double>(start) + static_cast<double>(i * (end - start)) / static_cast<double>(num_draft_layers - 1);
    out.push_back(static_cast<std::int64_t>(std::nearbyint(x)));
  }
  return out;
}

}  // namespace eaglekit::trainer
