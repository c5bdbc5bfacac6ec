#include "tests/torch_doctest.h"
#include <torch/csrc/autograd/autograd.h>
#include <torch/optim/adam.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <map>
#include <set>

#include "formats/error.h"
#include "lib/collate.h"
#include "tests/support.h"
#include "tests/tensor_compare.h"
#include "tests/trainer/trainer_fixtures.h"
#include "trainer/io/export.h"
#include "trainer/model/soft_ce.h"
#include "trainer/run/cpu_memory.h"
#include "trainer/run/run_setup.h"
#include "trainer/unroll/ttt.h"

using namespace eaglekit;
using namespace eaglekit::trainer;

namespace {

std::vector<std::set<std::int64_t>> mask_rows(const at::Tensor& m) {
  std::vector<std::set<std::int64_t>> rows(static_cast<std::size_t>(m.size(0)));
  for (std::int64_t q = 0; q < m.size(0); ++q)
    for (std::int64_t j = 0; j < m.size(1); ++j)
      if (m[q][j].item<bool>()) rows[static_cast<std::size_t>(q)].insert(j);
  return rows;
}

std::vector<at::Tensor> grads_of(DraftModel& d) {
  std::vector<at::Tensor> g;
  for (const auto& [name, p] : d.named_parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : at::zeros_like(p));
  return g;
}

// Every parameter's gradient within tol of its largest reference entry; a reference that is
// all zero (an undefined gradient reads as zeros) fails.
void check_grads_close(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want, double tol) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    CAPTURE(i);
    const double scale = want[i].abs().max().item<double>();
    REQUIRE(scale > 0);
    CHECK((got[i] - want[i]).abs().max().item<double>() <= tol * scale);
  }
}

nlohmann::json metrics_json(const TttResult& r) {
  return {{"loss", r.loss.item<double>()},
          {"loss_per_step", [&] {
             std::vector<double> v;
             for (std::int64_t s = 0; s < r.stats.steps(); ++s)
               v.push_back(r.stats.ce_sum[s] / (r.stats.mask_sum[s] + 1e-5));
             return v;
           }()},
          {"acc", r.stats.acc()},
          {"cond_acc", r.stats.cond_acc()},
          {"correct", r.stats.correct},
          {"cond_correct", r.stats.cond_correct},
          {"cond_total", r.stats.cond_total},
          {"mask_sum", r.stats.mask_sum}};
}

}  // namespace

TEST_CASE("ttt: the mask matches the worked examples of docs/ttt.md") {
  using Rows = std::vector<std::set<std::int64_t>>;
  // L=4, s=1: q0->{4}; q1->{0,5}; q2->{0,1,6}; q3->{0,1,2,7}.
  CHECK((mask_rows(ttt_mask(4, 1)) == Rows{{4}, {0, 5}, {0, 1, 6}, {0, 1, 2, 7}}));
  // L=4, s=2: q0->{8}; q1->{4,9}; q2->{0,5,10}; q3->{0,1,6,11}.
  CHECK((mask_rows(ttt_mask(4, 2)) == Rows{{8}, {4, 9}, {0, 5, 10}, {0, 1, 6, 11}}));
  // Step 0 is causal.
  CHECK((mask_rows(ttt_mask(4, 0)) == Rows{{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}}));
  CHECK(ttt_mask(4, 2).sizes() == at::IntArrayRef({4, 12}));
  // The tensor form, the scalar predicate and every sub-rectangle (ring chunks) agree.
  for (std::int64_t l = 1; l <= 6; ++l) {
    for (std::int64_t s = 0; s <= 4; ++s) {
      const at::Tensor m = ttt_mask(l, s);
      for (std::int64_t q = 0; q < l; ++q)
        for (std::int64_t j = 0; j < l * (s + 1); ++j) REQUIRE(m[q][j].item<bool>() == ttt_allowed(l, s, q, j));
      const std::int64_t qb = l / 3, qe = l - l / 4, kb = l / 2, ke = l * (s + 1) - 1;
      CHECK(at::equal(ttt_mask(l, s, qb, qe, kb, ke), m.slice(0, qb, qe).slice(1, kb, ke)));
    }
  }
}

TEST_CASE("ttt: fast attention equals dense attention under the docs/ttt.md mask, values and gradients") {
  at::manual_seed(11);
  const std::int64_t b = 2, heads = 4, kv = 2, l = 9, d = 8;
  const at::Tensor key_valid = at::ones({b, l}, at::kBool);
  key_valid[1].narrow(0, 6, 3).fill_(false);  // row 1 is padded after 6 keys
  key_valid[1][0] = false;                     // and its query 0 sees no key at all at step 0
  at::Tensor docs = at::zeros({b, l}, at::kLong);
  docs[0].narrow(0, 4, 5).fill_(1);  // row 0 packs two documents
  docs[1].narrow(0, 6, 3).fill_(-1);
  for (const bool packed : {false, true}) {
    for (std::int64_t s = 0; s <= 3; ++s) {
      CAPTURE(s);
      CAPTURE(packed);
      const at::Tensor q = at::randn({b, heads, l, d}).requires_grad_();
      std::vector<at::Tensor> ks, vs;
      for (std::int64_t i = 0; i <= s; ++i) {
        ks.push_back(at::randn({b, kv, l, d}).requires_grad_());
        vs.push_back(at::randn({b, kv, l, d}).requires_grad_());
      }
      const at::Tensor doc = packed ? docs : at::Tensor();
      const at::Tensor dense = ttt_attention_dense({q, ks, vs, key_valid, s, 0.35, doc});
      const at::Tensor w = at::randn(dense.sizes());
      std::vector<at::Tensor> inputs = {q};
      inputs.insert(inputs.end(), ks.begin(), ks.end());
      inputs.insert(inputs.end(), vs.begin(), vs.end());
      const auto g_dense = torch::autograd::grad({(dense * w).sum()}, inputs);
      // Query chunks: the default (one chunk at L=9); 1 row (at s >= 1 the first chunks see
      // no block-0 key); 2 and 4 rows (the last chunk shorter).
      for (const std::int64_t rows : {0, 1, 2, 4}) {
        CAPTURE(rows);
        TttMaskCache cache;
        const at::Tensor fast = ttt_attention_local({q, ks, vs, key_valid, s, 0.35, doc}, &cache, rows);
        CHECK(fast.sizes() == q.sizes());
        CHECK(test::tensor_rel_diff(fast, dense) < 1e-5);
        CHECK(cache.size() == 1);
        const auto g_fast = torch::autograd::grad({(fast * w).sum()}, inputs);
        for (std::size_t i = 0; i < inputs.size(); ++i) {
          CHECK(at::isfinite(g_fast[i]).all().item<bool>());
          CHECK(test::tensor_rel_diff(g_fast[i], g_dense[i]) < 1e-5);
        }
      }
    }
  }
}

TEST_CASE("ttt: query chunks of the fast attention") {
  CHECK(ttt_query_chunk_rows(1) == 1);
  CHECK(ttt_query_chunk_rows(128) == 128);
  CHECK(ttt_query_chunk_rows(129) == 65);   // 2 chunks
  CHECK(ttt_query_chunk_rows(256) == 128);
  CHECK(ttt_query_chunk_rows(2048) == 256);  // at most 8 chunks
  CHECK(ttt_query_chunk_rows(4097) == 513);
}

TEST_CASE("ttt: partial attention merged by log-sum-exp equals attention over all keys, never NaN") {
  at::manual_seed(3);
  const at::Tensor q = at::randn({1, 4, 5, 8}).requires_grad_();
  const at::Tensor k = at::randn({1, 2, 10, 8}).requires_grad_();
  const at::Tensor v = at::randn({1, 2, 10, 8}).requires_grad_();
  at::Tensor allowed = at::rand({5, 10}) > 0.4;
  allowed[0].narrow(0, 0, 5).fill_(false);  // query 0 sees nothing in the first chunk
  allowed[0][7] = true;
  allowed[3].fill_(false);                  // query 3 sees nothing at all
  const AttentionPartial full = attend(q, k, v, allowed, 0.3);
  const AttentionPartial a = attend(q, k.narrow(2, 0, 5), v.narrow(2, 0, 5), allowed.narrow(1, 0, 5), 0.3);
  const AttentionPartial c = attend(q, k.narrow(2, 5, 5), v.narrow(2, 5, 5), allowed.narrow(1, 5, 5), 0.3);
  const AttentionPartial merged = merge_partials(a, c);
  CHECK(test::tensor_rel_diff(merged.out, full.out) < 1e-6);
  CHECK(std::isinf(full.lse[0][0][3].item<double>()));
  CHECK(at::equal(full.out.select(2, 3), at::zeros({1, 4, 8})));
  CHECK(at::allclose(merged.lse.masked_fill(at::isinf(merged.lse), 0), full.lse.masked_fill(at::isinf(full.lse), 0)));
  const auto g = torch::autograd::grad({merged.out.sum() + merged.lse.masked_fill(at::isinf(merged.lse), 0).sum()}, {q, k, v});
  for (const auto& t : g) CHECK(at::isfinite(t).all().item<bool>());
  const auto g_full = torch::autograd::grad({full.out.sum() + full.lse.masked_fill(at::isinf(full.lse), 0).sum()}, {q, k, v});
  for (std::size_t i = 0; i < 3; ++i) CHECK(test::tensor_rel_diff(g[i], g_full[i]) < 1e-5);
}

TEST_CASE("ttt: statistics pool by summing and give the metrics of docs/ttt.md") {
  TttStats s(3);
  s.ce_sum = {10, 8, 6};
  s.mask_sum = {10, 9, 8};
  s.correct = {8, 6, 4};
  s.cond_correct = {8, 5, 3};
  s.cond_total = {10, 7, 4};
  CHECK((s.loss_per_step() == std::vector<double>{1.0, 8.0 / 9, 0.75}));
  CHECK(s.loss(0.9) == doctest::Approx(1.0 + 0.9 * 8.0 / 9 + 0.81 * 0.75));
  CHECK((s.acc() == std::vector<double>{0.8, 6.0 / 9, 0.5}));
  CHECK((s.cond_acc() == std::vector<double>{0.8, 5.0 / 7, 0.75}));
  CHECK(s.est_ar() == doctest::Approx(1 + 0.8 + 0.8 * 6.0 / 9 + 0.8 * 6.0 / 9 * 0.5));
  CHECK(s.est_ar_conditional() == doctest::Approx(1 + 0.8 + 0.8 * 5.0 / 7 + 0.8 * 5.0 / 7 * 0.75));
  CHECK(s.tokens() == 10);
  TttStats twice = s;
  twice += s;
  CHECK(twice.acc() == s.acc());
  CHECK(twice.mask_sum[2] == 16);
  const TttStats back = TttStats::from_tensor(s.to_tensor());
  CHECK(back.cond_total == s.cond_total);
  CHECK(back.ce_sum == s.ce_sum);
  CHECK_THROWS_AS(twice += TttStats(2), UsageError);
  CHECK((TttStats(2).acc() == std::vector<double>{0.0, 0.0}));  // nothing counted: 0, not NaN
}

TEST_CASE("ttt: loss, accuracies and gradients agree with the independent Python reference") {
  test::TempDir dir("ttt-ref");
  const DraftConfig base_cfg = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(base_cfg, 21);
  fixtures::write_base_folder(dir / "base", base);
  const TttBatch batch = fixtures::random_batch(base_cfg, 3, 12, {12, 9, 7}, 22);
  fixtures::write_tensors(dir / "batch.safetensors", fixtures::batch_tensors(batch));

  nlohmann::json manifest = {{"cases", nlohmann::json::array()}};
  std::vector<nlohmann::json> ours;
  struct Case {
    bool modelopt;
    std::int64_t steps, layers;
  };
  // One layer in both norm forms; deeper drafts (docs/draft.md) of 2 and 3 layers.
  const std::vector<Case> cases = {{false, 1, 1}, {false, 3, 1}, {true, 1, 1}, {true, 3, 1}, {false, 3, 2}, {false, 2, 3}};
  std::map<std::string, std::int64_t> tensors_of;
  std::string planted_nan_tensor;
  for (const Case& k : cases) {
    {
      const bool modelopt = k.modelopt;
      const std::int64_t steps = k.steps;
      const std::string name = std::string(modelopt ? "modelopt" : "serving") + "-S" + std::to_string(steps) + "-N" +
                               std::to_string(k.layers);
      DraftConfig c = base_cfg;
      c.modelopt_norm = modelopt;
      c.num_hidden_layers = k.layers;
      DraftModel draft(c, fixtures::spread_d2t(c), base.lm_head, 23);
      // Norm weights away from 1 so that every weight matters.
      for (const auto& [n, p] : draft.named_parameters())
        if (p.dim() == 1) draft.load_parameter(n, 1.0 + 0.3 * at::randn({c.hidden_size}));
      // 13 tensors in the first layer, fc, norm and lm_head; 9 in each further layer.
      tensors_of[name] = 13 + 9 * (k.layers - 1);
      CHECK(static_cast<std::int64_t>(draft.named_parameters().size()) == tensors_of[name]);
      export_draft(draft, dir / name);
      TttUnroll unroll(base, load_draft(dir / name), TttOptions{steps, 0.8, std::nullopt});
      const TttResult r = unroll.forward(batch);
      r.loss.backward();
      std::vector<std::pair<std::string, at::Tensor>> grads;
      for (const auto& [pname, p] : unroll.draft().named_parameters()) grads.emplace_back(pname, p.grad());
      fixtures::write_tensors(dir / (name + ".grads.safetensors"), grads);
      if (manifest["cases"].empty()) {
        // Must-fail twin of the first case: a NaN in one element of a tensor past the first
        // (the oracle's max(grad_rel, key=...) once skipped it unless it came first).
        auto planted = grads;
        planted[4].second = planted[4].second.clone();
        planted[4].second.view(-1)[1] = std::nanf("");
        fixtures::write_tensors(dir / "planted-nan.grads.safetensors", planted);
        planted_nan_tensor = planted[4].first;
      }
      test::write_text(dir / (name + ".metrics.json"), metrics_json(r).dump());
      manifest["cases"].push_back({{"name", name},
                                   {"base", dir / "base"},
                                   {"draft", dir / name},
                                   {"batch", dir / "batch.safetensors"},
                                   {"cpp_grads", dir / (name + ".grads.safetensors")},
                                   {"cpp_metrics", dir / (name + ".metrics.json")},
                                   {"steps", steps},
                                   {"decay", 0.8}});
    }
  }
  nlohmann::json planted = manifest["cases"][0];
  planted["name"] = "planted-nan";
  planted["cpp_grads"] = dir / "planted-nan.grads.safetensors";
  manifest["cases"].push_back(planted);
  test::write_text(dir / "manifest.json", manifest.dump());
  const auto py = test::run(test::python_bin() + " " + test::quote(test::source_dir() + "/tests/trainer/reference_draft.py") +
                            " " + test::quote(dir / "manifest.json"));
  INFO(py.err);
  REQUIRE(py.exit_code == 0);
  auto out = nlohmann::json::parse(py.out);
  REQUIRE(out["cases"].size() == cases.size() + 1);
  {
    const auto& c = out["cases"].back();
    INFO(c.dump());
    CHECK(c["name"] == "planted-nan");
    CHECK(c["grad_rel_max"].get<double>() >= 1e300);  // tests/compare.py writes +inf as the largest double
    CHECK(c["grad_rel_worst"] == planted_nan_tensor);
  }
  out["cases"].erase(out["cases"].size() - 1);
  for (const auto& c : out["cases"]) {
    INFO(c.dump());
    const std::int64_t tensors = tensors_of.at(c["name"].get<std::string>());
    CHECK(c["loss_rel"].get<double>() < 1e-5);
    CHECK(c["loss_per_step_rel"].get<double>() < 1e-5);
    CHECK(c["grad_rel_max"].get<double>() < 1e-5);
    CHECK(c["grads_compared"] == tensors);
    CHECK(c["grads_expected"] == tensors);
    CHECK(c["acc_equal"] == true);
    CHECK(c["cond_acc_equal"] == true);
    CHECK(c["correct_equal"] == true);
    CHECK(c["mask_sum_equal"] == true);
    CHECK(c["loss"].get<double>() > 0.5);  // a real loss, not a degenerate zero
  }
  MESSAGE("reference agreement: " << out.dump());
}

TEST_CASE("ttt: packed rows give the same sums and gradients as the documents in separate rows") {
  const DraftConfig c = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(c, 31);
  const TttBatch two = fixtures::random_batch(c, 2, 12, {7, 4}, 32);
  // Pack row 0's 7 tokens and row 1's 4 tokens into one row of 12 (1 padding column).
  TttBatch packed;
  auto pack = [&](const at::Tensor& t) {
    at::Tensor row = at::zeros_like(t.narrow(0, 0, 1));
    row[0].narrow(0, 0, 7).copy_(t[0].narrow(0, 0, 7));
    row[0].narrow(0, 7, 4).copy_(t[1].narrow(0, 0, 4));
    return row;
  };
  packed.input_ids = pack(two.input_ids);
  packed.attention_mask = pack(two.attention_mask);
  packed.loss_mask = pack(two.loss_mask);
  packed.hidden_states = pack(two.hidden_states);
  packed.aux_hidden_states = pack(two.aux_hidden_states);
  packed.document_ids = at::tensor(std::vector<std::int64_t>{0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, -1}).unsqueeze(0);
  packed.position_ids = at::tensor(std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 0}).unsqueeze(0);

  TttUnroll a(base, DraftModel(c, fixtures::spread_d2t(c), base.lm_head, 33), TttOptions{3, 0.9, std::nullopt});
  TttUnroll b(base, DraftModel(c, fixtures::spread_d2t(c), base.lm_head, 33), TttOptions{3, 0.9, std::nullopt});
  const TttResult ra = a.forward(two);
  const TttResult rb = b.forward(packed);
  CHECK(ra.stats.mask_sum == rb.stats.mask_sum);
  CHECK(ra.stats.correct == rb.stats.correct);
  CHECK(ra.stats.cond_correct == rb.stats.cond_correct);
  CHECK(ra.stats.cond_total == rb.stats.cond_total);
  CHECK(test::tensor_rel_diff(rb.ce_sum, ra.ce_sum) < 1e-5);
  ra.ce_sum.sum().backward();
  rb.ce_sum.sum().backward();
  const auto ga = grads_of(a.draft()), gb = grads_of(b.draft());
  for (std::size_t i = 0; i < ga.size(); ++i) CHECK(test::tensor_rel_diff(gb[i], ga[i]) < 1e-4);
}

TEST_CASE("ttt: pooled evaluation statistics do not depend on the batch size") {
  const DraftConfig c = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(c, 41);
  const TttBatch all = fixtures::random_batch(c, 4, 10, {10, 8, 10, 5}, 42);
  TttUnroll unroll(base, DraftModel(c, fixtures::spread_d2t(c), base.lm_head, 43));
  at::NoGradGuard no_grad;
  const TttStats whole = unroll.forward(all).stats;
  TttStats parts(3);
  for (std::int64_t first : {0, 2}) {
    TttBatch half;
    half.input_ids = all.input_ids.narrow(0, first, 2);
    half.attention_mask = all.attention_mask.narrow(0, first, 2);
    half.loss_mask = all.loss_mask.narrow(0, first, 2);
    half.hidden_states = all.hidden_states.narrow(0, first, 2);
    half.aux_hidden_states = all.aux_hidden_states.narrow(0, first, 2);
    parts += unroll.forward(half).stats;
  }
  CHECK(whole.mask_sum == parts.mask_sum);
  CHECK(whole.correct == parts.correct);
  CHECK(whole.cond_correct == parts.cond_correct);
  CHECK(whole.cond_total == parts.cond_total);
  for (std::int64_t s = 0; s < 3; ++s) CHECK(whole.ce_sum[s] == doctest::Approx(parts.ce_sum[s]).epsilon(1e-6));
  // loss_mask is 1 on tokens 2..n-1, so positions t = 1..n-2 count at step 0.
  CHECK(whole.mask_sum[0] == (10 - 2) + (8 - 2) + (10 - 2) + (5 - 2));
}

TEST_CASE("ttt: masks are built once per (L, step) and reused") {
  const DraftConfig c = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(c, 51);
  TttUnroll unroll(base, DraftModel(c, fixtures::spread_d2t(c), base.lm_head, 52));
  SingleRankContext context(TttAttention::kLocal);  // the path that builds masks (auto may be fused)
  at::NoGradGuard no_grad;
  for (int i = 0; i < 3; ++i) unroll.forward(fixtures::random_batch(c, 1, 8, {8}, 53 + i), &context);
  CHECK(context.masks().size() == 3);
  unroll.forward(fixtures::random_batch(c, 1, 6, {6}, 60), &context);
  CHECK(context.masks().size() == 6);
}

TEST_CASE("ttt: a bf16 base gives the targets of its float32 upcast (target head in the draft's dtype)") {
  const DraftConfig c = fixtures::tiny_config();
  BaseModel base16 = fixtures::random_base(c, 71);
  base16.embed_tokens = base16.embed_tokens.to(at::kBFloat16);
  base16.lm_head = base16.lm_head.to(at::kBFloat16);
  BaseModel base32 = base16;
  base32.embed_tokens = base16.embed_tokens.to(at::kFloat);
  base32.lm_head = base16.lm_head.to(at::kFloat);
  const DraftModel draft(c, fixtures::spread_d2t(c), base32.lm_head, 72);
  TttUnroll u16(base16, draft), u32(base32, draft);
  CHECK(std::string(c10::toString(u16.target_head().scalar_type())) == "Float");
  CHECK(at::equal(u16.target_head(), u32.target_head()));
  at::NoGradGuard no_grad;
  const TttBatch batch = fixtures::random_batch(c, 2, 8, {8, 5}, 73);
  CHECK(u16.forward(batch).loss.item<double>() == u32.forward(batch).loss.item<double>());
}

TEST_CASE("ttt: batch shape errors say which tensor is wrong") {
  const DraftConfig c = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(c, 61);
  TttUnroll unroll(base, DraftModel(c, fixtures::spread_d2t(c), base.lm_head, 62));
  TttBatch b = fixtures::random_batch(c, 2, 8, {8, 8}, 63);
  b.aux_hidden_states = b.aux_hidden_states.narrow(2, 0, 64);
  try {
    unroll.forward(b);
    FAIL("expected UsageError");
  } catch (const UsageError& e) {
    CHECK(std::string(e.what()) == "TTT batch: aux_hidden_states has shape [2, 8, 64], expected [2, 8, 96]");
  }
  CHECK_THROWS_AS(TttUnroll(base, DraftModel(c, fixtures::spread_d2t(c), at::Tensor()), TttOptions{0, 0.9, std::nullopt}),
                  UsageError);
  BaseModel wrong = base;
  wrong.embed_tokens = at::zeros({c.vocab_size, 16});
  CHECK_THROWS_AS(TttUnroll(wrong, DraftModel(c, fixtures::spread_d2t(c), at::Tensor())), UsageError);
}

TEST_CASE("ttt: bf16 autocast trains the same model closely") {
  const DraftConfig c = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(c, 71);
  const TttBatch batch = fixtures::random_batch(c, 2, 16, {16, 11}, 72);
  TttUnroll fp32(base, DraftModel(c, fixtures::spread_d2t(c), base.lm_head, 73), TttOptions{3, 0.9, std::nullopt});
  TttUnroll bf16(base, DraftModel(c, fixtures::spread_d2t(c), base.lm_head, 73), TttOptions{3, 0.9, at::kBFloat16});
  TttUnroll again(base, DraftModel(c, fixtures::spread_d2t(c), base.lm_head, 73), TttOptions{3, 0.9, std::nullopt});
  const TttResult a = fp32.forward(batch);
  const TttResult b = bf16.forward(batch);
  const TttResult a2 = again.forward(batch);
  CHECK((b.loss.scalar_type() == at::kFloat));
  // Two-sided: the same weights and batch, so the loss differs only by the arithmetic. Two
  // float32 runs agree to 1e-6 (the same ops in the same order); bf16 autocast moves it beyond
  // float32 rounding (1e-5 bounds that in every equivalence test) and within a few units of
  // bf16's 2^-8 precision. Autocast not applied would give the float32 loss.
  const double moved = test::rel_diff(b.loss.item<double>(), a.loss.item<double>());
  MESSAGE("bf16 autocast moves the loss by " << moved << " relative");
  CHECK(test::rel_diff(a2.loss.item<double>(), a.loss.item<double>()) <= 1e-6);
  CHECK(moved > 1e-5);
  CHECK(moved < 3e-2);
  a.loss.backward();
  b.loss.backward();
  const auto pa = fp32.draft().named_parameters(), pb = bf16.draft().named_parameters();
  REQUIRE(pa.size() == pb.size());
  double grads_moved = 0;
  for (std::size_t i = 0; i < pb.size(); ++i) {
    CAPTURE(pb[i].first);
    CHECK((pb[i].second.scalar_type() == at::kFloat));
    // Each gradient within bf16's reach of the float32 one (NaN counts as infinitely far).
    const double g = test::tensor_rel_diff(pb[i].second.grad(), pa[i].second.grad());
    CHECK(g < 0.1);
    grads_moved = test::worst_of(grads_moved, g);
  }
  MESSAGE("bf16 autocast moves the gradients by up to " << grads_moved << " relative");
  CHECK(grads_moved > 1e-5);
}

TEST_CASE("ttt: a short optimization raises step-0 accuracy far above chance") {
  const DraftConfig c = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(c, 81);
  TttUnroll unroll(base, DraftModel(c, fixtures::spread_d2t(c), base.lm_head, 84));
  const at::Tensor targets = unroll.draft().draft_to_target();
  const TttBatch train = fixtures::pattern_batch(c, base, targets, 8, 16, 82);
  const TttBatch held_out = fixtures::pattern_batch(c, base, targets, 8, 16, 83);
  torch::optim::Adam adam(unroll.draft().parameters(), torch::optim::AdamOptions(1e-2));
  auto evaluate = [&](const TttBatch& b) {
    at::NoGradGuard no_grad;
    return unroll.forward(b).stats;
  };
  const TttStats before = evaluate(held_out);
  const auto start = std::chrono::steady_clock::now();
  const int kSteps = 60;
  for (int i = 0; i < kSteps; ++i) {
    adam.zero_grad();
    unroll.forward(train).loss.backward();
    adam.step();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const TttStats trained = evaluate(train);
  const TttStats after = evaluate(held_out);
  const double chance = 1.0 / static_cast<double>(c.draft_vocab_size);
  MESSAGE("held-out step-0 acc " << before.acc()[0] << " -> " << after.acc()[0] << " (chance " << chance
                                 << "), steps 1-2 " << after.acc()[1] << ", " << after.acc()[2] << ", est_ar "
                                 << after.est_ar() << "; train acc " << trained.acc()[0] << "; " << kSteps
                                 << " steps in " << seconds << " s");
  CHECK(before.acc()[0] < 0.2);
  CHECK(trained.acc()[0] > 0.9);
  CHECK(after.acc()[0] > 0.8);
  CHECK(after.loss(0.9) < 0.5 * before.loss(0.9));
}

TEST_CASE("ttt: pre-norm hidden states with the base's final RMSNorm give the post-norm targets; without it they do not") {
  at::manual_seed(80);  // the norm weight and the scales below
  const DraftConfig c = fixtures::tiny_config();
  BaseModel base = fixtures::random_base(c, 81);
  base.config.rms_norm_eps = 1e-6;
  // A final-norm weight far from uniform, as real ones are.
  base.final_norm = at::exp(0.6 * at::randn({c.hidden_size}, at::TensorOptions().dtype(at::kFloat)));
  TttBatch post = fixtures::random_batch(c, 3, 12, {12, 9, 12}, 82);
  // Post-norm states: the norm weight times unit-RMS directions. Pre-norm states: the
  // directions at a per-token scale (1 to 20), the weight not applied.
  const at::Tensor u = post.hidden_states / at::sqrt(post.hidden_states.pow(2).mean(-1, true) + 1e-12);  // padding stays 0
  post.hidden_states = u * base.final_norm;
  TttBatch pre = post;
  pre.hidden_states = u * (5.0 + 45.0 * at::rand({3, 12, 1}, at::TensorOptions().dtype(at::kFloat)));

  const DraftModel draft(c, fixtures::spread_d2t(c), base.lm_head, 83);
  TttOptions plain{3, 0.9, std::nullopt};
  TttOptions prenorm = plain;
  prenorm.prenorm_hidden_states = true;
  at::NoGradGuard no_grad;
  const TttResult want = TttUnroll(base, draft, plain).forward(post);
  const TttResult got = TttUnroll(base, draft, prenorm).forward(pre);
  const TttResult wrong = TttUnroll(base, draft, plain).forward(pre);
  double wrong_by = 0;
  for (std::int64_t s = 0; s < 3; ++s) {
    const double w = want.ce_sum[s].item<double>();
    CHECK(std::abs(got.ce_sum[s].item<double>() - w) <= 1e-5 * std::abs(w));
    wrong_by = test::worst_of(wrong_by, test::rel_diff(wrong.ce_sum[s].item<double>(), w));
  }
  CHECK(wrong_by > 0.01);  // read as post-norm, the same states give other targets (1000x the tolerance)
  CHECK(got.stats.correct == want.stats.correct);

  BaseModel no_norm = base;
  no_norm.final_norm = at::Tensor();
  CHECK_THROWS_WITH_AS(TttUnroll(no_norm, draft, prenorm),
                       "--hidden-states-norm pre: the base in memory holds no final norm weight (model.norm.weight); "
                       "it is needed to turn pre-norm hidden states into the base's logits",
                       UsageError);
}

TEST_CASE("ttt: lm_head and the loss in chunks of rows equal the whole step (loss, metrics, every gradient)") {
  // trainer/model/soft_ce.h: the step's logits never whole; chunks of 1 row, uneven chunks, one
  // chunk larger than the batch, for a one- and a two-layer draft, fp32 and bf16 autocast.
  CHECK(auto_loss_chunk_rows(2048, 32000) == 0);  // 65.5M logits: under 2^26, kept whole
  CHECK(auto_loss_chunk_rows(4096, 32000) == (std::int64_t{1} << 26) / 32000);
  CHECK_THROWS_AS(chunked_soft_ce(at::zeros({2, 4}), at::zeros({3, 4}), at::zeros({2, 3}), at::zeros({2}), 0, at::kFloat),
                  UsageError);
  for (const std::int64_t layers : {1, 2}) {
    for (const bool bf16 : {false, true}) {
      CAPTURE(layers);
      CAPTURE(bf16);
      DraftConfig c = fixtures::tiny_config();
      c.num_hidden_layers = layers;
      const BaseModel base = fixtures::random_base(c, 41);
      const TttBatch batch = fixtures::random_batch(c, 3, 12, {12, 9, 7}, 42);
      auto run = [&](std::int64_t chunk) {
        TttOptions o{3, 0.8, std::nullopt};
        if (bf16) o.autocast = at::kBFloat16;
        o.loss_chunk_rows = chunk;
        TttUnroll unroll(base, DraftModel(c, fixtures::spread_d2t(c), base.lm_head, 43), o);
        TttResult r = unroll.forward(batch);
        r.loss.backward();
        return std::make_pair(r, grads_of(unroll.draft()));
      };
      const auto whole = run(0);
      for (const std::int64_t chunk : {1, 5, 7, 40}) {
        CAPTURE(chunk);
        const auto part = run(chunk);
        // bf16: the whole step's dW is one bf16 matmul, the chunked one sums chunks in fp32,
        // so they differ by bf16 rounding (2^-8 of the scale, a few ulps after the sums).
        const double tol = bf16 ? 3e-2 : 1e-5;
        CHECK(std::abs(part.first.loss.item<double>() - whole.first.loss.item<double>()) <=
              tol * std::abs(whole.first.loss.item<double>()));
        // The chunk's matmul may round otherwise than the whole one's (another BLAS kernel
        // for another shape): an argmax at a near-tie can flip, one position either way.
        for (std::size_t s = 0; s < whole.first.stats.correct.size(); ++s) {
          CHECK(std::abs(part.first.stats.correct[s] - whole.first.stats.correct[s]) <= 1);
          CHECK(std::abs(part.first.stats.cond_correct[s] - whole.first.stats.cond_correct[s]) <= 1);
        }
        CHECK(part.first.stats.mask_sum == whole.first.stats.mask_sum);
        check_grads_close(part.second, whole.second, tol);  // every parameter, lm_head included
      }
    }
  }
}

TEST_CASE("ttt: --recompute gives the loss, metrics and every gradient of the plain unroll and keeps no MLP activation") {
  // docs/ttt.md, "Recomputation": the layers' projections and MLPs rerun in backward. The
  // reruns are the same ops on the same values, so fp32 agrees to float rounding and bf16
  // autocast too (the rerun carries the autocast state; without it backward throws on the
  // dtypes).
  for (const std::int64_t layers : {1, 2}) {
    for (const bool bf16 : {false, true}) {
      CAPTURE(layers);
      CAPTURE(bf16);
      DraftConfig c = fixtures::tiny_config();
      c.num_hidden_layers = layers;
      c.intermediate_size = 256;  // 8 H: the MLP's activations dominate what a step keeps
      const BaseModel base = fixtures::random_base(c, 51);
      const TttBatch batch = fixtures::random_batch(c, 3, 40, {40, 31, 17}, 52);
      const std::int64_t steps = 3;
      auto run = [&](bool recompute) {
        TttOptions o{steps, 0.8, std::nullopt};
        if (bf16) o.autocast = at::kBFloat16;
        o.recompute = recompute;
        TttUnroll unroll(base, DraftModel(c, fixtures::spread_d2t(c), base.lm_head, 53), o);
        std::int64_t kept = 0;
        TttResult r;
        {
          CpuAllocationProbe probe;
          r = unroll.forward(batch);
          kept = probe.live_bytes();
          r.loss.backward();
        }
        for (const auto& [name, p] : unroll.draft().named_parameters()) {
          CAPTURE(name);
          CAPTURE(recompute);
          REQUIRE(p.grad().defined());
        }
        return std::make_tuple(r, grads_of(unroll.draft()), kept);
      };
      const auto [plain, plain_grads, plain_kept] = run(false);
      const auto [rec, rec_grads, rec_kept] = run(true);
      const double tol = bf16 ? 1e-3 : 1e-6;
      CHECK(std::abs(rec.loss.item<double>() - plain.loss.item<double>()) <= tol * std::abs(plain.loss.item<double>()));
      CHECK(rec.stats.correct == plain.stats.correct);
      CHECK(rec.stats.cond_correct == plain.stats.cond_correct);
      check_grads_close(rec_grads, plain_grads, tol);
      // The plain unroll keeps at least gate, up, silu(gate) * up ([B, L, I] each) per layer
      // and step; recomputation keeps none of them (what it keeps is O(H) per token).
      const std::int64_t mlp = 3 * 3 * 40 * c.intermediate_size * (bf16 ? 2 : 4) * steps * layers;
      MESSAGE("kept after forward: plain " << plain_kept << " B, recompute " << rec_kept << " B, MLP bound " << mlp);
      CHECK(plain_kept - rec_kept >= mlp);
    }
  }
}

// Mixed dumps: each token's stated form (TttBatch::hidden_states_prenorm, from its record)
// decides whether the final norm is applied, whatever the run's default.
TEST_CASE("ttt: a batch mixing stated pre- and post-norm tokens gives the all-post targets; ignoring the flags does not") {
  at::manual_seed(90);
  const DraftConfig c = fixtures::tiny_config();
  BaseModel base = fixtures::random_base(c, 91);
  base.config.rms_norm_eps = 1e-6;
  base.final_norm = at::exp(0.6 * at::randn({c.hidden_size}, at::TensorOptions().dtype(at::kFloat)));
  TttBatch post = fixtures::random_batch(c, 3, 12, {12, 9, 12}, 92);
  const at::Tensor u = post.hidden_states / at::sqrt(post.hidden_states.pow(2).mean(-1, true) + 1e-12);
  post.hidden_states = u * base.final_norm;
  const at::Tensor pre_states = u * (5.0 + 45.0 * at::rand({3, 12, 1}, at::TensorOptions().dtype(at::kFloat)));
  // Row 0 pre-norm, row 1 post-norm, row 2 (as in a packed row of two records) pre-norm on
  // tokens 0..5 and post-norm on 6..11. Padding states no form.
  at::Tensor flags = at::zeros({3, 12}, at::kChar);
  flags[0].fill_(1);
  flags[1].narrow(0, 9, 3).fill_(-1);
  flags[2].narrow(0, 0, 6).fill_(1);
  TttBatch mixed = post;
  mixed.hidden_states = at::where((flags == 1).unsqueeze(-1), pre_states, post.hidden_states);
  mixed.hidden_states_prenorm = flags;

  const DraftModel draft(c, fixtures::spread_d2t(c), base.lm_head, 93);
  TttOptions plain{3, 0.9, std::nullopt};
  TttOptions prenorm = plain;
  prenorm.prenorm_hidden_states = true;
  at::NoGradGuard no_grad;
  const TttResult want = TttUnroll(base, draft, plain).forward(post);
  auto rel_gap = [&](const TttResult& r) {
    double gap = 0;
    for (std::int64_t s = 0; s < 3; ++s) {
      const double w = want.ce_sum[s].item<double>();
      gap = test::worst_of(gap, test::rel_diff(r.ce_sum[s].item<double>(), w));
    }
    return gap;
  };
  // The stated forms win over either default.
  const TttResult got = TttUnroll(base, draft, plain).forward(mixed);
  CHECK(rel_gap(got) <= 1e-5);
  CHECK(got.stats.correct == want.stats.correct);
  CHECK(rel_gap(TttUnroll(base, draft, prenorm).forward(mixed)) <= 1e-5);
  // Tokens that state nothing take the default: row 0's pre-norm tokens unflagged, default pre.
  TttBatch unstated = mixed;
  unstated.hidden_states_prenorm = flags.clone();
  unstated.hidden_states_prenorm[0].fill_(-1);
  CHECK(rel_gap(TttUnroll(base, draft, prenorm).forward(unstated)) <= 1e-5);
  CHECK(rel_gap(TttUnroll(base, draft, plain).forward(unstated)) > 0.01);  // ... and post is wrong for them

  // Must fail: the same states with the flags ignored, either way.
  TttBatch ignored = mixed;
  ignored.hidden_states_prenorm = at::Tensor();
  CHECK(rel_gap(TttUnroll(base, draft, plain).forward(ignored)) > 0.01);
  CHECK(rel_gap(TttUnroll(base, draft, prenorm).forward(ignored)) > 0.01);

  // A stated pre-norm token needs the norm weight.
  BaseModel no_norm = base;
  no_norm.final_norm = at::Tensor();
  CHECK_THROWS_WITH_AS(TttUnroll(no_norm, draft, plain).forward(mixed),
                       "TTT batch: records state pre-norm hidden states but the base was loaded without its final "
                       "norm weight (model.norm.weight)",
                       UsageError);
  CHECK_NOTHROW(TttUnroll(no_norm, draft, plain).forward(post));
}

// The whole path of a record's stated form: Record::hidden_states_prenorm -> collate (per
// token, packed rows too) -> to_ttt_batch -> the targets.
TEST_CASE("ttt: mixed pre/post records collate and train to the targets of the all-post records") {
  at::manual_seed(95);
  const DraftConfig c = fixtures::tiny_config();
  BaseModel base = fixtures::random_base(c, 96);
  base.config.rms_norm_eps = 1e-6;
  base.final_norm = at::exp(0.6 * at::randn({c.hidden_size}, at::TensorOptions().dtype(at::kFloat)));
  const std::vector<std::int64_t> lengths = {12, 9, 14, 7};
  std::vector<Record> post_records, mixed_records;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    const std::int64_t n = lengths[i];
    const at::Tensor ids = at::randint(c.vocab_size, {n}, at::kLong);
    const at::Tensor dir = at::randn({n, c.hidden_size});
    const at::Tensor unit = dir / at::sqrt(dir.pow(2).mean(-1, true));
    const at::Tensor aux = at::randn({n, c.aux_width()});
    Record r;
    r.conversation_id = "r" + std::to_string(i);
    r.input_ids = to_host_tensor(ids);
    r.hidden_states = to_host_tensor(unit * base.final_norm);
    r.aux_hidden_states = to_host_tensor(aux);
    post_records.push_back(r);
    if (i % 2 == 0) {  // records 0 and 2: dumped before the final norm, and they say so
      r.hidden_states = to_host_tensor(unit * (3.0 + 30.0 * at::rand({n, 1})));
      r.hidden_states_prenorm = true;
    } else {
      r.hidden_states_prenorm = false;
    }
    mixed_records.push_back(r);
  }
  const DraftModel draft(c, fixtures::spread_d2t(c), base.lm_head, 97);
  TttOptions plain{3, 0.9, std::nullopt};
  at::NoGradGuard no_grad;
  for (const CollateMode mode : {CollateMode::kPad, CollateMode::kPack}) {
    CAPTURE(collate_mode_name(mode));
    CollateOptions co;
    co.mode = mode;
    co.max_length = 24;
    const Batch post_batch = collate_records(post_records, co);
    const Batch mixed_batch = collate_records(mixed_records, co);
    REQUIRE(mixed_batch.hidden_states_prenorm.defined());
    CHECK_FALSE(post_batch.hidden_states_prenorm.defined());
    // Per token: every real token carries its record's form, padding -1.
    CHECK(mixed_batch.hidden_states_prenorm.ne(-1).sum().item<std::int64_t>() == mixed_batch.tokens);
    const TttResult want = TttUnroll(base, draft, plain).forward(to_ttt_batch(post_batch));
    const TttResult got = TttUnroll(base, draft, plain).forward(to_ttt_batch(mixed_batch));
    TttBatch ignored = to_ttt_batch(mixed_batch);
    ignored.hidden_states_prenorm = at::Tensor();
    const TttResult wrong = TttUnroll(base, draft, plain).forward(ignored);
    double gap = 0, wrong_gap = 0;
    for (std::int64_t s = 0; s < 3; ++s) {
      const double w = want.ce_sum[s].item<double>();
      gap = test::worst_of(gap, test::rel_diff(got.ce_sum[s].item<double>(), w));
      wrong_gap = test::worst_of(wrong_gap, test::rel_diff(wrong.ce_sum[s].item<double>(), w));
    }
    CHECK(gap <= 1e-5);
    CHECK(got.stats.correct == want.stats.correct);
    CHECK(wrong_gap > 0.01);  // must fail: the flags dropped, the pre-norm records give other targets
  }
}
