// eaglekit report: one self-contained HTML page about training runs (lib/report.h).
#include <cstddef>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "formats/error.h"
#include "lib/report.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

int run_report(int argc, char** argv) {
  ReportOptions o;
  DataSelection data;
  std::string out;
  bool json = false;
  const opt::Groups groups{opt::Group{"Report",
                                      {opt::field("out", "FILE", out, "HTML file to write (atomically)"),
                                       opt::field("title", "TEXT", o.title, "Page title"),
                                       opt::field("json", "", json, "Print {\"out\", \"runs\", \"warnings\"}")}},
                           data_options(data).only({"index"})};
  const std::optional<CommandLine> cl = parse_or_help(
      argc, argv, groups, std::string(argv[0]) + " RUN [RUN...] --out FILE [OPTIONS]",
      "One self-contained HTML page (inline SVG, nothing fetched) about training runs: "
      "their curves overlaid (loss, per-step accuracy, est_ar, lr, tokens/s, data wait), "
      "the final evaluation, the options each ran with, and with --index the dataset's "
      "token-length histogram and disk per token. RUN: a train --out folder.", std::numeric_limits<std::size_t>::max());
  if (!cl) return 0;
  if (cl->positionals.empty()) throw UsageError("give at least one RUN folder (train --out)");
  if (!cl->given("out")) throw UsageError("--out FILE is required");
  cl->apply();
  o.runs = cl->positionals;
  o.index = data.index;
  std::vector<std::string> warnings;
  write_report(o, out, &warnings);
  for (const auto& w : warnings) std::cerr << "report: warning: " << w << "\n";
  if (json) {
    std::cout << nlohmann::json({{"out", out}, {"runs", o.runs}, {"warnings", warnings}}).dump() << "\n";
  } else {
    std::cout << "wrote " << out << " (" << o.runs.size() << " run(s))\n";
  }
  return 0;
}

}  // namespace eaglekit::tools
