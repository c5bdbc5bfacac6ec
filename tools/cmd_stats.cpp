// eaglekit stats: token distribution, disk use and a disk estimate from an index, and the
// SpecForge batch padding of its torch.save records.
#include <iostream>
#include <optional>
#include <string>

#include "formats/error.h"
#include "lib/index.h"
#include "lib/stats.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

int run_stats(int argc, char** argv) {
  DataSelection data;
  StatsOptions o;
  bool json = false;
  using opt::field;
  const opt::Groups groups{
      data_options(data).only({"index"}),
      opt::Group{"Stats",
                 {field("plan_conversations", "N", o.plan_conversations,
                        "Estimate the disk a dump of N conversations takes"),
                  opt::note(field("plan_tokens", "T", o.plan_tokens, "Tokens per conversation in that dump"),
                            "this dataset's mean"),
                  field("skip_padding", "", o.skip_padding,
                        "Open no record: leave out the count of SpecForge batch padding (read from the "
                        "torch.save records that hold a loss mask)"),
                  opt::short_named(field("jobs", "N", o.jobs, "Threads reading records (0: all cores)"), 'j'),
                  field("json", "", json, "Machine-readable output")}}};
  const std::optional<CommandLine> cl = parse_or_help(
      argc, argv, groups, std::string(argv[0]) + " --index FILE [OPTIONS]",
      "Token distribution, bytes on disk per token, records per format and dtype, and a disk "
      "estimate for a planned dump.");
  if (!cl) return 0;
  if (!cl->given("index")) throw UsageError("--index INDEX is required");
  cl->apply();
  const DatasetIndex index = DatasetIndex::load(data.index);
  const DatasetStats s = compute_stats(index, o);
  std::cout << (json ? stats_to_json(s) : stats_to_text(s));
  return 0;
}

}  // namespace eaglekit::tools
