// The draft's configuration as plain values (docs/draft.md, docs/export.md): the decoder
// layers' sizes, the vocabularies, the aux layers of the dump and the architecture that
// computes it (trainer/model/architecture.h). Read and written by trainer/model/config.h;
// no LibTorch here.
//
// Errors: check() throws UsageError naming the first inconsistency.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/model/rope.h"

namespace eaglekit::trainer {

// The draft's sizes (docs/draft.md). For EAGLE-3: a first Llama decoder layer over
// cat(emb, h) with 2H-wide q/k/v, then num_hidden_layers - 1 plain decoder layers on H.
struct DraftConfig {
  // The row of trainer/model/architecture.h that computes it: "eagle3" for a fresh draft;
  // read from config.json by the row that claims it.
  std::string architecture = "eagle3";
  std::int64_t hidden_size = 0;  // H, equal to the base's (the draft shares its embeddings)
  std::int64_t intermediate_size = 0;
  std::int64_t num_attention_heads = 0;
  std::int64_t num_key_value_heads = 0;
  std::int64_t head_dim = 0;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  std::int64_t vocab_size = 0;        // V, the target's
  std::int64_t draft_vocab_size = 0;  // Vd <= V
  std::int64_t target_hidden_size = 0;  // width of one aux layer in the dump
  std::int64_t num_aux_layers = 3;      // k: fc maps k*target_hidden_size -> hidden_size
  std::int64_t max_position_embeddings = 2048;
  std::int64_t num_hidden_layers = 1;  // N, the draft's decoder layers (config.json's key)
  // Hugging Face hidden_states indices of the dumped aux layers (vLLM's convention, low to
  // high); SGLang's "output of layer k" ids are these minus one. Empty when unknown.
  std::vector<std::int64_t> aux_layer_ids;
  // ModelOpt's form: input_layernorm is also applied to h before hidden_norm.
  bool modelopt_norm = false;
  // The norms vLLM (0.32) and speculators (0.9) name by these config keys (docs/draft.md,
  // EAGLE 3.1). Any of the first three makes the draft EAGLE 3.1's (the "eagle3.1" row):
  // - fc_norm: one learned RMSNorm per aux layer's slice of the fc input (fc_norm.{i}.weight,
  //   [target_hidden_size] each), the EAGLE 3.1 paper's;
  // - norm_before_fc: one learned RMSNorm over the whole fc input (input_norm.weight,
  //   [k * target_hidden_size]); speculators' form, exclusive with fc_norm there;
  // - norm_output: the next TTT step (the engine's next draft token) takes the final norm's
  //   output instead of the last layer's residual stream.
  // norm_before_residual (EAGLE-3's too): the first layer's residual is hidden_norm(h), not h.
  bool fc_norm = false;
  bool norm_before_fc = false;
  bool norm_output = false;
  bool norm_before_residual = false;
  // Block-parallel drafters (architecture "dflash", docs/dflash.md): the tokens one draft
  // forward covers (the anchor, then block_size - 1 predictions), and the token id fed at
  // the block's unknown positions, whose base embedding the draft reads. 0 and -1 for the
  // TTT drafters (EAGLE-3, EAGLE 3.1).
  std::int64_t block_size = 0;
  std::int64_t mask_token_id = -1;
  // The dtype the draft is served in: the base's torch_dtype (bf16 when it names none).
  // Kept apart from the dtype of stored weights (float32 in checkpoints): config.json
  // carries it as eaglekit_serving_dtype beside torch_dtype.
  std::string torch_dtype = "bfloat16";

  std::int64_t aux_width() const { return num_aux_layers * target_hidden_size; }
  // Throws UsageError naming the first inconsistency (heads * head_dim, GQA divisibility,
  // Vd > V, aux ids count != k, ...).
  void check() const;
};

}  // namespace eaglekit::trainer
