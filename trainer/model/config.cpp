#include "trainer/model/config.h"

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>

#include "formats/error.h"
#include "trainer/model/architecture_rows.h"

namespace eaglekit::trainer {

namespace {

using nlohmann::json;

constexpr auto kInt64Max = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());

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
  } catch (const json::exception& e) {  // a number out of range (406) is not a parse_error
    throw FormatError(where, std::nullopt, "config", std::string("not valid JSON: ") + e.what());
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
  if (v->is_number_unsigned() && v->get<std::uint64_t>() > kInt64Max)
    throw FormatError(where, std::nullopt, key, "out of range, got " + v->dump());
  if (v->is_number_integer()) return v->get<std::int64_t>();
  // Some exporters write integral values as floats (32.0).
  if (v->is_number_float()) {
    const double d = v->get<double>();
    // Range first: casting a double outside int64 is undefined.
    if (d == std::floor(d) && std::abs(d) < 9.0e18) return static_cast<std::int64_t>(d);
  }
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
    if (!e.is_number_integer() ||
        (e.is_number_unsigned() && e.get<std::uint64_t>() > kInt64Max))
      throw FormatError(where, std::nullopt, key, "expected a list of integers, got " + e.dump());
    out.push_back(e.get<std::int64_t>());
  }
  return out;
}

std::optional<double> get_optional_double(const json& j, const char* key, const std::string& where,
                                          const std::string& field_name) {
  const auto v = field(j, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) throw FormatError(where, std::nullopt, field_name, "expected a number, got " + v->dump());
  return v->get<double>();
}

std::vector<double> get_double_list(const json& j, const char* key, const std::string& where,
                                    const std::string& field_name) {
  const auto v = field(j, key);
  if (!v) throw FormatError(where, std::nullopt, field_name, "missing");
  if (!v->is_array()) throw FormatError(where, std::nullopt, field_name, "expected a list of numbers");
  std::vector<double> out;
  for (const auto& e : *v) {
    if (!e.is_number()) throw FormatError(where, std::nullopt, field_name, "expected a list of numbers");
    out.push_back(e.get<double>());
  }
  return out;
}

std::string number_text(double v) {
  std::string s = json(v).dump();
  return s;
}

// One RoPE object: `rope_scaling` (v4) or `rope_parameters` (v5). `name` is its key, for
// messages; `top` the config holding it (longrope's original_max_position_embeddings may
// sit there); `max_pos` the config's max_position_embeddings.
RopeScaling parse_rope_object(const json& v, const std::string& name, const json& top, std::int64_t max_pos,
                              const std::string& where, std::vector<std::string>* notes) {
  auto note = [&](const std::string& text) {
    if (notes) notes->push_back(text);
  };
  const auto key = [&](const char* k) { return name + "." + k; };
  const auto number = [&](const char* k) {
    const auto x = get_optional_double(v, k, where, key(k));
    if (!x) throw FormatError(where, std::nullopt, key(k), "missing");
    return *x;
  };
  const auto integer = [&](const char* k) {
    // An integer is taken as written: through a double, one past 2^53 would change, and
    // the exported config would no longer read back as the draft trained (found by fuzz_config).
    if (const auto exact = field(v, k); exact && exact->is_number_integer()) {
      if (exact->is_number_unsigned() && exact->get<std::uint64_t>() > kInt64Max)
        throw FormatError(where, std::nullopt, key(k), "out of range, got " + exact->dump());
      return exact->get<std::int64_t>();
    }
    const double x = number(k);
    if (x != std::floor(x) || !(std::abs(x) < 9.0e18))
      throw FormatError(where, std::nullopt, key(k), "expected an integer, got " + number_text(x));
    return static_cast<std::int64_t>(x);
  };
  RopeScaling r;
  std::string type = "default";
  if (auto t = field(v, "rope_type")) type = t->is_string() ? t->get<std::string>() : t->dump();
  else if (auto t2 = field(v, "type")) type = t2->is_string() ? t2->get<std::string>() : t2->dump();
  if (field(v, "mrope_section")) {
    throw UnsupportedError(where, std::nullopt, key("mrope_section"),
                           "multimodal RoPE (mrope) is not implemented for a Llama draft");
  }
  if (auto p = get_optional_double(v, "partial_rotary_factor", where, key("partial_rotary_factor")); p && *p != 1.0) {
    throw UnsupportedError(where, std::nullopt, key("partial_rotary_factor"),
                           "partial rotary embeddings (" + number_text(*p) + ") are not implemented for a Llama draft");
  }
  const auto parsed = parse_rope_type(type);
  if (!parsed) {
    throw UnsupportedError(where, std::nullopt, key("rope_type"),
                           "'" + type + "' is not implemented (default, linear, dynamic, llama3, yarn and longrope are)");
  }
  r.type = *parsed;
  switch (r.type) {
    case RopeType::kDefault:
      break;
    case RopeType::kLinear:
      r.factor = number("factor");
      break;
    case RopeType::kDynamic:
      if (field(v, "alpha")) {
        throw UnsupportedError(where, std::nullopt, key("alpha"), "dynamic NTK-alpha RoPE is not implemented");
      }
      r.factor = number("factor");
      break;
    case RopeType::kLlama3:
      r.factor = number("factor");
      r.low_freq_factor = number("low_freq_factor");
      r.high_freq_factor = number("high_freq_factor");
      r.original_max_position_embeddings = integer("original_max_position_embeddings");
      break;
    case RopeType::kYarn: {
      if (field(v, "original_max_position_embeddings")) {
        r.original_max_position_embeddings = integer("original_max_position_embeddings");
      } else {
        r.original_max_position_embeddings = max_pos;
        note(key("original_max_position_embeddings") + " is absent: " + std::to_string(max_pos) +
             ", the config's max_position_embeddings (as transformers v4 takes it)");
      }
      if (field(v, "factor")) {
        r.factor = number("factor");
      } else {
        r.factor = static_cast<double>(max_pos) / static_cast<double>(r.original_max_position_embeddings);
        note(key("factor") + " is absent: " + number_text(r.factor) +
             " = max_position_embeddings / original_max_position_embeddings (as transformers takes it)");
      }
      // transformers reads these with `or`: absent, null and 0 all take the paper's values.
      const auto fast = get_optional_double(v, "beta_fast", where, key("beta_fast"));
      const auto slow = get_optional_double(v, "beta_slow", where, key("beta_slow"));
      r.beta_fast = fast && *fast != 0 ? *fast : 32.0;
      r.beta_slow = slow && *slow != 0 ? *slow : 1.0;
      if (!fast || *fast == 0) note(key("beta_fast") + " is absent: 32, YaRN's default");
      if (!slow || *slow == 0) note(key("beta_slow") + " is absent: 1, YaRN's default");
      r.truncate = get_bool(v, "truncate", where, true);
      r.attention_factor = get_optional_double(v, "attention_factor", where, key("attention_factor"));
      r.mscale = get_optional_double(v, "mscale", where, key("mscale"));
      r.mscale_all_dim = get_optional_double(v, "mscale_all_dim", where, key("mscale_all_dim"));
      break;
    }
    case RopeType::kLongrope:
      r.short_factor = get_double_list(v, "short_factor", where, key("short_factor"));
      r.long_factor = get_double_list(v, "long_factor", where, key("long_factor"));
      if (field(v, "original_max_position_embeddings")) {
        r.original_max_position_embeddings = integer("original_max_position_embeddings");
      } else if (field(top, "original_max_position_embeddings")) {  // Phi-3 keeps it at the top
        r.original_max_position_embeddings = get_int(top, "original_max_position_embeddings", where);
      } else {
        throw FormatError(where, std::nullopt, key("original_max_position_embeddings"), "missing (longrope needs it)");
      }
      r.attention_factor = get_optional_double(v, "attention_factor", where, key("attention_factor"));
      r.short_mscale = get_optional_double(v, "short_mscale", where, key("short_mscale"));
      r.long_mscale = get_optional_double(v, "long_mscale", where, key("long_mscale"));
      break;
  }
  return r;
}

struct Rope {
  double theta = 10000.0;
  RopeScaling scaling;
};

// RoPE of a config: transformers v5 `rope_parameters` (rope_theta inside it; a per-layer-type
// map uses its "full_attention" entry) or v4 `rope_theta` + `rope_scaling`. Where both
// forms are present they must agree.
Rope read_rope(const json& j, std::int64_t max_pos, const std::string& where, std::vector<std::string>* notes) {
  Rope out;
  const auto top_theta = get_optional_double(j, "rope_theta", where, "rope_theta");
  std::optional<RopeScaling> legacy;
  if (const auto rs = field(j, "rope_scaling")) {
    if (!rs->is_object()) throw FormatError(where, std::nullopt, "rope_scaling", "expected an object or null");
    legacy = parse_rope_object(*rs, "rope_scaling", j, max_pos, where, notes);
  }
  if (const auto rp = field(j, "rope_parameters")) {
    if (!rp->is_object()) throw FormatError(where, std::nullopt, "rope_parameters", "expected an object or null");
    json params = *rp;
    std::string name = "rope_parameters";
    if (!params.contains("rope_type") && !params.contains("rope_theta") && !params.contains("type")) {
      const auto full = field(params, "full_attention");
      if (!full || !full->is_object()) {
        throw FormatError(where, std::nullopt, "rope_parameters",
                          "expected rope_type and rope_theta, or a map of layer types with full_attention");
      }
      if (notes) notes->push_back("rope_parameters is given per layer type: the draft uses full_attention's");
      params = *full;
      name = "rope_parameters.full_attention";
    }
    const auto theta = get_optional_double(params, "rope_theta", where, name + ".rope_theta");
    if (!theta && !top_theta) throw FormatError(where, std::nullopt, name + ".rope_theta", "missing");
    if (theta && top_theta && *theta != *top_theta) {
      throw FormatError(where, std::nullopt, name + ".rope_theta",
                        number_text(*theta) + " disagrees with rope_theta " + number_text(*top_theta));
    }
    out.theta = theta ? *theta : *top_theta;
    // Without v4 dropping, some tools save the legacy key beside it: both must say the same.
    std::vector<std::string> ignored;
    out.scaling = parse_rope_object(params, name, j, max_pos, where, legacy ? &ignored : notes);
    if (legacy && *legacy != out.scaling) {
      throw FormatError(where, std::nullopt, "rope_scaling", "disagrees with " + name);
    }
    return out;
  }
  if (top_theta) {
    out.theta = *top_theta;
  } else if (notes) {
    notes->push_back("rope_theta is absent: 10000, the transformers default");
  }
  if (legacy) out.scaling = *legacy;
  return out;
}


std::string get_dtype_name(const json& j, const std::string& fallback) {
  auto v = field(j, "torch_dtype");
  if (!v) v = field(j, "dtype");  // newer transformers
  if (!v || !v->is_string()) return fallback;
  return v->get<std::string>();
}

}  // namespace

BaseConfig parse_base_config(const std::string& json_text, const std::string& where) {
  json j = parse_json(json_text, where);
  if (!j.contains("hidden_size") && j.contains("text_config") && j["text_config"].is_object())
    j = j["text_config"];
  BaseConfig c;
  auto noted = [&](const char* key, const std::string& value) {
    if (!field(j, key)) c.defaults_applied.push_back(std::string(key) + " is absent: " + value);
  };
  c.hidden_size = get_int(j, "hidden_size", where);
  c.intermediate_size = get_int(j, "intermediate_size", where);
  c.num_attention_heads = get_int(j, "num_attention_heads", where);
  c.num_key_value_heads = get_int(j, "num_key_value_heads", where, c.num_attention_heads);
  if (c.num_attention_heads <= 0)
    throw FormatError(where, std::nullopt, "num_attention_heads", "must be positive");
  noted("num_key_value_heads", std::to_string(c.num_key_value_heads) + " (no grouped-query attention), the transformers default");
  c.head_dim = get_int(j, "head_dim", where, c.hidden_size / c.num_attention_heads);
  noted("head_dim", std::to_string(c.head_dim) + " = hidden_size / num_attention_heads, the transformers default");
  c.num_hidden_layers = get_int(j, "num_hidden_layers", where);
  c.vocab_size = get_int(j, "vocab_size", where);
  c.max_position_embeddings = get_int(j, "max_position_embeddings", where, 2048);
  noted("max_position_embeddings", "2048, the transformers LlamaConfig default");
  c.rms_norm_eps = get_double(j, "rms_norm_eps", where, 1e-6);
  noted("rms_norm_eps", "1e-6, the transformers LlamaConfig default");
  const Rope rope = read_rope(j, c.max_position_embeddings, where, &c.defaults_applied);
  c.rope_theta = rope.theta;
  c.rope_scaling = rope.scaling;
  c.tie_word_embeddings = get_bool(j, "tie_word_embeddings", where, false);
  c.torch_dtype = get_dtype_name(j, "bfloat16");
  if (!field(j, "torch_dtype") && !field(j, "dtype")) {
    c.defaults_applied.push_back("torch_dtype is absent: the draft is exported as bfloat16");
  } else if (c.torch_dtype != "bfloat16" && c.torch_dtype != "float16" && c.torch_dtype != "float32") {
    c.defaults_applied.push_back("torch_dtype '" + c.torch_dtype + "' names no float type: the draft is exported as bfloat16");
    c.torch_dtype = "bfloat16";
  }
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
  d.num_hidden_layers = options.num_hidden_layers;
  d.max_position_embeddings = base.max_position_embeddings;
  d.aux_layer_ids = options.aux_layer_ids;
  if (d.aux_layer_ids.empty() && d.num_aux_layers == 3 && base.num_hidden_layers >= 6)
    d.aux_layer_ids = default_aux_layer_ids(base.num_hidden_layers);
  d.modelopt_norm = options.modelopt_norm;
  d.architecture = options.architecture;
  d.fc_norm = options.fc_norm;
  d.norm_before_fc = options.norm_before_fc;
  d.norm_output = options.norm_output;
  d.norm_before_residual = options.norm_before_residual;
  d.block_size = options.block_size;
  d.mask_token_id = options.mask_token_id;
  d.torch_dtype = options.torch_dtype.empty() ? base.torch_dtype : options.torch_dtype;
  d.check();
  return d;
}

DraftConfig parse_draft_config(const std::string& json_text, const std::string& where) {
  const json j = parse_json(json_text, where);
  DraftConfig d;
  d.architecture = std::string(architecture_of_config(j, where).name());
  d.hidden_size = get_int(j, "hidden_size", where);
  d.intermediate_size = get_int(j, "intermediate_size", where);
  d.num_attention_heads = get_int(j, "num_attention_heads", where);
  d.num_key_value_heads = get_int(j, "num_key_value_heads", where, d.num_attention_heads);
  if (d.num_attention_heads <= 0)
    throw FormatError(where, std::nullopt, "num_attention_heads", "must be positive");
  d.head_dim = get_int(j, "head_dim", where, d.hidden_size / d.num_attention_heads);
  // Every EAGLE-3 draft config names its layer count; absent, the weights decide (load_draft
  // refuses layers beyond the first when this says one).
  d.num_hidden_layers = get_int(j, "num_hidden_layers", where, 1);
  d.rms_norm_eps = get_double(j, "rms_norm_eps", where, 1e-6);
  d.vocab_size = get_int(j, "vocab_size", where);
  d.draft_vocab_size = get_int(j, "draft_vocab_size", where, d.vocab_size);
  d.target_hidden_size = get_int(j, "target_hidden_size", where, d.hidden_size);
  d.max_position_embeddings = get_int(j, "max_position_embeddings", where, 2048);
  const Rope rope = read_rope(j, d.max_position_embeddings, where, nullptr);
  d.rope_theta = rope.theta;
  d.rope_scaling = rope.scaling;
  if (const auto ids = field(j, "eagle_aux_hidden_state_layer_ids")) {
    d.aux_layer_ids = get_int_list(*ids, "eagle_aux_hidden_state_layer_ids", where);
  } else if (const auto ec = field(j, "eagle_config"); ec && ec->is_object()) {
    if (const auto nested = field(*ec, "eagle_aux_hidden_state_layer_ids")) {
      d.aux_layer_ids = get_int_list(*nested, "eagle_config.eagle_aux_hidden_state_layer_ids", where);
      for (auto& id : d.aux_layer_ids) {
        // SGLang's ids count layers from 0; one at INT64_MAX has no HF index (found by fuzz_config).
        if (id < 0 || id == std::numeric_limits<std::int64_t>::max()) {
          throw FormatError(where, std::nullopt, "eagle_config.eagle_aux_hidden_state_layer_ids",
                            "expected layer indices from 0, got " + std::to_string(id));
        }
        id += 1;
      }
    }
  }
  // DFlash (vLLM's DFlashDraftModel, ModelOpt's export): block_size at the top,
  // dflash_config.mask_token_id and target_layer_ids (base layer indices: HF hidden_states
  // index minus one).
  d.block_size = get_int(j, "block_size", where, 0);
  if (const auto dc = field(j, "dflash_config"); dc && dc->is_object()) {
    d.mask_token_id = get_int(*dc, "mask_token_id", where, -1);
    if (const auto ids = field(*dc, "target_layer_ids")) {
      d.aux_layer_ids = get_int_list(*ids, "dflash_config.target_layer_ids", where);
      for (auto& id : d.aux_layer_ids) {
        if (id < 0 || id == std::numeric_limits<std::int64_t>::max())
          throw FormatError(where, std::nullopt, "dflash_config.target_layer_ids",
                            "expected layer indices from 0, got " + std::to_string(id));
        id += 1;
      }
    }
  }
  // k: ours, else the engines' num_aux_hidden_states, else the number of aux ids, else 3.
  const std::int64_t k_default =
      get_int(j, "num_aux_hidden_states", where,
              d.aux_layer_ids.empty() ? 3 : static_cast<std::int64_t>(d.aux_layer_ids.size()));
  d.num_aux_layers = get_int(j, "eaglekit_num_aux_layers", where, k_default);
  d.modelopt_norm = get_bool(j, "eaglekit_modelopt_norm", where, false);
  // The norms as vLLM 0.32 reads them (trainer/model/draft_config.h); norm_before_fc from
  // eagle_config first, as vLLM does.
  d.fc_norm = get_bool(j, "fc_norm", where, false);
  d.norm_output = get_bool(j, "norm_output", where, false);
  d.norm_before_residual = get_bool(j, "norm_before_residual", where, false);
  d.norm_before_fc = get_bool(j, "norm_before_fc", where, false);
  if (const auto ec = field(j, "eagle_config"); ec && ec->is_object() && field(*ec, "norm_before_fc"))
    d.norm_before_fc = get_bool(*ec, "norm_before_fc", where, false);
  // Our checkpoints store float32 weights for a draft served in the base's dtype.
  if (const auto serving = field(j, "eaglekit_serving_dtype"); serving && serving->is_string())
    d.torch_dtype = serving->get<std::string>();
  else
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

std::string draft_config_json(const DraftConfig& c, const std::string& weights_dtype) {
  return draft_architecture(c.architecture).served_config(c, weights_dtype).dump(2) + "\n";
}

}  // namespace eaglekit::trainer
