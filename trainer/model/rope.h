// Rotary position embedding variants as Hugging Face transformers defines them and vLLM and
// SGLang serve them (docs/rope.md): the inverse frequencies of each rotary pair and the
// attention factor that scales cos and sin. Plain values, no LibTorch: the draft model turns
// them into tables (trainer/model/rotary.h), the config reads and writes their JSON
// (trainer/model/config.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace eaglekit::trainer {

enum class RopeType { kDefault, kLinear, kDynamic, kLlama3, kYarn, kLongrope };

// "default", "linear", "dynamic", "llama3", "yarn", "longrope"; nullopt for anything else.
std::optional<RopeType> parse_rope_type(const std::string& name);
const char* rope_type_name(RopeType type);

// The scaling of a config's `rope_scaling` (or transformers v5 `rope_parameters`). Each
// field is used only by the types named beside it; optional ones keep "absent" distinct
// from any value, since the formulas treat absence specially and the export writes back
// only what was given.
struct RopeScaling {
  RopeType type = RopeType::kDefault;
  double factor = 1.0;  // linear, dynamic, llama3, yarn
  // llama3, yarn, longrope: the pretraining context the scaling extends.
  std::int64_t original_max_position_embeddings = 0;
  double low_freq_factor = 1.0;   // llama3
  double high_freq_factor = 4.0;  // llama3
  double beta_fast = 32.0;        // yarn
  double beta_slow = 1.0;         // yarn
  bool truncate = true;           // yarn: round the correction range to whole dimensions
  std::optional<double> attention_factor;  // yarn, longrope: overrides the derived one
  std::optional<double> mscale;            // yarn (DeepSeek form)
  std::optional<double> mscale_all_dim;    // yarn (DeepSeek form)
  std::vector<double> short_factor;        // longrope, head_dim / 2 each
  std::vector<double> long_factor;         // longrope
  std::optional<double> short_mscale;      // longrope (vLLM)
  std::optional<double> long_mscale;       // longrope (vLLM)

  bool operator==(const RopeScaling& o) const;
  bool operator!=(const RopeScaling& o) const { return !(*this == o); }
};

struct RopeFrequencies {
  std::vector<double> inv_freq;  // head_dim / 2 inverse frequencies, pair i rotates by pos * inv_freq[i]
  double attention_factor = 1.0; // multiplies cos and sin (so q.k by its square)
  bool long_factors = false;     // longrope: long_factor was used
};

// The frequencies a draft with this RoPE uses at positions up to max_position_embeddings
// (the target's). Throws UsageError when a needed field is missing or out of range.
RopeFrequencies rope_frequencies(double theta, const RopeScaling& scaling, std::int64_t head_dim,
                                 std::int64_t max_position_embeddings);

// `rope_scaling` as config.json writes it (null for the default RoPE), the keys each variant
// reads in transformers.
nlohmann::ordered_json rope_scaling_json(const RopeScaling& scaling);

}  // namespace eaglekit::trainer
