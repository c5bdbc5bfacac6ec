#include "tests/torch_doctest.h"

#include <nlohmann/json.hpp>

#include "formats/error.h"
#include "tests/support.h"
#include "tests/trainer/trainer_fixtures.h"
#include "trainer/model/base_model.h"

using namespace eaglekit;
using namespace eaglekit::trainer;

TEST_CASE("base_model: reads config, embed_tokens and lm_head from a model folder") {
  test::TempDir dir("base");
  const DraftConfig c = fixtures::tiny_config();
  const BaseModel made = fixtures::random_base(c, 1);
  fixtures::write_base_folder(dir / "m", made, 12);
  const BaseModel b = load_base_model(dir / "m");
  CHECK(b.config.hidden_size == 32);
  CHECK(b.config.vocab_size == 40);
  CHECK(b.config.num_hidden_layers == 12);
  CHECK(b.config.rope_scaling == c.rope_scaling);
  CHECK_FALSE(b.tied);
  CHECK(at::equal(b.embed_tokens, made.embed_tokens));
  CHECK(at::equal(b.lm_head, made.lm_head));
  CHECK_FALSE(b.embed_tokens.requires_grad());

  const BaseModel half = load_base_model(dir / "m", BaseLoadOptions{at::kCPU, at::kBFloat16});
  CHECK((half.lm_head.scalar_type() == at::kBFloat16));
  CHECK(at::equal(half.lm_head, made.lm_head.to(at::kBFloat16)));
}

TEST_CASE("base_model: tied embeddings when lm_head.weight is absent") {
  test::TempDir dir("base-tied");
  const DraftConfig c = fixtures::tiny_config();
  fixtures::write_base_folder(dir / "m", fixtures::random_base(c, 2, /*tied=*/true));
  const BaseModel b = load_base_model(dir / "m");
  CHECK(b.tied);
  CHECK(b.lm_head.data_ptr() == b.embed_tokens.data_ptr());
}

TEST_CASE("base_model: a sharded folder reads only the shards holding the two tensors") {
  test::TempDir dir("base-shard");
  const DraftConfig c = fixtures::tiny_config();
  const BaseModel made = fixtures::random_base(c, 3);
  fixtures::write_base_folder(dir / "full", made);  // for config.json
  const std::string m = dir / "m";
  std::filesystem::create_directories(m);
  std::filesystem::copy_file(dir / "full/config.json", m + "/config.json");
  fixtures::write_tensors(m + "/model-00001-of-00003.safetensors", {{"model.embed_tokens.weight", made.embed_tokens}});
  fixtures::write_tensors(m + "/model-00003-of-00003.safetensors", {{"lm_head.weight", made.lm_head}});
  // The decoder layers' shard is garbage: reading it would fail, so it must not be read.
  test::write_text(m + "/model-00002-of-00003.safetensors", "not a safetensors file");
  const nlohmann::json index = {
      {"metadata", {{"total_size", 0}}},
      {"weight_map", {{"model.embed_tokens.weight", "model-00001-of-00003.safetensors"},
                      {"model.layers.0.mlp.up_proj.weight", "model-00002-of-00003.safetensors"},
                      {"model.norm.weight", "model-00002-of-00003.safetensors"},
                      {"lm_head.weight", "model-00003-of-00003.safetensors"}}}};
  test::write_text(m + "/model.safetensors.index.json", index.dump());
  const BaseModel b = load_base_model(m);
  CHECK(at::equal(b.embed_tokens, made.embed_tokens));
  CHECK(at::equal(b.lm_head, made.lm_head));
}

TEST_CASE("base_model: wrong shapes and missing embeddings are format errors") {
  test::TempDir dir("base-bad");
  const DraftConfig c = fixtures::tiny_config();
  BaseModel made = fixtures::random_base(c, 4);
  fixtures::write_base_folder(dir / "ok", made);
  const std::string m = dir / "m";
  std::filesystem::create_directories(m);
  std::filesystem::copy_file(dir / "ok/config.json", m + "/config.json");
  fixtures::write_tensors(m + "/model.safetensors",
                          {{"model.embed_tokens.weight", made.embed_tokens}, {"lm_head.weight", at::zeros({39, 32})}});
  try {
    load_base_model(m);
    FAIL("expected FormatError");
  } catch (const FormatError& e) {
    CHECK(std::string(e.what()) == m + "/model.safetensors: lm_head.weight: shape [39, 32] does not match "
                                       "config.json [vocab_size 40, hidden_size 32]");
  }
  fixtures::write_tensors(m + "/model.safetensors", {{"lm_head.weight", made.lm_head}});
  try {
    load_base_model(m);
    FAIL("expected FormatError");
  } catch (const FormatError& e) {
    CHECK(std::string(e.what()).find("model.embed_tokens.weight: missing") != std::string::npos);
  }
  fixtures::write_tensors(m + "/model.safetensors",
                          {{"model.embed_tokens.weight", at::zeros({40, 32}, at::kLong)}});
  CHECK_THROWS_AS(load_base_model(m), FormatError);
  CHECK_THROWS_AS(load_base_model(dir / "absent"), IoError);
}

TEST_CASE("base_model: the final norm's weight is read when asked, and checked") {
  test::TempDir dir("base-norm");
  const DraftConfig c = fixtures::tiny_config();
  const BaseModel made = fixtures::random_base(c, 5);
  fixtures::write_base_folder(dir / "full", made);
  const std::string m = dir / "m";
  std::filesystem::create_directories(m);
  std::filesystem::copy_file(dir / "full/config.json", m + "/config.json");
  const at::Tensor norm = at::rand({c.hidden_size}, at::TensorOptions().dtype(at::kFloat)) + 0.5;
  fixtures::write_tensors(m + "/model.safetensors", {{"model.embed_tokens.weight", made.embed_tokens},
                                                     {"lm_head.weight", made.lm_head},
                                                     {"model.norm.weight", norm.to(at::kBFloat16)}});
  CHECK(!load_base_model(m).final_norm.defined());  // not asked for: not read
  BaseLoadOptions with_norm;
  with_norm.final_norm = true;
  const BaseModel b = load_base_model(m, with_norm);
  REQUIRE(b.final_norm.defined());
  CHECK((b.final_norm.scalar_type() == at::kFloat));
  CHECK(at::equal(b.final_norm, norm.to(at::kBFloat16).to(at::kFloat)));
  // A weight of the wrong shape names the tensor and what was expected.
  fixtures::write_tensors(m + "/model.safetensors", {{"model.embed_tokens.weight", made.embed_tokens},
                                                     {"lm_head.weight", made.lm_head},
                                                     {"model.norm.weight", at::ones({c.hidden_size + 1})}});
  const std::string msg = test::message_of<FormatError>([&] { load_base_model(m, with_norm); });
  CHECK(msg.find("model.norm.weight: expected a floating-point [hidden_size " + std::to_string(c.hidden_size) +
                 "] vector") != std::string::npos);
}
