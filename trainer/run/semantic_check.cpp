#include "trainer/run/semantic_check.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "formats/error.h"
#include "formats/format.h"
#include "lib/dataset.h"
#include "trainer/io/metrics_log.h"
#include "trainer/model/base_model.h"
#include "trainer/run/plan.h"
#include "trainer/run/run_setup.h"

namespace eaglekit::trainer {

namespace {

constexpr std::int64_t kChunkRecords = 64;  // records read at a time
constexpr std::int64_t kBlockRows = 256;    // rows per head matmul: [256, V] float32 logits

// One record's sampled rows.
struct Sampled {
  at::Tensor rows;  // [n, H] float32
  at::Tensor next, same, skip;  // [n] int64 (skip: -1 past the end)
};

Sampled sample_record(const RecordReader& reader, std::uint32_t record, std::int64_t positions, std::int64_t hidden,
                      const std::string& where) {
  const Record r = reader.read(record);
  if (r.target_probs)
    throw UsageError(where + ": stores the target's distribution (NeMo AutoModel's EAGLE-3 cache), not a last hidden "
                     "state, so there is nothing to run through the base's head; validate --deep checks the stored "
                     "distributions instead");
  const at::Tensor ids = tensor_from_host(r.input_ids).to(at::kLong).reshape({-1});
  const at::Tensor hs = tensor_from_host(r.hidden_states).to(at::kFloat);
  const std::int64_t t = ids.size(0);
  if (hs.dim() != 2 || hs.size(0) != t || hs.size(1) != hidden)
    throw FormatError(where, std::nullopt, "hidden_states",
                      "shape " + c10::str(hs.sizes()) + ", expected [" + std::to_string(t) + ", " +
                          std::to_string(hidden) + "] (the base's hidden_size)");
  // Counted positions: t whose next token the loss mask counts.
  std::vector<std::int64_t> counted;
  at::Tensor mask;
  if (r.loss_mask) mask = tensor_from_host(*r.loss_mask).to(at::kLong).reshape({-1});
  const std::int64_t* m = mask.defined() ? mask.data_ptr<std::int64_t>() : nullptr;
  for (std::int64_t p = 0; p + 1 < t; ++p)
    if (!m || m[p + 1] != 0) counted.push_back(p);
  Sampled s;
  const std::int64_t n = std::min<std::int64_t>(positions, static_cast<std::int64_t>(counted.size()));
  std::vector<std::int64_t> at_pos(static_cast<std::size_t>(n)), next(at_pos.size()), same(at_pos.size()),
      skip(at_pos.size());
  const std::int64_t* id = ids.data_ptr<std::int64_t>();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t p = counted[static_cast<std::size_t>(i * static_cast<std::int64_t>(counted.size()) / n)];
    at_pos[static_cast<std::size_t>(i)] = p;
    next[static_cast<std::size_t>(i)] = id[p + 1];
    same[static_cast<std::size_t>(i)] = id[p];
    skip[static_cast<std::size_t>(i)] = p + 2 < t ? id[p + 2] : -1;
  }
  auto as_tensor = [](const std::vector<std::int64_t>& v) {
    return at::tensor(at::ArrayRef<std::int64_t>(v), at::TensorOptions().dtype(at::kLong));
  };
  s.rows = n > 0 ? hs.index_select(0, as_tensor(at_pos)).contiguous() : at::zeros({0, hidden}, at::kFloat);
  s.next = as_tensor(next);
  s.same = as_tensor(same);
  s.skip = as_tensor(skip);
  return s;
}

// log P(X <= k) for X ~ Binomial(n, p).
double log_binomial_cdf(std::int64_t k, std::int64_t n, double p) {
  if (p <= 0) return 0.0;
  if (p >= 1) return k >= n ? 0.0 : -INFINITY;
  double best = -INFINITY, sum = 0;
  std::vector<double> terms;
  for (std::int64_t j = 0; j <= k; ++j) {
    const double lt = std::lgamma(n + 1.0) - std::lgamma(j + 1.0) - std::lgamma(n - j + 1.0) + j * std::log(p) +
                      (n - j) * std::log1p(-p);
    terms.push_back(lt);
    best = std::max(best, lt);
  }
  for (double lt : terms) sum += std::exp(lt - best);
  return best + std::log(sum);
}

// Whether the better form's agreement is near chance (a dump of another model than the base).
bool near_chance(double best_agreement, double chance) { return best_agreement < std::max(5.0 * chance, 0.02); }

// The two-sided exact sign test's p for a against b (X ~ Binomial(a + b, 1/2)).
double sign_test_p(std::int64_t a, std::int64_t b) {
  if (a + b == 0) return 1.0;
  return std::min(1.0, 2.0 * std::exp(log_binomial_cdf(std::min(a, b), a + b, 0.5)));
}

// norm_sequential_test's result in words, for validate's report and train's plan.
std::string norm_test_words(const NormTest& t) {
  std::ostringstream os;
  os.precision(3);
  const double pos = static_cast<double>(std::max<std::int64_t>(t.positions, 1));
  os << "argmax(lm_head(h[t])) is the next token on " << 100.0 * t.agree_post / pos << "% of " << t.positions
     << " positions of " << t.records << " records as post-norm and " << 100.0 * t.agree_pre / pos
     << "% as pre-norm; " << t.post_only << " only as post-norm, " << t.pre_only << " only as pre-norm (sign test p "
     << t.p << " at look " << t.look << " of " << t.looks << ", which decides at p <= " << t.threshold
     << "; at most " << kNormAlpha << " over all looks)";
  return os.str();
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(pos));
  const auto hi = std::min(v.size() - 1, lo + 1);
  return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

}  // namespace

std::string semantic_check_notice(std::int64_t records, std::int64_t positions, std::int64_t vocab_size,
                                  std::int64_t hidden_size, const std::string& device) {
  // Two [rows, H] x [H, V] matmuls per block of sampled rows (post- and pre-norm).
  const double head = static_cast<double>(vocab_size) * static_cast<double>(hidden_size);
  const double flops = 2.0 * 2.0 * head * static_cast<double>(records) * static_cast<double>(positions);
  std::ostringstream os;
  os << "the semantic check runs " << records << " records x " << positions << " positions through the base's head ("
     << vocab_size << " x " << hidden_size << " = " << static_cast<std::int64_t>(head) << " parameters, read first) on "
     << device << ": " << flops_text(flops);
  if (parse_device(device, /*check_available=*/false).is_cpu()) {
    const double rate = measure_cpu_matmul_flops_per_s(false);
    if (rate > 0) {
      const double s = flops / rate;
      char r[32];
      std::snprintf(r, sizeof r, "%.3g", rate / 1e9);
      os << ", at least " << format_duration(s) << " at the " << r << " GFLOP/s a float32 matmul reached here";
      if (s >= 60)
        os << ". This will take long: a lower --positions or --device cuda is faster";
    } else {
      os << " (its time not estimated: the matmul timing failed)";
    }
  }
  return os.str();
}

SemanticReport semantic_check(const Dataset& dataset, const std::vector<SampleRef>& samples, const BaseModel& base,
                              const SemanticOptions& o) {
  if (o.positions < 1) throw UsageError("--semantic-positions must be at least 1");
  if (!(o.tail > 0 && o.tail < 1)) throw UsageError("the suspect threshold must be in (0, 1)");
  at::NoGradGuard no_grad;
  const c10::Device device = parse_device(o.device);
  const std::int64_t hidden = base.config.hidden_size;
  const at::Tensor head = base.lm_head.to(device, at::kFloat).contiguous();  // [V, H]
  const bool has_norm = base.final_norm.defined();
  const at::Tensor gamma = has_norm ? base.final_norm.to(device, at::kFloat) : at::Tensor();
  const double eps = base.config.rms_norm_eps;

  SemanticReport rep;
  rep.has_final_norm = has_norm;
  rep.chance = 1.0 / static_cast<double>(base.config.vocab_size);
  std::vector<SemanticRecord> per(samples.size());
  tbb::task_arena arena(o.jobs > 0 ? o.jobs : tbb::task_arena::automatic);
  for (std::size_t first = 0; first < samples.size(); first += kChunkRecords) {
    const std::size_t last = std::min(samples.size(), first + static_cast<std::size_t>(kChunkRecords));
    std::vector<Sampled> got(last - first);
    arena.execute([&] {
      tbb::parallel_for(first, last, [&](std::size_t i) {
        const SampleRef& s = samples[i];
        const std::string& path = dataset.files.at(s.file);
        const auto reader = open_reader(path);
        got[i - first] = sample_record(*reader, s.record, o.positions, hidden, path + "#" + s.conversation_id);
      });
    });
    std::vector<at::Tensor> rows, next, same, skip;
    std::vector<std::int64_t> owner;
    for (std::size_t i = 0; i < got.size(); ++i) {
      rows.push_back(got[i].rows);
      next.push_back(got[i].next);
      same.push_back(got[i].same);
      skip.push_back(got[i].skip);
      owner.insert(owner.end(), static_cast<std::size_t>(got[i].rows.size(0)), static_cast<std::int64_t>(first + i));
    }
    const at::Tensor all = at::cat(rows).to(device);
    const at::Tensor nx = at::cat(next), sm = at::cat(same), sk = at::cat(skip);
    for (std::int64_t b = 0; b < all.size(0); b += kBlockRows) {
      const std::int64_t len = std::min(kBlockRows, all.size(0) - b);
      const at::Tensor h = all.narrow(0, b, len);
      const at::Tensor post = at::matmul(h, head.t()).argmax(-1).to(at::kCPU);
      at::Tensor pre;
      if (has_norm) pre = at::matmul(h * at::rsqrt(h.pow(2).mean(-1, true) + eps) * gamma, head.t()).argmax(-1).to(at::kCPU);
      const auto* pp = post.data_ptr<std::int64_t>();
      const auto* pr = has_norm ? pre.data_ptr<std::int64_t>() : nullptr;
      const auto* n = nx.data_ptr<std::int64_t>() + b;
      const auto* s0 = sm.data_ptr<std::int64_t>() + b;
      const auto* s2 = sk.data_ptr<std::int64_t>() + b;
      for (std::int64_t r = 0; r < len; ++r) {
        SemanticRecord& rec = per[static_cast<std::size_t>(owner[static_cast<std::size_t>(b + r)])];
        ++rec.positions;
        rec.agree_post += pp[r] == n[r];
        if (pr) {
          rec.agree_pre += pr[r] == n[r];
          rec.post_only += pp[r] == n[r] && pr[r] != n[r];
          rec.pre_only += pr[r] == n[r] && pp[r] != n[r];
        }
        // Shifted ids: either form's argmax equal to ids[t] or to ids[t + 2].
        const std::int64_t a = pp[r], c = pr ? pr[r] : pp[r];
        rec.agree_same += (a == s0[r]) || (c == s0[r]);
        rec.agree_skip += s2[r] >= 0 && ((a == s2[r]) || (c == s2[r]));
      }
    }
  }
  for (std::size_t i = 0; i < samples.size(); ++i) {
    per[i].id = samples[i].conversation_id;
    per[i].stated = samples[i].hidden_states_prenorm;
    per[i].layout = samples[i].layout_prenorm;
    if (per[i].stated) ++(*per[i].stated ? rep.stated_pre : rep.stated_post);
    rep.positions += per[i].positions;
    rep.agree_post += per[i].agree_post;
    rep.agree_pre += per[i].agree_pre;
    rep.post_only += per[i].post_only;
    rep.pre_only += per[i].pre_only;
  }
  rep.records = static_cast<std::int64_t>(samples.size());
  const double n = static_cast<double>(std::max<std::int64_t>(rep.positions, 1));
  const double r_post = rep.agree_post / n, r_pre = rep.agree_pre / n;
  // The form: the sequential test train and evaluate use (norm_sequential_test), over every
  // record in its read order, so that on the same records both reach the same decision.
  {
    std::vector<SemanticRecord> in_order;
    for (std::size_t i : norm_read_order(per.size())) in_order.push_back(per[i]);
    const NormTest t = norm_sequential_test(in_order, per.size(), base.config.vocab_size, has_norm);
    rep.norm_form = t.form;
    rep.norm_test = norm_test_words(t);
  }
  // Each record is read in its stated form, else in the one the options name, else in the
  // detected form (post when unclear); against the pooled rate of the records read in that form.
  const bool detected_pre = rep.norm_form == "pre";
  std::int64_t pos_in[2] = {0, 0}, agree_in[2] = {0, 0};
  for (auto& r : per) {
    r.measured_pre = r.stated                ? *r.stated
                     : o.unstated_form >= 0  ? o.unstated_form == 1
                     : r.layout              ? *r.layout
                                             : detected_pre;
    if (r.measured_pre && !has_norm) r.measured_pre = false;  // nothing else can be measured
    pos_in[r.measured_pre] += r.positions;
    agree_in[r.measured_pre] += r.measured_pre ? r.agree_pre : r.agree_post;
  }
  auto rate_of = [&](bool pre) {
    return pos_in[pre] > 0 ? static_cast<double>(agree_in[pre]) / static_cast<double>(pos_in[pre]) : 0.0;
  };
  if (rep.positions > 0 && near_chance(std::max(r_post, r_pre), rep.chance)) {
    std::ostringstream os;
    os << "argmax(lm_head(h[t])) equals the next token on " << 100.0 * std::max(r_post, r_pre)
       << "% of sampled positions, near chance (" << 100.0 * rep.chance
       << "%): the hidden states were likely dumped from another model (or another layer) than --base";
    rep.problems.push_back(os.str());
  }
  std::vector<double> rates;
  for (auto& r : per) {
    if (r.positions == 0) continue;
    const bool use_pre = r.measured_pre;
    const double rate = rate_of(use_pre);
    const std::int64_t k = use_pre ? r.agree_pre : r.agree_post;
    rates.push_back(static_cast<double>(k) / static_cast<double>(r.positions));
    if (!rep.problems.empty()) continue;  // the whole dump disagrees: no per-record outliers
    const bool by_layout = !r.stated && o.unstated_form < 0 && r.layout;
    if ((r.stated || o.unstated_form >= 0 || by_layout) && has_norm) {
      // A form named for it (its flag, or the option) that its states contradict: the other
      // form right clearly more often on the positions where exactly one is (McNemar).
      const std::int64_t only_this = use_pre ? r.pre_only : r.post_only;
      const std::int64_t only_other = use_pre ? r.post_only : r.pre_only;
      const double z = static_cast<double>(only_other - only_this) /
                       std::sqrt(static_cast<double>(std::max<std::int64_t>(only_other + only_this, 1)));
      if (z > 4) {
        const char* named = use_pre ? "pre" : "post";
        const char* other = use_pre ? "post" : "pre";
        std::ostringstream os;
        os << (r.stated ? "it states " : by_layout ? "its layout implies " : "it is read as ") << named
           << "-norm hidden states" << (r.stated || by_layout ? "" : " (--hidden-states-norm)") << ", but of "
           << r.positions
           << " sampled positions " << only_other << " predict the next token only as " << other << "-norm and "
           << only_this << " only as " << named << "-norm: "
           << (r.stated    ? "its hidden_states_prenorm flag is wrong"
               : by_layout ? "its producer wrote the other form: train it with --hidden-states-norm " +
                                 std::string(other)
                           : "it is in the other form");
        r.reason = os.str();
        rep.suspects.push_back(r);
        continue;
      }
    }
    if (log_binomial_cdf(k, r.positions, rate) >= std::log(o.tail)) continue;
    std::ostringstream os;
    os << "its hidden states predict the next token on " << k << " of " << r.positions
       << " sampled positions (the dataset: " << static_cast<int>(100 * rate + 0.5) << "%)";
    const std::int64_t shifted = std::max(r.agree_same, r.agree_skip);
    if (shifted > 2 * std::max<std::int64_t>(k, 1) && shifted >= r.positions / 4)
      os << "; they predict input_ids[t" << (r.agree_same >= r.agree_skip ? "" : " + 2") << "] on " << shifted
         << ": input_ids look shifted by one against the hidden states";
    else
      os << ": hidden states of another conversation, layer or model?";
    r.reason = os.str();
    rep.suspects.push_back(r);
  }
  rep.per_record = std::move(per);
  rep.p10 = percentile(rates, 0.1);
  rep.median = percentile(rates, 0.5);
  rep.p90 = percentile(rates, 0.9);
  return rep;
}

std::vector<std::size_t> norm_looks(std::size_t n) {
  std::vector<std::size_t> looks;
  for (std::size_t m = 8; n > 0; m *= 2) {
    looks.push_back(std::min(m, n));
    if (m >= n) break;
  }
  return looks;
}

std::vector<std::size_t> norm_read_order(std::size_t n) {
  // Look by look, records i * n / m for i < m (nested: look m's include look m/2's), new ones
  // in increasing order; the last look takes the rest.
  std::vector<std::size_t> order;
  std::vector<char> taken(n, 0);
  for (std::size_t m : norm_looks(n)) {
    const std::size_t size = m < n ? m : n;
    for (std::size_t i = 0; i < size; ++i) {
      const std::size_t j = m < n ? i * n / m : i;
      if (!taken[j]) {
        taken[j] = 1;
        order.push_back(j);
      }
    }
  }
  return order;
}

NormTest norm_sequential_test(const std::vector<SemanticRecord>& read, std::size_t total, std::int64_t vocab_size,
                              bool has_final_norm) {
  NormTest t;
  const std::vector<std::size_t> looks = norm_looks(total);
  t.looks = static_cast<int>(looks.size());
  if (!has_final_norm) return t;
  const double chance = vocab_size > 0 ? 1.0 / static_cast<double>(vocab_size) : 0.0;
  std::size_t next = 0;
  for (std::size_t k = 0; k < looks.size() && looks[k] <= read.size(); ++k) {
    for (; next < looks[k]; ++next) {
      const SemanticRecord& r = read[next];
      t.positions += r.positions;
      t.agree_post += r.agree_post;
      t.agree_pre += r.agree_pre;
      t.post_only += r.post_only;
      t.pre_only += r.pre_only;
    }
    t.records = static_cast<std::int64_t>(looks[k]);
    t.look = static_cast<int>(k + 1);
    t.p = sign_test_p(t.post_only, t.pre_only);
    t.threshold = kNormAlpha / std::ldexp(1.0, t.look);
    const double best = static_cast<double>(std::max(t.agree_post, t.agree_pre)) /
                        static_cast<double>(std::max<std::int64_t>(t.positions, 1));
    if (t.positions > 0 && near_chance(best, chance)) {
      t.near_chance = true;
      t.form = "unclear";
      return t;
    }
    if (t.p <= t.threshold) {
      t.form = t.post_only > t.pre_only ? "post" : "pre";
      return t;
    }
  }
  return t;
}

NormMeasurement measure_norm_form(const Dataset& dataset, const std::vector<SampleRef>& samples, const BaseModel& base,
                                  std::int64_t max_records, std::int64_t positions) {
  NormMeasurement m;
  const bool has_norm = base.final_norm.defined();
  const std::vector<std::size_t> order = norm_read_order(samples.size());
  const std::vector<std::size_t> looks = norm_looks(samples.size());
  SemanticOptions o;
  o.positions = positions;
  o.jobs = 0;
  o.unstated_form = 0;  // not used for the counts
  std::vector<SemanticRecord> read;
  NormTest t;
  t.looks = static_cast<int>(looks.size());
  bool capped = false;
  for (std::size_t k = 0; k < looks.size() && has_norm; ++k) {
    if (static_cast<std::int64_t>(looks[k]) > max_records) {
      capped = true;
      break;
    }
    std::vector<SampleRef> part;
    for (std::size_t i = read.size(); i < looks[k]; ++i) part.push_back(samples[order[i]]);
    // One record at a time through semantic_check keeps its per-record counts.
    const SemanticReport r = semantic_check(dataset, part, base, o);
    read.insert(read.end(), r.per_record.begin(), r.per_record.end());
    t = norm_sequential_test(read, samples.size(), base.config.vocab_size, has_norm);
    if (t.form != "unclear" || t.near_chance) break;
  }
  m.form = t.form;
  m.records = t.records;
  m.positions = t.positions;
  m.post_only = t.post_only;
  m.pre_only = t.pre_only;
  std::ostringstream os;
  os.precision(3);
  if (!has_norm) {
    os << "the base holds no final norm (model.norm.weight), so pre-norm states cannot be told from post-norm ones";
  } else {
    os << norm_test_words(t);
    if (t.near_chance)
      os << "; both near chance (" << 100.0 / static_cast<double>(base.config.vocab_size)
         << "%): not a dump of this base?";
    else if (t.form == "unclear")
      os << (capped ? "; stopped at the measurement's cap of " + std::to_string(max_records) + " records of " +
                          std::to_string(samples.size())
                    : "; every record read");
  }
  m.said = os.str();
  return m;
}

std::string SemanticReport::to_json() const {
  nlohmann::ordered_json j;
  j["records"] = records;
  j["positions"] = positions;
  const double n = static_cast<double>(std::max<std::int64_t>(positions, 1));
  j["agreement_post"] = agree_post / n;
  j["agreement_pre"] = has_final_norm ? nlohmann::ordered_json(agree_pre / n) : nlohmann::ordered_json(nullptr);
  j["norm_form"] = norm_form;
  j["norm_test"] = norm_test;
  j["stated_pre"] = stated_pre;
  j["stated_post"] = stated_post;
  j["chance"] = chance;
  j["post_only"] = post_only;
  j["pre_only"] = pre_only;
  j["per_record"] = {{"p10", p10}, {"median", median}, {"p90", p90}};
  auto s = nlohmann::ordered_json::array();
  for (const auto& r : suspects)
    s.push_back({{"id", r.id},
                 {"positions", r.positions},
                 {"agree_post", r.agree_post},
                 {"agree_pre", r.agree_pre},
                 {"stated", r.stated ? nlohmann::ordered_json(*r.stated ? "pre" : "post") : nlohmann::ordered_json(nullptr)},
                 {"reason", r.reason}});
  j["suspects"] = s;
  j["problems"] = problems;
  return j.dump();
}

std::string SemanticReport::to_text() const {
  std::ostringstream os;
  const double n = static_cast<double>(std::max<std::int64_t>(positions, 1));
  os.precision(3);
  os << "\nsemantic check (--base): " << positions << " positions of " << records << " records\n";
  os << "  argmax(lm_head(h[t])) == input_ids[t+1]: " << 100.0 * agree_post / n << "% as post-norm";
  if (has_final_norm) os << ", " << 100.0 * agree_pre / n << "% as pre-norm (final RMSNorm applied)";
  os << "; chance " << 100.0 * chance << "%\n";
  if (norm_form == "post")
    os << "  norm form: post (hidden states after the final norm; train and evaluate measure this themselves for "
          "records that state no form)\n";
  else if (norm_form == "pre")
    os << "  norm form: pre (hidden states before the final norm; train and evaluate measure this themselves "
          "for records that state no form; --hidden-states-norm pre says it outright)\n";
  else
    os << "  norm form: unclear" << (has_final_norm ? " (the test below did not decide)" : " (the base holds no model.norm.weight)") << "\n";
  if (!norm_test.empty()) os << "  the form's test: " << norm_test << "\n";
  if (stated_pre + stated_post > 0)
    os << "  stated by the records (hidden_states_prenorm): " << stated_pre << " pre-norm, " << stated_post
       << " post-norm; those are measured in their stated form\n";
  os << "  per record: p10 " << 100 * p10 << "%, median " << 100 * median << "%, p90 " << 100 * p90 << "%\n";
  for (const auto& p : problems) os << "  problem: " << p << "\n";
  os << "  suspects: " << suspects.size() << "\n";
  for (std::size_t i = 0; i < suspects.size() && i < 20; ++i) os << "    " << suspects[i].id << ": " << suspects[i].reason << "\n";
  if (suspects.size() > 20) os << "    ... " << suspects.size() - 20 << " more (--json lists all)\n";
  return os.str();
}

}  // namespace eaglekit::trainer
