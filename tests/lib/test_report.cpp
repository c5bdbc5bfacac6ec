// lib/report.h: the page is self-contained, overlays every run, shows the last evaluation,
// the options (differences marked) and the dataset section, escapes what it quotes, and
// survives a torn last metrics line; bad input names the file.
#include <doctest/doctest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "formats/error.h"
#include "lib/index.h"
#include "lib/report.h"
#include "tests/support.h"

using namespace eaglekit;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// A run folder as train writes it: metrics.jsonl (train lines, eval lines) and a
// checkpoint's train_options.json.
void write_run(const std::string& dir, double lr, bool torn_tail) {
  fs::create_directories(dir + "/checkpoint-4");
  std::string lines;
  for (int step = 1; step <= 4; ++step) {
    json j = {{"step", step}, {"epoch", 0}, {"lr", lr}, {"loss", 3.0 / step}, {"loss_per_step", {2.0 / step, 1.0 / step}},
              {"acc", {0.1 * step, 0.05 * step}}, {"cond_acc", {0.1 * step, 0.2}}, {"est_ar", 1 + 0.1 * step},
              {"est_ar_cond", 1 + 0.12 * step}, {"tokens", 100}, {"grad_norm", 1.5}, {"tokens_per_s", 900 + step},
              {"data_wait_share", 0.01}, {"peak_rss_mb", 300}};
    lines += j.dump() + "\n";
    if (step % 2 == 0) {
      json e = {{"split", "eval"}, {"step", step}, {"loss", 2.5 / step}, {"acc", {0.42, 0.17}},
                {"cond_acc", {0.42, 0.3}}, {"est_ar", 1.5}, {"est_ar_cond", 1.55}, {"tokens", 77}};
      lines += e.dump() + "\n";
    }
  }
  if (torn_tail) lines += "{\"step\": 5, \"lo";
  test::write_text(dir + "/metrics.jsonl", lines);
  test::write_text(dir + "/checkpoint-4/train_options.json",
                   json({{"lr", lr}, {"batch_size", 8}, {"base", "/models/<base>"}}).dump());
}

}  // namespace

TEST_CASE("report: a self-contained page overlaying runs, with evaluation, options and dataset") {
  test::TempDir d("report");
  write_run(d / "a&b", 1e-3, true);
  write_run(d / "other", 3e-4, false);
  // A small index: three files of 10, 100 and 1000 tokens.
  std::vector<IndexedFile> files;
  for (int t : {10, 100, 1000}) {
    IndexedFile f;
    f.path = "/d/" + std::to_string(t) + ".pt";
    f.size = 64 * static_cast<std::uint64_t>(t);
    f.format = Format::kPt;
    IndexedRecord r;
    r.info.conversation_id = std::to_string(t);
    r.info.tokens = t;
    r.info.hidden_size = 8;
    r.info.aux_width = 24;
    r.info.hidden_dtype = DType::kBFloat16;
    f.records.push_back(r);
    files.push_back(f);
  }
  write_index(d / "i.ekidx", {"/d"}, files);

  ReportOptions o;
  o.runs = {d / "a&b", d / "other"};
  o.index = d / "i.ekidx";
  write_report(o, d / "r.html");
  const std::string html = [&] {
    const auto b = test::read_bytes(d / "r.html");
    return std::string(b.begin(), b.end());
  }();
  auto has = [&](const std::string& s) { return html.find(s) != std::string::npos; };
  auto count = [&](const std::string& s) {
    std::size_t n = 0;
    for (auto at = html.find(s); at != std::string::npos; at = html.find(s, at + 1)) ++n;
    return n;
  };
  CHECK(html.rfind("<!doctype html>", 0) == 0);
  // Nothing fetched: no links, scripts or external resources.
  CHECK_FALSE(has("http"));
  CHECK_FALSE(has("src="));
  CHECK_FALSE(has("href="));
  CHECK_FALSE(has("<script"));
  CHECK(has("name=\"viewport\""));
  CHECK(has("prefers-color-scheme: dark"));
  for (const char* title : {"Loss", "Accuracy per TTT step (train)", "Conditional accuracy per TTT step (train)",
                            "Estimated acceptance length", "Learning rate", "Tokens per second",
                            "Data wait (share of step time)", "Peak host memory (MiB)", "Final evaluation", "Options",
                            "Tokens per record"})
    CHECK_MESSAGE(has(">" + std::string(title) + "<"), title);
  // Both runs in every overlay, their names escaped.
  CHECK(has("a&amp;b train"));
  CHECK(has("other train"));
  CHECK_FALSE(has("a&b"));
  CHECK(has("a&amp;b step 1"));
  // The torn last line of a killed run is left out: 4 train lines, 2 evaluations.
  CHECK(has("a&amp;b (4 log lines, 2 evaluations)"));
  // The last evaluation (step 4) of each run.
  CHECK(count("<td>0.625</td>") == 2);  // eval loss 2.5 / 4
  CHECK(count("<td>0.42</td>") == 4);   // acc 0 and cond 0, two runs
  // Options: lr differs (marked), batch_size does not; quoted values escaped.
  CHECK(has("<td>lr &#9679;</td><td>0.001</td><td>0.0003</td>"));
  CHECK(has("<td>batch_size</td><td>8</td><td>8</td>"));
  CHECK(has("/models/&lt;base&gt;"));
  // Dataset: the three records and a bar per power-of-two bin, 8-15 up to 512-1023.
  CHECK(has("<dt>records</dt><dd>3</dd>"));
  CHECK(count("<rect ") == 7);

  // One run, no index: no dataset section.
  o.runs = {d / "other"};
  o.index.clear();
  const std::string one = render_report(o);
  CHECK(one.find("Tokens per record") == std::string::npos);
  CHECK(one.find("other train") == std::string::npos);  // one run: series named by what they are
  CHECK(one.find(">train</li>") != std::string::npos);

  // Bad input names the file.
  o.runs = {d / "missing"};
  CHECK_THROWS_WITH_AS(render_report(o), doctest::Contains((d / "missing/metrics.jsonl").c_str()), IoError);
  fs::create_directories(d / "bad");
  test::write_text(d / "bad/metrics.jsonl", "{\"step\": 1}\nnot json\n{\"step\": 2}\n");
  o.runs = {d / "bad"};
  CHECK_THROWS_WITH_AS(render_report(o), doctest::Contains((d / "bad/metrics.jsonl: line at byte 12").c_str()), FormatError);
  o.runs.clear();
  CHECK_THROWS_AS(render_report(o), UsageError);
}

TEST_CASE("report: renders in headless Chromium at phone and desktop widths") {
  // tests/lib/render_check.py renders the page in a frame of each width (headless Chromium lays
  // a top-level page out at least 500 px wide), reads its layout through a probe script and
  // its pixels from a screenshot, and lists what is wrong: a blank page, chart cards without
  // the stylesheet's background, a chart whose box holds no drawn (coloured) pixels, anything
  // reaching past the viewport. Must-fails: the same page without its stylesheet, and with the
  // first chart's data emptied.
  const char* chromium = "/usr/bin/chromium";
  if (!test::require_program(chromium, "install Debian's chromium (scripts/setup does)")) return;
  test::TempDir d("report-render");
  write_run(d / "run", 1e-3, false);
  write_run(d / "other", 3e-4, false);
  ReportOptions o;
  o.runs = {d / "run", d / "other"};
  write_report(o, d / "r.html");
  const auto bytes = test::read_bytes(d / "r.html");
  const std::string page(bytes.begin(), bytes.end());
  std::string unstyled = page;
  const std::size_t s0 = unstyled.find("<style>"), s1 = unstyled.find("</style>");
  REQUIRE(s0 != std::string::npos);
  REQUIRE(s1 != std::string::npos);
  unstyled.erase(s0, s1 + 8 - s0);
  test::write_text(d / "unstyled.html", unstyled);
  std::string emptied = page;
  const std::size_t f0 = emptied.find("<figure>"), f1 = emptied.find("</figure>", f0);
  REQUIRE(f0 != std::string::npos);
  std::string first = emptied.substr(f0, f1 - f0);
  int removed = 0;
  for (std::size_t p; (p = first.find("<polyline")) != std::string::npos; ++removed)
    first.erase(p, first.find("</polyline>", p) + 11 - p);
  REQUIRE(removed > 0);
  emptied.replace(f0, f1 - f0, first);
  test::write_text(d / "emptied.html", emptied);

  auto problems = [&](const std::string& file, int width) {
    const auto r = test::run(test::python_bin() + " " + test::quote(test::source_dir() + "/tests/lib/render_check.py") +
                             " " + chromium + " " + test::quote(d / file) + " " + std::to_string(width) + " " +
                             test::quote(d / ("work-" + file + "-" + std::to_string(width))));
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    const json j = json::parse(r.out);
    MESSAGE(file << " at " << width << " px: " << j["measured"].dump());
    std::string all;
    for (const auto& p : j["problems"]) all += p.get<std::string>() + "\n";
    return all;
  };
  for (const int width : {390, 1400}) {
    CAPTURE(width);
    const std::string good = problems("r.html", width);
    CHECK_MESSAGE(good.empty(), good);
    const std::string u = problems("unstyled.html", width);
    CHECK_MESSAGE(u.find("unstyled: the chart cards have no background") != std::string::npos, u);
    if (width == 390)  // the tables no longer scroll in their box: the page overflows the phone
      CHECK_MESSAGE(u.find("overflow: the page is ") != std::string::npos, u);
    const std::string e = problems("emptied.html", width);
    CHECK_MESSAGE(e.find("chart 'Loss': its plot area ") != std::string::npos, e);
    CHECK_MESSAGE(e.find("holds 0 drawn pixels") != std::string::npos, e);
    CHECK_MESSAGE(e.find("chart 'Accuracy per TTT step (train)'") == std::string::npos, e);  // only the first
  }
}

TEST_CASE("report: runs of different --ttt-steps are flagged as not comparable; every chart titles its axes") {
  test::TempDir d("report-ttt");
  write_run(d / "three", 1e-3, false);
  write_run(d / "five", 1e-3, false);
  write_run(d / "three-again", 3e-4, false);
  test::write_text(d / "three/checkpoint-4/train_options.json", json({{"ttt_steps", 3}}).dump());
  test::write_text(d / "five/checkpoint-4/train_options.json", json({{"ttt_steps", 5}}).dump());
  test::write_text(d / "three-again/checkpoint-4/train_options.json", json({{"ttt_steps", 3}}).dump());
  ReportOptions o;
  o.runs = {d / "three", d / "five"};
  std::vector<std::string> warnings;
  const std::string page = render_report(o, &warnings);
  REQUIRE(warnings.size() == 1);
  CHECK(warnings[0].rfind("these runs trained with different --ttt-steps (--ttt-steps 3: three; --ttt-steps 5: five): "
                          "their loss, accuracy and est_ar curves are not comparable", 0) == 0);
  CHECK(page.find("<p class=\"warning\">warning: these runs trained with different --ttt-steps") != std::string::npos);
  // Every chart: the steps across, its own quantity up.
  std::size_t charts = 0, x_titles = 0;
  for (std::size_t at = page.find("<svg viewBox=\"0 0 600 290\""); at != std::string::npos;
       at = page.find("<svg viewBox=\"0 0 600 290\"", at + 1))
    ++charts;
  for (std::size_t at = page.find(">optimizer step</text>"); at != std::string::npos;
       at = page.find(">optimizer step</text>", at + 1))
    ++x_titles;
  CHECK(charts == 10);
  CHECK(x_titles == charts);
  CHECK(page.find("rotate(-90)\" text-anchor=\"middle\">tokens per base pass</text>") != std::string::npos);
  // Runs of one --ttt-steps: no warning. Without train_options.json the acc lists tell.
  o.runs = {d / "three", d / "three-again"};
  CHECK(render_report(o, &warnings).find("class=\"warning\"") == std::string::npos);
  CHECK(warnings.empty());
  fs::remove(d / "five/checkpoint-4/train_options.json");
  o.runs = {d / "three", d / "five"};  // both now 2 steps (three's options say 3, five's acc lists 2)
  render_report(o, &warnings);
  CHECK(warnings.size() == 1);
}


// A DFlash run (its checkpoint's config.json names DFlashDraftModel; or only its options say
// draft_arch dflash): the per-position charts are titled and labelled by block position
// (entry s is position s + 1), the final table's columns too, and overlaying it with a TTT run
// warns that the curves do not compare.
TEST_CASE("report: a DFlash run's figures are per block position, and a mix with a TTT run warns") {
  test::TempDir d("report-dflash");
  write_run(d / "df", 1e-3, false);
  test::write_text(d / "df/checkpoint-4/config.json",
                   json({{"architectures", {"DFlashDraftModel"}}, {"block_size", 3}, {"dflash_config", json::object()}}).dump());
  write_run(d / "df2", 1e-3, false);  // a DFlash run known by its options only
  test::write_text(d / "df2/checkpoint-4/train_options.json",
                   json({{"draft_arch", "dflash"}, {"block_size", 3}, {"ttt_steps", 3}}).dump());
  write_run(d / "ttt", 1e-3, false);
  auto page = [&](std::vector<std::string> runs) {
    ReportOptions o;
    o.runs = std::move(runs);
    std::vector<std::string> warnings;
    const std::string html = render_report(o, &warnings);
    return std::make_pair(html, warnings);
  };
  for (const char* name : {"df", "df2"}) {
    CAPTURE(name);
    const auto [html, warnings] = page({d / name});
    auto has = [&](const std::string& s) { return html.find(s) != std::string::npos; };
    CHECK(has(">Accuracy per block position (train)<"));
    CHECK(has(">Conditional accuracy per block position (train)<"));
    CHECK(has(">Accuracy per block position (eval)<"));
    CHECK(has(">loss (positions weighted)<"));
    CHECK_FALSE(has("TTT step"));
    CHECK(has(">position 1</li>"));
    CHECK(has(">position 2</li>"));
    CHECK_FALSE(has(">step 0</li>"));
    CHECK(has("<th>acc 1</th><th>acc 2</th><th>cond 1</th>"));
    CHECK(warnings.empty());
  }
  const auto [mixed, warnings] = page({d / "df", d / "ttt"});
  CHECK(mixed.find(">Accuracy per TTT step / block position (train)<") != std::string::npos);
  CHECK(mixed.find("df position 1") != std::string::npos);
  CHECK(mixed.find("ttt step 0") != std::string::npos);
  REQUIRE(warnings.size() == 1);
  CHECK(warnings[0].find("DFlash --block-size 3: df") != std::string::npos);
  CHECK(warnings[0].find("--ttt-steps 2: ttt") != std::string::npos);
  CHECK(warnings[0].find("draft differently") != std::string::npos);
  const auto [plain, no_warning] = page({d / "ttt"});
  CHECK(plain.find(">Accuracy per TTT step (train)<") != std::string::npos);
  CHECK(no_warning.empty());
}
