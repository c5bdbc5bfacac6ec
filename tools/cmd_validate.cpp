// eaglekit validate: check an index's records against the conversations before training.
#include <cxxopts.hpp>

#include <iostream>

#include "formats/error.h"
#include "lib/validate.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

int run_validate(int argc, char** argv) {
  cxxopts::Options options(argv[0],
                           "Check records against the conversations and against each other. Exit "
                           "0: trainable as is (warnings listed); 1: not trainable.\n");
  options.add_options()
      ("data", "Conversations: a .jsonl file, a folder of them, or a JSON array file", cxxopts::value<std::string>())
      ("index", "Dataset index (eaglekit index)", cxxopts::value<std::string>())
      ("deep", "Read every value of every matched record: NaN/Inf, checksums, shapes")
      ("max-length", "Report how many records and tokens truncation to L drops", cxxopts::value<std::int64_t>()->default_value("0"))
      ("quarantine", "Write the ids of every problem record to FILE (the loader's --quarantine)", cxxopts::value<std::string>())
      ("j,jobs", "Threads for --deep (0: all cores)", cxxopts::value<int>()->default_value("0"))
      ("json", "Machine-readable output");
  const auto args = parse_args(options, argc, argv);
  if (!args) return 0;
  ValidateOptions o;
  if (!args->count("data")) throw UsageError("--data CONVERSATIONS is required");
  if (!args->count("index")) throw UsageError("--index INDEX is required (build one with eaglekit index)");
  o.data = (*args)["data"].as<std::string>();
  o.index = (*args)["index"].as<std::string>();
  o.deep = args->count("deep") > 0;
  o.max_length = (*args)["max-length"].as<std::int64_t>();
  if (args->count("quarantine")) o.quarantine = (*args)["quarantine"].as<std::string>();
  o.jobs = (*args)["jobs"].as<int>();
  o.progress = stderr_is_tty() ? 1 : 0;
  const ValidateReport report = validate_dataset(o);
  std::cout << (args->count("json") ? validate_report_to_json(report) : validate_report_to_text(report));
  return report.exit_code();
}

}  // namespace eaglekit::tools
