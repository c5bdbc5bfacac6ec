// eaglekit loader-bench: stream batches without writing them and report the loader's speed
// and how long the consumer waited. Takes the same data options as collate.
#include <iostream>
#include <memory>
#include <optional>
#include <string>

#include "formats/error.h"
#include "lib/loader.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

int run_loader_bench(int argc, char** argv) {
  LoaderJob job;
  bool json = false;
  opt::Groups groups = job.groups();
  groups.push_back(opt::Group{
      "Output",
      {opt::cli_only(opt::field("json", "", json,
                                "Print {\"samples_per_s\", \"bytes_per_s\", \"wait_ms_per_batch\", \"batches\", ...}"))}});
  const std::optional<CommandLine> cl = parse_or_help(
      argc, argv, groups, std::string(argv[0]) + " --data PATH --index FILE [OPTIONS]",
      "Stream batches through the loader without writing them; print samples/s, bytes/s and "
      "the consumer's wait per batch.");
  if (!cl) return 0;
  cl->apply();
  std::string summary;
  auto loader = open_loader(job, summary);
  if (!json) std::cerr << summary << "\n";
  const BenchReport report = bench_loader(*loader, job.batches);
  std::cout << (json ? report.to_json() + "\n" : report.to_text());
  return 0;
}

}  // namespace eaglekit::tools
