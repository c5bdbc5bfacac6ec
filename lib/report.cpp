#include "lib/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "lib/index.h"
#include "lib/stats.h"

namespace eaglekit {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct Run {
  std::string name;
  std::string dir;
  std::vector<json> train, eval;
  json options = json::object();
  // A block drafter's block size (DFlash: its list-valued figures are per block position
  // 1..block-1, not per TTT step); 0 for the TTT unroll's drafts.
  std::int64_t block = 0;
};

// The block size of a DFlash draft's config.json (DFlashDraftModel, or a dflash_config), else 0.
std::int64_t block_of_config(const fs::path& config) {
  std::ifstream f(config);
  if (!f) return 0;
  const json c = json::parse(f, nullptr, false);
  if (!c.is_object()) return 0;
  bool dflash = c.contains("dflash_config");
  if (c.contains("architectures") && c["architectures"].is_array())
    for (const auto& a : c["architectures"]) dflash = dflash || (a.is_string() && a.get<std::string>() == "DFlashDraftModel");
  if (!dflash) return 0;
  return c.contains("block_size") && c["block_size"].is_number_integer() ? c["block_size"].get<std::int64_t>() : -1;
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string num(double v, int digits = 4) {
  if (!std::isfinite(v)) return "-";
  char b[32];
  std::snprintf(b, sizeof b, "%.*g", digits, v);
  return b;
}

Run load_run(const std::string& dir) {
  Run r;
  r.dir = dir;
  r.name = fs::path(dir).lexically_normal().filename().string();
  if (r.name.empty() || r.name == ".") r.name = fs::path(dir).lexically_normal().parent_path().filename().string();
  const std::string path = (fs::path(dir) / "metrics.jsonl").string();
  std::ifstream in(path);
  if (!in) throw IoError(path + ": cannot open (is " + dir + " a training output folder?)");
  std::string line;
  std::uint64_t offset = 0;
  while (std::getline(in, line)) {
    const std::uint64_t at = offset;
    offset += line.size() + 1;
    if (line.empty()) continue;
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception& e) {
      if (in.peek() == EOF) break;  // a torn last line of a killed run
      throw FormatError(path, at, "line", std::string("not JSON: ") + e.what());
    }
    (j.value("split", "") == "eval" ? r.eval : r.train).push_back(std::move(j));
  }
  // The options of its newest checkpoint.
  std::int64_t newest = -1;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("checkpoint-", 0) != 0 || !fs::exists(e.path() / "train_options.json")) continue;
    try {
      const std::int64_t step = std::stoll(n.substr(11));
      if (step > newest) {
        newest = step;
        std::ifstream f(e.path() / "train_options.json");
        r.options = json::parse(f, nullptr, false);
        if (r.options.is_discarded()) r.options = json::object();
        r.block = block_of_config(e.path() / "config.json");
      }
    } catch (const std::exception&) {
    }
  }
  // The draft itself says what it is: a checkpoint's or the final draft's config.json (a run
  // started from a DFlash --init-draft has draft_arch auto in its options); else the options.
  if (r.block == 0) r.block = block_of_config(fs::path(dir) / "final" / "config.json");
  if (r.block == 0 && r.options.value("draft_arch", json()) == "dflash")
    r.block = r.options.contains("block_size") && r.options["block_size"].is_number_integer()
                  ? r.options["block_size"].get<std::int64_t>()
                  : -1;
  return r;
}

// What a list-valued figure's entries are, over the runs shown: TTT steps, block positions
// (DFlash), or either.
std::string per_what(const std::vector<Run>& runs) {
  bool ttt = false, block = false;
  for (const auto& r : runs) (r.block != 0 ? block : ttt) = true;
  return block && ttt ? "TTT step / block position" : block ? "block position" : "TTT step";
}

struct Series {
  std::string label;
  std::string color;
  std::string dash;
  std::vector<std::pair<double, double>> points;  // (step, value)
};

std::vector<std::pair<double, double>> points(const std::vector<json>& lines, const std::string& key, int index = -1) {
  std::vector<std::pair<double, double>> out;
  for (const auto& j : lines) {
    if (!j.contains(key) || !j.contains("step")) continue;
    const json& v = index < 0 ? j[key] : (j[key].is_array() && index < static_cast<int>(j[key].size()) ? j[key][index] : json());
    if (v.is_number() && std::isfinite(v.get<double>())) out.emplace_back(j["step"].get<double>(), v.get<double>());
  }
  return out;
}

const char* kColors[] = {"#2f81f7", "#e5534b", "#3fb950", "#d29922", "#a371f7", "#db61a2", "#39c5cf", "#8b949e"};
const char* kDashes[] = {"", "6 3", "2 3", "8 3 2 3", "1 2"};

// Round tick values inside [lo, hi]: a step of 1, 2, 2.5 or 5 times a power of ten giving
// about four intervals, and labels with just the decimals that step needs.
struct Ticks {
  std::vector<double> values;
  double step = 1;
};

Ticks nice_ticks(double lo, double hi) {
  const double raw = (hi - lo) / 4;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  Ticks t;
  t.step = 10 * mag;
  for (double m : {1.0, 2.0, 2.5, 5.0})
    if (m * mag >= raw) {
      t.step = m * mag;
      break;
    }
  for (double v = std::ceil(lo / t.step) * t.step; v <= hi + t.step * 1e-9; v += t.step)
    t.values.push_back(std::abs(v) < t.step * 1e-9 ? 0 : v);
  return t;
}

std::string tick_label(double v, double step) {
  char b[32];
  if (std::abs(v) >= 1e4 && step >= 100) {
    std::snprintf(b, sizeof b, "%gk", v / 1e3);
  } else if (step < 1e-4 || std::abs(v) >= 1e7) {
    std::snprintf(b, sizeof b, "%.1e", v);
  } else {
    int decimals = 0;  // the fewest that write the step exactly
    while (decimals < 6 && std::abs(step * std::pow(10.0, decimals) - std::round(step * std::pow(10.0, decimals))) > 1e-6)
      ++decimals;
    std::snprintf(b, sizeof b, "%.*f", decimals, v);
  }
  return b;
}

// A line chart of several series, with a y range from the data, five labelled ticks and
// the axes' titles: optimizer steps across, `y_title` up.
std::string chart(const std::string& title, const std::string& y_title, const std::vector<Series>& series) {
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const auto& s : series)
    for (const auto& [x, y] : s.points) {
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  std::ostringstream o;
  o << "<figure><figcaption>" << escape(title) << "</figcaption>";
  if (!std::isfinite(x0)) {
    o << "<p class=\"muted\">no data</p></figure>\n";
    return o.str();
  }
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) {
    const double pad = y0 == 0 ? 1 : std::abs(y0) * 0.1;
    y0 -= pad, y1 += pad;
  }
  const double W = 600, H = 290, L = 92, R = 14, T = 12, B = 54;
  auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  auto py = [&](double y) { return T + (1 - (y - y0) / (y1 - y0)) * (H - T - B); };
  o << "<svg viewBox=\"0 0 " << W << " " << H << "\" role=\"img\" aria-label=\"" << escape(title) << "\">";
  const Ticks yt = nice_ticks(y0, y1), xt = nice_ticks(x0, x1);
  const double ystep = yt.step, xstep = xt.step;
  for (double y : yt.values) {
    o << "<line class=\"grid\" x1=\"" << L << "\" x2=\"" << W - R << "\" y1=\"" << py(y) << "\" y2=\"" << py(y) << "\"/>"
      << "<text class=\"tick\" x=\"" << L - 8 << "\" y=\"" << py(y) + 5 << "\" text-anchor=\"end\">" << tick_label(y, ystep)
      << "</text>";
  }
  for (double x : xt.values) {
    o << "<text class=\"tick\" x=\"" << px(x) << "\" y=\"" << H - 30 << "\" text-anchor=\"middle\">"
      << tick_label(x, std::max(1.0, xstep)) << "</text>";
  }
  o << "<text class=\"axis\" x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 6
    << "\" text-anchor=\"middle\">optimizer step</text>";
  o << "<text class=\"axis\" transform=\"translate(18 " << (T + H - B) / 2
    << ") rotate(-90)\" text-anchor=\"middle\">" << escape(y_title) << "</text>";
  for (const auto& s : series) {
    if (s.points.empty()) continue;
    if (s.points.size() == 1) {
      o << "<circle cx=\"" << px(s.points[0].first) << "\" cy=\"" << py(s.points[0].second) << "\" r=\"3.5\" fill=\""
        << s.color << "\"><title>" << escape(s.label) << "</title></circle>";
      continue;
    }
    o << "<polyline fill=\"none\" stroke=\"" << s.color << "\" stroke-width=\"2\"";
    if (!s.dash.empty()) o << " stroke-dasharray=\"" << s.dash << "\"";
    o << " points=\"";
    for (const auto& [x, y] : s.points) o << num(px(x), 6) << "," << num(py(y), 6) << " ";
    o << "\"><title>" << escape(s.label) << "</title></polyline>";
  }
  o << "</svg>";
  o << "<ul class=\"legend\">";
  for (const auto& s : series) {
    if (s.points.empty()) continue;
    o << "<li><svg class=\"swatch\" viewBox=\"0 0 24 8\"><line x1=\"0\" x2=\"24\" y1=\"4\" y2=\"4\" stroke=\"" << s.color
      << "\" stroke-width=\"3\"" << (s.dash.empty() ? "" : " stroke-dasharray=\"" + s.dash + "\"") << "/></svg>"
      << escape(s.label) << "</li>";
  }
  o << "</ul></figure>\n";
  return o.str();
}

// Per run, the series of (split, key[, TTT step s]) under the given labels.
std::vector<Series> collect(const std::vector<Run>& runs,
                            const std::vector<std::tuple<std::string, std::string, std::string>>& what) {
  std::vector<Series> out;
  for (std::size_t r = 0; r < runs.size(); ++r) {
    for (std::size_t w = 0; w < what.size(); ++w) {
      const auto& [split, key, label] = what[w];
      const auto& lines = split == "eval" ? runs[r].eval : runs[r].train;
      Series s;
      s.label = (runs.size() > 1 ? runs[r].name + " " : "") + label;
      s.color = kColors[r % 8];
      s.dash = kDashes[w % 5];
      s.points = points(lines, key);
      out.push_back(std::move(s));
    }
  }
  return out;
}

// Per run, one series per TTT step of a list-valued key.
std::vector<Series> per_step(const std::vector<Run>& runs, const std::string& split, const std::string& key) {
  std::vector<Series> out;
  for (std::size_t r = 0; r < runs.size(); ++r) {
    const auto& lines = split == "eval" ? runs[r].eval : runs[r].train;
    std::size_t steps = 0;
    for (const auto& j : lines)
      if (j.contains(key) && j[key].is_array()) steps = std::max(steps, j[key].size());
    for (std::size_t s = 0; s < steps; ++s) {
      Series se;
      // DFlash's entry s is block position s + 1 (position 0, the anchor, is never scored).
      se.label = (runs.size() > 1 ? runs[r].name + " " : "") +
                 (runs[r].block != 0 ? "position " + std::to_string(s + 1) : "step " + std::to_string(s));
      se.color = runs.size() > 1 ? kColors[r % 8] : kColors[s % 8];
      se.dash = runs.size() > 1 ? kDashes[s % 5] : "";
      se.points = points(lines, key, static_cast<int>(s));
      out.push_back(std::move(se));
    }
  }
  return out;
}

std::string cell(const json& v) {
  if (v.is_null()) return "-";
  if (v.is_number_float()) return num(v.get<double>());
  if (v.is_string()) return escape(v.get<std::string>());
  if (v.is_array()) {
    std::string s;
    for (const auto& e : v) s += (s.empty() ? "" : " ") + cell(e);
    return s;
  }
  return escape(v.dump());
}

constexpr const char* kStyle = R"CSS(
:root{--bg:#ffffff;--fg:#1f2328;--muted:#59636e;--card:#f6f8fa;--line:#d1d9e0}
@media (prefers-color-scheme: dark){:root{--bg:#0d1117;--fg:#e6edf3;--muted:#9198a1;--card:#151b23;--line:#3d444d}}
*{box-sizing:border-box}
body{margin:0;padding:16px;background:var(--bg);color:var(--fg);font:15px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif}
main{max-width:1440px;margin:0 auto}
h1{font-size:1.5em;margin:0 0 4px}h2{font-size:1.15em;margin:28px 0 10px}
.muted{color:var(--muted)}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(100%,440px),1fr));gap:14px}
figure{margin:0;background:var(--card);border:1px solid var(--line);border-radius:8px;padding:10px 12px}
figcaption{font-weight:600;margin-bottom:4px}
svg{display:block;width:100%;height:auto}
.grid line.grid,svg line.grid{stroke:var(--line);stroke-width:1}
text.tick{fill:var(--muted);font-size:15px}
text.axis{fill:var(--fg);font-size:15px}
.warning{border-left:4px solid #d29922;padding:6px 12px;background:var(--card)}
.legend{list-style:none;padding:0;margin:6px 0 0;display:flex;flex-wrap:wrap;gap:2px 14px;font-size:13px}
.legend li{display:flex;align-items:center;gap:6px}.swatch{width:24px;height:8px}
.table{overflow-x:auto;background:var(--card);border:1px solid var(--line);border-radius:8px}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
th,td{padding:5px 10px;border-bottom:1px solid var(--line);text-align:right;white-space:nowrap}
th:first-child,td:first-child{text-align:left}
dl{display:grid;grid-template-columns:max-content 1fr;gap:4px 16px;margin:0}dt{color:var(--muted)}dd{margin:0}
)CSS";

std::vector<std::string> comparability_warnings(const std::vector<Run>& runs) {
  // What each run drafts: a TTT draft's steps (its train_options.json, else the length of its
  // acc lists), or a DFlash draft's block.
  std::vector<std::string> warnings;
  std::map<std::string, std::vector<std::string>> by_kind;
  bool block = false;
  for (const auto& r : runs) {
    if (r.block != 0) {
      block = true;
      by_kind["DFlash --block-size " + (r.block > 0 ? std::to_string(r.block) : std::string("?"))].push_back(r.name);
      continue;
    }
    std::int64_t steps = -1;
    if (r.options.contains("ttt_steps") && r.options["ttt_steps"].is_number_integer()) {
      steps = r.options["ttt_steps"].get<std::int64_t>();
    } else {
      for (const auto& j : r.train)
        if (j.contains("acc") && j["acc"].is_array()) steps = static_cast<std::int64_t>(j["acc"].size());
    }
    if (steps > 0) by_kind["--ttt-steps " + std::to_string(steps)].push_back(r.name);
  }
  if (by_kind.size() > 1) {
    std::string which;
    for (const auto& [kind, names] : by_kind) {
      std::string list;
      for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
      which += (which.empty() ? "" : "; ") + kind + ": " + list;
    }
    if (block)
      warnings.push_back("these runs draft differently (" + which +
                         "): their loss, accuracy and est_ar curves are not comparable (a DFlash draft's figures are "
                         "per block position of one parallel draft, a TTT draft's per drafted step; the losses weigh "
                         "different positions); compare the drafts by the acceptance an engine measures");
    else
      warnings.push_back("these runs trained with different --ttt-steps (" + which +
                         "): their loss, accuracy and est_ar curves are not comparable (the loss sums a different "
                         "number of weighted steps, est_ar counts a different number of drafted tokens); compare "
                         "the per-step accuracies step by step, or evaluate the drafts alike with eaglekit evaluate "
                         "--ttt-steps");
  }
  return warnings;
}

}  // namespace

std::string render_report(const ReportOptions& options, std::vector<std::string>* warnings_out) {
  if (options.runs.empty()) throw UsageError("report: give at least one training output folder");
  std::vector<Run> runs;
  for (const auto& d : options.runs) runs.push_back(load_run(d));
  std::set<std::string> names;
  for (auto& r : runs)
    if (!names.insert(r.name).second) r.name = r.dir;  // two runs of one name: their paths

  std::ostringstream o;
  o << "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
    << "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
    << "<title>" << escape(options.title) << "</title><style>" << kStyle << "</style></head><body><main>\n";
  o << "<h1>" << escape(options.title) << "</h1><p class=\"muted\">";
  for (std::size_t i = 0; i < runs.size(); ++i)
    o << (i ? " &middot; " : "") << "<span style=\"color:" << kColors[i % 8] << "\">&#9632;</span> " << escape(runs[i].name)
      << " (" << runs[i].train.size() << " log lines, " << runs[i].eval.size() << " evaluations)";
  o << "</p>\n";
  const std::vector<std::string> warnings = comparability_warnings(runs);
  for (const auto& w : warnings) o << "<p class=\"warning\">warning: " << escape(w) << "</p>\n";
  if (warnings_out) *warnings_out = warnings;

  o << "<h2>Curves <span class=\"muted\">(by optimizer step)</span></h2><div class=\"grid\">\n";
  const std::string per = per_what(runs);
  o << chart("Loss", "loss (" + std::string(per == "TTT step" ? "TTT steps" : "positions") + " weighted)",
             collect(runs, {{"train", "loss", "train"}, {"eval", "loss", "eval"}}));
  o << chart("Accuracy per " + per + " (train)", "accuracy", per_step(runs, "train", "acc"));
  o << chart("Conditional accuracy per " + per + " (train)", "conditional accuracy", per_step(runs, "train", "cond_acc"));
  o << chart("Estimated acceptance length", "tokens per base pass",
             collect(runs, {{"train", "est_ar", "train"}, {"train", "est_ar_cond", "train, conditional"},
                            {"eval", "est_ar", "eval"}, {"eval", "est_ar_cond", "eval, conditional"}}));
  o << chart("Accuracy per " + per + " (eval)", "accuracy", per_step(runs, "eval", "acc"));
  o << chart("Learning rate", "learning rate", collect(runs, {{"train", "lr", "lr"}}));
  o << chart("Tokens per second", "tokens / s", collect(runs, {{"train", "tokens_per_s", "tokens/s"}}));
  o << chart("Data wait (share of step time)", "share of step time", collect(runs, {{"train", "data_wait_share", "data wait"}}));
  o << chart("Gradient norm", "L2 norm", collect(runs, {{"train", "grad_norm", "before clipping"}}));
  o << chart("Peak host memory (MiB)", "MiB", collect(runs, {{"train", "peak_rss_mb", "peak RSS"}}));
  o << "</div>\n";

  // The last evaluation of each run.
  std::size_t ttt = 0;
  for (const auto& r : runs)
    if (!r.eval.empty() && r.eval.back().contains("acc")) ttt = std::max(ttt, r.eval.back()["acc"].size());
  o << "<h2>Final evaluation</h2>";
  if (ttt == 0) {
    o << "<p class=\"muted\">no evaluation in these runs (train --eval-every)</p>\n";
  } else {
    o << "<div class=\"table\"><table><thead><tr><th>run</th><th>step</th><th>loss</th>";
    // Columns by TTT step, or by block position (1, 2, ...) when every run is DFlash.
    const std::size_t first = per == "block position" ? 1 : 0;
    for (std::size_t s = 0; s < ttt; ++s) o << "<th>acc " << s + first << "</th>";
    for (std::size_t s = 0; s < ttt; ++s) o << "<th>cond " << s + first << "</th>";
    o << "<th>est_ar</th><th>est_ar cond</th><th>tokens</th></tr></thead><tbody>";
    for (const auto& r : runs) {
      if (r.eval.empty()) continue;
      const json& e = r.eval.back();
      o << "<tr><td>" << escape(r.name) << "</td><td>" << cell(e.value("step", json())) << "</td><td>"
        << cell(e.value("loss", json())) << "</td>";
      for (const char* k : {"acc", "cond_acc"})
        for (std::size_t s = 0; s < ttt; ++s)
          o << "<td>" << (e.contains(k) && s < e[k].size() ? cell(e[k][s]) : "-") << "</td>";
      o << "<td>" << cell(e.value("est_ar", json())) << "</td><td>" << cell(e.value("est_ar_cond", json())) << "</td><td>"
        << cell(e.value("tokens", json())) << "</td></tr>";
    }
    o << "</tbody></table></div>\n";
  }

  // Options, one column per run; keys where the runs differ first.
  std::set<std::string> keys;
  for (const auto& r : runs)
    for (const auto& [k, v] : r.options.items()) keys.insert(k);
  o << "<h2>Options</h2>";
  if (keys.empty()) {
    o << "<p class=\"muted\">no checkpoint with train_options.json</p>\n";
  } else {
    std::vector<std::string> differ, same;
    for (const auto& k : keys) {
      bool d = false;
      for (const auto& r : runs) d = d || r.options.value(k, json()) != runs[0].options.value(k, json());
      (d ? differ : same).push_back(k);
    }
    o << "<div class=\"table\"><table><thead><tr><th>option</th>";
    for (const auto& r : runs) o << "<th>" << escape(r.name) << "</th>";
    o << "</tr></thead><tbody>";
    for (const auto* group : {&differ, &same})
      for (const auto& k : *group) {
        o << "<tr><td>" << escape(k) << (group == &differ && runs.size() > 1 ? " &#9679;" : "") << "</td>";
        for (const auto& r : runs) o << "<td>" << cell(r.options.value(k, json())) << "</td>";
        o << "</tr>";
      }
    o << "</tbody></table></div>\n";
  }

  if (!options.index.empty()) {
    const DatasetIndex index = DatasetIndex::load(options.index);
    const DatasetStats st = compute_stats(index);
    o << "<h2>Dataset</h2><div class=\"grid\"><figure><figcaption>" << escape(options.index) << "</figcaption><dl>"
      << "<dt>records</dt><dd>" << st.records << (st.bad_records ? " (" + std::to_string(st.bad_records) + " bad)" : "")
      << "</dd><dt>tokens</dt><dd>" << st.total_tokens << "</dd><dt>tokens per record</dt><dd>min " << st.min_tokens
      << ", median " << st.median_tokens << ", p90 " << st.p90_tokens << ", p99 " << st.p99_tokens << ", max "
      << st.max_tokens << "</dd><dt>on disk</dt><dd>" << num(static_cast<double>(st.bytes_on_disk) / (1 << 20), 5)
      << " MiB, " << num(st.bytes_per_token, 5) << " B per token (raw " << num(st.raw_bytes_per_token, 5) << ")</dd>"
      << "<dt>width</dt><dd>H " << st.hidden_size << ", aux " << st.aux_width << ", " << escape(st.dtype) << "</dd></dl></figure>";
    // The histogram as bars.
    std::size_t most = 1;
    for (const auto& b : st.histogram) most = std::max(most, b.count);
    const double W = 600, H = 260, L = 44, B = 46, T = 10;
    const double bw = st.histogram.empty() ? 0 : (W - L - 8) / static_cast<double>(st.histogram.size());
    o << "<figure><figcaption>Tokens per record</figcaption><svg viewBox=\"0 0 600 260\" role=\"img\" "
         "aria-label=\"token length histogram\">";
    for (int i = 0; i <= 4; ++i) {
      const double y = T + (H - T - B) * (1 - i / 4.0);
      o << "<line class=\"grid\" x1=\"" << L << "\" x2=\"" << W - 8 << "\" y1=\"" << y << "\" y2=\"" << y << "\"/>"
        << "<text class=\"tick\" x=\"" << L - 6 << "\" y=\"" << y + 4 << "\" text-anchor=\"end\">"
        << num(static_cast<double>(most) * i / 4.0, 3) << "</text>";
    }
    for (std::size_t i = 0; i < st.histogram.size(); ++i) {
      const auto& b = st.histogram[i];
      const double h = (H - T - B) * static_cast<double>(b.count) / static_cast<double>(most);
      const double x = L + bw * static_cast<double>(i);
      o << "<rect x=\"" << x + 1 << "\" y=\"" << H - B - h << "\" width=\"" << std::max(1.0, bw - 2) << "\" height=\"" << h
        << "\" fill=\"" << kColors[0] << "\"><title>" << b.lo << "-" << b.hi << " tokens: " << b.count
        << " records</title></rect>";
      o << "<text class=\"tick\" x=\"" << x + bw / 2 << "\" y=\"" << H - B + 16 << "\" text-anchor=\"middle\">" << b.lo
        << "</text>";
    }
    o << "<text class=\"tick\" x=\"" << W - 8 << "\" y=\"" << H - 8 << "\" text-anchor=\"end\">tokens (bin start)</text>"
      << "</svg></figure></div>\n";
  }
  o << "<p class=\"muted\">Written by eaglekit report from " << runs.size()
    << " run(s). Curves are the metrics.jsonl lines (one per --log-every steps); a run resumed after a kill "
       "shows its steps once.</p>\n</main></body></html>\n";
  return o.str();
}

void write_report(const ReportOptions& options, const std::string& out, std::vector<std::string>* warnings) {
  const std::string html = render_report(options, warnings);
  write_file_atomic(out, html.data(), html.size());
}

}  // namespace eaglekit
