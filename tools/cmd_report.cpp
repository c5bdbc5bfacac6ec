// eaglekit report: one self-contained HTML page about training runs (lib/report.h).
#include <cxxopts.hpp>

#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "formats/error.h"
#include "lib/report.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

int run_report(int argc, char** argv) {
  cxxopts::Options options(argv[0],
                           "One self-contained HTML page (inline SVG, nothing fetched) about training runs: "
                           "their curves overlaid (loss, per-step accuracy, est_ar, lr, tokens/s, data wait), "
                           "the final evaluation, the options each ran with, and with --index the dataset's "
                           "token-length histogram and disk per token. RUN: a train --out folder.");
  options.positional_help("RUN [RUN...]");
  options.add_options()
      ("runs", "Training output folders", cxxopts::value<std::vector<std::string>>())
      ("out", "HTML file to write (atomically)", cxxopts::value<std::string>())
      ("index", "Dataset index (eaglekit index) for the dataset section", cxxopts::value<std::string>())
      ("title", "Page title", cxxopts::value<std::string>()->default_value("eaglekit training report"))
      ("json", "Print {\"out\", \"runs\"}");
  options.parse_positional({"runs"});
  const auto args = parse_args(options, argc, argv);
  if (!args) return 0;
  const auto& a = *args;
  if (!a.count("runs")) throw UsageError("give at least one RUN folder (train --out)");
  if (!a.count("out")) throw UsageError("--out FILE is required");
  ReportOptions o;
  o.runs = a["runs"].as<std::vector<std::string>>();
  if (a.count("index")) o.index = a["index"].as<std::string>();
  o.title = a["title"].as<std::string>();
  const std::string out = a["out"].as<std::string>();
  write_report(o, out);
  if (a.count("json")) {
    std::cout << nlohmann::json({{"out", out}, {"runs", o.runs}}).dump() << "\n";
  } else {
    std::cout << "wrote " << out << " (" << o.runs.size() << " run(s))\n";
  }
  return 0;
}

}  // namespace eaglekit::tools
