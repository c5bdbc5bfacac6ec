// eaglekit stats: token distribution, disk use and a disk estimate from an index, and the
// SpecForge batch padding of its torch.save records; with --plan-dump, the disk a dump of
// the conversations will take before it is made (lib/stats.h plan_dump).
#include <iostream>
#include <optional>
#include <string>

#include "formats/error.h"
#include "lib/index.h"
#include "lib/progress.h"
#include "lib/stats.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace eaglekit::tools {

int run_stats(int argc, char** argv) {
  DataSelection data;
  StatsOptions o;
  DumpPlanOptions plan;
  bool planning = false;
  std::string disk;
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
                  field("json", "", json, "Machine-readable output")}},
      opt::Group{"Plan a dump (--plan-dump: before dumping, from --data and --base; --index is then a sample)",
                 {field("plan_dump", "", planning,
                        "Print the tokens of --data and the bytes a dump of them takes raw (bf16), as .eks zstd "
                        "and as .eks fp8, and suggest one"),
                  field("data", "PATH", plan.conversations,
                        "The conversations to dump: a .jsonl file, a folder of them, or a JSON array file"),
                  field("base", "DIR", plan.base, "The base's folder (its config.json gives the hidden size)"),
                  field("aux_layers", "K", plan.aux_layers, "Aux layers the dump captures (EAGLE-3: 3)"),
                  opt::note(field("text_bytes_per_token", "X", plan.text_bytes_per_token,
                                  "UTF-8 bytes of conversation text per token"),
                            "measured on --index SAMPLE, an index of some of these conversations already dumped"),
                  opt::note(field("disk", "SIZE", disk, "The disk the dump may take (e.g. 20TiB): the suggestion fits it"),
                            "no limit")}}};
  const std::optional<CommandLine> cl = parse_or_help(
      argc, argv, groups,
      std::string(argv[0]) + " --index FILE [OPTIONS]\n       " + argv[0] +
          " --plan-dump --data CONVERSATIONS --base DIR [--index SAMPLE | --text-bytes-per-token X] [OPTIONS]",
      "Token distribution, bytes on disk per token, records per format and dtype, and a disk "
      "estimate for a planned dump. With --plan-dump, before anything is dumped: the tokens of the "
      "conversations and the disk a dump of them takes in each format, and the one to choose.");
  if (!cl) return 0;
  cl->apply();
  if (planning) {
    for (const char* only : {"plan_conversations", "plan_tokens", "skip_padding"})
      if (cl->given(only))
        throw UsageError(std::string("--") + only + " is for a dump that exists; --plan-dump plans from --data");
    if (!disk.empty()) plan.disk_bytes = static_cast<double>(parse_bytes(disk));
    std::optional<DatasetIndex> sample;
    if (cl->given("index")) sample = DatasetIndex::load(data.index);
    const DumpPlan p = eaglekit::plan_dump(plan, sample ? &*sample : nullptr);
    std::cout << (json ? dump_plan_to_json(p) : dump_plan_to_text(p));
    return 0;
  }
  for (const char* only : {"data", "base", "aux_layers", "text_bytes_per_token", "disk"})
    if (cl->given(only)) throw UsageError(std::string("--") + only + " goes with --plan-dump");
  if (!cl->given("index")) throw UsageError("--index INDEX is required (or --plan-dump to plan a dump)");
  const DatasetIndex index = DatasetIndex::load(data.index);
  const DatasetStats s = compute_stats(index, o);
  std::cout << (json ? stats_to_json(s) : stats_to_text(s));
  return 0;
}

}  // namespace eaglekit::tools
