#include "trainer/model/eagle3.h"

#include <nlohmann/json.hpp>

#include "formats/error.h"
#include "trainer/model/draft_config.h"

// EAGLE-3's row without LibTorch (what the config readers and the fuzz build need); its
// network and make_net are in eagle3_net.cpp.

namespace eaglekit::trainer {

namespace {

bool is_true(const nlohmann::json& config, const char* key) {
  const auto it = config.find(key);
  return it != config.end() && it->is_boolean() && it->get<bool>();
}

// A flag key is absent, null or a boolean; anything else is neither row's (explain_unclaimed
// refuses it as such).
bool typed(const nlohmann::json& config, const char* key) {
  const auto it = config.find(key);
  return it == config.end() || it->is_null() || it->is_boolean();
}

const nlohmann::json* eagle_config(const nlohmann::json& config) {
  const auto it = config.find("eagle_config");
  return it != config.end() && it->is_object() ? &*it : nullptr;
}

// The keys vLLM 0.32 reads for EAGLE 3.1: fc_norm, norm_output, and norm_before_fc at the top
// or (first) in eagle_config. All typed: a mistyped one is claimed by no row.
bool all_typed(const nlohmann::json& config) {
  const nlohmann::json* ec = eagle_config(config);
  return typed(config, "fc_norm") && typed(config, "norm_output") && typed(config, "norm_before_fc") &&
         typed(config, "norm_before_residual") && (ec == nullptr || typed(*ec, "norm_before_fc"));
}
bool any_31_key(const nlohmann::json& config) {
  const nlohmann::json* ec = eagle_config(config);
  return is_true(config, "fc_norm") || is_true(config, "norm_output") || is_true(config, "norm_before_fc") ||
         (ec != nullptr && is_true(*ec, "norm_before_fc"));
}

void refuse_mistyped(const nlohmann::json& config, const std::string& where) {
  for (const char* key : {"fc_norm", "norm_output", "norm_before_fc", "norm_before_residual"})
    if (!typed(config, key))
      throw FormatError(where, std::nullopt, key, "expected true/false, got " + config.at(key).dump());
  if (const nlohmann::json* ec = eagle_config(config); ec != nullptr && !typed(*ec, "norm_before_fc"))
    throw FormatError(where, std::nullopt, "eagle_config.norm_before_fc",
                      "expected true/false, got " + ec->at("norm_before_fc").dump());
}

}  // namespace

bool Eagle3Architecture::claims(const nlohmann::json& config) const {
  return all_typed(config) && !any_31_key(config);
}

void Eagle3Architecture::explain_unclaimed(const nlohmann::json& config, const std::string& where) const {
  refuse_mistyped(config, where);
}

bool Eagle31Architecture::claims(const nlohmann::json& config) const {
  return all_typed(config) && any_31_key(config);
}

void Eagle31Architecture::explain_unclaimed(const nlohmann::json& config, const std::string& where) const {
  refuse_mistyped(config, where);
}

std::vector<std::string> Eagle31Architecture::serving_warnings(const DraftConfig& c) const {
  std::vector<std::string> out = Eagle3Architecture::serving_warnings(c);
  out.push_back(
      "an EAGLE 3.1 draft (" + std::string(c.fc_norm ? "fc_norm" : c.norm_before_fc ? "norm_before_fc" : "") +
      (c.norm_output ? std::string(c.fc_norm || c.norm_before_fc ? ", " : "") + "norm_output" : "") +
      ") is served as trained by vLLM 0.32 and later; older vLLM versions and SGLang do not compute these norms "
      "(docs/export.md)");
  return out;
}

// fc; per decoder layer input_layernorm, (layer 0) hidden_norm, q/k/v/o, post_attention_layernorm
// and the MLP, in the module's registration order; the final norm and lm_head.
std::vector<ParameterShape> Eagle3Architecture::parameters(const DraftConfig& c) const {
  const std::int64_t h = c.hidden_size, qd = c.num_attention_heads * c.head_dim, kvd = c.num_key_value_heads * c.head_dim;
  std::vector<ParameterShape> out;
  // EAGLE 3.1's norms on the fc input come first, as the network registers them.
  if (c.norm_before_fc) out.push_back({"input_norm.weight", {c.aux_width()}});
  if (c.fc_norm)
    for (std::int64_t i = 0; i < c.num_aux_layers; ++i)
      out.push_back({"fc_norm." + std::to_string(i) + ".weight", {c.target_hidden_size}});
  out.push_back({"fc.weight", {h, c.aux_width()}});
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = c.num_hidden_layers == 1 ? "midlayer." : "layers." + std::to_string(i) + ".";
    const std::int64_t in = i == 0 ? 2 * h : h;
    out.push_back({p + "input_layernorm.weight", {h}});
    if (i == 0) out.push_back({p + "hidden_norm.weight", {h}});
    out.push_back({p + "self_attn.q_proj.weight", {qd, in}});
    out.push_back({p + "self_attn.k_proj.weight", {kvd, in}});
    out.push_back({p + "self_attn.v_proj.weight", {kvd, in}});
    out.push_back({p + "self_attn.o_proj.weight", {h, qd}});
    out.push_back({p + "post_attention_layernorm.weight", {h}});
    out.push_back({p + "mlp.gate_proj.weight", {c.intermediate_size, h}});
    out.push_back({p + "mlp.up_proj.weight", {c.intermediate_size, h}});
    out.push_back({p + "mlp.down_proj.weight", {h, c.intermediate_size}});
  }
  out.push_back({"norm.weight", {h}});
  out.push_back({"lm_head.weight", {c.draft_vocab_size, h}});
  return out;
}

std::optional<std::string> Eagle3Architecture::unservable(const DraftConfig& c) const {
  if (!c.modelopt_norm) return std::nullopt;
  return std::string(
      "the draft uses ModelOpt's norm form (input_layernorm applied to the hidden input "
      "before hidden_norm), which neither vLLM nor SGLang computes: served there it would run "
      "another function than the one trained, with low acceptance and no error. Pass "
      "--allow-unservable to write it anyway (for ModelOpt's own stack)");
}

std::vector<std::string> Eagle3Architecture::serving_warnings(const DraftConfig& c) const {
  if (c.num_hidden_layers <= 1) return {};
  return {"a draft of " + std::to_string(c.num_hidden_layers) +
          " decoder layers serves as trained in vLLM (layers.{i}.* names); SGLang loads its extra layers from "
          "additional_layers.* and computes them differently, so do not serve it there (docs/export.md)"};
}

nlohmann::ordered_json Eagle3Architecture::served_config(const DraftConfig& c, const std::string& weights_dtype) const {
  c.check();
  if (c.aux_layer_ids.empty()) {
    throw UsageError(
        "the aux layer ids of the dump are unknown: declare them (e.g. --aux-layer-ids 2,16,29 for "
        "Llama-3.1-8B, as Hugging Face hidden_states indices)");
  }
  std::vector<std::int64_t> sglang_ids;
  for (auto id : c.aux_layer_ids) sglang_ids.push_back(id - 1);
  // nlohmann's ordered_json keeps the documented field order in the file.
  nlohmann::ordered_json j;
  j["architectures"] = {"LlamaForCausalLMEagle3"};
  j["model_type"] = "llama";
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["vocab_size"] = c.vocab_size;
  j["draft_vocab_size"] = c.draft_vocab_size;
  j["target_hidden_size"] = c.target_hidden_size;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rope_theta"] = c.rope_theta;
  j["rope_scaling"] = rope_scaling_json(c.rope_scaling);
  // transformers' Phi-3 reads longrope's pretraining context at the top level.
  if (c.rope_scaling.type == RopeType::kLongrope)
    j["original_max_position_embeddings"] = c.rope_scaling.original_max_position_embeddings;
  j["tie_word_embeddings"] = false;
  j["torch_dtype"] = weights_dtype.empty() ? c.torch_dtype : weights_dtype;
  j["num_aux_hidden_states"] = c.num_aux_layers;
  // Written always: vLLM's speculators path reads an absent norm_before_residual as true.
  j["norm_before_residual"] = c.norm_before_residual;
  if (c.architecture != "eagle3") {
    j["fc_norm"] = c.fc_norm;
    j["norm_before_fc"] = c.norm_before_fc;
    j["norm_output"] = c.norm_output;
  }
  j["eagle_aux_hidden_state_layer_ids"] = c.aux_layer_ids;
  j["eagle_config"] = {{"eagle_aux_hidden_state_layer_ids", sglang_ids},
                       {"use_aux_hidden_state", true}};
  j["eaglekit_num_aux_layers"] = c.num_aux_layers;
  j["eaglekit_modelopt_norm"] = c.modelopt_norm;
  j["eaglekit_serving_dtype"] = c.torch_dtype;
  return j;
}

}  // namespace eaglekit::trainer
