#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <set>
#include <sstream>
#include <nlohmann/json.hpp>

#include "formats/error.h"
#include "tests/support.h"
#include "trainer/model/config.h"
#include "trainer/model/rope.h"

using namespace eaglekit;
using namespace eaglekit::trainer;
using test::message_of;

namespace {

// The fields of meta-llama/Llama-3.1-8B-Instruct's config.json that matter here.
const char* kLlama31 = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
  "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256,
  "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";

}  // namespace

TEST_CASE("config: Llama-3.1-8B base config") {
  const BaseConfig b = parse_base_config(kLlama31, "base/config.json");
  CHECK(b.hidden_size == 4096);
  CHECK(b.intermediate_size == 14336);
  CHECK(b.num_attention_heads == 32);
  CHECK(b.num_key_value_heads == 8);
  CHECK(b.head_dim == 128);  // implied: hidden_size / heads
  CHECK(b.num_hidden_layers == 32);
  CHECK(b.vocab_size == 128256);
  CHECK(b.max_position_embeddings == 131072);
  CHECK(b.rms_norm_eps == 1e-5);
  CHECK(b.rope_theta == 500000.0);
  CHECK(b.rope_scaling.type == RopeType::kLlama3);
  CHECK(b.rope_scaling.factor == 8.0);
  CHECK(b.rope_scaling.original_max_position_embeddings == 8192);
  CHECK(b.torch_dtype == "bfloat16");

  const DraftConfig d = draft_config_from_base(b, DraftOptions{});
  CHECK(d.hidden_size == 4096);
  CHECK(d.num_attention_heads == 32);
  CHECK(d.num_key_value_heads == 8);
  CHECK(d.head_dim == 128);
  CHECK(d.intermediate_size == 14336);
  CHECK(d.draft_vocab_size == 128256);
  CHECK(d.target_hidden_size == 4096);
  CHECK(d.aux_width() == 3 * 4096);
  CHECK(d.aux_layer_ids == std::vector<std::int64_t>{2, 16, 29});
  CHECK(d.rope_scaling == b.rope_scaling);
}

TEST_CASE("config: defaults, legacy rope 'type' key and nested text_config") {
  const BaseConfig b = parse_base_config(R"({"text_config": {"hidden_size": 64, "intermediate_size": 128,
      "num_attention_heads": 4, "num_hidden_layers": 6, "vocab_size": 100,
      "rope_scaling": {"type": "default"}}})", "x");
  CHECK(b.num_key_value_heads == 4);
  CHECK(b.head_dim == 16);
  CHECK(b.rms_norm_eps == 1e-6);
  CHECK(b.rope_theta == 10000.0);
  CHECK(b.rope_scaling.type == RopeType::kDefault);
  CHECK(b.max_position_embeddings == 2048);
  CHECK(default_aux_layer_ids(6) == std::vector<std::int64_t>{2, 3, 3});  // degenerate: not increasing
  CHECK_THROWS_AS(draft_config_from_base(b, DraftOptions{}), UsageError);
  DraftOptions o;
  o.aux_layer_ids = {1, 3, 5};
  o.draft_vocab_size = 32;
  const DraftConfig d = draft_config_from_base(b, o);
  CHECK(d.aux_layer_ids == std::vector<std::int64_t>{1, 3, 5});
  CHECK(d.draft_vocab_size == 32);
}

TEST_CASE("config: bad base configs name the file and the field") {
  CHECK(message_of<FormatError>([] { parse_base_config(R"({"hidden_size": 8})", "b/config.json"); }) ==
        "b/config.json: intermediate_size: missing");
  CHECK(message_of<FormatError>([] {
          parse_base_config(R"({"hidden_size": "8", "intermediate_size": 1})", "b/config.json");
        }) == "b/config.json: hidden_size: expected an integer, got \"8\"");
  CHECK(message_of<FormatError>([] { parse_base_config("{not json", "b/config.json"); })
            .rfind("b/config.json", 0) == 0);
  // Found by fuzz_config: a number past a double's range is nlohmann's out_of_range, not a
  // parse_error, and escaped as an unknown exception.
  const std::string overflow = test::source_dir() + "/tests/fuzz/regressions/config-number-overflow.json";
  CHECK(message_of<FormatError>([&] { load_base_config(overflow); }).rfind(overflow + ": config: not valid JSON: ", 0) == 0);
  CHECK(message_of<UnsupportedError>([] {
          parse_base_config(R"({"hidden_size": 8, "intermediate_size": 8, "num_attention_heads": 2,
              "num_hidden_layers": 8, "vocab_size": 9, "rope_scaling": {"rope_type": "ntk", "factor": 4}})",
                            "b/config.json");
        }) == "b/config.json: rope_scaling.rope_type: 'ntk' is not implemented (default, linear, dynamic, llama3, yarn "
              "and longrope are)");
  CHECK(message_of<FormatError>([] {
          parse_base_config(R"({"hidden_size": 8, "intermediate_size": 8, "num_attention_heads": 2,
              "num_hidden_layers": 8, "vocab_size": 0})", "b/config.json");
        }) == "b/config.json: vocab_size: must be positive, got 0");
  CHECK_THROWS_AS(load_base_config("/nonexistent/eaglekit/base"), IoError);
}

// Found by fuzz_config: integers past 2^53 went through a double on the way back in, so
// an exported config read back as another RoPE; an SGLang aux id of INT64_MAX overflowed.
TEST_CASE("config: context lengths past 2^53 read back exactly; out-of-range ids are refused") {
  const std::string dir = test::source_dir() + "/tests/fuzz/regressions/";
  const std::int64_t past = 9007199254740993;  // 2^53 + 1: no double holds it
  for (const char* name : {"config-yarn-context-past-2p53.json", "config-longrope-top-context-past-2p53.json"}) {
    CAPTURE(name);
    const BaseConfig b = load_base_config(dir + name);
    CHECK(b.rope_scaling.original_max_position_embeddings == past);
    const DraftConfig d = draft_config_from_base(b, {});
    const DraftConfig back = parse_draft_config(draft_config_json(d), "export");
    CHECK(back.rope_scaling.original_max_position_embeddings == past);
    CHECK(back.rope_scaling == d.rope_scaling);
  }
  CHECK(message_of<FormatError>([&] { load_draft_config(dir + "config-sglang-aux-id-int64-max.json"); }) ==
        dir + "config-sglang-aux-id-int64-max.json: eagle_config.eagle_aux_hidden_state_layer_ids: expected layer "
              "indices from 0, got 9223372036854775807");
  CHECK(message_of<FormatError>([] {
          parse_base_config(R"({"hidden_size": 18446744073709551615, "intermediate_size": 8})", "b/config.json");
        }) == "b/config.json: hidden_size: out of range, got 18446744073709551615");
  CHECK(message_of<FormatError>([] {
          parse_draft_config(R"({"hidden_size": 8, "intermediate_size": 8, "num_attention_heads": 2, "vocab_size": 9,
              "eagle_aux_hidden_state_layer_ids": [1, 18446744073709551615]})", "d/config.json");
        }) == "d/config.json: eagle_aux_hidden_state_layer_ids: expected a list of integers, got 18446744073709551615");
}

TEST_CASE("config: draft config.json writes both aux-layer conventions and reads back") {
  DraftOptions options;
  options.draft_vocab_size = 32000;
  const DraftConfig d = draft_config_from_base(parse_base_config(kLlama31, "c"), options);
  const nlohmann::json j = nlohmann::json::parse(draft_config_json(d));
  CHECK(j["architectures"] == nlohmann::json::array({"LlamaForCausalLMEagle3"}));
  CHECK(j["model_type"] == "llama");
  CHECK(j["num_hidden_layers"] == 1);
  CHECK(j["hidden_act"] == "silu");
  CHECK(j["tie_word_embeddings"] == false);
  CHECK(j["vocab_size"] == 128256);
  CHECK(j["draft_vocab_size"] == 32000);
  CHECK(j["target_hidden_size"] == 4096);
  CHECK(j["max_position_embeddings"] == 131072);
  CHECK(j["head_dim"] == 128);
  CHECK(j["rope_theta"] == 500000.0);
  CHECK(j["rope_scaling"]["rope_type"] == "llama3");
  CHECK(j["rope_scaling"]["factor"] == 8.0);
  CHECK(j["rope_scaling"]["original_max_position_embeddings"] == 8192);
  CHECK(j["eagle_aux_hidden_state_layer_ids"] == nlohmann::json::array({2, 16, 29}));
  CHECK(j["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == nlohmann::json::array({1, 15, 28}));
  CHECK(j["torch_dtype"] == "bfloat16");

  const DraftConfig back = parse_draft_config(j.dump(), "draft/config.json");
  CHECK(back.hidden_size == d.hidden_size);
  CHECK(back.intermediate_size == d.intermediate_size);
  CHECK(back.num_key_value_heads == d.num_key_value_heads);
  CHECK(back.head_dim == d.head_dim);
  CHECK(back.rms_norm_eps == d.rms_norm_eps);
  CHECK(back.rope_theta == d.rope_theta);
  CHECK(back.rope_scaling == d.rope_scaling);
  CHECK(back.vocab_size == d.vocab_size);
  CHECK(back.draft_vocab_size == d.draft_vocab_size);
  CHECK(back.aux_layer_ids == d.aux_layer_ids);
  CHECK(back.num_aux_layers == 3);
  CHECK(back.modelopt_norm == false);

  // A published draft that only has SGLang's nested ids.
  nlohmann::json nested = j;
  nested.erase("eagle_aux_hidden_state_layer_ids");
  nested.erase("eaglekit_num_aux_layers");
  CHECK(parse_draft_config(nested.dump(), "p").aux_layer_ids == std::vector<std::int64_t>{2, 16, 29});
  // A draft of another trainer with k = 4 says so only in num_aux_hidden_states.
  nlohmann::json four = j;
  four.erase("eaglekit_num_aux_layers");
  four.erase("eagle_aux_hidden_state_layer_ids");
  four.erase("eagle_config");
  four["num_aux_hidden_states"] = 4;
  CHECK(parse_draft_config(four.dump(), "p").num_aux_layers == 4);
  CHECK(j["num_aux_hidden_states"] == 3);
  CHECK(j["norm_before_residual"] == false);
  // num_hidden_layers is the draft's depth, written and read back; absent means one layer.
  nlohmann::json two_layers = j;
  two_layers["num_hidden_layers"] = 2;
  CHECK(parse_draft_config(two_layers.dump(), "p").num_hidden_layers == 2);
  CHECK(nlohmann::json::parse(draft_config_json(parse_draft_config(two_layers.dump(), "p")))["num_hidden_layers"] == 2);
  nlohmann::json no_count = j;
  no_count.erase("num_hidden_layers");
  CHECK(parse_draft_config(no_count.dump(), "p").num_hidden_layers == 1);
  two_layers["num_hidden_layers"] = 0;
  CHECK_THROWS_AS(parse_draft_config(two_layers.dump(), "p"), FormatError);

  DraftConfig unknown = d;
  unknown.aux_layer_ids.clear();
  CHECK_THROWS_AS(draft_config_json(unknown), UsageError);
}

TEST_CASE("config: draft consistency checks") {
  DraftConfig d = draft_config_from_base(parse_base_config(kLlama31, "c"), DraftOptions{});
  d.num_key_value_heads = 5;
  CHECK(message_of<UsageError>([&] { d.check(); }) ==
        "draft config: num_attention_heads (32) is not a multiple of num_key_value_heads (5)");
  d.num_key_value_heads = 8;
  d.draft_vocab_size = d.vocab_size + 1;
  CHECK(message_of<UsageError>([&] { d.check(); }) ==
        "draft config: draft_vocab_size 128257 exceeds vocab_size 128256");
  d.draft_vocab_size = 100;
  d.aux_layer_ids = {2, 16};
  CHECK(message_of<UsageError>([&] { d.check(); }) == "draft config: 2 aux layer ids for 3 aux layers");
  d.aux_layer_ids = {16, 2, 29};
  CHECK(message_of<UsageError>([&] { d.check(); }) == "draft config: aux layer ids must increase");
}

// The published config.json of real bases (tests/data/base-configs/README.md says where
// each was copied from) and the draft each implies. docs/bases.md's table of bases shows the
// same rows.
TEST_CASE("config: real base configs give the draft the engines would build, or a clear error") {
  struct Row {
    const char* file;
    std::int64_t hidden, heads, kv_heads, head_dim, intermediate, vocab;
    std::vector<std::int64_t> aux_ids;
    RopeType rope;
    double theta;
    const char* dtype;
    bool tied;
  };
  const std::vector<Row> rows = {
      {"llama-3.1-8b.json", 4096, 32, 8, 128, 14336, 128256, {2, 16, 29}, RopeType::kLlama3, 500000, "bfloat16", false},
      {"llama-3.2-1b.json", 2048, 32, 8, 64, 8192, 128256, {2, 8, 13}, RopeType::kLlama3, 500000, "bfloat16", true},
      {"llama-3.1-70b-instruct.json", 8192, 64, 8, 128, 28672, 128256, {2, 40, 77}, RopeType::kLlama3, 500000, "bfloat16", false},
      {"llama-4-scout.json", 5120, 40, 8, 128, 8192, 202048, {2, 24, 45}, RopeType::kLlama3, 500000, "bfloat16", false},
      {"qwen2.5-7b.json", 3584, 28, 4, 128, 18944, 152064, {2, 14, 25}, RopeType::kDefault, 1e6, "bfloat16", false},
      {"qwen3-8b.json", 4096, 32, 8, 128, 12288, 151936, {2, 18, 33}, RopeType::kDefault, 1e6, "bfloat16", false},
      {"qwen3-30b-a3b.json", 2048, 32, 4, 128, 6144, 151936, {2, 24, 45}, RopeType::kDefault, 1e6, "bfloat16", false},
      {"gpt-oss-20b.json", 2880, 64, 8, 64, 2880, 201088, {2, 12, 21}, RopeType::kYarn, 150000, "bfloat16", false},
      {"kimi-k2.json", 7168, 64, 64, 112, 18432, 163840, {2, 30, 58}, RopeType::kYarn, 50000, "bfloat16", false},
      {"deepseek-r1.json", 7168, 128, 128, 56, 18432, 129280, {2, 30, 58}, RopeType::kYarn, 10000, "bfloat16", false},
      {"gemma-3-1b.json", 1152, 4, 1, 256, 6912, 262144, {2, 13, 23}, RopeType::kDefault, 1e6, "bfloat16", false},
      {"mistral.json", 5120, 32, 8, 128, 14336, 131072, {2, 20, 37}, RopeType::kDefault, 1e6, "bfloat16", false},
      {"glm-5-v5.json", 6144, 64, 64, 64, 12288, 154880, {2, 39, 75}, RopeType::kDefault, 1e6, "bfloat16", false},
  };
  const std::string dir = test::source_dir() + "/tests/data/base-configs/";
  for (const auto& r : rows) {
    CAPTURE(r.file);
    const BaseConfig b = load_base_config(dir + r.file);
    const DraftConfig d = draft_config_from_base(b, {});
    CHECK(d.hidden_size == r.hidden);
    CHECK(d.num_attention_heads == r.heads);
    CHECK(d.num_key_value_heads == r.kv_heads);
    CHECK(d.head_dim == r.head_dim);
    CHECK(d.intermediate_size == r.intermediate);
    CHECK(d.vocab_size == r.vocab);
    CHECK(d.aux_layer_ids == r.aux_ids);
    CHECK(d.rope_scaling.type == r.rope);
    CHECK(d.rope_theta == r.theta);
    CHECK(d.torch_dtype == r.dtype);
    CHECK(b.tie_word_embeddings == r.tied);
  }
  // gpt-oss names no dtype (its weights are mxfp4): the default is said.
  const auto oss = load_base_config(dir + "gpt-oss-20b.json").defaults_applied;
  CHECK(std::find(oss.begin(), oss.end(), "torch_dtype is absent: the draft is exported as bfloat16") != oss.end());
  // Llama-3.1 omits head_dim: derived, and said.
  const auto llama = load_base_config(dir + "llama-3.1-8b.json").defaults_applied;
  CHECK(std::find(llama.begin(), llama.end(),
                  "head_dim is absent: 128 = hidden_size / num_attention_heads, the transformers default") != llama.end());
  // Gemma-3 27B's text_config leaves vocab_size to transformers' Gemma3TextConfig default,
  // which is not ours to assume.
  CHECK(message_of<FormatError>([&] { load_base_config(dir + "gemma-3.json"); }) ==
        dir + "gemma-3.json: vocab_size: missing");
  // Qwen3.5's multimodal RoPE is not a Llama draft's.
  CHECK(message_of<UnsupportedError>([&] { load_base_config(dir + "qwen3.5-27b-v5.json"); }) ==
        dir + "qwen3.5-27b-v5.json: rope_parameters.mrope_section: multimodal RoPE (mrope) is not implemented for a "
              "Llama draft");
}

namespace {

// One row of docs/bases.md's table of bases, as the code derives it: the cells after the
// first (which names the base and its file): H, heads / KV / head dim, I, V, aux ids, RoPE;
// or, for a config that is refused, the error after "PATH: ".
std::vector<std::string> derived_cells(const std::string& path) {
  auto g = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.10g", v);
    return std::string(buf);
  };
  try {
    const BaseConfig b = load_base_config(path);
    const DraftConfig d = draft_config_from_base(b, {});
    std::string ids;
    for (auto id : d.aux_layer_ids) ids += (ids.empty() ? "" : ",") + std::to_string(id);
    std::string rope = rope_type_name(d.rope_scaling.type);
    if (d.rope_scaling.type != RopeType::kDefault) rope += " x" + g(d.rope_scaling.factor);
    rope += ", theta " + g(d.rope_theta);
    return {std::to_string(d.hidden_size),
            std::to_string(d.num_attention_heads) + " / " + std::to_string(d.num_key_value_heads) + " / " +
                std::to_string(d.head_dim),
            std::to_string(d.intermediate_size), std::to_string(d.vocab_size), ids, rope};
  } catch (const Error& e) {
    const std::string m = e.what();
    return {"refused: " + (m.rfind(path + ": ", 0) == 0 ? m.substr(path.size() + 2) : m)};
  }
}

std::vector<std::string> cells_of(const std::string& line) {
  std::vector<std::string> out;
  std::size_t p = 1;
  while (p < line.size()) {
    const std::size_t q = line.find('|', p);
    if (q == std::string::npos) break;
    std::string c = line.substr(p, q - p);
    c.erase(0, c.find_first_not_of(' '));
    c.erase(c.find_last_not_of(' ') + 1);
    out.push_back(c);
    p = q + 1;
  }
  while (!out.empty() && out.back().empty()) out.pop_back();
  return out;
}

// Every way docs/bases.md's table (between its markers) differs from what the code derives
// for tests/data/base-configs/*.json; empty when it agrees, and each file has one row.
std::vector<std::string> table_mismatches(const std::string& readme, const std::string& dir) {
  std::vector<std::string> bad;
  const std::string begin = "<!-- base-config table: test_config checks it against the code -->";
  const std::string end = "<!-- end of base-config table -->";
  const auto a = readme.find(begin), z = readme.find(end);
  if (a == std::string::npos || z == std::string::npos || z < a) return {"no table markers"};
  std::set<std::string> seen;
  std::istringstream lines(readme.substr(a + begin.size(), z - a - begin.size()));
  std::string line;
  int row = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("| ", 0) != 0 || line.rfind("| base", 0) == 0) continue;
    ++row;
    const auto cells = cells_of(line);
    const auto tick = cells.empty() ? std::string::npos : cells[0].find("(`");
    if (tick == std::string::npos) {
      bad.push_back("row " + std::to_string(row) + ": no (`file.json`) in " + line);
      continue;
    }
    const std::string file = cells[0].substr(tick + 2, cells[0].find("`)", tick) - tick - 2);
    if (!seen.insert(file).second) bad.push_back(file + ": two rows");
    const auto want = derived_cells(dir + file);
    const std::vector<std::string> got(cells.begin() + 1, cells.end());
    if (got != want) {
      std::string w;
      for (const auto& c : want) w += " | " + c;
      bad.push_back(file + ": docs/bases.md says " + line + ", the code derives" + w);
    }
  }
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (entry.path().extension() == ".json" && seen.count(name) == 0) bad.push_back(name + ": no row");
  }
  return bad;
}

}  // namespace

TEST_CASE("config: the table of base models in docs/bases.md is what the code derives from every config") {
  const std::string dir = test::source_dir() + "/tests/data/base-configs/";
  const auto bytes = test::read_bytes(test::source_dir() + "/docs/bases.md");
  const std::string readme(bytes.begin(), bytes.end());
  const auto bad = table_mismatches(readme, dir);
  for (const auto& b : bad) MESSAGE(b);
  CHECK(bad.empty());
  // Must fail: a planted wrong cell, a dropped row.
  std::string wrong = readme;
  const auto at = wrong.find("| 2,16,29 |");
  REQUIRE(at != std::string::npos);
  wrong.replace(at, 11, "| 2,16,30 |");
  const auto w = table_mismatches(wrong, dir);
  REQUIRE(w.size() == 1);
  CHECK(w[0].rfind("llama-3.1-8b.json: docs/bases.md says", 0) == 0);
  std::string dropped = readme;
  const auto row = dropped.find("(`qwen3-8b.json`)");
  REQUIRE(row != std::string::npos);
  const auto line_begin = dropped.rfind('\n', row) + 1;
  dropped.erase(line_begin, dropped.find('\n', row) + 1 - line_begin);
  CHECK(table_mismatches(dropped, dir) == std::vector<std::string>{"qwen3-8b.json: no row"});
}
