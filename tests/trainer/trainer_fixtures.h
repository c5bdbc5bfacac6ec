// Small deterministic models and batches shared by the trainer tests: a tiny draft config,
// a random base (written as a Hugging Face folder when needed) and TTT batches.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/model/base_model.h"
#include "trainer/model/config.h"
#include "trainer/unroll/ttt.h"

namespace eaglekit::trainer::fixtures {

// V=40, Vd=24, H=32, 4 heads / 2 kv heads of dim 8, I=48, k=3 aux layers, llama3 RoPE
// with a short original context so that all three frequency bands occur.
DraftConfig tiny_config();
// The base config a tiny_config draft comes from.
BaseConfig tiny_base_config(const DraftConfig& c, std::int64_t num_hidden_layers = 8);

// Random embed_tokens / lm_head (N(0, 1)), untied unless `tied`.
BaseModel random_base(const DraftConfig& c, std::uint64_t seed, bool tied = false);
// DIR/config.json + DIR/model.safetensors ("model.embed_tokens.weight", "lm_head.weight"
// unless tied), like a Hugging Face checkpoint folder.
void write_base_folder(const std::string& dir, const BaseModel& base, std::int64_t num_hidden_layers = 8);

// d2t selecting Vd distinct target ids (deterministic, not the identity).
at::Tensor spread_d2t(const DraftConfig& c);

// Random fp32 batch: B rows of length L; row r has lengths[r] real tokens (then padding,
// as the collator writes it: zeros everywhere, masks 0), loss_mask 0 on the first two
// tokens of every row.
TttBatch random_batch(const DraftConfig& c, std::int64_t rows, std::int64_t length,
                      const std::vector<std::int64_t>& lengths, std::uint64_t seed);

// Packs row 0 of `b` as two documents, positions [0, split) and [split, L), with position
// ids restarting at split; every other row stays one document (document id 0).
void pack_first_row(TttBatch& b, std::int64_t split);

// A learnable batch: tokens follow next = (cur + 7) mod V from a seed-dependent start per
// row; hidden_states[t] makes the base predict (sharply) the draft-vocabulary token
// draft_to_target[ids[t + 1] mod Vd], a function of token t + 1; the first aux layer is
// the embedding of token t, the rest small noise.
TttBatch pattern_batch(const DraftConfig& c, const BaseModel& base, const at::Tensor& draft_to_target,
                       std::int64_t rows, std::int64_t length, std::uint64_t seed);

// Writes tensors as safetensors (our writer), e.g. a batch for the Python reference.
void write_tensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors);
std::vector<std::pair<std::string, at::Tensor>> batch_tensors(const TttBatch& b);

}  // namespace eaglekit::trainer::fixtures
