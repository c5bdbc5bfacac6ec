// Architecture of the base model (read from a Hugging Face config.json) and of the EAGLE-3
// draft (docs/draft.md, docs/export.md): what the draft is built from and what `export` writes
// back. Plain values; no LibTorch here.
//
// Errors: a missing or mistyped field throws FormatError naming the file and the field; a
// RoPE variant we do not implement throws UnsupportedError; inconsistent sizes throw
// UsageError from DraftConfig::check().
//
// RoPE is read from `rope_theta` + `rope_scaling` (transformers v4) or `rope_parameters`
// (transformers v5, where rope_theta lives inside; per-layer-type forms use
// "full_attention"), see docs/rope.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/model/draft_config.h"
#include "trainer/model/rope.h"

namespace eaglekit::trainer {

// The fields of a base model's config.json that the draft depends on. Multimodal configs
// that nest the language model under "text_config" are read from there.
struct BaseConfig {
  std::int64_t hidden_size = 0;
  std::int64_t intermediate_size = 0;
  std::int64_t num_attention_heads = 0;
  std::int64_t num_key_value_heads = 0;  // defaults to num_attention_heads
  std::int64_t head_dim = 0;             // defaults to hidden_size / num_attention_heads
  std::int64_t num_hidden_layers = 0;
  std::int64_t vocab_size = 0;
  std::int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;  // the HF default when the field is absent
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  std::string torch_dtype = "bfloat16";
  // Fields of meaning that the file left out and the value taken for each, as sentences
  // ("rope_theta is absent: 10000, the transformers default"): shown to the user.
  std::vector<std::string> defaults_applied;
};

// `where` names the source in error messages (a path).
BaseConfig parse_base_config(const std::string& json_text, const std::string& where);
// `path` is a config.json or a folder holding one. Throws IoError when unreadable.
BaseConfig load_base_config(const std::string& path);

struct DraftOptions {
  std::int64_t draft_vocab_size = 0;  // 0: the base vocabulary size
  std::int64_t num_aux_layers = 3;
  std::int64_t num_hidden_layers = 1;  // the draft's decoder layers
  // Empty: default_aux_layer_ids(base.num_hidden_layers) when num_aux_layers == 3.
  std::vector<std::int64_t> aux_layer_ids;
  bool modelopt_norm = false;
  // The architecture row and its norms (trainer/model/draft_config.h); draft_config_from_base
  // copies them and check() refuses a combination the row does not compute.
  std::string architecture = "eagle3";
  bool fc_norm = false, norm_before_fc = false, norm_output = false, norm_before_residual = false;
  // DFlash's (architecture "dflash"): DraftConfig::block_size and mask_token_id.
  std::int64_t block_size = 0;
  std::int64_t mask_token_id = -1;
  std::string torch_dtype;  // empty: the base's
};

// EAGLE-3's default aux layers as HF hidden_states indices: {2, N/2, N-3}
// (Llama-3.1-8B, N = 32: {2, 16, 29}; SGLang's form {1, 15, 28}).
std::vector<std::int64_t> default_aux_layer_ids(std::int64_t num_hidden_layers);

// The draft a base implies (docs/draft.md defaults: the base's heads, head_dim,
// intermediate size, eps and RoPE). Validated with check().
DraftConfig draft_config_from_base(const BaseConfig& base, const DraftOptions& options);

// An exported draft's config.json (ours or a published one). The architecture is the row
// that claims it (architecture_of_config: UnsupportedError for a variant none computes). Aux
// layer ids are read from the top-level `eagle_aux_hidden_state_layer_ids`, else from
// `eagle_config.eagle_aux_hidden_state_layer_ids` plus one.
DraftConfig parse_draft_config(const std::string& json_text, const std::string& where);
DraftConfig load_draft_config(const std::string& path);  // config.json or its folder

// The config.json that `export` writes (docs/export.md), pretty-printed: the served config
// of config.architecture (trainer/model/architecture.h). EAGLE-3's: aux layer ids
// are written both ways, num_aux_hidden_states (the fc's k, read by newer vLLM and SGLang)
// and norm_before_residual: false (vLLM's other first-layer form) too; throws UsageError
// when the ids are unknown. `weights_dtype`: the dtype of the weights beside it, written as
// torch_dtype ("" = the serving dtype config.torch_dtype, also written as
// eaglekit_serving_dtype).
std::string draft_config_json(const DraftConfig& config, const std::string& weights_dtype = "");

}  // namespace eaglekit::trainer
