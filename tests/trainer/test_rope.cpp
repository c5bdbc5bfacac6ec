// trainer/model/rope.h: every RoPE variant against an independent Python reading of the same
// config.json (tests/trainer/rope_reference.py, written from the published formulas), for
// the transformers v4 (rope_theta + rope_scaling) and v5 (rope_parameters) forms; the
// exported draft config read back by that reference gives the frequencies trained with.
// LibTorch first: glog's CHECK clashes with doctest's.
#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "formats/error.h"
#include "tests/support.h"
#include "trainer/model/config.h"
#include "trainer/model/draft_model.h"
#include "trainer/model/rope.h"

using namespace eaglekit;
using namespace eaglekit::trainer;
using test::message_of;
using nlohmann::json;

namespace {

// A small Llama-shaped base with the given RoPE keys merged in.
json base_with(const json& rope, std::int64_t max_pos = 131072, std::int64_t head_dim = 128) {
  json j = {{"hidden_size", 512},  {"intermediate_size", 1024}, {"num_attention_heads", 4},
            {"num_key_value_heads", 2}, {"head_dim", head_dim}, {"num_hidden_layers", 8},
            {"vocab_size", 1000}, {"max_position_embeddings", max_pos}, {"rms_norm_eps", 1e-5},
            {"torch_dtype", "bfloat16"}};
  j.update(rope);
  return j;
}

std::vector<double> ramp(int n, double start, double step) {
  std::vector<double> v;
  for (int i = 0; i < n; ++i) v.push_back(start + step * i);
  return v;
}

struct Case {
  const char* name;
  json config;
  RopeType type;
};

std::vector<Case> cases() {
  const json llama3 = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  const json full_yarn = {{"rope_type", "yarn"}, {"rope_theta", 1000000.0}, {"factor", 4.0},
                          {"original_max_position_embeddings", 32768}};
  return {
      {"default, rope_theta absent", base_with(json::object()), RopeType::kDefault},
      {"default", base_with({{"rope_theta", 1000000.0}, {"rope_scaling", nullptr}}), RopeType::kDefault},
      {"linear (Gemma-3 27B)", base_with({{"rope_theta", 1000000.0}, {"rope_scaling", {{"rope_type", "linear"}, {"factor", 8.0}}}}),
       RopeType::kLinear},
      {"dynamic", base_with({{"rope_theta", 10000.0}, {"rope_scaling", {{"type", "dynamic"}, {"factor", 2.0}}}}),
       RopeType::kDynamic},
      {"llama3 (Llama-3.1)", base_with({{"rope_theta", 500000.0}, {"rope_scaling", llama3}}), RopeType::kLlama3},
      {"llama3, equal frequency factors (Llama-4)",
       base_with({{"rope_theta", 500000.0},
                  {"rope_scaling", {{"rope_type", "llama3"}, {"factor", 16.0}, {"low_freq_factor", 1.0},
                                    {"high_freq_factor", 1.0}, {"original_max_position_embeddings", 8192}}}}),
       RopeType::kLlama3},
      {"yarn, truncate false (gpt-oss)",
       base_with({{"rope_theta", 150000},
                  {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 32.0}, {"beta_fast", 32.0}, {"beta_slow", 1.0},
                                    {"original_max_position_embeddings", 4096}, {"truncate", false}}}},
                 131072, 64),
       RopeType::kYarn},
      {"yarn, mscale = mscale_all_dim (DeepSeek-V3)",
       base_with({{"rope_theta", 10000},
                  {"rope_scaling", {{"type", "yarn"}, {"factor", 40}, {"beta_fast", 32}, {"beta_slow", 1},
                                    {"mscale", 1.0}, {"mscale_all_dim", 1.0},
                                    {"original_max_position_embeddings", 4096}}}},
                 163840, 64),
       RopeType::kYarn},
      {"yarn, beta_fast = beta_slow (Kimi-K2)",
       base_with({{"rope_theta", 50000.0},
                  {"rope_scaling", {{"type", "yarn"}, {"factor", 32.0}, {"beta_fast", 1.0}, {"beta_slow", 1.0},
                                    {"mscale", 1.0}, {"mscale_all_dim", 1.0},
                                    {"original_max_position_embeddings", 4096}}}},
                 131072, 112),
       RopeType::kYarn},
      {"yarn, Qwen3's long-context form (betas absent)",
       base_with({{"rope_theta", 1000000.0},
                  {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}}}}),
       RopeType::kYarn},
      {"yarn, factor absent",
       base_with({{"rope_theta", 10000.0},
                  {"rope_scaling", {{"rope_type", "yarn"}, {"original_max_position_embeddings", 8192}}}}, 65536),
       RopeType::kYarn},
      {"yarn, original context absent",
       base_with({{"rope_theta", 10000.0}, {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 2.0}}}}, 16384),
       RopeType::kYarn},
      {"yarn, attention_factor wins over mscale",
       base_with({{"rope_theta", 10000.0},
                  {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 8.0}, {"attention_factor", 1.2}, {"mscale", 0.707},
                                    {"mscale_all_dim", 1.0}, {"original_max_position_embeddings", 4096}}}}),
       RopeType::kYarn},
      {"yarn, mscale / mscale_all_dim",
       base_with({{"rope_theta", 10000.0},
                  {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 8.0}, {"mscale", 0.707}, {"mscale_all_dim", 1.0},
                                    {"original_max_position_embeddings", 4096}}}}),
       RopeType::kYarn},
      {"longrope, served beyond the original context: long factors (Phi-3 form)",
       base_with({{"rope_theta", 10000.0},
                  {"original_max_position_embeddings", 4096},
                  {"rope_scaling", {{"type", "longrope"}, {"short_factor", ramp(64, 1.0, 0.01)},
                                    {"long_factor", ramp(64, 1.0, 0.5)}}}}),
       RopeType::kLongrope},
      {"longrope, within the original context: short factors",
       base_with({{"rope_theta", 10000.0},
                  {"rope_scaling", {{"rope_type", "longrope"}, {"short_factor", ramp(64, 1.0, 0.01)},
                                    {"long_factor", ramp(64, 1.0, 0.5)}, {"original_max_position_embeddings", 4096}}}},
                 4096),
       RopeType::kLongrope},
      {"longrope, long_mscale",
       base_with({{"rope_theta", 10000.0},
                  {"rope_scaling", {{"rope_type", "longrope"}, {"short_factor", ramp(64, 1.0, 0.01)},
                                    {"long_factor", ramp(64, 2.0, 0.25)}, {"long_mscale", 1.3},
                                    {"original_max_position_embeddings", 8192}}}}),
       RopeType::kLongrope},
      {"transformers v5: rope_parameters with yarn", base_with({{"rope_parameters", full_yarn}, {"dtype", "bfloat16"}}),
       RopeType::kYarn},
      {"transformers v5: rope_parameters per layer type",
       base_with({{"rope_parameters", {{"full_attention", {{"rope_type", "linear"}, {"rope_theta", 1000000.0}, {"factor", 8.0}}},
                                       {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 10000.0}}}}}}),
       RopeType::kLinear},
      {"transformers v5: rope_parameters, default",
       base_with({{"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 500000.0}}}}), RopeType::kDefault},
  };
}

// The reference's reading of each config (one Python run for all of them).
std::vector<json> reference(const std::vector<json>& configs) {
  test::require_python("json");
  test::TempDir d("rope");
  test::write_text(d / "configs.json", json(configs).dump());
  const auto r = test::run(test::python_bin() + " " +
                           test::quote(test::source_dir() + "/tests/trainer/rope_reference.py") + " " +
                           test::quote(d / "configs.json"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  return json::parse(r.out).get<std::vector<json>>();
}

void check_same(const RopeFrequencies& got, const json& want) {
  REQUIRE_MESSAGE(!want.contains("error"), want.dump());
  REQUIRE(got.inv_freq.size() == want["inv_freq"].size());
  for (std::size_t i = 0; i < got.inv_freq.size(); ++i) {
    const double w = want["inv_freq"][i].get<double>();
    CHECK_MESSAGE(std::abs(got.inv_freq[i] - w) <= 1e-13 * w, "pair " << i << ": " << got.inv_freq[i] << " vs " << w);
  }
  CHECK(got.attention_factor == doctest::Approx(want["attention_factor"].get<double>()).epsilon(1e-14).scale(0));
}

}  // namespace

TEST_CASE("rope: every variant equals the Python reference, and so does the exported draft config") {
  const auto all = cases();
  std::vector<json> configs;
  for (const auto& c : all) configs.push_back(c.config);
  // The exported draft configs, read back by the reference.
  std::vector<DraftConfig> drafts;
  for (const auto& c : all) {
    CAPTURE(c.name);
    const BaseConfig b = parse_base_config(c.config.dump(), "base/config.json");
    drafts.push_back(draft_config_from_base(b, {}));
    configs.push_back(json::parse(draft_config_json(drafts.back())));
  }
  const std::vector<json> want = reference(configs);
  REQUIRE(want.size() == 2 * all.size());
  std::size_t distinct = 0;
  for (std::size_t i = 0; i < all.size(); ++i) {
    CAPTURE(all[i].name);
    const BaseConfig b = parse_base_config(all[i].config.dump(), "base/config.json");
    CHECK(b.rope_scaling.type == all[i].type);
    const RopeFrequencies f = rope_frequencies(b.rope_theta, b.rope_scaling, b.head_dim, b.max_position_embeddings);
    check_same(f, want[i]);
    CHECK(want[i]["type"] == rope_type_name(b.rope_scaling.type));
    // Exactly as trained: the export read by the reference gives the same frequencies...
    check_same(f, want[all.size() + i]);
    // ... and read by us, the same scaling.
    const DraftConfig back = parse_draft_config(draft_config_json(drafts[i]), "draft/config.json");
    CHECK(back.rope_theta == b.rope_theta);
    CHECK(back.rope_scaling == b.rope_scaling);
    // The variant changes something: only the default cases equal unscaled RoPE.
    const RopeFrequencies plain = rope_frequencies(b.rope_theta, RopeScaling{}, b.head_dim, b.max_position_embeddings);
    if (f.inv_freq != plain.inv_freq || f.attention_factor != 1.0) ++distinct;
  }
  // All but the two default cases, dynamic (unscaled by design) and the v5 default.
  CHECK(distinct == all.size() - 4);
}

TEST_CASE("rope: what the file left out is said, with the value taken") {
  auto notes = [](const json& rope, std::int64_t max_pos = 131072) {
    return parse_base_config(base_with(rope, max_pos).dump(), "b").defaults_applied;
  };
  auto has = [](const std::vector<std::string>& v, const std::string& s) {
    for (const auto& x : v)
      if (x == s) return true;
    INFO(nlohmann::json(v).dump());
    return false;
  };
  CHECK(has(notes(json::object()), "rope_theta is absent: 10000, the transformers default"));
  CHECK(notes({{"rope_theta", 500000.0}}).empty());
  const auto yarn = notes({{"rope_theta", 1e4}, {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 2.0}}}}, 16384);
  CHECK(has(yarn, "rope_scaling.original_max_position_embeddings is absent: 16384, the config's "
                  "max_position_embeddings (as transformers v4 takes it)"));
  CHECK(has(yarn, "rope_scaling.beta_fast is absent: 32, YaRN's default"));
  CHECK(has(yarn, "rope_scaling.beta_slow is absent: 1, YaRN's default"));
  const auto v5 = notes({{"rope_parameters", {{"full_attention", {{"rope_type", "default"}, {"rope_theta", 1e6}}}}}});
  CHECK(has(v5, "rope_parameters is given per layer type: the draft uses full_attention's"));
}

TEST_CASE("rope: unsupported and inconsistent RoPE configs fail naming the key") {
  auto parse_error = [](const json& rope) {
    return message_of<FormatError>([&] { parse_base_config(base_with(rope).dump(), "b/config.json"); });
  };
  auto usage_error = [](const json& rope) {
    return message_of<UsageError>(
        [&] { draft_config_from_base(parse_base_config(base_with(rope).dump(), "b/config.json"), {}); });
  };
  CHECK(parse_error({{"rope_scaling", {{"rope_type", "ntk"}, {"factor", 2.0}}}}) ==
        "b/config.json: rope_scaling.rope_type: 'ntk' is not implemented (default, linear, dynamic, llama3, yarn and "
        "longrope are)");
  CHECK(parse_error({{"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1e7}, {"mrope_section", {11, 11, 10}}}}}) ==
        "b/config.json: rope_parameters.mrope_section: multimodal RoPE (mrope) is not implemented for a Llama draft");
  CHECK(parse_error({{"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1e7}, {"partial_rotary_factor", 0.25}}}}) ==
        "b/config.json: rope_parameters.partial_rotary_factor: partial rotary embeddings (0.25) are not implemented "
        "for a Llama draft");
  CHECK(parse_error({{"rope_theta", 10000.0}, {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1e6}}}}) ==
        "b/config.json: rope_parameters.rope_theta: 1000000.0 disagrees with rope_theta 10000.0");
  CHECK(parse_error({{"rope_parameters", {{"rope_type", "default"}}}}) == "b/config.json: rope_parameters.rope_theta: missing");
  CHECK(parse_error({{"rope_parameters", {{"sliding_attention", {{"rope_type", "default"}}}}}}) ==
        "b/config.json: rope_parameters: expected rope_type and rope_theta, or a map of layer types with full_attention");
  CHECK(parse_error({{"rope_theta", 1e4}, {"rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}}}}) ==
        "b/config.json: rope_scaling.low_freq_factor: missing");
  CHECK(parse_error({{"rope_theta", 1e4}, {"rope_scaling", {{"rope_type", "longrope"}, {"short_factor", {1.0}},
                                                           {"long_factor", {1.0}}}}}) ==
        "b/config.json: rope_scaling.original_max_position_embeddings: missing (longrope needs it)");
  CHECK(parse_error({{"rope_theta", 1e4}, {"rope_scaling", {{"rope_type", "dynamic"}, {"alpha", 1000}}}}) ==
        "b/config.json: rope_scaling.alpha: dynamic NTK-alpha RoPE is not implemented");
  CHECK(usage_error({{"rope_theta", 1e4},
                     {"rope_scaling", {{"rope_type", "longrope"}, {"short_factor", {1.0, 2.0}}, {"long_factor", {1.0, 2.0}},
                                       {"original_max_position_embeddings", 4096}}}}) ==
        "draft config: rope_scaling: longrope needs short_factor and long_factor of head_dim / 2 = 64 values, got 2 and 2");
  CHECK(usage_error({{"rope_theta", 1e4}, {"rope_scaling", {{"rope_type", "yarn"}, {"factor", -2.0}}}}) ==
        "draft config: rope_scaling: yarn needs factor > 0");
}

TEST_CASE("rope: the rotary table carries the attention factor") {
  const BaseConfig b = parse_base_config(
      base_with({{"rope_theta", 10000.0},
                 {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 16.0}, {"original_max_position_embeddings", 4096}}}})
          .dump(),
      "b");
  const DraftConfig d = draft_config_from_base(b, {});
  const RopeFrequencies f = rope_frequencies(d.rope_theta, d.rope_scaling, d.head_dim, d.max_position_embeddings);
  CHECK(f.attention_factor == doctest::Approx(0.1 * std::log(16.0) + 1).epsilon(1e-15).scale(0));
  const RotaryTable t = rope_table(d, at::tensor(std::vector<std::int64_t>{0, 3, 70000}));
  const std::int64_t pos[] = {0, 3, 70000};
  for (int p = 0; p < 3; ++p) {
    for (int i = 0; i < 64; i += 9) {
      const double a = static_cast<double>(pos[p]) * f.inv_freq[static_cast<std::size_t>(i)];
      CHECK(t.cos[p][i].item<double>() == doctest::Approx(std::cos(a) * f.attention_factor).epsilon(1e-6).scale(1.0));
      CHECK(t.sin[p][i + 64].item<double>() == doctest::Approx(std::sin(a) * f.attention_factor).epsilon(1e-6).scale(1.0));
    }
  }
}
