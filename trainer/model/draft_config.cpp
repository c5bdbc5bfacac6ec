#include "trainer/model/draft_config.h"

#include <string>
#include <utility>

#include "formats/error.h"

namespace eaglekit::trainer {

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
      {"max_position_embeddings", max_position_embeddings},
      {"num_hidden_layers", num_hidden_layers}};
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
  try {
    rope_frequencies(rope_theta, rope_scaling, head_dim, max_position_embeddings);
  } catch (const UsageError& e) {
    fail(e.what());
  }
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
  if (fc_norm && norm_before_fc)
    fail("fc_norm and norm_before_fc are exclusive (a norm per aux layer or one over all of them; speculators "
         "refuses both)");
  const bool v31 = fc_norm || norm_before_fc || norm_output;
  if (architecture == "eagle3" && v31)
    fail("fc_norm, norm_before_fc and norm_output are EAGLE 3.1's (architecture eagle3.1), not EAGLE-3's");
  if (architecture == "eagle3.1" && !v31)
    fail("EAGLE 3.1 (architecture eagle3.1) needs fc_norm, norm_before_fc or norm_output");
  const bool block = architecture == "dflash";
  if (block != (block_size != 0))
    fail(block ? "a DFlash draft needs block_size (2 or more)" : "block_size is DFlash's (architecture dflash)");
  if (block) {
    if (block_size < 2) fail("block_size must be at least 2 (the anchor and one prediction), got " + std::to_string(block_size));
    if (mask_token_id < 0 || mask_token_id >= vocab_size)
      fail("mask_token_id " + std::to_string(mask_token_id) + " is not a token of the vocabulary [0, " +
           std::to_string(vocab_size) + ")");
    if (draft_vocab_size != vocab_size)
      fail("a DFlash draft predicts over the base's whole vocabulary (its lm_head is the base's): draft_vocab_size " +
           std::to_string(draft_vocab_size) + " != vocab_size " + std::to_string(vocab_size));
    if (modelopt_norm || fc_norm || norm_before_fc || norm_output || norm_before_residual)
      fail("the EAGLE norms (ModelOpt's form, fc_norm, norm_before_fc, norm_output, norm_before_residual) are not DFlash's");
  } else if (mask_token_id != -1) {
    fail("mask_token_id is DFlash's (architecture dflash)");
  }
  if (modelopt_norm && (fc_norm || norm_before_fc || norm_output || norm_before_residual))
    fail("ModelOpt's norm form does not combine with fc_norm, norm_before_fc, norm_output or norm_before_residual");
}

}  // namespace eaglekit::trainer
