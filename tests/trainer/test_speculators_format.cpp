// trainer/speculators_format: the speculators config written for a draft, read back as vLLM
// translates it (the same draft config), and the variants that must be refused.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "formats/error.h"
#include "trainer/io/speculators_format.h"
#include "trainer/model/architecture_rows.h"
#include "trainer/model/config.h"

using namespace eaglekit;
using namespace eaglekit::trainer;
using nlohmann::json;

namespace {

DraftConfig sample() {
  DraftConfig c;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.vocab_size = 100;
  c.draft_vocab_size = 40;
  c.target_hidden_size = 64;
  c.num_aux_layers = 4;
  c.aux_layer_ids = {2, 5, 9, 13};
  c.max_position_embeddings = 512;
  c.rope_theta = 500000.0;
  c.torch_dtype = "bfloat16";
  return c;
}

SpeculatorsInfo info() {
  SpeculatorsInfo i;
  i.speculative_tokens = 4;
  i.verifier = "meta-llama/Llama-3.1-8B-Instruct";
  i.verifier_architectures = {"LlamaForCausalLM"};
  return i;
}

}  // namespace

TEST_CASE("speculators: the config holds what vLLM reads, and reads back as the same draft") {
  const std::string text = speculators_config_json(sample(), info(), "bfloat16");
  const json j = json::parse(text);
  CHECK(j["speculators_model_type"] == "eagle3");
  CHECK(j["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4);
  CHECK(j["speculators_config"]["default_proposal_method"] == "greedy");
  CHECK(j["speculators_config"]["verifier"]["name_or_path"] == "meta-llama/Llama-3.1-8B-Instruct");
  CHECK(j["norm_before_residual"] == false);
  CHECK(j["draft_vocab_size"] == 40);
  CHECK(j["eagle_aux_hidden_state_layer_ids"] == json::array({2, 5, 9, 13}));
  const json& layer = j["transformer_layer_config"];
  CHECK(layer["num_aux_hidden_states"] == 4);  // where vLLM's translation keeps it
  CHECK(layer["hidden_size"] == 64);
  CHECK(layer["model_type"] == "llama");
  CHECK_FALSE(layer.contains("draft_vocab_size"));
  CHECK(is_speculators_config(text));
  CHECK_FALSE(is_speculators_config(draft_config_json(sample())));
  CHECK_FALSE(is_speculators_config("not json"));

  SpeculatorsInfo back;
  const DraftConfig c = parse_draft_config(speculators_to_draft_config(text, "spec/config.json", &back), "spec/config.json");
  CHECK(draft_config_json(c) == draft_config_json(sample()));
  CHECK(back.speculative_tokens == 4);
  CHECK(back.verifier == "meta-llama/Llama-3.1-8B-Instruct");
  CHECK(back.verifier_architectures == std::vector<std::string>{"LlamaForCausalLM"});
  CHECK(speculators_tensor_name("midlayer.self_attn.q_proj.weight") == "layers.0.self_attn.q_proj.weight");
  CHECK(speculators_tensor_name("fc.weight") == "fc.weight");
}

TEST_CASE("speculators: refused variants and missing keys") {
  const json good = json::parse(speculators_config_json(sample(), info(), "bfloat16"));
  auto refused = [](json j, const std::string& detail) {
    try {
      parse_draft_config(speculators_to_draft_config(j.dump(), "c.json"), "c.json");
      FAIL("accepted: " << detail);
    } catch (const FormatError& e) {
      CHECK_MESSAGE(std::string(e.what()).find(detail) != std::string::npos, e.what());
    }
  };
  // The norms vLLM reads are read as vLLM reads them: an absent norm_before_residual is true
  // (EAGLE-3's other first-layer form), norm_output and fc_norm make it EAGLE 3.1's.
  auto read = [](const json& j) { return parse_draft_config(speculators_to_draft_config(j.dump(), "c.json"), "c.json"); };
  json j = good;
  j.erase("norm_before_residual");
  CHECK(read(j).norm_before_residual);
  CHECK(read(j).architecture == "eagle3");
  j = good;
  j["norm_output"] = true;
  CHECK(read(j).architecture == "eagle3.1");
  CHECK(read(j).norm_output);
  j["fc_norm"] = true;
  CHECK(read(j).fc_norm);
  j["norm_before_fc"] = true;  // speculators refuses both; so does check()
  refused(j, "exclusive");
  j = good;
  j["fc_norm"] = "true";
  refused(j, "fc_norm");
  j = good;
  j["speculators_model_type"] = "eagle";
  refused(j, "only eagle3 and dflash drafts");
  j = good;
  j["transformer_layer_config"]["model_type"] = "qwen3";
  refused(j, "only Llama decoder layers");
  j = good;
  j.erase("draft_vocab_size");
  refused(j, "draft_vocab_size");
  // The twin: the unchanged config is accepted.
  CHECK_NOTHROW(parse_draft_config(speculators_to_draft_config(good.dump(), "c.json"), "c.json"));

  // A variant key of another type is refused as such, never read as EAGLE-3.
  CHECK_THROWS_AS(architecture_of_config(json::parse(R"({"fc_norm": "true"})"), "c.json"), FormatError);
  CHECK(architecture_of_config(json::parse(R"({"norm_output": false, "fc_norm": false})"), "c.json").name() == "eagle3");
  CHECK_THROWS_AS(speculators_config_json(sample(), SpeculatorsInfo{}, "bfloat16"), UsageError);
}
