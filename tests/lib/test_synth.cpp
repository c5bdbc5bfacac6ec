#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "formats/error.h"
#include "formats/format.h"
#include "formats/safetensors_format.h"
#include "lib/synth.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;

namespace {

SynthOptions small(const std::string& out) {
  SynthOptions o;
  o.out_dir = out;
  o.conversations = 12;
  o.hidden = 32;
  o.vocab = 256;
  o.min_tokens = 8;
  o.max_tokens = 40;
  o.seed = 7;
  return o;
}

std::map<std::string, std::vector<std::uint8_t>> tree(const std::string& root) {
  std::map<std::string, std::vector<std::uint8_t>> files;
  for (const auto& e : fs::recursive_directory_iterator(root))
    if (e.is_regular_file())
      files[fs::relative(e.path(), root).string()] = test::read_bytes(e.path().string());
  return files;
}

// Row t of a [T, H] tensor as floats.
std::vector<double> row(const HostTensor& t, std::int64_t r) {
  std::vector<double> out(static_cast<std::size_t>(t.shape[1]));
  const HostTensor one = t.slice_rows(r, r + 1).contiguous();
  for (std::int64_t i = 0; i < t.shape[1]; ++i) out[static_cast<std::size_t>(i)] = one.get(i);
  return out;
}

std::int64_t argmax_logit(const HostTensor& lm_head, const std::vector<double>& h) {
  const HostTensor w = lm_head.contiguous();
  std::int64_t best = 0;
  double best_v = -1e300;
  for (std::int64_t v = 0; v < w.shape[0]; ++v) {
    double s = 0;
    for (std::int64_t i = 0; i < w.shape[1]; ++i) s += w.get(v * w.shape[1] + i) * h[static_cast<std::size_t>(i)];
    if (s > best_v) {
      best_v = s;
      best = v;
    }
  }
  return best;
}

double cosine(const std::vector<double>& a, const std::vector<double>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    ab += a[i] * b[i];
    aa += a[i] * a[i];
    bb += b[i] * b[i];
  }
  return ab / std::sqrt(aa * bb + 1e-30);
}

}  // namespace

TEST_CASE("synth: the same seed gives the same bytes whatever --jobs is") {
  test::TempDir dir("synth");
  SynthOptions a = small(dir / "a");
  a.jobs = 1;
  a.base_out = dir / "a-base";
  SynthOptions b = small(dir / "b");
  b.jobs = 2;
  b.base_out = dir / "b-base";
  const SynthResult ra = synthesize(a);
  synthesize(b);
  CHECK(ra.conversations == 12);
  const auto ta = tree(a.out_dir), tb = tree(b.out_dir);
  CHECK(ta.size() == 13);  // 12 records + conversations.jsonl
  CHECK(ta == tb);
  CHECK(tree(a.base_out) == tree(b.base_out));
  std::int64_t bytes = 0;
  for (const auto& [name, content] : ta)
    if (name != "conversations.jsonl") bytes += static_cast<std::int64_t>(content.size());
  CHECK(ra.bytes == bytes);

  SynthOptions c = small(dir / "c");
  c.seed = 8;
  synthesize(c);
  CHECK(tree(c.out_dir) != ta);
}

TEST_CASE("synth: records have the requested shapes, dtypes, ids and nested folders") {
  test::TempDir dir("synth");
  for (const auto& [dt, name] : std::vector<std::pair<DType, std::string>>{
           {DType::kBFloat16, "bf16"}, {DType::kFloat16, "fp16"}, {DType::kFloat32, "fp32"}}) {
    CAPTURE(name);
    SynthOptions o = small(dir / name);
    o.dtype = dt;
    o.aux_layers = name == "fp32" ? 2 : 3;
    const SynthResult r = synthesize(o);
    std::ifstream jsonl(r.jsonl_path);
    std::string line;
    std::int64_t n = 0, tokens = 0;
    SynthGenerator gen(o);
    while (std::getline(jsonl, line)) {
      const auto j = nlohmann::json::parse(line);
      const std::string id = j["conversation_id"].get<std::string>();
      CHECK(id == gen.conversation_id(n));
      REQUIRE(j["conversations"].size() == 2);
      CHECK(j["conversations"][0]["role"] == "user");
      CHECK(j["conversations"][1]["role"] == "assistant");
      CHECK_FALSE(j["conversations"][1]["content"].get<std::string>().empty());
      const std::string path = (fs::path(o.out_dir) / gen.record_path(n)).string();
      CHECK(fs::path(path).stem() == id);
      const auto reader = open_reader(path);
      CHECK(reader->format() == Format::kPt);
      const Record rec = reader->read(0);
      CHECK(rec.conversation_id == id);
      const std::int64_t t = rec.tokens();
      CHECK(t >= o.min_tokens);
      CHECK(t <= o.max_tokens);
      CHECK(rec.input_ids.dtype == DType::kInt64);
      CHECK(rec.hidden_states.dtype == dt);
      CHECK(rec.hidden_states.shape == std::vector<std::int64_t>{t, 32});
      CHECK(rec.aux_hidden_states.shape == std::vector<std::int64_t>{t, o.aux_layers * 32});
      for (std::int64_t i = 0; i < t; ++i) {
        CHECK(rec.input_ids.get(i) >= 0);
        CHECK(rec.input_ids.get(i) < o.vocab);
      }
      // What the generator gives in memory is what was written.
      const Record mem = gen.record(n);
      CHECK(mem.input_ids.equal(rec.input_ids));
      CHECK(mem.hidden_states.equal(rec.hidden_states));
      CHECK(mem.aux_hidden_states.equal(rec.aux_hidden_states));
      tokens += t;
      ++n;
    }
    CHECK(n == 12);
    CHECK(r.tokens == tokens);
    CHECK(fs::is_directory(dir / name + "/records/000/more"));  // some records nested deeper
  }
  SynthOptions s = small(dir / "st");
  s.format = Format::kSafetensors;
  s.conversations = 2;
  synthesize(s);
  CHECK(open_reader(dir / "st/records/000/synth-000001.safetensors")->read(0).tokens() >= 8);
}

TEST_CASE("synth: lm_head of the base model predicts the next token far above chance") {
  test::TempDir dir("synth");
  SynthOptions o = small(dir / "d");
  o.hidden = 64;
  o.vocab = 512;
  o.conversations = 6;
  o.base_out = dir / "base";
  synthesize(o);
  const auto weights = SafetensorsWeights::open_folder(o.base_out);
  const HostTensor lm_head = *weights.get("lm_head.weight");
  const HostTensor embed = *weights.get("model.embed_tokens.weight");
  CHECK(lm_head.shape == std::vector<std::int64_t>{512, 64});
  CHECK(embed.shape == std::vector<std::int64_t>{512, 64});
  CHECK(lm_head.dtype == DType::kBFloat16);
  const auto cfg = nlohmann::json::parse(test::read_bytes(o.base_out + "/config.json"));
  CHECK(cfg["hidden_size"] == 64);
  CHECK(cfg["vocab_size"] == 512);
  CHECK(cfg["architectures"][0] == "LlamaForCausalLM");
  CHECK(cfg["num_attention_heads"].get<int>() * cfg["head_dim"].get<int>() == 64);
  CHECK(cfg["tie_word_embeddings"] == false);
  CHECK(cfg["torch_dtype"] == "bfloat16");
  for (const char* key : {"num_key_value_heads", "intermediate_size", "rms_norm_eps", "rope_theta",
                          "max_position_embeddings"})
    CHECK(cfg.contains(key));

  SynthGenerator gen(o);
  std::int64_t hits = 0, oracle = 0, total = 0;
  for (std::int64_t c = 0; c < o.conversations; ++c) {
    const Record r = open_reader(fs::path(o.out_dir) / gen.record_path(c))->read(0);
    for (std::int64_t t = 0; t + 1 < r.tokens(); ++t) {
      const auto next = static_cast<std::int64_t>(r.input_ids.get(t + 1));
      const auto cur = static_cast<std::int64_t>(r.input_ids.get(t));
      hits += argmax_logit(lm_head, row(r.hidden_states, t)) == next;
      oracle += gen.successors(cur).ids.front() == next;
      ++total;
    }
  }
  const double acc = static_cast<double>(hits) / static_cast<double>(total);
  const double best = static_cast<double>(oracle) / static_cast<double>(total);
  MESSAGE("lm_head next-token accuracy " << acc << ", oracle " << best << ", chance " << 1.0 / 512);
  CHECK(total > 100);
  CHECK(acc > 0.3);              // chance is 0.002
  CHECK(acc > 0.9 * best);  // nearly what a perfect predictor gets
}

TEST_CASE("synth: aux states identify the current token; activations are heavy-tailed") {
  SynthOptions o = small("unused");
  o.hidden = 64;
  o.vocab = 64;  // few tokens, so that repeats are common
  SynthGenerator gen(o);
  const Record r = gen.record(3);
  REQUIRE(r.tokens() >= 8);
  // Layer 0, centered per channel over the positions (what a learned linear map sees; it
  // removes the outlier channels' shared offset).
  std::vector<std::vector<double>> layer0;
  std::vector<double> mean(64, 0.0);
  for (std::int64_t a = 0; a < r.tokens(); ++a) {
    const auto ra = row(r.aux_hidden_states, a);
    layer0.emplace_back(ra.begin(), ra.begin() + 64);
    for (std::size_t c = 0; c < 64; ++c) mean[c] += ra[c] / static_cast<double>(r.tokens());
  }
  for (auto& l : layer0)
    for (std::size_t c = 0; c < 64; ++c) l[c] -= mean[c];
  double same = 0, diff = 0;
  int n_same = 0, n_diff = 0;
  for (std::int64_t a = 0; a < r.tokens(); ++a)
    for (std::int64_t b = a + 1; b < r.tokens(); ++b) {
      const double cs = cosine(layer0[static_cast<std::size_t>(a)], layer0[static_cast<std::size_t>(b)]);
      if (r.input_ids.get(a) == r.input_ids.get(b)) {
        same += cs;
        ++n_same;
      } else {
        diff += cs;
        ++n_diff;
      }
    }
  REQUIRE(n_same > 0);
  MESSAGE("aux layer 0 cosine: same token " << same / n_same << ", different " << diff / n_diff);
  CHECK(same / n_same > diff / n_diff + 0.3);

  // Outlier channels: a few channels far above the typical magnitude, in every token.
  const HostTensor h = r.hidden_states.contiguous();
  const std::int64_t t = r.tokens(), hs = 64;
  std::vector<double> mean_abs(static_cast<std::size_t>(hs), 0);
  double sum2 = 0, sum4 = 0;
  std::int64_t n = 0;
  for (std::int64_t i = 0; i < t; ++i)
    for (std::int64_t c = 0; c < hs; ++c) mean_abs[static_cast<std::size_t>(c)] += std::fabs(h.get(i * hs + c)) / t;
  std::vector<double> sorted = mean_abs;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  int outliers = 0;
  for (std::int64_t c = 0; c < hs; ++c) {
    if (mean_abs[static_cast<std::size_t>(c)] > 5 * median) {
      ++outliers;
      continue;
    }
    for (std::int64_t i = 0; i < t; ++i) {
      const double x = h.get(i * hs + c);
      sum2 += x * x;
      sum4 += x * x * x * x;
      ++n;
    }
  }
  CHECK(outliers >= 1);
  CHECK(outliers <= 8);
  const double kurtosis = (sum4 / n) / ((sum2 / n) * (sum2 / n));
  MESSAGE("outlier channels " << outliers << ", kurtosis of the rest " << kurtosis);
  CHECK(kurtosis > 3.0);  // a Gaussian has 3
}

TEST_CASE("synth: bad options are usage errors that name the option") {
  SynthOptions o = small("x");
  o.max_tokens = 4;
  o.min_tokens = 8;
  CHECK_THROWS_WITH_AS(check_synth_options(o), "--max-tokens (4) is below --min-tokens (8)", UsageError);
  o = small("x");
  o.dtype = DType::kInt32;
  CHECK_THROWS_WITH_AS(check_synth_options(o), "--dtype must be bf16, fp16 or fp32, not int32", UsageError);
  o = small("x");
  o.format = Format::kEks;
  CHECK_THROWS_WITH_AS(check_synth_options(o),
                       "synth writes one file per record: --format must be pt or safetensors, not eks",
                       UsageError);
  o = small("");
  CHECK_THROWS_WITH_AS(check_synth_options(o), "--out is required", UsageError);
  o = small("x");
  o.conversations = 0;
  CHECK_THROWS_WITH_AS(SynthGenerator{o}, "--conversations must be at least 1", UsageError);
}
