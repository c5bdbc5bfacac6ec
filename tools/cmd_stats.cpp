// eaglekit stats: token distribution, disk use and a disk estimate, from an index alone.
#include <cxxopts.hpp>

#include <iostream>

#include "formats/error.h"
#include "lib/index.h"
#include "lib/stats.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

int run_stats(int argc, char** argv) {
  cxxopts::Options options(argv[0],
                           "Token distribution, bytes on disk per token, records per format and "
                           "dtype, and a disk estimate for a planned dump.\n");
  options.add_options()
      ("index", "Dataset index (eaglekit index)", cxxopts::value<std::string>())
      ("plan-conversations", "Estimate the disk a dump of N conversations takes", cxxopts::value<std::int64_t>()->default_value("0"))
      ("plan-tokens", "Tokens per conversation in that dump (default: this dataset's mean)", cxxopts::value<double>()->default_value("0"))
      ("json", "Machine-readable output");
  const auto args = parse_args(options, argc, argv);
  if (!args) return 0;
  if (!args->count("index")) throw UsageError("--index INDEX is required");
  StatsOptions o;
  o.plan_conversations = (*args)["plan-conversations"].as<std::int64_t>();
  o.plan_tokens = (*args)["plan-tokens"].as<double>();
  const DatasetIndex index = DatasetIndex::load((*args)["index"].as<std::string>());
  const DatasetStats s = compute_stats(index, o);
  std::cout << (args->count("json") ? stats_to_json(s) : stats_to_text(s));
  return 0;
}

}  // namespace eaglekit::tools
