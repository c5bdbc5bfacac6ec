// `eaglekit report`: one self-contained HTML page (inline SVG and CSS, nothing fetched) about
// one or several training runs: their curves overlaid, the final evaluation, the options
// each ran with, and with an index the dataset's token-length histogram and disk per token.
// Reads only files a run writes (OUT/metrics.jsonl, OUT/checkpoint-N/train_options.json).
//
// Thread safety: pure functions of the files. Throws IoError / FormatError naming the file
// (a run folder without metrics.jsonl, a line that is not JSON); UsageError for no runs.
#pragma once

#include <string>
#include <vector>

namespace eaglekit {

struct ReportOptions {
  std::vector<std::string> runs;  // training output folders (train --out)
  std::string index;              // optional dataset index for the dataset section
  std::string title = "eaglekit training report";
};

// The page as a string. `warnings`, when given, receives what the page warns about at its
// top: runs trained with different --ttt-steps, whose curves are overlaid but not comparable.
std::string render_report(const ReportOptions& options, std::vector<std::string>* warnings = nullptr);
// Renders and writes `out` atomically (temp file + rename).
void write_report(const ReportOptions& options, const std::string& out, std::vector<std::string>* warnings = nullptr);

}  // namespace eaglekit
