// eaglekit inspect: format, conversation id, codec and each tensor's dtype and shape of a
// record (FILE or FILE#conversation_id), or the list of records of a shard.
#include <cxxopts.hpp>

#include <iostream>

#include "formats/error.h"
#include "lib/inspect.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

int run_inspect(int argc, char** argv) {
  cxxopts::Options options(
      argv[0],
      "Show a record file's format, conversation id, codec and each tensor's dtype and shape. "
      "FILE#conversation_id picks one record of a multi-record file (HDF5, .eks); without it "
      "such a file lists its records.");
  options.positional_help("FILE[#conversation_id]");
  options.add_options()("file", "Record file", cxxopts::value<std::string>())
      ("stats", "Add min/max/mean/std and NaN/Inf counts per tensor (reads every value)")
      ("json", "Print JSON");
  options.parse_positional({"file"});
  const auto args = parse_args(options, argc, argv);
  if (!args) return 0;
  if (!args->count("file")) throw UsageError("FILE is required (see --help)");
  InspectOptions o;
  o.stats = args->count("stats") > 0;
  const InspectResult r = inspect((*args)["file"].as<std::string>(), o);
  std::cout << (args->count("json") ? inspect_json(r) : inspect_text(r));
  return 0;
}

}  // namespace eaglekit::tools
