#include "trainer/config.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>

#include "formats/error.h"

namespace eaglekit::trainer {

namespace {

using nlohmann::json;

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw IoError::from_errno(path, "open", errno);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

std::string config_path(const std::string& path) {
  if (std::filesystem::is_directory(path)) return path + "/config.json";
  return path;
}

json parse_json(const std::string& text, const std::string& where) {
  try {
    json j = json::parse(text);
    if (!j.is_object()) throw FormatError(where, std::nullopt, "config", "not a JSON object");
    return j;
  } catch (const json::parse_error& e) {
    throw FormatError(where, e.byte, "config", std::string("not valid JSON: ") + e.what());
  }
}

// A field of an object, or nullopt when absent or null.
std::optional<json> field(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  return *it;
}

std::int64_t get_int(const json& j, const char* key, const std::string& where,
                     std::optional<std::int64_t> fallback = std::nullopt) {
  auto v = field(j, key);
  if (!v) {
    if (fallback) return *fallback;
    throw FormatError(where, std::nullopt, key, "missing");
  }
  if (v->is_number_integer()) return v->get<std::int64_t>();
  // Some exporters write integral values as floats (32.0).
  if (v->is_number_float() && v->get<double>() == static_cast<double>(static_cast<std::int64_t>(v->get<double>())))
    return static_cast<std::int64_t>(v->get<double>());
  throw FormatError(where, std::nullopt, key, "expected an integer, got " + v->dump());
}

double get_double(const json& j, const char* key, const std::string& where,
                  std::optional<double> fallback = std::nullopt) {
  auto v = field(j, key);
  if (!v) {
    if (fallback) return *fallback;
    throw FormatError(where, std::nullopt, key, "missing");
  }
  if (!v->is_number()) throw FormatError(where, std::nullopt, key, "expected a number, got " + v->dump());
  return v->get<double>();
}

bool get_bool(const json& j, const char* key, const std::string& where, bool fallback) {
  auto v = field(j, key);
  if (!v) return fallback;
  if (!v->is_boolean()) throw FormatError(where, std::nullopt, key, "expected true/false, got " + v->dump());
  return v->get<bool>();
}

std::vector<std::int64_t> get_int_list(const json& v, const char* key, const std::string& where) {
  if (!v.is_array()) throw FormatError(where, std::nullopt, key, "expected a list of integers");
  std::vector<std::int64_t> out;
  for (const auto& e : v) {
    if (!e.is_number_integer()) throw FormatError(where, std::nullopt, key, "expected a list of integers");
    out.push_back(e.get<std::int64_t>());
  }
  return out;
}

RopeScaling parse_rope_scaling(const json& j, const std::string& where) {
  RopeScaling r;
  auto v = field(j, "rope_scaling");
  if (!v) return r;
  if (!v->is_object()) throw FormatError(where, std::nullopt, "rope_scaling", "expected an object or null");
  std::string type = "default";
  if (auto t = field(*v, "rope_type")) type = t->is_string() ? t->get<std::string>() : t->dump();
  else if (auto t2 = field(*v, "type")) type = t2->is_string() ? t2->get<std::string>() : t2->dump();
  if (type == "default") return r;
  if (type != "llama3") {
    throw UnsupportedError(where, std::nullopt, "rope_scaling.rope_type",
                           "'" + type + "' is not implemented (default and llama3 are)");
  }
  const std::string w = where;
  r.type = RopeType::kLlama3;
  r.factor = get_double(*v, "factor", w);
  r.low_freq_factor = get_double(*v, "low_freq_factor", w);
  r.high_freq_factor = get_double(*v, "high_freq_factor", w);
  r.original_max_position_embeddings = get_int(*v, "original_max_position_embeddings", w);
  if (r.factor <= 0 || r.low_freq_factor <= 0 || r.high_freq_factor <= r.low_freq_factor ||
      r.original_max_position_embeddings <= 0) {
    throw FormatError(where, std::nullopt, "rope_scaling",
                      "llama3 needs factor > 0 and 0 < low_freq_factor < high_freq_factor, got " +
                          v->dump());
  }
  return r;
}

nlohmann::ordered_json rope_scaling_json(const RopeScaling& r) {
  if (r.type == RopeType::kDefault) return nullptr;
  return nlohmann::ordered_json{{"rope_type", "llama3"},
              {"factor", r.factor},
              {"low_freq_factor", r.low_freq_factor},
              {"high_freq_factor", r.high_freq_factor},
              {"original_max_position_embeddings", r.original_max_position_embeddings}};
}

std::string get_dtype_name(const json& j, const std::string& fallback) {
  auto v = field(j, "torch_dtype");
  if (!v) v = field(j, "dtype");  // newer transformers
  if (!v || !v->is_string()) return fallback;
  return v->get<std::string>();
}

}  // namespace

bool RopeScaling::operator==(const RopeScaling& o) const {
  if (type != o.type) return false;
  if (type == RopeType::kDefault) return true;
  return factor == o.factor && low_freq_factor == o.low_freq_factor &&
         high_freq_factor == o.high_freq_factor &&
         original_max_position_embeddings == o.original_max_position_embeddings;
}

BaseConfig parse_base_config(const std::string& json_text, const std::string& where) {
  json j = parse_json(json_text, where);
  if (!j.contains("hidden_size") && j.contains("text_config") && j["text_config"].is_object())
    j = j["text_config"];
  BaseConfig c;
  c.hidden_size = get_int(j, "hidden_size", where);
  c.intermediate_size = get_int(j, "intermediate_size", where);
  c.num_attention_heads = get_int(j, "num_attention_heads", where);
  c.num_key_value_heads = get_int(j, "num_key_value_heads", where, c.num_attention_heads);
  if (c.num_attention_heads <= 0)
    throw FormatError(where, std::nullopt, "num_attention_heads", "must be positive");
  c.head_dim = get_int(j, "head_dim", where, c.hidden_size / c.num_attention_heads);
  c.num_hidden_layers = get_int(j, "num_hidden_layers", where);
  c.vocab_size = get_int(j, "vocab_size", where);
  c.max_position_embeddings = get_int(j, "max_position_embeddings", where, 2048);
  c.rms_norm_eps = get_double(j, "rms_norm_eps", where, 1e-6);
  c.rope_theta = get_double(j, "rope_theta", where, 10000.0);
  c.rope_scaling = parse_rope_scaling(j, where);
  c.tie_word_embeddings = get_bool(j, "tie_word_embeddings", where, false);
  c.torch_dtype = get_dtype_name(j, "bfloat16");
  const std::pair<const char*, std::int64_t> positive[] = {
      {"hidden_size", c.hidden_size},       {"intermediate_size", c.intermediate_size},
      {"num_key_value_heads", c.num_key_value_heads}, {"head_dim", c.head_dim},
      {"num_hidden_layers", c.num_hidden_layers}, {"vocab_size", c.vocab_size}};
  for (const auto& [name, value] : positive) {
    if (value <= 0) throw FormatError(where, std::nullopt, name, "must be positive, got " + std::to_string(value));
  }
  return c;
}

BaseConfig load_base_config(const std::string& path) {
  const std::string p = config_path(path);
  return parse_base_config(read_text(p), p);
}

std::vector<std::int64_t> default_aux_layer_ids(std::int64_t n) {
  return {2, n / 2, n - 3};
}

void DraftConfig::check() const {
  auto fail = [](const std::string& what) { throw UsageError("draft config: " + what); };
  const std::pair<const char*, std::int64_t> positive[] = {
      {"hidden_size", hidden_size},
      {"intermediate_size", intermediate_size},
      {"num_attention_heads", num_attention_heads},
      {"num_key_value_heads", num_key_value_heads},
      {"head_dim", head_dim},
      {"vocab_size", vocab_size},
      {"draft_vocab_size", draft_vocab_size},
      {"target_hidden_size", target_hidden_size},
      {"num_aux_layers", num_aux_layers},
      {"max_position_embeddings", max_position_embeddings}};
  for (const auto& [name, value] : positive) {
    if (value <= 0) fail(std::string(name) + " must be positive, got " + std::to_string(value));
  }
  if (num_attention_heads % num_key_value_heads != 0) {
    fail("num_attention_heads (" + std::to_string(num_attention_heads) +
         ") is not a multiple of num_key_value_heads (" + std::to_string(num_key_value_heads) + ")");
  }
  if (head_dim % 2 != 0) fail("head_dim must be even for RoPE, got " + std::to_string(head_dim));
  if (draft_vocab_size > vocab_size) {
    fail("draft_vocab_size " + std::to_string(draft_vocab_size) + " exceeds vocab_size " +
         std::to_string(vocab_size));
  }
  if (!(rms_norm_eps > 0)) fail("rms_norm_eps must be positive");
  if (!(rope_theta > 0)) fail("rope_theta must be positive");
  if (!aux_layer_ids.empty()) {
    if (static_cast<std::int64_t>(aux_layer_ids.size()) != num_aux_layers) {
      fail(std::to_string(aux_layer_ids.size()) + " aux layer ids for " +
           std::to_string(num_aux_layers) + " aux layers");
    }
    for (std::size_t i = 0; i < aux_layer_ids.size(); ++i) {
      if (aux_layer_ids[i] < 1) fail("aux layer ids are HF hidden_states indices and start at 1");
      if (i > 0 && aux_layer_ids[i] <= aux_layer_ids[i - 1]) fail("aux layer ids must increase");
    }
  }
}

DraftConfig draft_config_from_base(const BaseConfig& base, const DraftOptions& options) {
  DraftConfig d;
  d.hidden_size = base.hidden_size;
  d.intermediate_size = base.intermediate_size;
  d.num_attention_heads = base.num_attention_heads;
  d.num_key_value_heads = base.num_key_value_heads;
  d.head_dim = base.head_dim;
  d.rms_norm_eps = base.rms_norm_eps;
  d.rope_theta = base.rope_theta;
  d.rope_scaling = base.rope_scaling;
  d.vocab_size = base.vocab_size;
  d.draft_vocab_size = options.draft_vocab_size > 0 ? options.draft_vocab_size : base.vocab_size;
  d.target_hidden_size = base.hidden_size;
  d.num_aux_layers = options.num_aux_layers;
  d.max_position_embeddings = base.max_position_embeddings;
  d.aux_layer_ids = options.aux_layer_ids;
  if (d.aux_layer_ids.empty() && d.num_aux_layers == 3 && base.num_hidden_layers >= 6)
    d.aux_layer_ids = default_aux_layer_ids(base.num_hidden_layers);
  d.modelopt_norm = options.modelopt_norm;
  d.torch_dtype = options.torch_dtype.empty() ? base.torch_dtype : options.torch_dtype;
  d.check();
  return d;
}

DraftConfig parse_draft_config(const std::string& json_text, const std::string& where) {
  const json j = parse_json(json_text, where);
  DraftConfig d;
  d.hidden_size = get_int(j, "hidden_size", where);
  d.intermediate_size = get_int(j, "intermediate_size", where);
  d.num_attention_heads = get_int(j, "num_attention_heads", where);
  d.num_key_value_heads = get_int(j, "num_key_value_heads", where, d.num_attention_heads);
  if (d.num_attention_heads <= 0)
    throw FormatError(where, std::nullopt, "num_attention_heads", "must be positive");
  d.head_dim = get_int(j, "head_dim", where, d.hidden_size / d.num_attention_heads);
  if (const auto layers = field(j, "num_hidden_layers")) {
    if (!layers->is_number_integer() || layers->get<std::int64_t>() != 1) {
      throw UnsupportedError(where, std::nullopt, "num_hidden_layers",
                             "only one-layer EAGLE-3 drafts are supported, got " + layers->dump());
    }
  }
  d.rms_norm_eps = get_double(j, "rms_norm_eps", where, 1e-6);
  d.rope_theta = get_double(j, "rope_theta", where, 10000.0);
  d.rope_scaling = parse_rope_scaling(j, where);
  d.vocab_size = get_int(j, "vocab_size", where);
  d.draft_vocab_size = get_int(j, "draft_vocab_size", where, d.vocab_size);
  d.target_hidden_size = get_int(j, "target_hidden_size", where, d.hidden_size);
  d.max_position_embeddings = get_int(j, "max_position_embeddings", where, 2048);
  if (const auto ids = field(j, "eagle_aux_hidden_state_layer_ids")) {
    d.aux_layer_ids = get_int_list(*ids, "eagle_aux_hidden_state_layer_ids", where);
  } else if (const auto ec = field(j, "eagle_config"); ec && ec->is_object()) {
    if (const auto nested = field(*ec, "eagle_aux_hidden_state_layer_ids")) {
      d.aux_layer_ids = get_int_list(*nested, "eagle_config.eagle_aux_hidden_state_layer_ids", where);
      for (auto& id : d.aux_layer_ids) id += 1;
    }
  }
  d.num_aux_layers = get_int(j, "eaglekit_num_aux_layers", where,
                             d.aux_layer_ids.empty() ? 3 : static_cast<std::int64_t>(d.aux_layer_ids.size()));
  d.modelopt_norm = get_bool(j, "eaglekit_modelopt_norm", where, false);
  d.torch_dtype = get_dtype_name(j, "bfloat16");
  try {
    d.check();
  } catch (const UsageError& e) {
    throw FormatError(where, std::nullopt, "config", e.what());
  }
  return d;
}

DraftConfig load_draft_config(const std::string& path) {
  const std::string p = config_path(path);
  return parse_draft_config(read_text(p), p);
}

std::string draft_config_json(const DraftConfig& c) {
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
  j["num_hidden_layers"] = 1;
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
  j["tie_word_embeddings"] = false;
  j["torch_dtype"] = c.torch_dtype;
  j["eagle_aux_hidden_state_layer_ids"] = c.aux_layer_ids;
  j["eagle_config"] = {{"eagle_aux_hidden_state_layer_ids", sglang_ids},
                       {"use_aux_hidden_state", true}};
  j["eaglekit_num_aux_layers"] = c.num_aux_layers;
  j["eaglekit_modelopt_norm"] = c.modelopt_norm;
  return j.dump(2) + "\n";
}

}  // namespace eaglekit::trainer
