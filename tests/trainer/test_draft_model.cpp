#include "tests/torch_doctest.h"

#include <nlohmann/json.hpp>
#include <sstream>

#include "formats/error.h"
#include "tests/support.h"
#include "tests/trainer/trainer_fixtures.h"
#include "trainer/model/draft_model.h"

using namespace eaglekit;
using namespace eaglekit::trainer;

TEST_CASE("draft_model: parameters carry the export names and layouts") {
  const DraftConfig c = fixtures::tiny_config();
  const DraftModel d(c, fixtures::spread_d2t(c), at::Tensor(), 1);
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> got;
  for (const auto& [name, t] : d.named_parameters()) got.emplace_back(name, t.sizes().vec());
  const std::int64_t h = 32, two_h = 64;
  const std::vector<std::pair<std::string, std::vector<std::int64_t>>> expected = {
      {"fc.weight", {h, 3 * 32}},
      {"midlayer.input_layernorm.weight", {h}},
      {"midlayer.hidden_norm.weight", {h}},
      {"midlayer.self_attn.q_proj.weight", {4 * 8, two_h}},
      {"midlayer.self_attn.k_proj.weight", {2 * 8, two_h}},
      {"midlayer.self_attn.v_proj.weight", {2 * 8, two_h}},
      {"midlayer.self_attn.o_proj.weight", {h, 4 * 8}},
      {"midlayer.post_attention_layernorm.weight", {h}},
      {"midlayer.mlp.gate_proj.weight", {48, h}},
      {"midlayer.mlp.up_proj.weight", {48, h}},
      {"midlayer.mlp.down_proj.weight", {h, 48}},
      {"norm.weight", {h}},
      {"lm_head.weight", {24, h}},
  };
  CHECK(got == expected);
  CHECK(d.parameters().size() == expected.size());
  for (const auto& t : d.parameters()) CHECK(t.requires_grad());
  CHECK(at::equal(d.named_parameters()[1].second, at::ones({h})));  // norms start at 1
  // Same seed, same weights; another seed, others.
  const DraftModel same(c, fixtures::spread_d2t(c), at::Tensor(), 1);
  const DraftModel other(c, fixtures::spread_d2t(c), at::Tensor(), 2);
  CHECK(at::equal(d.named_parameters()[0].second, same.named_parameters()[0].second));
  CHECK_FALSE(at::equal(d.named_parameters()[0].second, other.named_parameters()[0].second));
  const double std = d.named_parameters()[3].second.std().item<double>();
  CHECK(std == doctest::Approx(0.02).epsilon(0.15));
}

TEST_CASE("draft_model: lm_head starts as the base rows of the draft vocabulary; d2t/t2d") {
  const DraftConfig c = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(c, 7);
  const at::Tensor d2t = fixtures::spread_d2t(c);
  const DraftModel d(c, d2t, base.lm_head, 3);
  const at::Tensor target = d.draft_to_target();
  for (std::int64_t i = 0; i < c.draft_vocab_size; ++i) {
    const std::int64_t t = target[i].item<std::int64_t>();
    CHECK(t == i + d2t[i].item<std::int64_t>());
    CHECK(at::equal(d.named_parameters().back().second[i], base.lm_head[t]));
  }
  const at::Tensor t2d = d.t2d();
  CHECK((t2d.scalar_type() == at::kBool));
  CHECK(t2d.size(0) == c.vocab_size);
  CHECK(t2d.sum().item<std::int64_t>() == c.draft_vocab_size);
  CHECK(t2d.index_select(0, target).all().item<bool>());

  at::Tensor out_of_range = d2t.clone();
  out_of_range[c.draft_vocab_size - 1] = 100;
  CHECK_THROWS_AS(DraftModel(c, out_of_range, at::Tensor()), UsageError);
  at::Tensor duplicate = at::zeros({c.draft_vocab_size}, at::kLong);
  duplicate[1] = -1;  // draft ids 0 and 1 both -> target 0
  CHECK_THROWS_AS(DraftModel(c, duplicate, at::Tensor()), UsageError);
  CHECK_THROWS_AS(DraftModel(c, at::zeros({3}, at::kLong), at::Tensor()), UsageError);
  CHECK_THROWS_AS(DraftModel(c, d2t, at::zeros({c.vocab_size, 5})), UsageError);
  DraftModel m(c, d2t, at::Tensor());
  CHECK_THROWS_AS(m.load_parameter("midlayer.nope.weight", at::zeros({1})), UsageError);
  CHECK_THROWS_AS(m.load_parameter("norm.weight", at::zeros({3})), UsageError);
  m.load_parameter("norm.weight", at::full({32}, 2.0, at::kDouble));
  CHECK(m.named_parameters()[11].second.sum().item<double>() == 64.0);
}

TEST_CASE("draft_model: llama3 RoPE frequencies and tables match a Python computation") {
  // Llama-3.1's RoPE: theta 500000, head_dim 128, factor 8, low 1, high 4, original 8192.
  DraftConfig c = fixtures::tiny_config();
  c.head_dim = 128;
  c.num_attention_heads = 1;
  c.num_key_value_heads = 1;
  c.rope_theta = 500000.0;
  c.rope_scaling.type = RopeType::kLlama3;
  c.rope_scaling.factor = 8.0;
  c.rope_scaling.low_freq_factor = 1.0;
  c.rope_scaling.high_freq_factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 8192;
  const auto r = test::python(R"(
import math, json
d, theta, factor, low, high, old = 128, 500000.0, 8.0, 1.0, 4.0, 8192
out = []
for i in range(0, d, 2):
    f = 1.0 / theta ** (i / d)
    wl = 2 * math.pi / f
    if wl < old / high: g = f
    elif wl > old / low: g = f / factor
    else:
        sm = (old / wl - low) / (high - low)
        g = (1 - sm) * f / factor + sm * f
    out.append(g)
pos = [0, 1, 100, 5000, 131071]
print(json.dumps({"inv": out, "cos": [[math.cos(p * g) for g in out] for p in pos],
                  "sin": [[math.sin(p * g) for g in out] for p in pos]}))
)");
  REQUIRE(r.exit_code == 0);
  const auto j = nlohmann::json::parse(r.out);
  const at::Tensor inv = rope_inv_freq(c);
  REQUIRE(inv.size(0) == 64);
  int scaled = 0, blended = 0;
  for (std::int64_t i = 0; i < 64; ++i) {
    const double expect = j["inv"][i].get<double>();
    CHECK(inv[i].item<double>() == doctest::Approx(expect).epsilon(1e-12));
    const double plain = 1.0 / std::pow(500000.0, 2.0 * i / 128.0);
    if (std::abs(expect - plain / 8.0) < 1e-15 * plain) ++scaled;
    else if (std::abs(expect - plain) > 1e-15 * plain) ++blended;
  }
  CHECK(scaled > 0);   // all three bands are exercised
  CHECK(blended > 0);
  const at::Tensor positions = at::tensor(std::vector<std::int64_t>{0, 1, 100, 5000, 131071});
  const RotaryTable t = rope_table(c, positions);
  CHECK(t.cos.sizes() == at::IntArrayRef({5, 128}));
  CHECK((t.cos.scalar_type() == at::kFloat));
  for (int p = 0; p < 5; ++p) {
    for (int i = 0; i < 64; i += 7) {
      const double ec = j["cos"][p][i].get<double>(), es = j["sin"][p][i].get<double>();
      CHECK(t.cos[p][i].item<double>() == doctest::Approx(ec).epsilon(1e-6).scale(1.0));
      CHECK(t.cos[p][i + 64].item<double>() == doctest::Approx(ec).epsilon(1e-6).scale(1.0));
      CHECK(t.sin[p][i].item<double>() == doctest::Approx(es).epsilon(1e-6).scale(1.0));
    }
  }
  // Default RoPE leaves the frequencies unscaled.
  c.rope_scaling = RopeScaling{};
  CHECK(rope_inv_freq(c)[63].item<double>() == doctest::Approx(1.0 / std::pow(500000.0, 126.0 / 128.0)).scale(0));
}

TEST_CASE("draft_model: apply_rope rotates pairs (i, i + D/2) by position * frequency") {
  DraftConfig c = fixtures::tiny_config();
  c.rope_scaling = RopeScaling{};
  const at::Tensor x = at::randn({1, 1, 6, 8});
  const at::Tensor positions = at::arange(6, at::kLong);
  const at::Tensor y = apply_rope(x, rope_table(c, positions));
  const at::Tensor inv = rope_inv_freq(c);
  for (int p = 0; p < 6; ++p) {
    for (int i = 0; i < 4; ++i) {
      const double a = p * inv[i].item<double>();
      const double x1 = x[0][0][p][i].item<double>(), x2 = x[0][0][p][i + 4].item<double>();
      CHECK(y[0][0][p][i].item<double>() == doctest::Approx(x1 * std::cos(a) - x2 * std::sin(a)).epsilon(1e-5));
      CHECK(y[0][0][p][i + 4].item<double>() == doctest::Approx(x2 * std::cos(a) + x1 * std::sin(a)).epsilon(1e-5));
    }
  }
  // Per-row position tables (packed rows) broadcast over heads.
  const at::Tensor rows = at::stack({positions, positions.flip(0)});
  const at::Tensor y2 = apply_rope(x.expand({2, 3, 6, 8}).contiguous(), rope_table(c, rows));
  CHECK(at::allclose(y2[0][2], y[0][0]));
  CHECK(at::allclose(y2[1][1], apply_rope(x, rope_table(c, positions.flip(0)))[0][0]));
}

TEST_CASE("draft_model: ModelOpt norm form feeds input_layernorm(h) to hidden_norm") {
  DraftConfig c = fixtures::tiny_config();
  DraftModel serving(c, fixtures::spread_d2t(c), at::Tensor(), 5);
  c.modelopt_norm = true;
  DraftModel modelopt(c, fixtures::spread_d2t(c), at::Tensor(), 5);
  // Distinct norm weights so the two forms differ.
  for (DraftModel* m : {&serving, &modelopt}) {
    m->load_parameter("midlayer.input_layernorm.weight", at::linspace(0.5, 1.5, 32));
    m->load_parameter("midlayer.hidden_norm.weight", at::linspace(2.0, 0.1, 32));
  }
  const at::Tensor emb = at::randn({1, 5, 32}), h = at::randn({1, 5, 32});
  const RotaryTable rope = rope_table(c, at::arange(5, at::kLong));
  const at::Tensor e = serving.ttt_net().norm_embeddings(emb);
  const Qkv a = serving.ttt_net().qkv(e, h, rope, 0);
  const Qkv b = modelopt.ttt_net().qkv(e, h, rope, 0);
  const Qkv b_equiv = serving.ttt_net().qkv(e, serving.ttt_net().norm_embeddings(h), rope, 0);
  CHECK_FALSE(at::allclose(a.q, b.q));
  CHECK(at::allclose(b.q, b_equiv.q, 1e-5, 1e-6));
  CHECK(at::allclose(b.v, b_equiv.v, 1e-5, 1e-6));
  CHECK(a.q.sizes() == at::IntArrayRef({1, 4, 5, 8}));
  CHECK(a.k.sizes() == at::IntArrayRef({1, 2, 5, 8}));
  // The embedding half of q/k/v is the first H input columns: zeroing them removes emb.
  at::Tensor q = serving.named_parameters()[3].second.detach().clone();
  q.narrow(1, 0, 32).zero_();
  DraftModel fresh(c, fixtures::spread_d2t(c), at::Tensor(), 5);
  fresh.load_parameter("midlayer.self_attn.q_proj.weight", q);
  const Qkv x1 = fresh.ttt_net().qkv(fresh.ttt_net().norm_embeddings(emb), h, rope, 0);
  const Qkv x2 = fresh.ttt_net().qkv(fresh.ttt_net().norm_embeddings(at::randn({1, 5, 32})), h, rope, 0);
  CHECK(at::allclose(x1.q, x2.q));
  CHECK_FALSE(at::allclose(x1.k, x2.k));
}
