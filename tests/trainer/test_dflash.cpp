// The DFlash row and its block unroll (trainer/model/dflash.h, trainer/unroll/dflash.h)
// against NVIDIA ModelOpt 0.47's own code: tests/data/dflash_modelopt/fixture.safetensors holds
// a tiny draft, a batch, anchors, and the loss, accuracy and gradients ModelOpt's
// DFlashModule and HFDFlashModel computed from them (make_fixture.py beside it); plus the
// anchor sampler's promises and ModelOpt's default choice of target layers.
// tests/data/dflash_speculators/ does the same with speculators 0.9's DFlashDraftModel (its
// loss, accuracy, accepted length and gradients), and holds speculators' own saved folder of
// that draft, which eaglekit reads and writes back in the speculators layout.
#include "tests/torch_doctest.h"
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "formats/error.h"
#include "formats/safetensors_format.h"
#include "lib/collate.h"
#include "tests/support.h"
#include "trainer/io/export.h"
#include "trainer/io/speculators_format.h"
#include "trainer/model/architecture_rows.h"
#include "trainer/model/base_model.h"
#include "trainer/model/config.h"
#include "trainer/model/dflash.h"
#include "trainer/run/run_setup.h"
#include "trainer/unroll/dflash.h"

using namespace eaglekit;
using namespace eaglekit::trainer;

namespace {

struct Fixture {
  std::map<std::string, at::Tensor> t;
  nlohmann::json config;
  const at::Tensor& operator[](const std::string& name) const {
    const auto it = t.find(name);
    REQUIRE_MESSAGE(it != t.end(), "fixture has no tensor " << name);
    return it->second;
  }
};

Fixture read_fixture(const std::string& folder) {
  Fixture out;
  const auto file = SafetensorsFile::open(test::source_dir() + "/tests/data/" + folder + "/fixture.safetensors");
  for (const auto& e : file->entries()) out.t[e.name] = tensor_from_host(file->tensor(e));
  out.config = nlohmann::json::parse(file->metadata().at("config"));
  return out;
}

const Fixture& fixture() {
  static const Fixture f = read_fixture("dflash_modelopt");
  return f;
}

DraftConfig fixture_config() {
  const nlohmann::json& j = fixture().config;
  DraftConfig c;
  c.architecture = "dflash";
  c.hidden_size = j["hidden_size"];
  c.intermediate_size = j["intermediate_size"];
  c.num_attention_heads = j["num_attention_heads"];
  c.num_key_value_heads = j["num_key_value_heads"];
  c.head_dim = j["head_dim"];
  c.rms_norm_eps = j["rms_norm_eps"];
  c.rope_theta = j["rope_theta"];
  c.vocab_size = j["vocab_size"];
  c.draft_vocab_size = c.vocab_size;
  c.target_hidden_size = c.hidden_size;
  c.num_aux_layers = j["num_aux_layers"];
  c.num_hidden_layers = j["num_hidden_layers"];
  c.max_position_embeddings = 256;
  for (std::int64_t id : j["target_layer_ids"].get<std::vector<std::int64_t>>()) c.aux_layer_ids.push_back(id + 1);
  c.block_size = j["block_size"];
  c.mask_token_id = j["mask_token_id"];
  c.torch_dtype = "float32";
  return c;
}

DraftModel fixture_draft() {
  const DraftConfig c = fixture_config();
  DraftModel d(c, at::zeros({c.vocab_size}, at::kLong), at::Tensor(), 1);
  for (const auto& [name, p] : d.named_parameters()) d.load_parameter(name, fixture()["w." + name]);
  return d;
}

BaseModel fixture_base() {
  BaseModel b;
  b.embed_tokens = fixture()["embed_tokens"];
  b.lm_head = fixture()["lm_head"];
  b.config.rms_norm_eps = 1e-6;
  return b;
}

TttBatch fixture_batch() {
  TttBatch b;
  b.input_ids = fixture()["input_ids"];
  b.loss_mask = fixture()["loss_mask"];
  b.attention_mask = b.loss_mask;
  b.hidden_states = fixture()["hidden_states"];
  b.aux_hidden_states = fixture()["aux_hidden_states"];
  return b;
}

DFlashAnchors fixture_anchors() { return {fixture()["anchors"], fixture()["keep"].to(at::kBool)}; }

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

struct CaseResult {
  double loss = 0, acc = 0;
  std::map<std::string, at::Tensor> grads;
};

CaseResult run_case(const DFlashOptions& o, const DFlashAnchors& anchors) {
  DraftModel d = fixture_draft();
  DFlashUnroll unroll(fixture_base(), d, o);
  const DFlashResult r = unroll.forward(fixture_batch(), anchors);
  const at::Tensor loss = dflash_loss(r.weighted_loss, r.weight_sum);
  loss.backward();
  CaseResult out;
  out.loss = loss.item<double>();
  double hits = 0, counted = 0;
  for (std::int64_t k = 0; k < r.stats.steps(); ++k) {
    hits += r.stats.correct[static_cast<std::size_t>(k)];
    counted += r.stats.mask_sum[static_cast<std::size_t>(k)];
  }
  out.acc = hits / (counted + 1e-6);
  for (const auto& [name, p] : d.named_parameters()) out.grads[name] = p.grad().clone();
  return out;
}

DFlashOptions options_of(const std::string& name) {
  DFlashOptions o;
  if (name == "decay" || name == "ce") {
    o.weighting = DFlashWeighting::kDecay;
    o.decay_gamma = 4.0;
  }
  o.self_distillation = name != "ce";
  return o;
}

// Four conversations of 9, 7, 6 and 10 tokens (random ids and features, loss mask 0 at
// position 2), on the fixture's draft. Packed into rows of 24 they make {0, 1, 2} and {3}:
// every block near a document's end runs into the next document or the row's padding.
std::vector<Record> pack_records() {
  const DraftConfig c = fixture_config();
  at::manual_seed(42);
  std::vector<Record> recs;
  const std::vector<std::int64_t> lengths{9, 7, 6, 10};
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    const std::int64_t t = lengths[i];
    Record r;
    r.conversation_id = "doc" + std::to_string(i);
    r.input_ids = to_host_tensor(at::randint(0, c.vocab_size, {t}, at::kLong));
    r.hidden_states = to_host_tensor(at::randn({t, c.hidden_size}));
    r.aux_hidden_states = to_host_tensor(at::randn({t, c.aux_width()}));
    at::Tensor mask = at::ones({t}, at::kLong);
    mask[2] = 0;
    r.loss_mask = to_host_tensor(mask);
    recs.push_back(std::move(r));
  }
  return recs;
}

Batch collate_as(CollateMode mode) {
  CollateOptions o;
  o.mode = mode;
  o.max_length = 24;
  return collate_records(pack_records(), o);
}

// Where each conversation of a batch lies: its row and first column.
std::map<std::string, std::pair<std::int64_t, std::int64_t>> document_places(const Batch& b) {
  std::map<std::string, std::pair<std::int64_t, std::int64_t>> out;
  for (std::size_t i = 0; i < b.conversation_ids.size(); ++i) {
    const std::int64_t r = b.sample_rows[i];
    std::int64_t col = 0;
    if (b.document_ids.defined())
      col = (b.document_ids[r] == b.sample_documents[i]).nonzero()[0][0].item<std::int64_t>();
    out[b.conversation_ids[i]] = {r, col};
  }
  return out;
}

// The kept anchors of a batch per conversation, as positions in the conversation.
std::map<std::string, std::vector<std::int64_t>> anchors_by_document(const Batch& b, const DFlashAnchors& a) {
  std::map<std::string, std::vector<std::int64_t>> out;
  for (const auto& [id, place] : document_places(b)) {
    const auto [r, start] = place;
    const std::int64_t doc = b.document_ids.defined() ? b.document_ids[r][start].item<std::int64_t>() : 0;
    for (std::int64_t i = 0; i < a.positions.size(1); ++i) {
      if (!a.keep[r][i].item<bool>()) continue;
      const std::int64_t col = a.positions[r][i].item<std::int64_t>();
      if (b.document_ids.defined() && b.document_ids[r][col].item<std::int64_t>() != doc) continue;
      out[id].push_back(col - start);
    }
  }
  return out;
}

// Anchors at the given positions of each conversation, laid out for batch `b`.
DFlashAnchors anchors_at(const Batch& b, const std::map<std::string, std::vector<std::int64_t>>& want) {
  std::vector<std::vector<std::int64_t>> rows(static_cast<std::size_t>(b.rows()));
  for (const auto& [id, place] : document_places(b))
    for (std::int64_t p : want.at(id)) rows[static_cast<std::size_t>(place.first)].push_back(place.second + p);
  std::size_t cols = 1;
  for (auto& r : rows) {
    std::sort(r.begin(), r.end());
    cols = std::max(cols, r.size());
  }
  DFlashAnchors a{at::zeros({b.rows(), static_cast<std::int64_t>(cols)}, at::kLong),
                  at::zeros({b.rows(), static_cast<std::int64_t>(cols)}, at::kBool)};
  for (std::size_t r = 0; r < rows.size(); ++r)
    for (std::size_t i = 0; i < rows[r].size(); ++i) {
      a.positions[static_cast<std::int64_t>(r)][static_cast<std::int64_t>(i)] = rows[r][i];
      a.keep[static_cast<std::int64_t>(r)][static_cast<std::int64_t>(i)] = true;
    }
  return a;
}

struct BatchRun {
  double loss = 0, weight_sum = 0;
  TttStats stats;
  std::map<std::string, at::Tensor> grads;
};

BatchRun run_batch(const DFlashOptions& o, const Batch& b, const DFlashAnchors& anchors) {
  DraftModel d = fixture_draft();
  DFlashUnroll unroll(fixture_base(), d, o);
  const DFlashResult r = unroll.forward(to_ttt_batch(b), anchors);
  const at::Tensor loss = dflash_loss(r.weighted_loss, r.weight_sum);
  loss.backward();
  BatchRun out{loss.item<double>(), r.weight_sum, r.stats, {}};
  for (const auto& [name, p] : d.named_parameters()) out.grads[name] = p.grad().clone();
  return out;
}

void check_same(const BatchRun& packed, const BatchRun& padded) {
  CHECK(padded.weight_sum > 1);
  CHECK(rel(packed.loss, padded.loss) < 1e-6);
  CHECK(rel(packed.weight_sum, padded.weight_sum) < 1e-6);
  CHECK(packed.stats.mask_sum == padded.stats.mask_sum);
  CHECK(packed.stats.correct == padded.stats.correct);
  CHECK(packed.stats.cond_correct == padded.stats.cond_correct);
  CHECK(packed.stats.cond_total == padded.stats.cond_total);
  for (std::size_t k = 0; k < padded.stats.ce_sum.size(); ++k)
    CHECK(rel(packed.stats.ce_sum[k], padded.stats.ce_sum[k]) < 1e-6);
  for (const auto& [param, g] : padded.grads) {
    CAPTURE(param);
    const double scale = std::max(g.abs().max().item<double>(), 1e-12);
    CHECK((packed.grads.at(param) - g).abs().max().item<double>() / scale < 1e-5);
  }
}

}  // namespace

TEST_CASE("dflash: loss, accuracy and gradients equal ModelOpt 0.47's on the same draft, batch and anchors") {
  for (const std::string name : {"dpace", "decay", "ce"}) {
    CAPTURE(name);
    const CaseResult ours = run_case(options_of(name), fixture_anchors());
    const double want = fixture()[name + ".loss"].item<double>();
    CHECK(rel(ours.loss, want) < 1e-6);
    CHECK(std::abs(ours.acc - fixture()[name + ".acc"].item<double>()) < 1e-6);
    for (const auto& [param, g] : ours.grads) {
      CAPTURE(param);
      const at::Tensor ref = fixture()[name + ".g." + param];
      const double scale = std::max(ref.abs().max().item<double>(), 1e-12);
      CHECK((g - ref).abs().max().item<double>() / scale < 1e-5);
    }
  }
}

TEST_CASE("dflash: the fixture tells a causal block and an anchor off by one from the trained function") {
  // ModelOpt's causal block gives another loss than the bidirectional one we match ...
  const CaseResult ours = run_case(options_of("dpace"), fixture_anchors());
  CHECK(rel(ours.loss, fixture()["causal.loss"].item<double>()) > 1e-4);
  // ... and so does every kept anchor moved one token later.
  DFlashAnchors shifted = fixture_anchors();
  shifted.positions = shifted.positions + shifted.keep.to(at::kLong);
  CHECK(rel(run_case(options_of("dpace"), shifted).loss, fixture()["dpace.loss"].item<double>()) > 1e-4);
}

TEST_CASE("dflash: anchors lie in the loss mask, fit a block, do not repeat, and follow only their row's seed") {
  const std::int64_t L = 64, block = 8;
  at::Tensor mask = at::zeros({3, L});
  mask[0].narrow(0, 20, 44).fill_(1);  // 44 positions, 37 of them <= L - block
  mask[1].narrow(0, 10, 4).fill_(1);  // 4 positions
  mask[2].narrow(0, 60, 4).fill_(1);  // none a block fits after
  const std::vector<std::uint64_t> seeds{dflash_row_seed(7, 0, "a"), dflash_row_seed(7, 0, "b"), dflash_row_seed(7, 0, "c")};
  const DFlashAnchors a = dflash_anchors(mask, block, 16, seeds);
  REQUIRE(a.positions.sizes() == at::IntArrayRef({3, 16}));
  for (std::int64_t r = 0; r < 3; ++r) {
    std::set<std::int64_t> seen;
    std::int64_t kept = 0;
    for (std::int64_t i = 0; i < 16; ++i) {
      if (!a.keep[r][i].item<bool>()) continue;
      ++kept;
      const std::int64_t p = a.positions[r][i].item<std::int64_t>();
      CHECK(mask[r][p].item<float>() == 1.0f);
      CHECK(p <= L - block);
      CHECK(seen.insert(p).second);
    }
    CHECK(kept == std::vector<std::int64_t>{16, 4, 0}[static_cast<std::size_t>(r)]);
  }
  // Row 0 alone, or beside other rows: the same anchors; another epoch: others.
  const DFlashAnchors alone = dflash_anchors(mask.narrow(0, 0, 1), block, 16, {seeds[0]});
  CHECK(at::equal(alone.positions[0], a.positions[0]));
  const DFlashAnchors next = dflash_anchors(mask.narrow(0, 0, 1), block, 16, {dflash_row_seed(7, 1, "a")});
  CHECK_FALSE(at::equal(next.positions[0], a.positions[0]));
  // Over many seeds every allowed position is drawn, and none other.
  std::set<std::int64_t> drawn;
  for (std::uint64_t s = 0; s < 200; ++s) {
    const DFlashAnchors x = dflash_anchors(mask.narrow(0, 0, 1), block, 4, {dflash_row_seed(s, 0, "a")});
    for (std::int64_t i = 0; i < 4; ++i) drawn.insert(x.positions[0][i].item<std::int64_t>());
  }
  CHECK(drawn.size() == 37);
}

TEST_CASE("dflash: the default target layers follow ModelOpt's build_target_layer_ids") {
  // Values from modelopt.torch.speculative.plugins.modeling_dflash.build_target_layer_ids.
  CHECK(dflash_default_target_layers(36, 5) == std::vector<std::int64_t>{1, 9, 17, 25, 33});
  CHECK(dflash_default_target_layers(32, 5) == std::vector<std::int64_t>{1, 8, 15, 22, 29});
  CHECK(dflash_default_target_layers(64, 5) == std::vector<std::int64_t>{1, 16, 31, 46, 61});
  CHECK(dflash_default_target_layers(8, 1) == std::vector<std::int64_t>{4});
  CHECK(dflash_default_target_layers(8, 3) == std::vector<std::int64_t>{1, 3, 5});
  CHECK_THROWS_AS(dflash_default_target_layers(2, 3), UsageError);
}

TEST_CASE("dflash: the served config names vLLM's DFlashDraftModel and reads back as the same draft") {
  const DraftConfig c = fixture_config();
  const std::string text = draft_config_json(c);
  const nlohmann::json j = nlohmann::json::parse(text);
  CHECK(j["architectures"][0] == "DFlashDraftModel");
  CHECK(j["block_size"] == 4);
  CHECK(j["dflash_config"]["mask_token_id"] == 39);
  CHECK(j["dflash_config"]["target_layer_ids"] == nlohmann::json({1, 3, 5}));
  const DraftConfig back = parse_draft_config(text, "config.json");
  CHECK(back.architecture == "dflash");
  CHECK(back.aux_layer_ids == c.aux_layer_ids);
  CHECK(back.block_size == 4);
  CHECK(back.mask_token_id == 39);
  CHECK(draft_config_json(back) == text);
  // The row's parameter list is the network's, in order.
  const DraftModel d = fixture_draft();
  const auto shapes = draft_architecture("dflash").parameters(c);
  const auto params = d.named_parameters();
  REQUIRE(shapes.size() == params.size());
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    CHECK(shapes[i].name == params[i].first);
    CHECK(at::IntArrayRef(shapes[i].shape) == params[i].second.sizes());
  }
}

TEST_CASE("dflash: a packed row gives each document the loss and gradients of a padded row of its own") {
  const Batch packed = collate_as(CollateMode::kPack), padded = collate_as(CollateMode::kPad);
  REQUIRE(packed.rows() == 2);  // {doc0, doc1, doc2} and {doc3}
  REQUIRE(padded.rows() == 4);
  REQUIRE(at::equal(packed.document_ids[0].narrow(0, 0, 23),
                    at::tensor({0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, -1}, at::kLong)));
  const DraftConfig c = fixture_config();
  REQUIRE(c.block_size == 4);
  // Anchors drawn by the trainer's own path: each document seeded by its conversation id
  // draws in the packed row what it draws as a padded row (few blocks and ModelOpt's 512).
  for (const std::int64_t n : {3, 512}) {
    CAPTURE(n);
    const DFlashAnchors a_pack = dflash_batch_anchors(packed, c, n, 7), a_pad = dflash_batch_anchors(padded, c, n, 7);
    const auto by_doc = anchors_by_document(padded, a_pad);
    CHECK(anchors_by_document(packed, a_pack) == by_doc);
    std::size_t drawn = 0;
    for (const auto& [id, v] : by_doc) drawn += v.size();
    // 3 each, or min(512, 9 - 1) = 8 of the 8, 6, 5 and 9 positions in the mask that fit a block in 24
    CHECK(drawn == (n == 3 ? 12u : 27u));
    for (const std::string name : {"dpace", "decay", "ce"}) {
      CAPTURE(name);
      check_same(run_batch(options_of(name), packed, a_pack), run_batch(options_of(name), padded, a_pad));
    }
  }
  // Forced anchors whose blocks run past their document's end (into the next document or
  // the padding), at a document's first position and at its last.
  const std::map<std::string, std::vector<std::int64_t>> forced{
      {"doc0", {0, 3, 7}}, {"doc1", {2, 5}}, {"doc2", {1, 4, 5}}, {"doc3", {0, 6, 8}}};
  const DFlashAnchors f_pack = anchors_at(packed, forced), f_pad = anchors_at(padded, forced);
  CHECK(anchors_by_document(packed, f_pack) == forced);
  for (const std::string name : {"dpace", "decay", "ce"}) {
    CAPTURE(name);
    check_same(run_batch(options_of(name), packed, f_pack), run_batch(options_of(name), padded, f_pad));
  }
}
// ---- speculators 0.9 (tests/data/dflash_speculators/make_fixture.py) ----

namespace {

const Fixture& spec_fixture() {
  static const Fixture f = read_fixture("dflash_speculators");
  return f;
}

DraftConfig spec_config() {
  const nlohmann::json& j = spec_fixture().config;
  DraftConfig c;
  c.architecture = "dflash";
  c.hidden_size = j["hidden_size"];
  c.intermediate_size = j["intermediate_size"];
  c.num_attention_heads = j["num_attention_heads"];
  c.num_key_value_heads = j["num_key_value_heads"];
  c.head_dim = j["head_dim"];
  c.rms_norm_eps = j["rms_norm_eps"];
  c.rope_theta = j["rope_theta"];
  c.vocab_size = j["vocab_size"];
  c.draft_vocab_size = c.vocab_size;
  c.target_hidden_size = c.hidden_size;
  c.num_aux_layers = j["num_aux_layers"];
  c.num_hidden_layers = j["num_hidden_layers"];
  c.max_position_embeddings = 256;
  c.aux_layer_ids = j["aux_hidden_state_layer_ids"].get<std::vector<std::int64_t>>();  // speculators counts as HF does
  c.block_size = j["block_size"];
  c.mask_token_id = j["mask_token_id"];
  c.torch_dtype = "float32";
  return c;
}

DraftModel spec_draft() {
  const DraftConfig c = spec_config();
  DraftModel d(c, at::zeros({c.vocab_size}, at::kLong), at::Tensor(), 1);
  for (const auto& [name, p] : d.named_parameters()) d.load_parameter(name, spec_fixture()["w." + name]);
  return d;
}

struct SpecResult {
  double loss = 0;          // eaglekit's own loss (dflash_loss)
  double spec_normed = 0;   // sum(w * l) / (counted + 1e-5): speculators' normalizer
  double acc = 0, eal = 0, counted = 0;
  std::map<std::string, at::Tensor> grads;  // of spec_normed
};

SpecResult run_spec_case(const DFlashOptions& o, const DFlashAnchors& anchors) {
  DraftModel d = spec_draft();
  BaseModel base;
  base.embed_tokens = spec_fixture()["embed_tokens"];
  base.lm_head = spec_fixture()["lm_head"];
  base.final_norm = spec_fixture()["final_norm"];
  base.config.rms_norm_eps = 1e-6;
  DFlashUnroll unroll(base, d, o);
  TttBatch b;
  b.input_ids = spec_fixture()["input_ids"];
  b.loss_mask = spec_fixture()["loss_mask"];
  b.attention_mask = b.loss_mask;
  b.hidden_states = spec_fixture()["hidden_states"];
  b.aux_hidden_states = spec_fixture()["aux_hidden_states"];
  const DFlashResult r = unroll.forward(b, anchors);
  SpecResult out;
  double hits = 0, chains = 0;
  for (std::int64_t k = 0; k < r.stats.steps(); ++k) {
    hits += r.stats.correct[static_cast<std::size_t>(k)];
    chains += r.stats.cond_correct[static_cast<std::size_t>(k)];
    out.counted += r.stats.mask_sum[static_cast<std::size_t>(k)];
  }
  out.acc = hits / out.counted;
  // Accepted run plus the bonus token, per block; every block of the fixture counts at position 1.
  out.eal = 1.0 + chains / r.stats.mask_sum[0];
  out.loss = dflash_loss(r.weighted_loss, r.weight_sum).item<double>();
  const at::Tensor normed = r.weighted_loss / (out.counted + 1e-5);
  normed.backward();
  out.spec_normed = normed.item<double>();
  for (const auto& [name, p] : d.named_parameters()) out.grads[name] = p.grad().clone();
  return out;
}

DFlashAnchors spec_anchors() { return {spec_fixture()["anchors"], spec_fixture()["keep"].to(at::kBool)}; }

// speculators' cases as eaglekit's options: ce (hard labels; the fixture's tokens are the
// base's argmax) is --dflash-distill off, kl_div is on (the soft cross-entropy: KL plus the
// targets' entropy); fixed-exp-decay is --dflash-weights decay (gamma inf: 0 here), dpace D-PACE.
DFlashOptions spec_options(const std::string& name) {
  DFlashOptions o;
  o.prenorm_hidden_states = true;  // speculators applies the verifier's final norm
  o.self_distillation = name.rfind("kl", 0) == 0;
  if (name.rfind("ce_dpace", 0) == 0) {
    o.weighting = DFlashWeighting::kDpace;
    o.dpace_alpha = name == "ce_dpace_a03" ? 0.3 : 0.5;
  } else {
    o.weighting = DFlashWeighting::kDecay;
    o.decay_gamma = name == "ce_uniform" ? 0.0 : 4.0;
  }
  return o;
}

}  // namespace

TEST_CASE("dflash: loss, accuracy, accepted length and gradients equal speculators 0.9's on the same draft, batch and anchors") {
  for (const std::string name : {"ce_uniform", "ce_decay", "ce_dpace", "ce_dpace_a03", "kl_decay"}) {
    CAPTURE(name);
    const SpecResult ours = run_spec_case(spec_options(name), spec_anchors());
    const Fixture& f = spec_fixture();
    CHECK(ours.counted == f[name + ".count"].item<double>());
    // speculators divides by the positions that count, eaglekit by the sum of the weights:
    // the weighted sums agree, and with every weight 1 (ce_uniform) so do the losses.
    const double entropy = name == "kl_decay" ? f["kl_decay.entropy"].item<double>() : 0.0;
    CHECK(rel(ours.spec_normed - entropy, f[name + ".loss"].item<double>()) < 1e-6);
    if (name == "ce_uniform") CHECK(rel(ours.loss, f[name + ".loss"].item<double>()) < 1e-6);
    CHECK(std::abs(ours.acc - f[name + ".acc"].item<double>()) < 1e-6);
    CHECK(std::abs(ours.eal - f[name + ".eal"].item<double>()) < 1e-6);
    for (const auto& [param, g] : ours.grads) {
      CAPTURE(param);
      const at::Tensor ref = f[name + ".g." + param];
      const double scale = std::max(ref.abs().max().item<double>(), 1e-12);
      CHECK((g - ref).abs().max().item<double>() / scale < 1e-5);
    }
  }
}

TEST_CASE("dflash: the speculators fixture tells a causal block and an anchor off by one from the trained function") {
  const double ours = run_spec_case(spec_options("ce_decay"), spec_anchors()).spec_normed;
  CHECK(rel(ours, spec_fixture()["causal.loss"].item<double>()) > 1e-4);
  DFlashAnchors shifted = spec_anchors();
  shifted.positions = shifted.positions + shifted.keep.to(at::kLong);
  CHECK(rel(run_spec_case(spec_options("ce_decay"), shifted).spec_normed, spec_fixture()["ce_decay.loss"].item<double>()) >
        1e-4);
}

TEST_CASE("dflash: speculators' own saved DFlash folder reads as the draft it holds") {
  DraftSource source;
  const DraftModel d = load_draft(test::source_dir() + "/tests/data/dflash_speculators/saved", &source);
  CHECK(source.layout.rfind("speculators", 0) == 0);
  CHECK(source.speculators.speculative_tokens == 3);
  CHECK(source.speculators.verifier == "tests/data/dflash_speculators/verifier");
  const DraftConfig& c = d.config();
  CHECK(c.architecture == "dflash");
  CHECK(c.block_size == 4);
  CHECK(c.mask_token_id == 39);
  CHECK(c.aux_layer_ids == std::vector<std::int64_t>{2, 4, 6});
  CHECK(c.num_hidden_layers == 2);
  CHECK(c.rope_theta == 10000.0);
  for (const auto& [name, p] : d.named_parameters()) {
    CAPTURE(name);
    CHECK(at::equal(p, spec_fixture()["w." + name]));
  }
}

TEST_CASE("dflash: the speculators layout is written as speculators' DFlashSpeculatorConfig and reads back") {
  test::TempDir dir("dflash-spec");
  ExportOptions o;
  o.format = ExportFormat::kSpeculators;
  o.speculators.speculative_tokens = 3;
  o.speculators.verifier = "Qwen/Qwen3-8B";
  o.speculators.verifier_architectures = {"Qwen3ForCausalLM"};
  const DraftModel d = spec_draft();
  export_draft(d, dir / "out", o);
  std::ifstream f(dir / "out/config.json");
  const nlohmann::json j = nlohmann::json::parse(f);
  CHECK(j["speculators_model_type"] == "dflash");
  CHECK(j["architectures"][0] == "DFlashDraftModel");
  CHECK(j["speculators_config"]["algorithm"] == "dflash");
  CHECK(j["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3);
  CHECK(j["speculators_config"]["verifier"]["name_or_path"] == "Qwen/Qwen3-8B");
  CHECK(j["block_size"] == 4);
  CHECK(j["mask_token_id"] == 39);
  CHECK(j["aux_hidden_state_layer_ids"] == nlohmann::json({2, 4, 6}));
  CHECK(j["draft_vocab_size"] == 40);
  CHECK(j["sample_from_anchor"] == false);
  CHECK(j["sliding_window_non_causal"] == true);
  CHECK(j["transformer_layer_config"]["model_type"] == "qwen3");
  CHECK(j["transformer_layer_config"]["num_hidden_layers"] == 2);
  CHECK_FALSE(j["transformer_layer_config"].contains("dflash_config"));
  // The tensors are speculators' names, the same as ModelOpt's: exactly the draft's.
  const auto file = SafetensorsFile::open(dir / "out/model.safetensors");
  std::set<std::string> names, want;
  for (const auto& e : file->entries()) names.insert(e.name);
  for (const auto& [name, p] : d.named_parameters()) want.insert(name);
  CHECK(names == want);
  DraftSource source;
  const DraftModel back = load_draft(dir / "out", &source);
  CHECK(source.layout.rfind("speculators", 0) == 0);
  CHECK(source.speculators.speculative_tokens == 3);
  CHECK(draft_config_json(back.config()) == draft_config_json(d.config()));
  for (const auto& [name, p] : back.named_parameters()) CHECK(at::equal(p, spec_fixture()["w." + name]));
}

TEST_CASE("dflash: a speculators DFlash config eaglekit does not compute is refused by its key") {
  std::ifstream in(test::source_dir() + "/tests/data/dflash_speculators/saved/config.json");
  const nlohmann::json saved = nlohmann::json::parse(in);
  auto refused = [&](const std::function<void(nlohmann::json&)>& edit, const std::string& key) {
    nlohmann::json j = saved;
    edit(j);
    try {
      (void)speculators_to_draft_config(j.dump(), "config.json");
      FAIL("accepted a config with " << key);
    } catch (const FormatError& e) {
      CHECK_MESSAGE(std::string(e.what()).find(key) != std::string::npos, e.what());
    }
  };
  refused([](nlohmann::json& j) { j["sample_from_anchor"] = true; }, "sample_from_anchor");
  refused([](nlohmann::json& j) { j["draft_vocab_size"] = 32; }, "draft_vocab_size");
  refused([](nlohmann::json& j) { j.erase("mask_token_id"); }, "mask_token_id");
  refused([](nlohmann::json& j) { j["mask_token_id"] = nullptr; }, "mask_token_id");
  refused([](nlohmann::json& j) { j.erase("block_size"); }, "block_size");
  refused([](nlohmann::json& j) { j["aux_hidden_state_layer_ids"] = {0, 4}; }, "aux_hidden_state_layer_ids");
  refused([](nlohmann::json& j) { j["transformer_layer_config"]["attention_bias"] = true; }, "attention_bias");
  refused([](nlohmann::json& j) { j["transformer_layer_config"]["layer_types"][1] = "sliding_attention"; }, "layer_types");
  refused([](nlohmann::json& j) { j["speculators_model_type"] = "dspark"; }, "speculators_model_type");
  const DraftConfig ok = parse_draft_config(speculators_to_draft_config(saved.dump(), "config.json"), "config.json");
  CHECK(ok.block_size == 4);
}
