// Training on NeMo AutoModel's EAGLE-3 cache (formats/nemo_cache_format.h, docs/formats.md):
// the stored target distribution takes the place of softmax(lm_head . last hidden state).
//
// The oracle: a NeMo cache written here, in NeMo's layout (shifted ids and masks, position_mask,
// target_probs[t] = the base's draft-vocabulary distribution read at position t+1), from a known
// base and known last hidden states, trains exactly as the same records with those hidden
// states do through eaglekit's own path: loss, per-step sums, metrics and gradients.
#include "tests/torch_doctest.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "formats/error.h"
#include "formats/nemo_cache_format.h"
#include "formats/safetensors_format.h"
#include "lib/collate.h"
#include "tests/support.h"
#include "tests/tensor_compare.h"
#include "tests/trainer/trainer_fixtures.h"
#include "trainer/model/base_model.h"
#include "trainer/model/soft_ce.h"
#include "trainer/run/run_setup.h"
#include "trainer/unroll/ttt.h"

using namespace eaglekit;
using namespace eaglekit::trainer;

namespace {

constexpr std::int64_t kSeq = 10;  // the cache's seq_length S

// Vd distinct target ids, not ascending (NeMo's build_eagle3_token_mapping puts the special
// tokens first, then the most frequent): the sorted spread_d2t targets in a shuffled order.
std::vector<std::int64_t> selected_ids(const DraftConfig& c) {
  const at::Tensor d2t = fixtures::spread_d2t(c);
  std::vector<std::int64_t> sorted;
  for (std::int64_t i = 0; i < c.draft_vocab_size; ++i) sorted.push_back(i + d2t[i].item<std::int64_t>());
  std::vector<std::int64_t> out;
  for (std::int64_t i = 0; i < c.draft_vocab_size; ++i)
    out.push_back(sorted[static_cast<std::size_t>((5 * i + 3) % c.draft_vocab_size)]);  // 5 is prime to 24
  return out;
}

at::Tensor d2t_of(const std::vector<std::int64_t>& selected) {
  at::Tensor d = at::empty({static_cast<std::int64_t>(selected.size())}, at::kLong);
  for (std::size_t i = 0; i < selected.size(); ++i) d[static_cast<std::int64_t>(i)] = selected[i] - static_cast<std::int64_t>(i);
  return d;
}

// One conversation as eaglekit's own dump would hold it, and the distribution the base gives.
struct Sample {
  at::Tensor ids, hs, aux, loss;  // [T], [T, H], [T, kH], [T] (the conversation's mask)
  at::Tensor p;                   // [T, Vd]: p_full[j] = softmax(target_head . hs[j])
  at::Tensor in_vocab;            // [T] bool: the base's argmax over all V at j is a draft token
};

std::vector<Sample> make_samples(const DraftConfig& c, const BaseModel& base, const std::vector<std::int64_t>& sel,
                                 const std::vector<std::int64_t>& lengths, std::uint64_t seed) {
  at::manual_seed(seed);
  const at::Tensor sel_t = at::tensor(sel, at::kLong);
  const at::Tensor head = base.lm_head.to(at::kFloat).index_select(0, sel_t);
  std::vector<Sample> out;
  for (const std::int64_t t : lengths) {
    Sample s;
    s.ids = at::randint(1, c.vocab_size, {t}, at::kLong);
    s.hs = at::randn({t, c.hidden_size});
    s.aux = at::randn({t, c.aux_width()});
    s.loss = at::ones({t}, at::kLong);
    s.loss.narrow(0, 0, 2).zero_();
    s.p = at::softmax(at::matmul(s.hs, head.t()), -1);
    const at::Tensor full_argmax = at::matmul(s.hs, base.lm_head.to(at::kFloat).t()).argmax(-1);
    s.in_vocab = at::isin(full_argmax, sel_t);
    out.push_back(s);
  }
  return out;
}

// eaglekit's own record: the last hidden states, and NeMo's position_mask condition folded
// into the loss mask (the target's argmax inside the draft vocabulary), so both see one mask.
Record own_record(const Sample& s, std::size_t i) {
  Record r;
  r.conversation_id = std::to_string(i);
  r.input_ids = to_host_tensor(s.ids);
  r.hidden_states = to_host_tensor(s.hs);
  r.aux_hidden_states = to_host_tensor(s.aux);
  r.loss_mask = to_host_tensor(s.loss * s.in_vocab.to(at::kLong));
  return r;
}

// NeMo's layout (docs/formats.md): input_ids and loss_mask shifted left by one with a zero
// tail, attention_mask a prefix of ones, aux not shifted, position_mask[t] = loss_mask[t+1] and
// the argmax at t+1 in the draft vocabulary, target_probs[t] = p_full[t+1]; rows from T-1 on
// hold the softmax of zero logits (uniform), as NeMo's zero-filled shifted logits give.
// `topk` > 0: the top k of each row, renormalised, as compress_target_probs stores them.
void write_cache(const std::string& dir, const DraftConfig& c, const std::vector<Sample>& samples,
                 const std::vector<std::int64_t>& sel, std::int64_t shard_size, std::int64_t topk = 0) {
  std::filesystem::create_directories(dir);
  const std::int64_t n = static_cast<std::int64_t>(samples.size()), vd = c.draft_vocab_size;
  nlohmann::ordered_json m;
  m["aux_hidden_dim"] = c.aux_width();
  m["aux_layer_ids"] = {1, 2, 3};
  m["draft_vocab_size"] = vd;
  m["dtype"] = "fp32";
  m["format_version"] = 2;
  m["num_samples"] = n;
  m["selected_token_ids"] = sel;
  m["seq_length"] = kSeq;
  m["shard_size"] = shard_size;
  m["target_probs_topk"] = topk;
  m["target_vocab_size"] = c.vocab_size;
  std::ofstream(dir + "/manifest.json") << m.dump(2);
  for (std::int64_t s0 = 0, shard = 0; s0 < n; s0 += shard_size, ++shard) {
    const std::int64_t rows = std::min(shard_size, n - s0);
    at::Tensor ids = at::zeros({rows, kSeq}, at::kLong), attn = at::zeros({rows, kSeq}, at::kLong),
               loss = at::zeros({rows, kSeq}, at::kLong), aux = at::zeros({rows, kSeq, c.aux_width()}),
               pm = at::zeros({rows, kSeq, 1}, at::kBool), probs = at::full({rows, kSeq, vd}, 1.0 / vd);
    for (std::int64_t r = 0; r < rows; ++r) {
      const Sample& s = samples[static_cast<std::size_t>(s0 + r)];
      const std::int64_t t = s.ids.size(0);
      attn[r].narrow(0, 0, t).fill_(1);
      aux[r].narrow(0, 0, t).copy_(s.aux);
      ids[r].narrow(0, 0, t - 1).copy_(s.ids.narrow(0, 1, t - 1));
      loss[r].narrow(0, 0, t - 1).copy_(s.loss.narrow(0, 1, t - 1));
      pm[r].narrow(0, 0, t - 1).copy_((s.loss.narrow(0, 1, t - 1).to(at::kBool) & s.in_vocab.narrow(0, 1, t - 1)).unsqueeze(-1));
      probs[r].narrow(0, 0, t - 1).copy_(s.p.narrow(0, 1, t - 1));
    }
    std::vector<std::pair<std::string, at::Tensor>> t = {{"input_ids", ids},       {"attention_mask", attn},
                                                         {"loss_mask", loss},      {"aux_hidden_states", aux},
                                                         {"position_mask", pm}};
    if (topk > 0) {
      const auto top = probs.topk(topk, -1);
      at::Tensor values = std::get<0>(top);
      values = values / values.sum(-1, true);
      t.push_back({"target_probs_values", values});
      t.push_back({"target_probs_indices", std::get<1>(top).to(at::kInt)});
    } else {
      t.push_back({"target_probs", probs});
    }
    char name[40];
    std::snprintf(name, sizeof name, "/shard-%06lld.safetensors", static_cast<long long>(shard));
    fixtures::write_tensors(dir + name, t);
  }
}

std::vector<Record> read_all(const std::string& manifest) {
  const auto reader = NemoCacheReader::open(manifest);
  std::vector<Record> out;
  for (std::size_t i = 0; i < reader->size(); ++i) out.push_back(reader->read(i));
  return out;
}

struct Step {
  TttResult result;
  std::vector<at::Tensor> grads;
};

Step train_step(const BaseModel& base, const DraftConfig& c, const at::Tensor& d2t, const Batch& batch,
                TttOptions options = TttOptions{3, 0.8, std::nullopt}) {
  TttUnroll unroll(base, DraftModel(c, d2t, base.lm_head, 33), options);
  Step s;
  s.result = unroll.forward(to_ttt_batch(batch));
  s.result.loss.backward();
  for (const auto& [name, p] : unroll.draft().named_parameters())
    s.grads.push_back(p.grad().defined() ? p.grad().clone() : at::zeros_like(p));
  return s;
}

// Loss, per-step sums, metrics and every gradient of two steps agree to `rel`.
void check_same_step(const Step& a, const Step& b, double rel) {
  CHECK(test::tensor_rel_diff(a.result.loss, b.result.loss) < rel);
  CHECK(test::tensor_rel_diff(a.result.ce_sum, b.result.ce_sum) < rel);
  CHECK(a.result.stats.mask_sum == b.result.stats.mask_sum);
  CHECK(a.result.stats.correct == b.result.stats.correct);
  CHECK(a.result.stats.cond_total == b.result.stats.cond_total);
  REQUIRE(a.grads.size() == b.grads.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.grads.size(); ++i) worst = std::max(worst, test::tensor_rel_diff(a.grads[i], b.grads[i]));
  CHECK_MESSAGE(worst < rel, "largest relative gradient difference " << worst);
}

}  // namespace

TEST_CASE("nemo train: a NeMo cache of the base's own distributions trains as the dump of its last hidden states") {
  const DraftConfig c = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(c, 401);
  const std::vector<std::int64_t> sel = selected_ids(c);
  const at::Tensor d2t = d2t_of(sel);
  const std::vector<Sample> samples = make_samples(c, base, sel, {7, 10, 5}, 402);
  test::TempDir dir("nemo-train");
  write_cache(dir / "cache", c, samples, sel, 2);

  const std::vector<Record> cached = read_all(dir / "cache/manifest.json");
  REQUIRE(cached.size() == samples.size());
  std::vector<Record> own;
  for (std::size_t i = 0; i < samples.size(); ++i) own.push_back(own_record(samples[i], i));
  // Some positions are dropped by the draft-vocabulary condition of position_mask, and some
  // kept: the mask is exercised both ways.
  std::int64_t kept = 0, dropped = 0;
  for (const Sample& s : samples) {
    kept += (s.loss.to(at::kBool) & s.in_vocab).narrow(0, 1, s.ids.size(0) - 1).sum().item<std::int64_t>();
    dropped += (s.loss.to(at::kBool) & ~s.in_vocab).narrow(0, 1, s.ids.size(0) - 1).sum().item<std::int64_t>();
  }
  CHECK(kept > 5);
  CHECK(dropped > 0);

  for (const CollateMode mode : {CollateMode::kPad, CollateMode::kPack}) {
    CAPTURE(collate_mode_name(mode));
    CollateOptions co;
    co.mode = mode;
    co.max_length = mode == CollateMode::kPack ? 24 : kSeq;
    const Batch from_cache = collate_records(cached, co), from_dump = collate_records(own, co);
    REQUIRE(from_cache.target_probs.defined());
    CHECK_FALSE(from_cache.hidden_states.defined());
    CHECK(from_cache.target_probs.sizes() == at::IntArrayRef({from_dump.rows(), co.max_length, c.draft_vocab_size}));
    CHECK(at::equal(from_cache.loss_mask, from_dump.loss_mask));
    CHECK(at::equal(from_cache.attention_mask, from_dump.attention_mask));
    // Token 0 of each conversation is not stored (NeMo shifts it out); nothing trained reads it.
    const at::Tensor keep = at::arange(co.max_length).unsqueeze(0) > 0;
    if (mode == CollateMode::kPad) CHECK(at::equal(from_cache.input_ids * keep, from_dump.input_ids * keep));

    const Step a = train_step(base, c, d2t, from_cache), b = train_step(base, c, d2t, from_dump);
    CHECK(a.result.stats.mask_sum[0] == static_cast<double>(kept));
    check_same_step(a, b, 1e-6);
  }
}

TEST_CASE("nemo train: a NeMo cache with top k trains as the full cache of the distribution its reader rebuilds") {
  const DraftConfig c = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(c, 411);
  const std::vector<std::int64_t> sel = selected_ids(c);
  const at::Tensor d2t = d2t_of(sel);
  std::vector<Sample> samples = make_samples(c, base, sel, {9, 6, 10, 8}, 412);
  test::TempDir dir("nemo-train-topk");
  write_cache(dir / "topk", c, samples, sel, 3, /*topk=*/4);
  // The distribution NeMo's reader rebuilds: the top 4 renormalised, zeros elsewhere.
  for (Sample& s : samples) {
    const auto top = s.p.topk(4, -1);
    const at::Tensor v = std::get<0>(top) / std::get<0>(top).sum(-1, true);
    s.p = at::zeros_like(s.p).scatter_(-1, std::get<1>(top), v);
  }
  write_cache(dir / "full", c, samples, sel, 3, 0);
  const std::vector<Record> topk = read_all(dir / "topk/manifest.json"), full = read_all(dir / "full/manifest.json");
  REQUIRE(topk.size() == full.size());
  for (std::size_t i = 0; i < topk.size(); ++i) {
    REQUIRE(topk[i].target_probs);
    // Rows up to T-2 are the renormalised top 4 of the same values: equal up to the rounding
    // of the renormalisation, done once in either cache.
    const at::Tensor a = tensor_from_host(*topk[i].target_probs), b = tensor_from_host(*full[i].target_probs);
    const std::int64_t t = a.size(0);
    CHECK(test::tensor_rel_diff(a.narrow(0, 0, t - 1), b.narrow(0, 0, t - 1)) < 1e-6);
    CHECK((a > 0).sum(-1).max().item<std::int64_t>() == 4);
  }
  CollateOptions co;
  co.max_length = kSeq;
  check_same_step(train_step(base, c, d2t, collate_records(topk, co)), train_step(base, c, d2t, collate_records(full, co)),
                  1e-6);
}

TEST_CASE("nemo train: the unroll refuses a loss that needs the base's logits, naming it") {
  const DraftConfig c = fixtures::tiny_config();
  const BaseModel base = fixtures::random_base(c, 421);
  const std::vector<std::int64_t> sel = selected_ids(c);
  const std::vector<Sample> samples = make_samples(c, base, sel, {6, 8}, 422);
  test::TempDir dir("nemo-train-loss");
  write_cache(dir / "cache", c, samples, sel, 2);
  CollateOptions co;
  co.max_length = kSeq;
  const Batch batch = collate_records(read_all(dir / "cache/manifest.json"), co);
  TttOptions o{3, 0.8, std::nullopt};
  o.loss_terms = parse_loss_spec("rkl");
  TttUnroll unroll(base, DraftModel(c, d2t_of(sel), base.lm_head, 33), o);
  try {
    unroll.forward(to_ttt_batch(batch));
    FAIL("an rkl step on stored probabilities ran");
  } catch (const UsageError& e) {
    CHECK(std::string(e.what()).find("--loss rkl") != std::string::npos);
    CHECK(std::string(e.what()).find("kl (the soft cross-entropy)") != std::string::npos);
  }
}

TEST_CASE("nemo train: the stored targets and weights of NeMo's own caches give NeMo's own loss at every TTT step") {
  // tests/data/nemo_cache/make_loss_fixture.py: NeMo's masked_soft_cross_entropy on the
  // CachedEagle3Dataset samples, the targets and masks rolled per step by NeMo's own
  // _shift_left_with_zero; the logits at slot j stand for the chain that starts at j.
  for (const std::string name : {"lossless", "topk"}) {
    CAPTURE(name);
    const std::string fx = test::source_dir() + "/tests/data/nemo_cache/";
    const std::vector<Record> records = read_all(fx + name + "/manifest.json");
    CollateOptions co;
    co.max_length = 8;
    const Batch b = collate_records(records, co);
    const auto want = SafetensorsFile::open(fx + "expected/" + name + "_soft_ce.safetensors");
    const at::Tensor logits = tensor_from_host(*want->get("logits")).to(at::kFloat);
    const at::Tensor loss = tensor_from_host(*want->get("loss")).to(at::kFloat);
    REQUIRE(logits.sizes() == b.target_probs.sizes());
    SingleRankContext cx;
    // What the unroll takes (trainer/unroll/ttt.cpp): p[t] = target_probs[t], w[t] = loss_mask[t+1].
    const at::Tensor p = b.target_probs.to(at::kFloat);
    const at::Tensor w = cx.shift_left(b.loss_mask.to(at::kFloat));
    const at::Tensor positions = at::arange(8, at::kLong);
    at::Tensor step_logits = logits;
    for (std::int64_t k = 0; k < 3; ++k) {
      CAPTURE(k);
      // eaglekit's chain from position j sits at position j + k in step k.
      if (k > 0) step_logits = cx.shift_right(step_logits);
      const at::Tensor weight = w * (positions >= k).to(at::kFloat);
      const SoftCeResult r = chunked_soft_ce(step_logits.reshape({-1, 16}), at::eye(16), p.reshape({-1, 16}),
                                             weight.reshape({-1}), 8, at::kFloat);
      const double ours = (r.ce_sum / weight.sum()).item<double>(), theirs = loss[k].item<double>();
      CHECK(std::abs(ours - theirs) <= 1e-6 * std::abs(theirs));
    }
  }
}
