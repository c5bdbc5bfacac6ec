// How the tests measure "how different" two runs are: the largest relative difference of
// numbers, where a NaN counts as infinitely different (std::max(acc, NaN) returns acc, so a
// plain running maximum would pass a run whose weights or metrics went NaN), and the
// per-step comparison of a field of two runs' metrics.jsonl. No LibTorch: the CLI tests use it.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace eaglekit::test {

// The larger of acc and x; a NaN x makes it +inf, which no bound passes.
inline double worst_of(double acc, double x) { return std::isnan(x) ? INFINITY : std::max(acc, x); }

// |a - b| / |b| (|b| floored at 1e-12); +inf when either is NaN or the two are unequal infinities.
inline double rel_diff(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return INFINITY;
  if (a == b) return 0;  // equal infinities too
  return worst_of(0, std::abs(a - b) / std::max(std::abs(b), 1e-12));
}

// The lines of a metrics.jsonl that describe training steps (evaluation lines carry "split").
inline std::vector<nlohmann::json> train_lines(const std::string& metrics_jsonl) {
  std::ifstream f(metrics_jsonl);
  REQUIRE_MESSAGE(f.good(), metrics_jsonl << ": cannot open");
  std::vector<nlohmann::json> out;
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line);
    if (!j.contains("split")) out.push_back(std::move(j));
  }
  return out;
}

// The largest per-step rel_diff of `key` between two runs' training lines (got against
// want), after checking that both logged the same steps. Used for grad_norm, which is logged
// before clipping and so sees a uniform scale error in the gradients that AdamW's
// scale-invariant update and the clip at 1.0 hide from the weights (docs/testing.md).
inline double metric_rel_diff(const std::string& got_jsonl, const std::string& want_jsonl, const std::string& key) {
  const auto got = train_lines(got_jsonl), want = train_lines(want_jsonl);
  REQUIRE_MESSAGE(got.size() == want.size(), got_jsonl << " vs " << want_jsonl);
  REQUIRE(!want.empty());
  double worst = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    REQUIRE(got[i].at("step") == want[i].at("step"));
    worst = worst_of(worst, rel_diff(got[i].at(key).get<double>(), want[i].at(key).get<double>()));
  }
  return worst;
}

}  // namespace eaglekit::test
