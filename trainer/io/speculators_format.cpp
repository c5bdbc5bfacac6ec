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

// The proposal and the verifier of speculators_config (absent parts stay empty).
void read_info(const ordered_json& j, SpeculatorsInfo& info) {
  info = SpeculatorsInfo{};
  const auto spec = j.find("speculators_config");
  if (spec == j.end() || !spec->is_object()) return;
  const auto methods = spec->find("proposal_methods");
  if (methods != spec->end() && methods->is_array() && !methods->empty()) {
    const auto& first = (*methods)[0];
    if (first.is_object() && first.contains("speculative_tokens") && first["speculative_tokens"].is_number_integer())
      info.speculative_tokens = first["speculative_tokens"].get<std::int64_t>();
  }
  const auto v = spec->find("verifier");
  if (v != spec->end() && v->is_object()) {
    if (v->contains("name_or_path") && (*v)["name_or_path"].is_string())
      info.verifier = (*v)["name_or_path"].get<std::string>();
    if (v->contains("architectures") && (*v)["architectures"].is_array())
      for (const auto& a : (*v)["architectures"])
        if (a.is_string()) info.verifier_architectures.push_back(a.get<std::string>());
  }
}

// A speculators 0.9 DFlash config (DFlashSpeculatorConfig) as the flat ModelOpt / vLLM config
// parse_draft_config reads: transformer_layer_config, with block_size, dflash_config
// (mask_token_id, target_layer_ids = aux_hidden_state_layer_ids - 1, vLLM's mapping) and
// target_hidden_size laid over it. What DFlashDraftModel can be but eaglekit does not
// compute is refused by name.
std::string speculators_dflash_to_draft_config(const ordered_json& j, const ordered_json& layer, const std::string& where) {
  ordered_json flat = layer;
  auto top = [&](const char* key) -> const ordered_json* {
    const auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  };
  auto required_int = [&](const char* key) -> std::int64_t {
    const ordered_json* v = top(key);
    if (!v) throw FormatError(where, std::nullopt, key, "missing");
    if (!v->is_number_integer()) throw FormatError(where, std::nullopt, key, "expected an integer, got " + v->dump());
    return v->get<std::int64_t>();
  };
  if (flag(j, "sample_from_anchor", where, "sample_from_anchor"))
    throw UnsupportedError(where, std::nullopt, "sample_from_anchor",
                           "true (the anchor slot predicts too, DSpark's form); eaglekit's DFlash gives the anchor");
  if (flag(layer, "attention_bias", where, "transformer_layer_config.attention_bias"))
    throw UnsupportedError(where, std::nullopt, "transformer_layer_config.attention_bias",
                           "true: eaglekit's DFlash layers have no biases");
  if (const auto act = layer.find("hidden_act"); act != layer.end() && !act->is_null() && *act != "silu")
    throw UnsupportedError(where, std::nullopt, "transformer_layer_config.hidden_act",
                           "only silu is computed, got " + act->dump());
  if (const auto types = layer.find("layer_types"); types != layer.end() && types->is_array())
    for (const auto& t : *types)
      if (t != "full_attention")
        throw UnsupportedError(where, std::nullopt, "transformer_layer_config.layer_types",
                               "only full_attention layers are computed, got " + t.dump());
  const std::int64_t block = required_int("block_size");
  const std::int64_t mask = required_int("mask_token_id");
  const std::int64_t draft_vocab = required_int("draft_vocab_size");
  if (const auto v = layer.find("vocab_size"); v != layer.end() && v->is_number_integer() &&
                                               v->get<std::int64_t>() != draft_vocab)
    throw UnsupportedError(where, std::nullopt, "draft_vocab_size",
                           std::to_string(draft_vocab) + " is not the vocabulary (" + v->dump() +
                               "): eaglekit's DFlash predicts with the base's lm_head over the whole vocabulary");
  const ordered_json* ids = top("aux_hidden_state_layer_ids");
  if (!ids) throw FormatError(where, std::nullopt, "aux_hidden_state_layer_ids", "missing");
  if (!ids->is_array() || ids->empty())
    throw FormatError(where, std::nullopt, "aux_hidden_state_layer_ids", "expected a list of layer ids, got " + ids->dump());
  ordered_json target = ordered_json::array();
  for (const auto& id : *ids) {
    // HF hidden_states indices: 0 is the embeddings, which no DFlash target layer is.
    if (!id.is_number_integer() || id.get<std::int64_t>() < 1)
      throw FormatError(where, std::nullopt, "aux_hidden_state_layer_ids",
                        "expected hidden_states indices from 1, got " + id.dump());
    target.push_back(id.get<std::int64_t>() - 1);
  }
  flat["architectures"] = {"DFlashDraftModel"};
  flat["block_size"] = block;
  flat["dflash_config"] = {{"mask_token_id", mask}, {"target_layer_ids", target}};
  if (const ordered_json* t = top("target_hidden_size")) flat["target_hidden_size"] = *t;
  if (!flat.contains("torch_dtype") && !flat.contains("dtype")) {
    if (const ordered_json* d = top("torch_dtype")) flat["torch_dtype"] = *d;
    else if (const ordered_json* d2 = top("dtype")) flat["torch_dtype"] = *d2;
  }
  for (const auto& [key, value] : j.items())
    if (key.rfind("eaglekit_", 0) == 0) flat[key] = value;
  return flat.dump(2) + "\n";
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

namespace {

ordered_json speculators_block(const std::string& algorithm, const SpeculatorsInfo& info) {
  ordered_json proposal;
  proposal["proposal_type"] = "greedy";
  proposal["speculative_tokens"] = info.speculative_tokens;
  proposal["verifier_accept_k"] = 1;
  proposal["accept_tolerance"] = 0.0;
  ordered_json verifier;
  verifier["name_or_path"] = info.verifier;
  verifier["architectures"] = info.verifier_architectures;
  ordered_json spec;
  spec["algorithm"] = algorithm;
  spec["proposal_methods"] = ordered_json::array({proposal});
  spec["default_proposal_method"] = "greedy";
  spec["verifier"] = verifier;
  return spec;
}

// speculators 0.9's DFlashSpeculatorConfig (models/dflash/config.py) for a DFlash draft: the
// Qwen3 decoder config as transformer_layer_config (the keys of the ModelOpt layout but its
// DFlash ones), and beside it what DFlashDraftModel and vLLM's dflash updater read.
std::string speculators_dflash_config_json(const DraftConfig& config, const SpeculatorsInfo& info,
                                           const std::string& weights_dtype) {
  const ordered_json flat = ordered_json::parse(draft_config_json(config, weights_dtype));
  ordered_json layer = ordered_json::object();
  for (const auto& [key, value] : flat.items())
    if (key != "architectures" && key != "block_size" && key != "dflash_config" && key != "target_hidden_size" &&
        key.rfind("eaglekit_", 0) != 0)
      layer[key] = value;
  ordered_json j;
  j["architectures"] = {"DFlashDraftModel"};
  j["speculators_model_type"] = "dflash";
  j["speculators_config"] = speculators_block("dflash", info);
  j["transformer_layer_config"] = layer;
  j["draft_vocab_size"] = config.draft_vocab_size;
  j["block_size"] = config.block_size;
  j["target_hidden_size"] = config.target_hidden_size;
  j["aux_hidden_state_layer_ids"] = config.aux_layer_ids;  // HF hidden_states indices, as speculators counts
  j["mask_token_id"] = config.mask_token_id;
  // The anchor is given, not predicted (DFlash; DSpark samples from it).
  j["sample_from_anchor"] = false;
  // speculators reads this only for sliding-window layers (a DFlash draft here has none; its
  // full-attention blocks are always bidirectional there); vLLM 0.32's dflash updater makes
  // every layer causal when it is false: true keeps the block as trained in both.
  j["sliding_window_non_causal"] = true;
  j["torch_dtype"] = flat.at("torch_dtype");
  for (const auto& [key, value] : flat.items())
    if (key.rfind("eaglekit_", 0) == 0) j[key] = value;
  return j.dump(2) + "\n";
}

}  // namespace

std::string speculators_config_json(const DraftConfig& config, const SpeculatorsInfo& info,
                                    const std::string& weights_dtype) {
  if (info.speculative_tokens < 1) throw UsageError("the speculators layout needs a speculative token count of at least 1");
  if (info.verifier.empty()) throw UsageError("the speculators layout names its verifier (the target model): give --verifier");
  if (config.architecture == "dflash") return speculators_dflash_config_json(config, info, weights_dtype);
  // The draft's own config as the flat export writes it; its decoder-layer keys become
  // transformer_layer_config, the EAGLE-3 keys stay at the top.
  const ordered_json flat = ordered_json::parse(draft_config_json(config, weights_dtype));
  ordered_json layer = ordered_json::object();
  for (const auto& [key, value] : flat.items())
    if (!top_level_key(key)) layer[key] = value;

  ordered_json j;
  j["architectures"] = {"Eagle3Speculator"};
  j["speculators_model_type"] = "eagle3";
  j["speculators_config"] = speculators_block("eagle3", info);
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
  const bool dflash = type.is_string() && type.get<std::string>() == "dflash";
  if (!type.is_string() || (type.get<std::string>() != "eagle3" && !dflash)) {
    throw UnsupportedError(where, std::nullopt, "speculators_model_type",
                           "only eagle3 and dflash drafts are read, got " + type.dump());
  }
  const auto layer_it = j.find("transformer_layer_config");
  if (layer_it == j.end() || !layer_it->is_object())
    throw FormatError(where, std::nullopt, "transformer_layer_config", "missing or not an object");
  if (info) read_info(j, *info);
  if (dflash) return speculators_dflash_to_draft_config(j, *layer_it, where);
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

  return flat.dump(2) + "\n";
}

}  // namespace eaglekit::trainer
