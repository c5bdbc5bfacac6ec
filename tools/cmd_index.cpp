// eaglekit index: build (or incrementally refresh) a dataset index, or print one.
#include <cxxopts.hpp>

#include <iostream>

#include "formats/error.h"
#include "lib/index.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

int run_index(int argc, char** argv) {
  cxxopts::Options options(argv[0],
                           "Index the hidden-state records below folders (headers only) into one "
                           "binary index file.\n"
                           "  eaglekit index DIR... --out INDEX [--jobs N] [--full] [--json]\n"
                           "  eaglekit index --show INDEX [--json]\n");
  options.add_options()
      ("dirs", "Folders (or record files) to index, recursively", cxxopts::value<std::vector<std::string>>())
      ("o,out", "Index file to write (atomically)", cxxopts::value<std::string>())
      ("j,jobs", "Threads (0: all cores)", cxxopts::value<int>()->default_value("0"))
      ("full", "Read every file again, ignoring an existing index at --out")
      ("show", "Print an index: one line per record", cxxopts::value<std::string>())
      ("json", "Machine-readable output");
  options.parse_positional({"dirs"});
  options.positional_help("DIR...");
  const auto args = parse_args(options, argc, argv);
  if (!args) return 0;
  const bool json = args->count("json") > 0;

  if (args->count("show")) {
    if (args->count("dirs") || args->count("out"))
      throw UsageError("--show INDEX takes no folders and no --out");
    const DatasetIndex index = DatasetIndex::load((*args)["show"].as<std::string>());
    std::cout << (json ? index_to_json(index) : index_to_text(index));
    return 0;
  }
  IndexOptions o;
  if (args->count("dirs")) o.roots = (*args)["dirs"].as<std::vector<std::string>>();
  if (o.roots.empty()) throw UsageError("give at least one folder to index (see --help)");
  if (!args->count("out")) throw UsageError("--out INDEX is required");
  o.out = (*args)["out"].as<std::string>();
  o.jobs = (*args)["jobs"].as<int>();
  o.incremental = args->count("full") == 0;
  o.progress = stderr_is_tty() ? 1 : 0;
  const IndexReport report = build_index(o);
  std::cout << (json ? index_report_to_json(report, o.out) : index_report_to_text(report, o.out));
  return 0;
}

}  // namespace eaglekit::tools
