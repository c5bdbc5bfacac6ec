// eaglekit loader-bench: stream batches without writing them and report the loader's speed
// and how long the consumer waited. Takes the same data options as collate.
#include <cxxopts.hpp>

#include <iostream>
#include <memory>
#include <string>

#include "formats/error.h"
#include "lib/loader.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

// Shared with collate, defined in tools/cmd_collate.cpp.
void add_loader_options(cxxopts::Options& options);
std::unique_ptr<Loader> open_loader(const cxxopts::ParseResult& args, std::int64_t& batches,
                                    std::string& summary);

int run_loader_bench(int argc, char** argv) {
  cxxopts::Options options(argv[0],
                           "Stream batches through the loader without writing them; print "
                           "samples/s, bytes/s and the consumer's wait per batch");
  add_loader_options(options);
  options.add_options()("json", "Print {\"samples_per_s\", \"bytes_per_s\", \"wait_ms_per_batch\", \"batches\", ...}");
  auto args = parse_args(options, argc, argv);
  if (!args) return 0;
  std::int64_t batches = -1;
  std::string summary;
  auto loader = open_loader(*args, batches, summary);
  const bool json = args->count("json") > 0;
  if (!json) std::cerr << summary << "\n";
  const BenchReport report = bench_loader(*loader, batches);
  std::cout << (json ? report.to_json() + "\n" : report.to_text());
  return 0;
}

}  // namespace eaglekit::tools
