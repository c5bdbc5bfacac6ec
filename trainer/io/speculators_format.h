// vLLM's "speculators" draft layout (docs/export.md, the speculators layout), both ways: the
// config.json that `export --format speculators` writes, and the translation of such a
// config into the flat EAGLE-3 config that parse_draft_config reads, done the way vLLM's
// speculators config code does it. Also the config keys of other trainers' drafts that name
// a variant eaglekit does not compute. LibTorch-free.
//
// Errors: FormatError (a key missing or mistyped, naming the file and the key),
// UnsupportedError (another algorithm or draft variant than the one trained here).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace eaglekit::trainer {

struct DraftConfig;

// The layout `export` writes: eaglekit's own (midlayer.*, flat config; vLLM and SGLang) or
// speculators' (layers.*, speculators_config; vLLM).
enum class ExportFormat { kEaglekit, kSpeculators };
std::string_view export_format_name(ExportFormat f);  // "eaglekit", "speculators"
std::optional<ExportFormat> parse_export_format(std::string_view name);

// What a speculators config says beyond the draft's architecture.
struct SpeculatorsInfo {
  // proposal_methods[0].speculative_tokens (DFlash: vLLM's block is this plus one)
  std::int64_t speculative_tokens = 0;
  std::string verifier;                 // verifier.name_or_path: the target vLLM serves
  std::vector<std::string> verifier_architectures;
};

// The config.json of the speculators layout for `config`, keys in a fixed order: top level
// speculators_model_type "eagle3", speculators_config (algorithm, one greedy proposal method
// with info.speculative_tokens, default_proposal_method, verifier), transformer_layer_config
// (the draft's Llama config as draft_config_json writes it, num_aux_hidden_states included),
// draft_vocab_size, target_hidden_size, the norm flags (norm_before_residual, norm_before_fc,
// fc_norm, norm_output: the draft's, always written), the aux ids as HF
// hidden_states indices, torch_dtype = `weights_dtype`, and eaglekit's own keys.
// A DFlash draft (architecture "dflash") gets speculators 0.9's DFlashSpeculatorConfig
// instead: speculators_model_type "dflash", transformer_layer_config (the Qwen3 keys of the
// ModelOpt layout), draft_vocab_size, block_size, target_hidden_size,
// aux_hidden_state_layer_ids (HF hidden_states indices), mask_token_id, sample_from_anchor
// false, sliding_window_non_causal true (vLLM 0.32 makes every layer causal when false).
// Throws UsageError as draft_config_json does, or when speculative_tokens < 1 or verifier
// is empty.
std::string speculators_config_json(const DraftConfig& config, const SpeculatorsInfo& info,
                                    const std::string& weights_dtype);

// A tensor's name in the speculators layout: eaglekit's "midlayer." is "layers.0.";
// every other name is unchanged.
std::string speculators_tensor_name(const std::string& eaglekit_name);

// True when the JSON object has `speculators_model_type` (how vLLM tells the layout).
// Does not throw on text that is not JSON (false).
bool is_speculators_config(const std::string& json_text);

// The flat config a speculators config stands for: transformer_layer_config with the
// top-level draft_vocab_size, target_hidden_size, norm_before_residual (true when absent,
// as vLLM reads it), eagle_aux_hidden_state_layer_ids and eaglekit's keys laid over it.
// `info` (optional) gets the proposal and verifier; fc_norm, norm_before_fc and norm_output
// are copied when true (the eagle3.1 row claims them). A "dflash" config becomes the flat
// DFlash config (architectures DFlashDraftModel, block_size, dflash_config with mask_token_id
// and target_layer_ids = aux ids - 1, as vLLM maps them). Throws UnsupportedError for another
// algorithm than eagle3 or dflash, a decoder layer other than Llama's (eagle3), or a DFlash
// variant eaglekit does not compute (sample_from_anchor, a reduced vocabulary, attention
// biases, sliding-window layers, an activation other than silu); FormatError for a missing or
// mistyped key.
std::string speculators_to_draft_config(const std::string& json_text, const std::string& where,
                                        SpeculatorsInfo* info = nullptr);

}  // namespace eaglekit::trainer
