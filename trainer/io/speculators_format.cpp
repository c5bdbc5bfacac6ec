#include "trainer/io/speculators_format.h"

#include <nlohmann/json.hpp>

#include "formats/error.h"
#include "trainer/model/config.h"

namespace eaglekit::trainer {

namespace {

using nlohmann::ordered_json;

// Top-level keys of the flat config that the speculators layout keeps beside
// transformer_layer_config rather than in it (vLLM's eagle3 updater reads them there).
bool top_level_key(const std::string& key) {
  return key == "architectures" || key == "draft_vocab_size" || key == "target_hidden_size" ||
         key == "norm_before_residual" || key == "fc_norm" || key == "norm_before_fc" || key == "norm_output" ||
         key == "eagle_aux_hidden_state_layer_ids" ||
         key.rfind("eaglekit_", 0) == 0;
}

ordered_json parse_object(const std::string& text, const std::string& where) {
  ordered_json j;
  try {
    j = ordered_json::parse(text);
  } catch (const ordered_json::exception& e) {
    throw FormatError(where, std::nullopt, "config", std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object()) throw FormatError(where, std::nullopt, "config", "not a JSON object");
  return j;
}

bool flag(const ordered_json& j, const char* key, const std::string& where, const std::string& name) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return false;
  if (!it->is_boolean()) throw FormatError(where, std::nullopt, name, "expected true/false, got " + it->dump());
  return it->get<bool>();
}

}  // namespace

std::string_view export_format_name(ExportFormat f) {
  return f == ExportFormat::kSpeculators ? "speculators" : "eaglekit";
}

std::optional<ExportFormat> parse_export_format(std::string_view name) {
  if (name == "eaglekit") return ExportFormat::kEaglekit;
  if (name == "speculators") return ExportFormat::kSpeculators;
  return std::nullopt;
}

std::string speculators_config_json(const DraftConfig& config, const SpeculatorsInfo& info,
                                    const std::string& weights_dtype) {
  if (info.speculative_tokens < 1) throw UsageError("the speculators layout needs a speculative token count of at least 1");
  if (info.verifier.empty()) throw UsageError("the speculators layout names its verifier (the target model): give --verifier");
  // The draft's own config as the flat export writes it; its decoder-layer keys become
  // transformer_layer_config, the EAGLE-3 keys stay at the top.
  const ordered_json flat = ordered_json::parse(draft_config_json(config, weights_dtype));
  ordered_json layer = ordered_json::object();
  for (const auto& [key, value] : flat.items())
    if (!top_level_key(key)) layer[key] = value;

  ordered_json j;
  j["architectures"] = {"Eagle3Speculator"};
  j["speculators_model_type"] = "eagle3";
  ordered_json proposal;
  proposal["proposal_type"] = "greedy";
  proposal["speculative_tokens"] = info.speculative_tokens;
  proposal["verifier_accept_k"] = 1;
  proposal["accept_tolerance"] = 0.0;
  ordered_json verifier;
  verifier["name_or_path"] = info.verifier;
  verifier["architectures"] = info.verifier_architectures;
  ordered_json spec;
  spec["algorithm"] = "eagle3";
  spec["proposal_methods"] = ordered_json::array({proposal});
  spec["default_proposal_method"] = "greedy";
  spec["verifier"] = verifier;
  j["speculators_config"] = spec;
  j["transformer_layer_config"] = layer;
  j["draft_vocab_size"] = flat.at("draft_vocab_size");
  j["target_hidden_size"] = flat.at("target_hidden_size");
  // vLLM's speculators path reads an absent norm_before_residual as true: always write it.
  j["norm_before_residual"] = config.norm_before_residual;
  j["norm_before_fc"] = config.norm_before_fc;
  j["fc_norm"] = config.fc_norm;
  j["norm_output"] = config.norm_output;
  j["embed_requires_grad"] = false;
  j["eagle_aux_hidden_state_layer_ids"] = flat.at("eagle_aux_hidden_state_layer_ids");
  j["torch_dtype"] = flat.at("torch_dtype");
  for (const auto& [key, value] : flat.items())
    if (key.rfind("eaglekit_", 0) == 0) j[key] = value;
  return j.dump(2) + "\n";
}

std::string speculators_tensor_name(const std::string& name) {
  if (name.rfind("midlayer.", 0) == 0) return "layers.0." + name.substr(9);
  return name;
}

bool is_speculators_config(const std::string& json_text) {
  const auto j = ordered_json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  return j.is_object() && j.contains("speculators_model_type");
}

std::string speculators_to_draft_config(const std::string& json_text, const std::string& where,
                                        SpeculatorsInfo* info) {
  const ordered_json j = parse_object(json_text, where);
  const auto type_it = j.find("speculators_model_type");
  if (type_it == j.end()) throw FormatError(where, std::nullopt, "speculators_model_type", "missing");
  const auto& type = *type_it;
  if (!type.is_string() || type.get<std::string>() != "eagle3") {
    throw UnsupportedError(where, std::nullopt, "speculators_model_type",
                           "only eagle3 drafts are read, got " + type.dump());
  }
  const auto layer_it = j.find("transformer_layer_config");
  if (layer_it == j.end() || !layer_it->is_object())
    throw FormatError(where, std::nullopt, "transformer_layer_config", "missing or not an object");
  ordered_json flat = *layer_it;
  if (const auto mt = flat.find("model_type"); mt != flat.end() && *mt != "llama") {
    throw UnsupportedError(where, std::nullopt, "transformer_layer_config.model_type",
                           "only Llama decoder layers are read, got " + mt->dump());
  }
  // EAGLE 3.1's norms (trainer/model/draft_config.h), as vLLM's eagle3 updater copies them:
  // the architecture row that claims them reads them from the flat config.
  for (const char* key : {"fc_norm", "norm_before_fc", "norm_output"})
    if (flag(j, key, where, key)) flat[key] = true;
  // draft_vocab_size: speculators' class default (32000) and vLLM's (the vocabulary) differ,
  // so an absent one is not guessed.
  const auto vd = j.find("draft_vocab_size");
  if (vd == j.end() || vd->is_null()) throw FormatError(where, std::nullopt, "draft_vocab_size", "missing");
  flat["draft_vocab_size"] = *vd;
  if (const auto t = j.find("target_hidden_size"); t != j.end() && !t->is_null()) flat["target_hidden_size"] = *t;
  // vLLM's eagle3 updater reads an absent norm_before_residual as true, and so does this.
  const auto nbr = j.find("norm_before_residual");
  flat["norm_before_residual"] = nbr == j.end() || nbr->is_null() ? ordered_json(true) : *nbr;
  if (const auto ids = j.find("eagle_aux_hidden_state_layer_ids"); ids != j.end() && !ids->is_null())
    flat["eagle_aux_hidden_state_layer_ids"] = *ids;
  if (!flat.contains("num_aux_hidden_states"))
    if (const auto k = j.find("num_aux_hidden_states"); k != j.end()) flat["num_aux_hidden_states"] = *k;
  if (!flat.contains("torch_dtype"))
    if (const auto d = j.find("torch_dtype"); d != j.end()) flat["torch_dtype"] = *d;
  for (const auto& [key, value] : j.items())
    if (key.rfind("eaglekit_", 0) == 0) flat[key] = value;

  if (info) {
    *info = SpeculatorsInfo{};
    const auto spec = j.find("speculators_config");
    if (spec != j.end() && spec->is_object()) {
      const auto methods = spec->find("proposal_methods");
      if (methods != spec->end() && methods->is_array() && !methods->empty()) {
        const auto& first = (*methods)[0];
        if (first.is_object() && first.contains("speculative_tokens") && first["speculative_tokens"].is_number_integer())
          info->speculative_tokens = first["speculative_tokens"].get<std::int64_t>();
      }
      const auto v = spec->find("verifier");
      if (v != spec->end() && v->is_object()) {
        if (v->contains("name_or_path") && (*v)["name_or_path"].is_string())
          info->verifier = (*v)["name_or_path"].get<std::string>();
        if (v->contains("architectures") && (*v)["architectures"].is_array())
          for (const auto& a : (*v)["architectures"])
            if (a.is_string()) info->verifier_architectures.push_back(a.get<std::string>());
      }
    }
  }
  return flat.dump(2) + "\n";
}

}  // namespace eaglekit::trainer
