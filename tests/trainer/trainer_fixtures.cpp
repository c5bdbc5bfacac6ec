#include "tests/trainer/trainer_fixtures.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "formats/safetensors_format.h"
#include "lib/collate.h"
#include "tests/support.h"

namespace eaglekit::trainer::fixtures {

DraftConfig tiny_config() {
  DraftConfig c;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.rope_scaling.type = RopeType::kLlama3;
  c.rope_scaling.factor = 4.0;
  c.rope_scaling.low_freq_factor = 1.0;
  c.rope_scaling.high_freq_factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 64;
  c.vocab_size = 40;
  c.draft_vocab_size = 24;
  c.target_hidden_size = 32;
  c.num_aux_layers = 3;
  c.max_position_embeddings = 256;
  c.aux_layer_ids = {2, 4, 5};
  c.torch_dtype = "float32";
  c.check();
  return c;
}

BaseConfig tiny_base_config(const DraftConfig& c, std::int64_t num_hidden_layers) {
  BaseConfig b;
  b.hidden_size = c.hidden_size;
  b.intermediate_size = c.intermediate_size;
  b.num_attention_heads = c.num_attention_heads;
  b.num_key_value_heads = c.num_key_value_heads;
  b.head_dim = c.head_dim;
  b.num_hidden_layers = num_hidden_layers;
  b.vocab_size = c.vocab_size;
  b.max_position_embeddings = c.max_position_embeddings;
  b.rms_norm_eps = c.rms_norm_eps;
  b.rope_theta = c.rope_theta;
  b.rope_scaling = c.rope_scaling;
  b.torch_dtype = "float32";
  return b;
}

BaseModel random_base(const DraftConfig& c, std::uint64_t seed, bool tied) {
  auto gen = at::detail::createCPUGenerator(seed);
  BaseModel b;
  b.config = tiny_base_config(c);
  b.embed_tokens = at::empty({c.vocab_size, c.hidden_size}, at::kFloat).normal_(0.0, 1.0, gen);
  b.lm_head = tied ? b.embed_tokens : at::empty({c.vocab_size, c.hidden_size}, at::kFloat).normal_(0.0, 1.0, gen);
  b.tied = tied;
  b.config.tie_word_embeddings = tied;
  return b;
}

void write_base_folder(const std::string& dir, const BaseModel& base, std::int64_t num_hidden_layers) {
  const BaseConfig& c = base.config;
  nlohmann::json j = {{"architectures", {"LlamaForCausalLM"}},
                      {"model_type", "llama"},
                      {"hidden_size", c.hidden_size},
                      {"intermediate_size", c.intermediate_size},
                      {"num_attention_heads", c.num_attention_heads},
                      {"num_key_value_heads", c.num_key_value_heads},
                      {"head_dim", c.head_dim},
                      {"num_hidden_layers", num_hidden_layers},
                      {"vocab_size", c.vocab_size},
                      {"max_position_embeddings", c.max_position_embeddings},
                      {"rms_norm_eps", c.rms_norm_eps},
                      {"rope_theta", c.rope_theta},
                      {"tie_word_embeddings", base.tied},
                      {"torch_dtype", "float32"}};
  if (c.rope_scaling.type == RopeType::kLlama3) {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", c.rope_scaling.factor},
                         {"low_freq_factor", c.rope_scaling.low_freq_factor},
                         {"high_freq_factor", c.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  }
  std::filesystem::create_directories(dir);
  test::write_text(dir + "/config.json", j.dump(2));
  std::vector<std::pair<std::string, at::Tensor>> tensors = {{"model.embed_tokens.weight", base.embed_tokens}};
  if (!base.tied) tensors.emplace_back("lm_head.weight", base.lm_head);
  // A decoy the loader must not need to read.
  tensors.emplace_back("model.norm.weight", at::ones({c.hidden_size}));
  write_tensors(dir + "/model.safetensors", tensors);
}

at::Tensor spread_d2t(const DraftConfig& c) {
  // Draft id i -> target id (7 i + 3) mod V is a bijection onto Vd targets when gcd(7, V) = 1;
  // sorted so draft ids keep the target order, like a real map.
  std::vector<std::int64_t> targets;
  for (std::int64_t i = 0; i < c.draft_vocab_size; ++i) targets.push_back((7 * i + 3) % c.vocab_size);
  std::sort(targets.begin(), targets.end());
  at::Tensor d2t = at::empty({c.draft_vocab_size}, at::kLong);
  for (std::int64_t i = 0; i < c.draft_vocab_size; ++i) d2t[i] = targets[static_cast<std::size_t>(i)] - i;
  return d2t;
}

void pack_first_row(TttBatch& b, std::int64_t split) {
  const std::int64_t rows = b.input_ids.size(0), length = b.input_ids.size(1);
  b.document_ids = at::zeros({rows, length}, at::kLong);
  b.document_ids[0].narrow(0, split, length - split).fill_(1);
  b.position_ids = at::arange(length, at::kLong).repeat({rows, 1});
  b.position_ids[0].narrow(0, split, length - split).copy_(at::arange(length - split, at::kLong));
}

TttBatch random_batch(const DraftConfig& c, std::int64_t rows, std::int64_t length,
                      const std::vector<std::int64_t>& lengths, std::uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  TttBatch b;
  b.input_ids = at::randint(c.vocab_size, {rows, length}, gen, at::kLong);
  b.hidden_states = at::empty({rows, length, c.hidden_size}, at::kFloat).normal_(0.0, 1.0, gen);
  b.aux_hidden_states = at::empty({rows, length, c.aux_width()}, at::kFloat).normal_(0.0, 1.0, gen);
  b.attention_mask = at::zeros({rows, length}, at::kLong);
  b.loss_mask = at::zeros({rows, length}, at::kLong);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t n = lengths.at(static_cast<std::size_t>(r));
    b.attention_mask[r].narrow(0, 0, n).fill_(1);
    b.loss_mask[r].narrow(0, 2, n - 2).fill_(1);
    b.input_ids[r].narrow(0, n, length - n).zero_();
    b.hidden_states[r].narrow(0, n, length - n).zero_();
    b.aux_hidden_states[r].narrow(0, n, length - n).zero_();
  }
  return b;
}

TttBatch pattern_batch(const DraftConfig& c, const BaseModel& base, const at::Tensor& draft_to_target,
                       std::int64_t rows, std::int64_t length, std::uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  TttBatch b;
  b.input_ids = at::empty({rows, length + 1}, at::kLong);
  for (std::int64_t r = 0; r < rows; ++r) {
    std::int64_t tok = static_cast<std::int64_t>(seed * 13 + 5 * r) % c.vocab_size;
    for (std::int64_t t = 0; t <= length; ++t) {
      b.input_ids[r][t] = tok;
      tok = (tok + 7) % c.vocab_size;  // one cycle through the whole vocabulary
    }
  }
  // The base's next-token prediction at t is a draft-vocabulary token chosen by token t + 1,
  // made sharp by scaling its lm_head row.
  const at::Tensor predicted = draft_to_target.index_select(
      0, at::remainder(b.input_ids.narrow(1, 1, length), c.draft_vocab_size).reshape({-1}));
  b.input_ids = b.input_ids.narrow(1, 0, length).contiguous();
  b.hidden_states = (6.0 / std::sqrt(static_cast<double>(c.hidden_size))) *
                    base.lm_head.index_select(0, predicted).view({rows, length, c.hidden_size});
  // The first aux layer sees the current token, the others are mostly noise.
  const at::Tensor noise = at::empty({rows, length, c.aux_width() - c.hidden_size}, at::kFloat).normal_(0.0, 0.1, gen);
  b.aux_hidden_states = at::cat({at::embedding(base.embed_tokens, b.input_ids), noise}, 2);
  b.attention_mask = at::ones({rows, length}, at::kLong);
  b.loss_mask = at::ones({rows, length}, at::kLong);
  return b;
}

void write_tensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::vector<NamedTensor> named;
  for (const auto& [name, t] : tensors) named.push_back({name, to_host_tensor(t.detach().cpu().contiguous())});
  write_safetensors(path, named);
}

std::vector<std::pair<std::string, at::Tensor>> batch_tensors(const TttBatch& b) {
  return {{"input_ids", b.input_ids},
          {"attention_mask", b.attention_mask},
          {"loss_mask", b.loss_mask},
          {"hidden_states", b.hidden_states},
          {"aux_hidden_states", b.aux_hidden_states}};
}

}  // namespace eaglekit::trainer::fixtures
